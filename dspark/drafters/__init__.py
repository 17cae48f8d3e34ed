"""Drafting methods behind one protocol (`Drafter.propose -> DraftBlock`)."""
from dspark.drafters.base import DraftBlock, Drafter, NoDrafter, RoundOutcome
from dspark.drafters.draft_model import DraftModelDrafter
from dspark.drafters.ngram import NgramDrafter

__all__ = ["DraftBlock", "Drafter", "DraftModelDrafter", "NgramDrafter", "NoDrafter", "RoundOutcome"]
