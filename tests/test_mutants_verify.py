"""Tests written to kill surviving mutants of `dspark.verify` (benchmarks/mutation_test.sh).

Each test pins down one behaviour of `verify` that the statistical suite (tests/test_verify.py) does not
single out: where its tensors live, what it does with a draft outside both supports, and its argument check.
"""
from __future__ import annotations

import pytest
import torch

from dspark.sampling import BatchSampling, SamplingParams
from dspark.verify import _reaches_total, verify


def _mixed_batch():
    """Four rows: greedy, sampled with q, sampled with a partial draft, sampled without drafts."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 4, 7, generator=g) * 2.0
    drafts = torch.randint(0, 7, (4, 3), generator=g)
    drafts[0] = logits[0, :3].argmax(-1)
    drafts[0, 2] = (drafts[0, 2] + 1) % 7  # the greedy row accepts two drafts, then corrects
    lens = torch.tensor([3, 3, 2, 0])
    q = torch.softmax(torch.randn(4, 3, 7, generator=g), -1)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=2), SamplingParams(temperature=1.3, seed=3)]
    return logits, drafts, lens, q, params


@pytest.mark.parametrize("with_q", [True, False])
def test_verify_keeps_every_tensor_on_the_inputs_device(with_q):
    """verify creates its tensors on target_logits' device, never on torch's default device: under a
    different default device (here "meta", as a CPU stand-in for `torch.set_default_device("cuda")`) it
    returns the same result as without one."""
    logits, drafts, lens, q, params = _mixed_batch()
    probs = q if with_q else None

    def run():
        sampling = BatchSampling.from_params(params, "cpu")
        gens = [torch.Generator().manual_seed(100 + r) for r in range(4)]
        return verify(logits, drafts, lens, probs, sampling, gens)

    expected = run()
    assert expected.accepted[0] == 2 and expected.accepted[3] == 0
    with torch.device("meta"):
        got = run()
    assert (got.accepted, got.tokens) == (expected.accepted, expected.tokens)


@pytest.mark.parametrize("with_q", [True, False])
def test_a_draft_outside_both_supports_is_rejected_and_corrected_from_p(with_q):
    """The target puts all its mass on token 0 (top-k 1) and so does q, but the draft is token 1:
    p(1) = q(1) = 0, so the draft must be rejected every time (accepting it would commit a token of
    probability 0), and max(0, p - q) is zero everywhere, so the corrected token comes from p itself."""
    n = 64
    logits = torch.tensor([[3.0, 1.0, 0.5], [3.0, 1.0, 0.5]]).expand(n, -1, -1)
    drafts = torch.ones(n, 1, dtype=torch.long)
    q = torch.tensor([[1.0, 0.0, 0.0]]).expand(n, -1, -1) if with_q else None
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(n)], "cpu")
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    res = verify(logits, drafts, torch.ones(n, dtype=torch.long), q, sampling, gens)
    assert res.accepted == [0] * n
    assert res.tokens == [[0]] * n


def test_a_draft_of_target_probability_zero_is_never_accepted_even_when_q_is_zero_too():
    """u·q(x) < p(x) with q(x) = p(x) = 0 is false for every u: such a draft is never accepted, while a draft
    with q(x) = 0 < p(x) always is."""
    n = 64
    # target (after top-k 2): tokens 0 and 1; q puts no mass on tokens 1 and 2
    logits = torch.tensor([[2.0, 1.5, -1.0], [0.0, 0.0, 0.0]]).expand(n, -1, -1)
    q = torch.tensor([[1.0, 0.0, 0.0]]).expand(n, -1, -1)
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0, top_k=2)] * n, "cpu")
    for draft, accepted in ((2, 0), (1, 1)):
        gens = [torch.Generator().manual_seed(i) for i in range(n)]
        res = verify(logits, torch.full((n, 1), draft), torch.ones(n, dtype=torch.long), q, sampling, gens)
        assert res.accepted == [accepted] * n, draft
        if accepted == 0:  # corrected from max(0, p - q): only token 1 has p > q
            assert res.tokens == [[1]] * n


def test_too_few_draft_columns_fail_naming_both_widths():
    logits = torch.zeros(1, 3, 5)
    sampling = BatchSampling.from_params([SamplingParams()], "cpu")
    with pytest.raises(ValueError, match=r"^draft_tokens has 1 columns, target_logits implies 2$"):
        verify(logits, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), None, sampling, [torch.Generator()])
    # more columns than the logits imply are fine: the extra ones are ignored
    res = verify(logits, torch.zeros(1, 4, dtype=torch.long), torch.tensor([2]), None, sampling, [torch.Generator()])
    assert res.accepted == [2] and res.tokens == [[0, 0, 0]]


def test_a_draw_is_capped_at_the_first_token_where_the_cdf_reaches_its_total():
    """The cap on an inverse-CDF draw is a token with mass: after trailing zeros the last token with mass;
    where trailing masses are too small to move a float32 cdf, the first token at the total (which has mass:
    the cdf rose there); a one-token distribution, that token."""
    dist = torch.tensor([[0.2, 0.0, 0.5, 0.3, 0.0, 0.0], [0.0, 1.0, 1e-12, 0.0, 0.0, 0.0],
                         [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]], dtype=torch.float32)
    cap = _reaches_total(dist.cumsum(-1))
    assert cap.tolist() == [3, 1, 5]
    assert all(dist[r, c] > 0 for r, c in enumerate(cap.tolist()))
