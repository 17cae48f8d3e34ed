"""What a decoding step costs outside its round, learned online: seconds ≈ a + c·B + b·T.

A step's round (drafting, the target pass, verification) is priced by the profiled table; everything else the
engine does between two rounds (a prefill chunk, joins and leaves, commit and streaming, the wait for the next
step) is measured here per step with its rows B and committed tokens T. Prefills (with their joins) are paid
per committed token in the long run: requests finish, and new ones take their rows, at a rate of tokens per
second over the mean output length, but the prefill a step runs serves the requests that finished before it,
so it is priced by the ratio of its sum to the sum of committed tokens. The rest (bookkeeping, commit and
streaming, the wait) is fitted against B and T by exponentially forgetting least squares.

Only the fixed part a + c·B enters a step's cost in the schedulers. The per-token part b·T cannot change a
decision: a step's true rate is T / (C + a + c·B + b·T) = 1 / ((C + a + c·B) / T + b), which ranks choices
exactly as T / (C + a + c·B) does. Pricing the overhead as its mean per step instead (a + c·B + b·T̄) counts the
per-token part as a fixed cost that longer verified blocks amortise, which over-rewards drafting where most
of the overhead grows with the tokens committed.
"""
from __future__ import annotations

import math

import numpy as np


class StepOverhead:
    """Online fit of a step's seconds outside its round against its rows B and committed tokens T.

    `fixed(B)` = a + c·B (≥ 0) is what the cost model adds to every step; `per_token` = b and
    `prefill_per_token` are reported only.
    Slopes are kept non-negative; while the observations do not vary enough to separate them (fewer than
    `min_steps`, or B and T constant), the fit falls back to the plain weighted mean.
    """

    def __init__(self, intercept: float = 0.0, per_row: float = 0.0, per_token: float = 0.0,
                 alpha: float = 0.02, min_steps: int = 8) -> None:
        for name, value in (("intercept", intercept), ("per_row", per_row), ("per_token", per_token)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"step overhead {name} must be a finite number ≥ 0, got {value}")
        if not 0 < alpha <= 1:
            raise ValueError(f"step overhead alpha must lie in (0, 1], got {alpha}")
        self.intercept, self.per_row, self.per_token = float(intercept), float(per_row), float(per_token)
        self.prefill_per_token = 0.0
        self.alpha = float(alpha)
        self.min_steps = int(min_steps)
        self.steps = 0
        # exponentially weighted sums of 1, B, T, y, B², B·T, T², B·y, T·y
        self._sums = np.zeros(9)
        self._prefill = np.zeros(2)  # exponentially weighted sums of prefill seconds and committed tokens

    def fixed(self, rows: int) -> float:
        """Seconds every step of `rows` requests pays outside its round, whatever it commits: a + c·B."""
        return max(0.0, self.intercept + self.per_row * rows)

    def predict(self, rows: int, tokens: int) -> float:
        """Seconds outside the round of a step of `rows` requests that commits `tokens` tokens, in the long run
        (prefills included at their rate per committed token)."""
        return self.fixed(rows) + (self.per_token + self.prefill_per_token) * tokens

    def observe(self, seconds: float, rows: int, tokens: int, prefill_seconds: float = 0.0) -> None:
        """Fold one step into the fit: `seconds` outside its round, of which `prefill_seconds` prefilled (and
        joined) new requests. A non-finite or negative time is ignored."""
        if not (math.isfinite(seconds) and seconds >= 0) or rows < 0 or tokens < 0:
            return
        prefill = min(seconds, prefill_seconds) if math.isfinite(prefill_seconds) and prefill_seconds > 0 else 0.0
        self._prefill *= 1.0 - self.alpha
        self._prefill += (prefill, float(tokens))
        if self._prefill[1] > 0:
            self.prefill_per_token = float(self._prefill[0] / self._prefill[1])
        b, t, y = float(rows), float(tokens), float(seconds - prefill)
        self._sums *= 1.0 - self.alpha
        self._sums += (1.0, b, t, y, b * b, b * t, t * t, b * y, t * y)
        self.steps += 1
        self._refit()

    def _refit(self) -> None:
        w, sb, st, sy, sbb, sbt, stt, sby, sty = self._sums
        mb, mt, my = sb / w, st / w, sy / w
        cov = np.array([[sbb / w - mb * mb, sbt / w - mb * mt], [sbt / w - mb * mt, stt / w - mt * mt]])
        rhs = np.array([sby / w - mb * my, sty / w - mt * my])
        slopes = np.zeros(2)
        if self.steps >= self.min_steps:
            slopes = _nonnegative_slopes(cov, rhs)
        self.per_row, self.per_token = float(slopes[0]), float(slopes[1])
        self.intercept = float(my - slopes[0] * mb - slopes[1] * mt)

    def __repr__(self) -> str:
        return (f"StepOverhead(intercept={self.intercept:.4g}, per_row={self.per_row:.4g}, "
                f"per_token={self.per_token:.4g}, prefill_per_token={self.prefill_per_token:.4g}, steps={self.steps})")


def _nonnegative_slopes(cov: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Least-squares slopes ≥ 0 from centred moments: the best of the four active sets. A feature that barely
    varies gets no slope; when B and T move together (plain steps commit one token per row) the rows take it,
    so the overhead stays priced per step, as the mean would."""
    var = np.diag(cov)
    usable = var > 1e-9 * (1.0 + np.abs(var).max())
    best, best_loss = np.zeros(2), 0.0
    for subset in ([0], [1], [0, 1]):
        if not all(usable[i] for i in subset):
            continue
        sub = cov[np.ix_(subset, subset)]
        if len(subset) == 2 and cov[0, 1] ** 2 >= 0.999 * var[0] * var[1]:
            continue  # B and T move together: the two slopes cannot be told apart
        coef = np.linalg.solve(sub, rhs[subset])
        if (coef < 0).any():
            continue
        slopes = np.zeros(2)
        slopes[subset] = coef
        loss = float(slopes @ cov @ slopes - 2 * slopes @ rhs)  # residual variance up to a constant
        if loss < best_loss:
            best, best_loss = slopes, loss
    return best
