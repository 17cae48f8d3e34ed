"""One request's options and state as it moves through the engine: waiting → prefilling → running → finished."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Sequence

from dspark.sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "cancelled", "error")
_ids = itertools.count()


@dataclass
class RoundStats:
    """One round of one request: how many drafts were verified and how many were accepted.

    available: drafts the block offered (after the token budget) before the scheduler cut it to
    draft_len. signals: the block's survival signals [available][3] when the engine records them.
    A request's first round is its prefill (0 drafts): the target pass that committed its first token, so
    τ = tokens / rounds stays tokens per target pass.
    """

    draft_len: int
    accepted: int
    available: int | None = None
    signals: list[list[float]] | None = None


@dataclass
class Request:
    """What a client asked for, plus the engine's record of it.

    max_tokens: new tokens at most. stop: strings that end the output (the text stops before them; matched on
    the decoded text, across token boundaries). stop_token_ids: more ids that end it, besides the target's EOS
    ids (ignored with ignore_eos: benchmarks of a fixed output length). speculate:
    False decodes this request without drafts; max_draft caps its verified drafts per round. workload: the
    label its rounds are calibrated under online.
    """

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 128
    stop: Sequence[str] = ()
    stop_token_ids: frozenset[int] | None = None
    ignore_eos: bool = False
    speculate: bool = True
    max_draft: int | None = None
    workload: str | None = None
    request_id: str = ""

    # --- engine state
    seq: int = field(default_factory=lambda: next(_ids))  # engine-wide number (scheduler / calibrator keys)
    state: str = "waiting"
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded output released so far (with a tokenizer)
    rounds: list[RoundStats] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    prefilled: int = 0  # prompt tokens already in the target cache

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        self.stop = tuple(self.stop)
        if not self.request_id:
            self.request_id = f"req-{self.seq}"

    @property
    def finished(self) -> bool:
        """True once the request has a finish reason."""
        return self.finish_reason is not None

    @property
    def draft_limit(self) -> int | None:
        """The most drafts a round of this request may verify (None: the drafter's block)."""
        if not self.speculate:
            return 0
        return self.max_draft

    @property
    def tau(self) -> float:
        """Accepted length τ: tokens committed per round, bonus token included."""
        return len(self.output_ids) / max(1, len(self.rounds))

    def speculation_stats(self) -> dict:
        """τ, rounds, drafted (verified) and accepted draft tokens, and accepted drafts per position."""
        per_pos: list[int] = []
        for r in self.rounds:
            for k in range(r.accepted):
                if k == len(per_pos):
                    per_pos.append(0)
                per_pos[k] += 1
        return {
            "tau": round(self.tau, 4),
            "rounds": len(self.rounds),
            "draft_tokens": sum(r.draft_len for r in self.rounds),
            "accepted_tokens": sum(r.accepted for r in self.rounds),
            "accepted_per_position": per_pos,
        }


@dataclass
class RequestOutput:
    """What one engine step produced for one request: new tokens, new text (when detokenizing), done or not."""

    request: Request
    token_ids: list[int]
    text: str = ""
    finished: bool = False
