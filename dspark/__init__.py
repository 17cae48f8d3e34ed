"""dspark: adaptive speculative decoding for Hugging Face causal LMs."""
from dspark.api import generate, load_drafter, load_target
from dspark.decoding import GenerationResult, RoundStats, decode
from dspark.drafters.base import DraftBlock, Drafter
from dspark.sampling import SamplingParams
from dspark.target import CausalLM
from dspark.verify import verify

__all__ = [
    "CausalLM",
    "DraftBlock",
    "Drafter",
    "GenerationResult",
    "RoundStats",
    "SamplingParams",
    "decode",
    "generate",
    "load_drafter",
    "load_target",
    "verify",
]
