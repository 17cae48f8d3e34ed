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
        # exponentially weighted sums of 1, B, T, y, B², B·T, T², B·y, T·y (plain floats: this runs every step,
        # and numpy's per-call cost on 2×2 arrays was about 1% of a step at 32 rows)
        self._sums = [0.0] * 9
        self._prefill = [0.0, 0.0]  # exponentially weighted sums of prefill seconds and committed tokens

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
        keep = 1.0 - self.alpha
        self._prefill = [keep * self._prefill[0] + prefill, keep * self._prefill[1] + float(tokens)]
        if self._prefill[1] > 0:
            self.prefill_per_token = self._prefill[0] / self._prefill[1]
        b, t, y = float(rows), float(tokens), float(seconds - prefill)
        self._sums = [keep * s + x for s, x in zip(self._sums, (1.0, b, t, y, b * b, b * t, t * t, b * y, t * y))]
        self.steps += 1
        self._refit()

    def _refit(self) -> None:
        w, sb, st, sy, sbb, sbt, stt, sby, sty = self._sums
        mb, mt, my = sb / w, st / w, sy / w
        cov = (sbb / w - mb * mb, sbt / w - mb * mt, stt / w - mt * mt)
        rhs = (sby / w - mb * my, sty / w - mt * my)
        slopes = _nonnegative_slopes(cov, rhs) if self.steps >= self.min_steps else (0.0, 0.0)
        self.per_row, self.per_token = slopes
        self.intercept = my - slopes[0] * mb - slopes[1] * mt

    def __repr__(self) -> str:
        return (f"StepOverhead(intercept={self.intercept:.4g}, per_row={self.per_row:.4g}, "
                f"per_token={self.per_token:.4g}, prefill_per_token={self.prefill_per_token:.4g}, steps={self.steps})")


def _nonnegative_slopes(cov: tuple[float, float, float], rhs: tuple[float, float]) -> tuple[float, float]:
    """Least-squares slopes ≥ 0 from centred moments (cov = var B, cov(B, T), var T; rhs = cov(B, y), cov(T, y)):
    the best of the four active sets. A feature that barely varies gets no slope; when B and T move together
    (plain steps commit one token per row) the rows take it, so the overhead stays priced per step, as the mean
    would."""
    vbb, vbt, vtt = cov
    rb, rt = rhs
    tiny = 1e-9 * (1.0 + max(abs(vbb), abs(vtt)))
    candidates: list[tuple[float, float]] = []
    if vbb > tiny:
        candidates.append((rb / vbb, 0.0))
    if vtt > tiny:
        candidates.append((0.0, rt / vtt))
    if vbb > tiny and vtt > tiny and vbt * vbt < 0.999 * vbb * vtt:  # else B and T cannot be told apart
        det = vbb * vtt - vbt * vbt
        candidates.append(((vtt * rb - vbt * rt) / det, (vbb * rt - vbt * rb) / det))
    best, best_loss = (0.0, 0.0), 0.0
    for c, b in candidates:
        if c < 0 or b < 0:
            continue
        loss = c * c * vbb + 2 * c * b * vbt + b * b * vtt - 2 * (c * rb + b * rt)  # residual variance + const
        if loss < best_loss:
            best, best_loss = (c, b), loss
    return best
