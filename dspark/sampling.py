"""Sampling parameters and the logits -> probabilities transform shared by drafters and the verifier."""
from __future__ import annotations

import math

from dataclasses import dataclass

import torch


SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        from dspark.arguments import int_problem, real_problem

        problems = {"temperature": real_problem(self.temperature, 0.0),
                    "top_k": int_problem(self.top_k, 0), "top_p": real_problem(self.top_p, 0.0, 1.0, low_open=True),
                    "seed": None if self.seed is None else int_problem(self.seed, SEED_RANGE[0], SEED_RANGE[1] - 1)}
        for name, problem in problems.items():
            if problem:
                note = {"top_k": " (0 disables it)", "seed": " or None"}.get(name, "")
                raise ValueError(f"{name} {problem.replace(', got', note + ', got', 1)}")

    @property
    def greedy(self) -> bool:
        """True when the request decodes by argmax."""
        return self.temperature == 0.0


@dataclass
class BatchSampling:
    """Per-request sampling parameters as tensors of shape [R] on one device."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str) -> "BatchSampling":
        """Stack a list of SamplingParams into tensors."""
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        )

    @property
    def greedy(self) -> torch.Tensor:
        """Bool [R]: rows that decode greedily."""
        return self.temperature == 0

    @property
    def divisor(self) -> torch.Tensor:
        """[R] temperature that logits are divided by (1 for greedy rows)."""
        return torch.where(self.greedy, torch.ones_like(self.temperature), self.temperature)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Return logits [R, L, V] with entries outside each row's top-k / top-p nucleus set to -inf.

    top_k and top_p have shape [R]; k = 0 and p = 1 keep everything. The most likely token always stays.
    """
    if bool((top_k == 0).all()) and bool((top_p >= 1.0).all()):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ranks = torch.arange(vocab, device=logits.device)
    remove |= ranks.view(1, 1, vocab) >= k.view(-1, 1, 1)
    masked_sorted = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(masked_sorted, dim=-1)
    # A token is dropped when the mass strictly before it already reaches top_p. Rows with top_p = 1 skip
    # the cut: in float32 the mass before a far-tail token can round to 1.0 and would drop it.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    remove |= (mass_before >= top_p.view(-1, 1, 1)) & (top_p < 1.0).view(-1, 1, 1)
    remove[..., 0] = False
    out = torch.full_like(logits, float("-inf"))
    return out.scatter(-1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))


def sampling_logits(logits: torch.Tensor, sampling: BatchSampling) -> torch.Tensor:
    """filter(logits / T) as float32 [R, L, V]: the log-weights each row samples from (T = 1 for greedy rows);
    float32 logits that need neither a division nor a filter are returned as they are (not a copy)."""
    scaled, divisor = logits.float(), sampling.divisor.view(-1, 1, 1)
    if not bool((divisor == 1).all()):  # x / 1 is x: temperature-1 batches skip a pass over [R, L, V]
        # divide in place when .float() made a copy (a float32 input is returned as is and must not change)
        scaled = scaled.div_(divisor) if scaled is not logits else scaled / divisor
    return filter_logits(scaled, sampling.top_k, sampling.top_p)


def probs_from_sampling_logits(scaled: torch.Tensor, sampling: BatchSampling) -> torch.Tensor:
    """softmax of `sampling_logits` output; greedy rows get the one-hot of their argmax."""
    return greedy_onehot(torch.softmax(scaled, dim=-1), scaled, sampling)


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1): the index of each row's largest entry, the first among ties, a NaN counting as largest.

    Taken as x.max(-1).indices, which gives the same indices: on a CPU torch's max reduction is 3-5x faster than
    its argmax (one thread: 2.2 against 10.9 ms over [64, 8, 8192] float32, 0.22 against 0.67 ms over
    [64, 8192]), and over bfloat16 it needs no float32 copy."""
    return x.max(-1).indices


def greedy_onehot(probs: torch.Tensor, scaled: torch.Tensor, sampling: BatchSampling) -> torch.Tensor:
    """`probs` [R, L, V] with each greedy row replaced by the one-hot of its argmax of `scaled`."""
    if bool(sampling.greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, argmax_last(scaled).unsqueeze(-1), 1.0)
        probs = torch.where(sampling.greedy.view(-1, 1, 1), onehot, probs)
    return probs


def logits_to_probs(logits: torch.Tensor, sampling: BatchSampling) -> torch.Tensor:
    """Return the sampling distribution [R, L, V] (float32) for logits [R, L, V].

    Sampled rows: softmax(filter(logits / T)). Greedy rows: one-hot on the argmax, the distribution a
    greedy decoder samples from.
    """
    return probs_from_sampling_logits(sampling_logits(logits, sampling), sampling)


def greedy_peaks(logits: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor | None:
    """max_x softmax(logits)(x) [R, L] (float32) for greedy rows of logits [R, L, V], NaN for sampled rows;
    None when no row is greedy. The peak at temperature 1 is what a greedy row's one-hot q hides."""
    if not bool(greedy.any()):
        return None
    rows = greedy.to(logits.device)
    # the softmax's own maximum: one fused pass, a third of amax + logsumexp's time on a CPU (0.10 against 0.32
    # ms at 4 rows, 7 slots, 8,192 tokens), and no copy of the rows when every row is greedy
    if bool(rows.all()):
        return torch.softmax(logits.float(), dim=-1).amax(-1)
    out = torch.full(logits.shape[:2], float("nan"), dtype=torch.float32, device=logits.device)
    out[rows] = torch.softmax(logits[rows].float(), dim=-1).amax(-1)
    return out


