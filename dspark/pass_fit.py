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
(N·S), the chunk's prompt tokens P, and whether it was fused (a packed pass: its own fixed part). The N·S slope
prices the context (`CostModel.set_context`); P's slope is the chunk's share, which the engine takes off a fused
round before the cost model's correction sees it (benchmarks/results/serving/pass_fit/).
"""
from __future__ import annotations

import math

import numpy as np

# feature scales that keep the normal equations well conditioned: a loaded step's rows, query tokens, query ×
# slot pairs and prompt tokens are each about 1 after scaling
_SCALES = np.array([1.0, 64.0, 512.0, 512.0 * 512.0, 256.0, 1.0])
_SLOTS, _CHUNK = 3, 4  # indices of N·S and P


class PassFit:
    """Online fit of target passes: seconds ≈ f + a·B + n·N + s·N·S + p·P + u·fused (s, p ≥ 0 when read).

    `slot_seconds` = s, or None until `min_steps` passes whose N·S varied (relative to its mean) were seen;
    `chunk_seconds(P)` = p·P, or None until `min_steps` fused passes with chunks of differing sizes.
    """

    def __init__(self, alpha: float = 0.02, min_steps: int = 16, ridge: float = 1e-3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"pass fit alpha must lie in (0, 1], got {alpha}")
        self.alpha, self.min_steps, self.ridge = float(alpha), int(min_steps), float(ridge)
        self.steps = self.fused_steps = 0
        self._coef: np.ndarray | None = None
        self._xx = np.zeros((6, 6))
        self._xy = np.zeros(6)
        self._spread = {_SLOTS: [0.0, 0.0, 0.0], _CHUNK: [0.0, 0.0, 0.0]}  # forgetting sums of weight, x, x²

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

    @property
    def slot_seconds(self) -> float | None:
        """Seconds one query token's attention adds per cache slot (None: not fitted yet)."""
        if self._coef is None or self.steps < self.min_steps or not self._varied(_SLOTS):
            return None
        return max(0.0, float(self._coef[_SLOTS]))

    def chunk_seconds(self, prompt_tokens: int) -> float | None:
        """A fused chunk's share of its pass, feeding `prompt_tokens` prompt tokens (None: not fitted yet)."""
        if self._coef is None or self.fused_steps < self.min_steps or not self._varied(_CHUNK):
            return None
        return max(0.0, float(self._coef[_CHUNK])) * prompt_tokens

    def __repr__(self) -> str:
        return (f"PassFit(slot_seconds={self.slot_seconds}, per_prompt_token={self.chunk_seconds(1)}, "
                f"steps={self.steps}, fused={self.fused_steps})")
