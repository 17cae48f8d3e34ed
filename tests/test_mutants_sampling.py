"""Tests written to kill surviving mutants of `dspark.sampling` (benchmarks/mutation_test.sh).

Row uniforms and inverse-CDF sampling (which rows draw, from which generator, and that the draw follows
the probabilities, never picking a zero-probability token), generators (seeded, unseeded), and the top-k /
top-p filter at its boundaries.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.sampling import (
    BatchSampling,
    SamplingParams,
    filter_logits,
    logits_to_probs,
    make_generator,
    probs_from_sampling_logits,
    row_uniforms,
    sample_inverse_cdf,
    sampling_logits,
)

PARAMS = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.5, top_k=3)]
SEEDS = (11, 22, 33)


def gens():
    return [torch.Generator().manual_seed(s) for s in SEEDS]


def test_row_uniforms_draw_each_sampled_row_from_its_own_generator():
    sampling = BatchSampling.from_params(PARAMS, "cpu")
    g = gens()
    u = row_uniforms(4, sampling, g, "cpu")
    assert u.shape == (3, 4) and u.dtype == torch.float64 and u.device.type == "cpu"
    for r in (0, 2):
        expected = torch.rand(4, generator=torch.Generator().manual_seed(SEEDS[r]), dtype=torch.float64)
        assert torch.equal(u[r], expected)
    assert (u[1] == 0).all()  # the greedy row draws nothing ...
    assert torch.equal(g[1].get_state(), torch.Generator().manual_seed(SEEDS[1]).get_state())  # ... from its generator


def test_row_uniforms_are_made_on_the_requested_device():
    sampling = BatchSampling.from_params(PARAMS, "cpu")
    expected = row_uniforms(3, sampling, gens(), "cpu")
    with torch.device("meta"):  # a default device other than the requested one must not be used
        got = row_uniforms(3, sampling, gens(), "cpu")
    assert torch.equal(got, expected)


def test_inverse_cdf_samples_the_probabilities():
    """Frequencies of 20,000 draws within 4.5 standard errors of the probabilities (0 for a token of
    probability 0, including the first and the last)."""
    n = 20_000
    probs = torch.softmax(torch.tensor([float("-inf"), 1.0, 0.0, -1.0, 2.0, float("-inf")]), -1)
    u = torch.rand(n, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    counts = torch.bincount(sample_inverse_cdf(probs.expand(n, -1), u), minlength=6).double()
    p = probs.double()
    sigma = (p * (1 - p) / n).sqrt()
    assert ((counts / n - p).abs() <= 4.5 * sigma + 1e-12).all(), (counts / n, p)


def test_inverse_cdf_at_the_ends_of_the_unit_interval_picks_a_possible_token():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 3)
    u = torch.tensor([0.0, 0.25 - 1e-12, 1.0 - 1e-17], dtype=torch.float64)  # the last rounds to 1
    assert sample_inverse_cdf(probs, u).tolist() == [1, 1, 3]
    onehot = torch.tensor([[0.0, 0.0, 1.0, 0.0]] * 3)
    assert sample_inverse_cdf(onehot, torch.tensor([0.0, 0.5, 1.0])).tolist() == [2, 2, 2]
    unnormalised = torch.tensor([[2.0, 2.0]])  # the draw scales u by the row's total
    assert sample_inverse_cdf(unnormalised, torch.tensor([0.6])).tolist() == [1]
    batched = sample_inverse_cdf(probs.view(1, 3, 5), u.view(1, 3))  # any leading shape
    assert batched.shape == (1, 3) and batched.tolist() == [[1, 1, 3]]


def test_two_level_draws_are_the_one_level_draws_and_never_a_token_without_mass():
    """`_two_level` (block sums, then one block's cumulative sums; large calls on a CPU take it) draws the token the
    whole-row cumulative sum draws: random rows with a third of their tokens at 0, the ends of the unit interval,
    one-hot rows, a vocabulary that is not a multiple of the block, and leading dimensions."""
    from dspark.sampling import _one_level as one_level, _two_level

    gen = torch.Generator().manual_seed(3)
    for vocab, block in ((8192, None), (1000, 64), (1000, 7)):
        for sharpness in (0.5, 3.0, 12.0):
            probs = torch.softmax(sharpness * torch.randn(48, vocab, generator=gen), -1)
            probs[torch.rand(48, vocab, generator=gen) < 0.33] = 0.0
            u = torch.rand(48, generator=gen, dtype=torch.float64)
            u[:3] = torch.tensor([0.0, 1.0 - 1e-17, 0.5], dtype=torch.float64)
            got = _two_level(probs, u, block)
            assert torch.equal(got, one_level(probs, u)), (vocab, block, sharpness)
            assert (probs.gather(1, got.unsqueeze(1)) > 0).all()
    onehot = torch.zeros(2, 3, 1000)
    onehot[..., 999] = 1.0
    assert _two_level(onehot, torch.tensor([[0.0, 0.5, 1.0]] * 2, dtype=torch.float64), 64).tolist() == [[999] * 3] * 2


def test_large_calls_draw_in_two_levels_with_the_probabilities():
    """A call of 64 rows × 8,192 tokens takes the two-level path; frequencies over 40,000 draws of one row's
    distribution stay within 4.5 standard errors of its probabilities on its 8 likeliest tokens and their rest."""
    from dspark import sampling

    assert 64 * 8192 >= sampling.TWO_LEVEL_MIN_ENTRIES and 8192 >= sampling.TWO_LEVEL_MIN_VOCAB
    gen = torch.Generator().manual_seed(4)
    row = torch.softmax(2.0 * torch.randn(8192, generator=gen), -1)
    top = row.topk(8).indices
    counts = torch.zeros(9, dtype=torch.float64)
    for _ in range(625):  # 625 calls of 64 rows
        picks = sample_inverse_cdf(row.expand(64, -1).contiguous(), torch.rand(64, generator=gen, dtype=torch.float64))
        hit = picks.unsqueeze(1) == top.unsqueeze(0)
        counts[:8] += hit.sum(0).double()
        counts[8] += float((~hit.any(1)).sum())
    n = counts.sum()
    p = torch.cat([row[top], (1 - row[top].sum()).view(1)]).double()
    sigma = (p * (1 - p) / n).sqrt()
    assert ((counts / n - p).abs() <= 4.5 * sigma + 1e-12).all(), (counts / n, p)


def test_seeded_generators_repeat_and_unseeded_ones_differ():
    a, b = make_generator(1234, "cpu"), make_generator(1234, "cpu")
    assert a.initial_seed() == 1234 and torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    torch.manual_seed(0)
    seeds = [make_generator(None, "cpu").initial_seed() for _ in range(200)]
    assert len(set(seeds)) == 200  # unseeded requests never share a stream
    torch.manual_seed(0)
    assert make_generator(None, "cpu").initial_seed() == seeds[0]  # drawn from torch's global RNG


# ------------------------------------------------------------------------------------------------------
# the filter


def test_batch_sampling_tensors_live_on_the_requested_device():
    with torch.device("meta"):
        s = BatchSampling.from_params(PARAMS, "cpu")
    for t, dtype in ((s.temperature, torch.float32), (s.top_k, torch.long), (s.top_p, torch.float32)):
        assert t.device.type == "cpu" and t.dtype == dtype
    assert s.temperature.tolist() == [1.0, 0.0, 0.5] and s.top_k.tolist() == [0, 0, 3]
    assert s.greedy.tolist() == [False, True, False] and s.divisor.tolist() == [1.0, 1.0, 0.5]


def test_batch_sampling_dtypes_do_not_follow_the_default_dtype():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        s = BatchSampling.from_params(PARAMS, "cpu")
        out = sampling_logits(torch.zeros(3, 1, 4), s)
    finally:
        torch.set_default_dtype(before)
    assert (s.temperature.dtype, s.top_k.dtype, s.top_p.dtype) == (torch.float32, torch.long, torch.float32)
    assert out.dtype == torch.float32


def test_disabled_filters_return_the_logits_untouched():
    """top_k 0 and top_p 1 on every row: no sort, no cumulative sum. (Through the filter, the tail below
    token 0 would be dropped: 1 − p0 ≈ 1.4e-8 is below float32 resolution, so its mass before rounds to 1.)"""
    logits = torch.tensor([10.0] + [-12.0] * 49 + [-20.0] * 50).view(1, 1, 100)
    out = filter_logits(logits, torch.tensor([0]), torch.tensor([1.0]))
    assert torch.equal(out, logits)


def test_mass_before_equal_to_top_p_drops_the_token():
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0]).log().view(1, 1, 4)  # p = 0.5, 0.25, 0.25, 0 exactly
    out = filter_logits(logits, torch.tensor([0]), torch.tensor([0.75]))
    assert torch.isfinite(out[0, 0]).tolist() == [True, True, False, False]  # mass before token 3: 0.75 ≥ 0.75


def test_top_k_removes_the_rest_even_when_their_mass_before_is_below_one():
    """The two kept probabilities sum to 0.99999994 in float32: top-p 1 alone would keep the third token."""
    logits = torch.tensor([0.0, -0.2, -5.0, -6.0]).view(1, 1, 4)
    out = filter_logits(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(out[0, 0]).tolist() == [True, True, False, False]


def test_top_k_one_keeps_only_the_argmax_and_k_beyond_the_vocabulary_keeps_all():
    logits = torch.tensor([[[0.5, 2.0, 1.0, -1.0]], [[0.5, 2.0, 1.0, -1.0]], [[0.5, 2.0, 1.0, -1.0]]])
    out = filter_logits(logits, torch.tensor([1, 9, 0]), torch.tensor([1.0, 1.0, 1.0]))
    assert torch.isfinite(out[0, 0]).tolist() == [False, True, False, False]
    assert torch.equal(out[1:], logits[1:])


@pytest.mark.parametrize("top_k", [0, 3])
def test_top_p_only_rows_are_filtered_and_kept_logits_are_unchanged(top_k):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().view(1, 1, 4).repeat(2, 3, 1)  # two rows, three positions each
    out = filter_logits(logits, torch.tensor([top_k, 0]), torch.tensor([0.7, 1.0]))
    keep = torch.isfinite(out)
    assert keep[0].tolist() == [[True, True, False, False]] * 3  # 0.5 < 0.7, 0.5 + 0.3 ≥ 0.7
    assert keep[1].all()
    assert torch.equal(out[keep], logits[keep])


def test_sampling_logits_divide_by_temperature_and_greedy_rows_by_one():
    logits = torch.tensor([[[1.0, 3.0, 2.0]], [[1.0, 3.0, 2.0]], [[1.0, 3.0, 2.0]]], dtype=torch.float64)
    s = BatchSampling.from_params(PARAMS, "cpu")
    out = sampling_logits(logits, s)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out[0], logits[0].float())
    torch.testing.assert_close(out[1], logits[1].float())
    torch.testing.assert_close(out[2], logits[2].float() / 0.5)


def test_greedy_rows_are_one_hot_beside_sampled_rows_at_every_position():
    logits = torch.tensor([[[1.0, 3.0, 2.0], [4.0, 0.0, 1.0]]] * 3)
    s = BatchSampling.from_params(PARAMS, "cpu")
    probs = probs_from_sampling_logits(sampling_logits(logits, s), s)
    assert probs[1].tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    torch.testing.assert_close(probs[0], torch.softmax(logits[0], -1))
    torch.testing.assert_close(probs[2], torch.softmax(logits[2] / 0.5, -1))
    torch.testing.assert_close(logits_to_probs(logits, s), probs)
    only_sampled = BatchSampling.from_params([PARAMS[0]], "cpu")
    torch.testing.assert_close(logits_to_probs(logits[:1], only_sampled)[0], torch.softmax(logits[0], -1))


# ------------------------------------------------------------------------------------------------------
# a real defect found by the mutation run (filter_logits mutants 2, 5, 6, 7 showed that the top-p cut was not
# a no-op at top_p = 1), fixed in dspark/sampling.py: rows with top_p = 1 skip the cut

TAIL = torch.tensor([10.0] + [-12.0] * 49 + [-20.0] * 50).view(1, 1, 100)  # 1 − p0 ≈ 1.4e-8 < float32 resolution


def test_top_p_one_keeps_every_token_beside_a_row_that_filters():
    logits = TAIL.expand(2, 1, 100)
    out = filter_logits(logits, torch.tensor([0, 0]), torch.tensor([1.0, 0.9]))
    assert torch.equal(out[0], logits[0])  # row 0 filters nothing, as when it is alone in its batch


def test_top_k_with_top_p_one_keeps_all_k_tokens():
    out = filter_logits(TAIL, torch.tensor([50]), torch.tensor([1.0]))
    assert int(torch.isfinite(out).sum()) == 50


# ------------------------------------------------------------------------------------------------------
# survivors of the full run (2026-12-02)


def test_disabled_filters_pass_the_logits_through_without_a_copy():
    """With top_k 0 and top_p 1 on every row the filter is a no-op that returns its input itself: no sort, no
    cumulative sum, no [R, L, V] copy (greedy and plain-temperature batches take this path every round)."""
    logits = torch.randn(3, 2, 11, generator=torch.Generator().manual_seed(0))
    assert filter_logits(logits, torch.tensor([0, 0, 0]), torch.tensor([1.0, 1.0, 1.0])) is logits
    # any filtering row, or a top_p below 1, takes the sorting path (a new tensor)
    assert filter_logits(logits, torch.tensor([0, 0, 5]), torch.tensor([1.0, 1.0, 1.0])) is not logits
    assert filter_logits(logits, torch.tensor([0, 0, 0]), torch.tensor([1.0, 0.9, 1.0])) is not logits


def test_top_k_of_a_narrow_integer_type_filters_a_wide_vocabulary():
    """SamplingParams takes any integer type for top_k (numpy's too); the batch stacks it as int64, so a top-k
    given as an int16 still filters a vocabulary wider than int16 can count (151,936 tokens for Qwen3)."""
    params = [SamplingParams(temperature=1.0, top_k=np.int16(2)), SamplingParams(temperature=1.0, top_k=np.int16(0))]
    s = BatchSampling.from_params(params, "cpu")
    assert s.top_k.dtype == torch.long and s.top_k.tolist() == [2, 0]
    vocab = 40_000
    logits = torch.zeros(2, 1, vocab)
    logits[:, 0, 7], logits[:, 0, 33_000] = 3.0, 2.0
    probs = logits_to_probs(logits, s)
    assert probs[0, 0].nonzero().flatten().tolist() == [7, 33_000]  # top-2 of 40,000
    assert bool((probs[1, 0] > 0).all())  # top_k 0: nothing filtered