def row_uniforms(count: int, sampling: BatchSampling, generators, device) -> torch.Tensor:
    """U[0, 1) draws [R, count] in float64 from each sampled row's own generator (zeros for greedy rows): one
    small random call per row, for `sample_inverse_cdf`."""
    greedy = sampling.greedy.tolist()
    out = torch.zeros(len(greedy), count, dtype=torch.float64, device=device)
    for r, is_greedy in enumerate(greedy):
        if not is_greedy:
            out[r] = torch.rand(count, generator=generators[r], dtype=torch.float64, device=device)
    return out


#: on a CPU, vocabularies at least this large, in calls of at least TWO_LEVEL_MIN_ENTRIES rows × tokens, draw in
#: two levels (`_two_level`)
TWO_LEVEL_MIN_VOCAB = 4096
TWO_LEVEL_MIN_ENTRIES = 1 << 18
#: entries whose block sums `_two_level` takes at a time (a few rows: their float64 copies stay small)
_SUM_CHUNK = 1 << 16


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens [...] drawn from probs [..., V] (float32, each row summing to about 1) by the uniforms u [...]
    (float64, `row_uniforms`): the first token whose cumulative mass exceeds u times the row's total.

    The cumulative sums run in float64, so a token is drawn with its probability divided by the row's sum
    to within about 1e-16 (in float32 every token's share would be off by up to half an ulp of the running
    sum, ~6e-8, whatever its size). A zero-probability token is never drawn, and a one-hot row gives its
    token for any u. One uniform per token instead of Gumbel noise over the vocabulary: at 54 rows, 7 slots
    and V = 8192 on 2 CPU cores, about 4 ms against 26 ms (`benchmarks/results/inverse_cdf.txt`). Large calls
    draw in two levels (`_two_level`): the same tokens, without a float64 copy of every row.
    """
    vocab = probs.shape[-1]
    if probs.device.type == "cpu" and vocab >= TWO_LEVEL_MIN_VOCAB and probs.numel() >= TWO_LEVEL_MIN_ENTRIES:
        return _two_level(probs, u)  # on a GPU one cumulative sum is cheap; the loop over rows would not be
    return _one_level(probs, u)


def _one_level(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sample_inverse_cdf` by one float64 cumulative sum of every row."""
    cdf = probs.double().cumsum(-1)
    total = cdf[..., -1]
    point = torch.minimum(u.to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, point.unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)  # a row of NaN or zeros (dropped later) stays in range


def _two_level(probs: torch.Tensor, u: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """`sample_inverse_cdf` by blocks of `block` tokens (default about √V, a power of two): the float64 sums of
    every block, their cumulative sums to find the block the draw falls in, then the cumulative sums within that
    block only. Each cumulative mass is the same sum in another order, so a draw differs from the one-level
    draw only where the point lies within rounding (about 1e-16) of a boundary; the first token whose mass
    exceeds the point within the chosen block has mass, and so does the block. One torch thread, ms a call,
    one level against two (`benchmarks/inverse_cdf_levels.py`): 0.33 against 0.23 at 64 rows of 8,192 tokens,
    0.17 against 0.14 at 32 (0.09 against 0.10 at 16: below TWO_LEVEL_MIN_ENTRIES one level is used); 0.79
    against 0.42 at 8 rows of Qwen3's 151,936 tokens (8.1 where the C allocator maps fresh pages for the
    float64 copy, `dspark.host_memory`), 69 against 3.6 at 64 rows."""
    shape, vocab = probs.shape[:-1], probs.shape[-1]
    p = probs.reshape(-1, vocab)
    rows = p.shape[0]
    size = block or max(16, 1 << int(math.isqrt(vocab)).bit_length())
    full, rest = divmod(vocab, size)
    sums = torch.empty(rows, full + (rest > 0), dtype=torch.float64, device=p.device)
    step = max(1, _SUM_CHUNK // vocab)
    for r in range(0, rows, step):
        part = p[r : r + step]
        sums[r : r + step, :full] = part[:, : full * size].reshape(-1, full, size).sum(-1, dtype=torch.float64)
        if rest:
            sums[r : r + step, full] = part[:, full * size :].sum(-1, dtype=torch.float64)
    bounds = sums.cumsum(-1)
    total = bounds[:, -1]
    zero = torch.zeros_like(total)
    point = torch.minimum(u.reshape(-1).to(torch.float64) * total, torch.nextafter(total, zero))
    j = torch.searchsorted(bounds, point.unsqueeze(-1), right=True).squeeze(-1).clamp_(max=bounds.shape[1] - 1)
    before = torch.where(j > 0, bounds.gather(1, (j - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), zero)
    idx = (j * size).unsqueeze(-1) + torch.arange(size, device=p.device)
    inside = idx < vocab
    within = torch.where(inside, p.gather(1, idx.clamp(max=vocab - 1)), p.new_zeros(())).double().cumsum(-1)
    # the point within the block, kept below the block's own cumulative total (the same mass summed in order)
    local = torch.minimum((point - before).clamp(min=0.0), torch.nextafter(within[:, -1], zero))
    k = torch.searchsorted(within, local.unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    return (j * size + k).clamp_(max=vocab - 1).view(shape)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """Return a generator on `device`, seeded with `seed` (or from torch's global RNG when None)."""
    gen = torch.Generator(device=device)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    gen.manual_seed(seed)
    return gen
