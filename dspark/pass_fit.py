"""What the target pass of a served round costs beyond the profiled table, learned online from every pass.

Two things the profile (measured on rows of one context length, each pass its own) cannot price:

- **The context.** Rows attend over every slot of the padded cache, and the cache spans the longest row plus the
  holes rolled-back drafts left: at 64 clients on 2 CPU cores one 374-token prompt made every row attend over
  300-570 slots while rows held 90 tokens on average, and rounds of one batch size and width took 80 ms or 170 ms
  depending on it. A query token's attention costs in proportion to the slots S, so a drafted round (N query
  tokens) grows with S about N / B times as fast as a plain step (B); a correction by one factor per kind would
  carry a drafted row's rise over to stale plain steps and keep drafting where plain steps had won.
- **A fused prefill chunk.** Under load nearly every step feeds a prompt chunk in its round's target pass
  (`EngineConfig.fuse_prefill`). If such rounds are left out of the online correction it stops where unfused
  rounds last left it, and a round that fed one costs the chunk on top of what the cost model predicts.

The passes' seconds are fitted by exponentially forgetting least squares against what a pass computes: a fixed
part, the running rows B, the round's query tokens N (the cost model's layout), their attention over the slots
(N·S), the chunk's prompt tokens P, and whether it was fused (a packed pass: its own fixed part u). The N·S slope
prices the context (`CostModel.set_context`); p·P + u is the chunk's share, which the engine takes off a fused
round before the cost model's correction sees it (benchmarks/results/serving/pass_fit/). The fused pass's own part
belongs to the chunk, not to the round: a round costs it whether it drafts or not, and left in (6-8 ms at 64
clients on 2 CPU cores, against 45 ms plain and 130 ms drafted rounds) it priced plain rounds, whose few
measurements nearly all rode with a chunk, about 15% dear and drafted ones 5%, which kept drafting where it did not
pay (benchmarks/results/serving/fused_part/). u is read only while both fused and unfused passes are seen, the
only way to tell it from the fixed part every pass pays.
"""
from __future__ import annotations

import math

import numpy as np

# feature scales that keep the normal equations well conditioned: a loaded step's rows, query tokens, query ×
# slot pairs and prompt tokens are each about 1 after scaling
_SCALES = np.array([1.0, 64.0, 512.0, 512.0 * 512.0, 256.0, 1.0])
_SLOTS, _CHUNK, _FUSED = 3, 4, 5  # indices of N·S, P and fused


def less_chunk(seconds: float, chunk: float) -> float:
    """A fused round's seconds less its chunk's share, never below half the round (a share fitted too large
    must not price the round at nothing)."""
    return max(seconds - chunk, 0.5 * seconds)


class PassFit:
    """Online fit of target passes: seconds ≈ f + a·B + n·N + s·N·S + p·P + u·fused (s, p ≥ 0 when read).

    `slot_seconds` = s, or None until `min_steps` passes whose N·S varied (relative to its mean) were seen;
    `chunk_seconds(P)` = p·P + u, or None until `min_steps` fused passes with chunks of differing sizes (u
    counted while fused and unfused passes are both common, `_mixed`).
    """

    #: the share of recent passes each of fused and unfused ones must reach before u is read (`_mixed`)
    MIXED = 0.05

    def __init__(self, alpha: float = 0.02, min_steps: int = 16, ridge: float = 1e-3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"pass fit alpha must lie in (0, 1], got {alpha}")
        self.alpha, self.min_steps, self.ridge = float(alpha), int(min_steps), float(ridge)
        self.steps = self.fused_steps = 0
        self._coef: np.ndarray | None = None
        self._xx = np.zeros((6, 6))
        self._xy = np.zeros(6)
        # forgetting sums of weight, x, x² (P's over fused passes only)
        self._spread = {_SLOTS: [0.0, 0.0, 0.0], _CHUNK: [0.0, 0.0, 0.0], _FUSED: [0.0, 0.0, 0.0]}

    def observe(self, seconds: float, batch: int, tokens: int, slots: int, prompt_tokens: int = 0,
                fused: bool = False) -> None:
        """Fold one target pass: its `seconds`, running rows, query tokens, cache slots per row before it and
        (fused) the prompt tokens of the chunk it fed. A non-finite or non-positive time is ignored."""
        if not (math.isfinite(seconds) and seconds > 0) or batch < 1 or tokens < 1 or slots < 0:
            return
        fused = bool(fused and prompt_tokens > 0)
        x = np.array([1.0, batch, tokens, tokens * slots, prompt_tokens if fused else 0.0, float(fused)]) / _SCALES
        keep = 1.0 - self.alpha
        self._xx = keep * self._xx + np.outer(x, x)
        self._xy = keep * self._xy + x * seconds
        for i, sums in self._spread.items():
            if i == _CHUNK and not fused:
                continue
            sums[:] = [keep * sums[0] + 1.0, keep * sums[1] + x[i], keep * sums[2] + x[i] * x[i]]
        self.steps += 1
        self.fused_steps += fused
        lhs = self._xx + self.ridge * self._xx[0, 0] * np.eye(len(x))
        try:
            self._coef = np.linalg.solve(lhs, self._xy) / _SCALES
        except np.linalg.LinAlgError:
            self._coef = None

    def _varied(self, i: int) -> bool:
        """Whether feature i has varied enough (squared coefficient of variation ≥ 1%) to tell its slope."""
        w, s1, s2 = self._spread[i]
        if w <= 0 or s1 <= 0:
            return False
        mean = s1 / w
        return (s2 / w - mean * mean) / (mean * mean) >= 0.01

    def _mixed(self) -> bool:
        """Whether fused and unfused passes have both been common lately (each at least MIXED of them, forgetting
        as the fit does): what tells a fused pass's own part from the fixed part of every pass."""
        w, s1, _ = self._spread[_FUSED]
        return w > 0 and self.MIXED <= s1 / w <= 1.0 - self.MIXED

    @property
    def slot_seconds(self) -> float | None:
        """Seconds one query token's attention adds per cache slot (None: not fitted yet)."""
        if self._coef is None or self.steps < self.min_steps or not self._varied(_SLOTS):
            return None
        return max(0.0, float(self._coef[_SLOTS]))

    def chunk_seconds(self, prompt_tokens: int) -> float | None:
        """A fused chunk's share of its pass, feeding `prompt_tokens` prompt tokens: its per-token slope and the
        fused pass's own fixed part (None: not fitted yet)."""
        if self._coef is None or self.fused_steps < self.min_steps or not self._varied(_CHUNK):
            return None
        own = max(0.0, float(self._coef[_FUSED])) if self._mixed() else 0.0
        return max(0.0, float(self._coef[_CHUNK])) * prompt_tokens + own

    def __repr__(self) -> str:
        return (f"PassFit(slot_seconds={self.slot_seconds}, one_token_chunk={self.chunk_seconds(1)}, "
                f"steps={self.steps}, fused={self.fused_steps})")
