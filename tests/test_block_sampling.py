"""The bundled DSpark drafters (Markov and RNN heads) sample exactly the distribution q they report to the verifier.

Many rows of one batch share a prompt, each with its own generator. Slot 0's drafts must follow q at
slot 0; slot 1's drafts, among rows whose slot-0 draft is the same token, must follow q at slot 1,
which the Markov head makes depend on that token. Chi-square tests at false-alarm rate ALPHA; q at slot
1 must also differ from the backbone's distribution without the head (the head is really used).
"""
import copy

import numpy as np
import pytest
import torch

import dspark
from dspark.api import encode_prompt
from dspark.sampling import BatchSampling, SamplingParams
from tests.test_verify import ALPHA, chi2_pvalue

ROWS = 6000
CHUNK = 1000


def follows(samples: np.ndarray, q: torch.Tensor) -> bool:
    """Chi-square goodness of fit of samples to q; a one-token support must be sampled every time."""
    probs = q.numpy().astype(np.float64)
    if (probs > 0).sum() == 1:
        return bool((samples == probs.argmax()).all())
    return chi2_pvalue(samples, probs) > ALPHA


def draw(drafter, target, ids, params: SamplingParams, rows=ROWS, seed=0):
    """tokens [rows, 2] and q [rows, 2, V] from `rows` independent proposals after prompt `ids`."""
    target.reset(1)
    target.set_feature_layers(drafter.feature_layers)
    feats = target.forward([ids[:-1]], features=True).features
    tokens, probs = [], []
    for start in range(0, rows, CHUNK):
        n = min(CHUNK, rows - start)
        drafter.start([ids] * n, feats.expand(n, -1, -1))
        sampling = BatchSampling.from_params([params] * n, "cpu")
        gens = [torch.Generator().manual_seed(seed * rows + start + i) for i in range(n)]
        block = drafter.propose([ids] * n, sampling, gens)
        tokens.append(block.tokens)
        probs.append(block.probs)
    return torch.cat(tokens).numpy(), None if probs[0] is None else torch.cat(probs)


@pytest.mark.parametrize(
    "name,params",
    [("dspark", SamplingParams(temperature=1.0)),
     ("dspark", SamplingParams(temperature=0.8, top_k=20, top_p=0.9)),
     ("dspark-rnn", SamplingParams(temperature=0.7))],  # the stateful head, temperature without filtering
    ids=["markov-T1", "markov-T0.8-topk20-topp0.9", "rnn-T0.7"],
)
def test_dspark_drafts_follow_reported_q(bundled_target, name, params, candidates=None):
    drafter = dspark.load_drafter(name, bundled_target, gamma=2)
    drafter.bias_candidates = candidates
    ids = encode_prompt(bundled_target, "Write a poem about the sea.")  # several likely first tokens
    tokens, q = draw(drafter, bundled_target, ids, params)
    assert torch.allclose(q[:, 0], q[:1, 0].expand_as(q[:, 0]))  # slot 0 does not depend on the noise
    assert follows(tokens[:, 0], q[0, 0])
    first = np.bincount(tokens[:, 0]).argmax()
    rows = np.flatnonzero(tokens[:, 0] == first)
    assert len(rows) >= 200
    q1 = q[rows[0], 1]
    assert torch.allclose(q[rows, 1], q1.expand(len(rows), -1))
    assert follows(tokens[rows, 1], q1)
    # slot 1's q depends on the slot-0 draft through the Markov head
    other = np.flatnonzero(tokens[:, 0] != first)[0]
    assert (q[other, 1] - q1).abs().sum() > 0.05

    plain = copy.copy(drafter)
    plain.model = copy.deepcopy(drafter.model)
    plain.model.markov_head = None
    plain.model.confidence_head = None
    _, q_plain = draw(plain, bundled_target, ids, params, rows=1)
    assert 0.5 * (q1 - q_plain[0, 1]).abs().sum() > 0.05  # the head changes the distribution sampled from


def test_dflash_block_sampling_follows_q(bundled_target):
    drafter = dspark.load_drafter("dflash", bundled_target, gamma=2)
    ids = encode_prompt(bundled_target, "What is a tuple?")
    tokens, q = draw(drafter, bundled_target, ids, SamplingParams(temperature=1.0), rows=2000, seed=1)
    for k in range(2):
        assert follows(tokens[:, k], q[0, k])


def test_candidate_drafts_follow_reported_q(bundled_target):
    """The Markov bias on each slot's top-64 base candidates only: drafts still follow the q reported."""
    test_dspark_drafts_follow_reported_q(bundled_target, "dspark", SamplingParams(temperature=1.0), candidates=64)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9)],
                         ids=["greedy", "T0.8-topk20-topp0.9"])
def test_candidates_over_whole_vocabulary_equal_the_full_bias(bundled_target, params):
    full = dspark.load_drafter("dspark", bundled_target)
    cand = dspark.load_drafter("dspark", bundled_target)
    cand.bias_candidates = bundled_target.vocab_size
    ids = encode_prompt(bundled_target, "Write a poem about the sea.")
    a_tokens, a_q = draw(full, bundled_target, ids, params, rows=64, seed=3)
    b_tokens, b_q = draw(cand, bundled_target, ids, params, rows=64, seed=3)
    assert (a_tokens == b_tokens).all()
    if a_q is not None:
        assert torch.allclose(a_q, b_q, atol=1e-5)


def test_candidate_drafting_is_lossless_and_restricted(bundled_target):
    from dspark.decoding import decode
    from dspark.drafters import NoDrafter

    drafter = dspark.load_drafter("dspark", bundled_target)
    drafter.bias_candidates = 4
    prompts = [encode_prompt(bundled_target, t) for t in ("def add(a, b):", "Name three colours.")]
    want = [r.token_ids for r in decode(bundled_target, NoDrafter(), prompts, max_new_tokens=24)]
    got = decode(bundled_target, drafter, prompts, max_new_tokens=24)
    assert [r.token_ids for r in got] == want
    assert sum(s.accepted for r in got for s in r.rounds) > 0
    _, q = draw(drafter, bundled_target, prompts[1], SamplingParams(temperature=1.0), rows=50, seed=4)
    support = (q > 0).sum(-1)
    assert int(support.max()) <= 4 and torch.allclose(q.sum(-1), torch.ones_like(q.sum(-1)))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9)],
                         ids=["greedy", "T0.8-topk20-topp0.9"])
def test_markov_table_equals_the_rank_r_product(bundled_target, params):
    """The cached rows of the V×V Markov bias table draft the same tokens with the same q as W1[x]·W2ᵀ per slot."""
    table = dspark.load_drafter("dspark", bundled_target)
    product = dspark.load_drafter("dspark", bundled_target)
    product.markov_table = False
    assert table.markov_table  # the bundled vocabulary (8192) is within the default table budget
    ids = encode_prompt(bundled_target, "Write a poem about the sea.")
    a_tokens, a_q = draw(table, bundled_target, ids, params, rows=64, seed=5)
    b_tokens, b_q = draw(product, bundled_target, ids, params, rows=64, seed=5)
    filled = int(table._markov_table_filled.sum())  # rows are computed only for tokens that preceded a slot
    assert 1 < filled < bundled_target.vocab_size and not hasattr(product, "_markov_table_cache")
    assert (a_tokens == b_tokens).all()
    if a_q is not None:
        assert torch.allclose(a_q, b_q, atol=1e-5)


def test_markov_table_fills_at_once_past_an_eighth(bundled_target):
    """Row by row while few tokens have been seen; past 1/32 of the vocabulary, the whole table in one product."""
    drafter = dspark.load_drafter("dspark", bundled_target)
    vocab = bundled_target.vocab_size
    w1, w2t = drafter._markov_weights()
    few = torch.arange(10, 20)
    torch.testing.assert_close(drafter._markov_rows_for(few), w1[few] @ w2t)
    assert drafter._markov_rows_for(None) is None  # not full yet: the loop asks row by row
    assert int(drafter._markov_table_filled.sum()) == 10
    many = torch.arange(0, vocab // 32)
    drafter._markov_rows_for(many)
    assert bool(drafter._markov_table_filled.all())
    torch.testing.assert_close(drafter._markov_rows_for(None), w1 @ w2t)


def test_prepare_computes_the_whole_markov_table_before_drafting(bundled_target):
    """`prepare` (what `dspark serve` calls before taking requests) fills every row of the table, so no
    drafting call pays for the fill; drafts and q stay those of the rank-r product."""
    drafter = dspark.load_drafter("dspark", bundled_target)
    product = dspark.load_drafter("dspark", bundled_target)
    product.markov_table = False
    drafter.prepare()
    assert bool(drafter._markov_table_filled.all())
    w1, w2t = drafter._markov_weights()
    torch.testing.assert_close(drafter._markov_rows_for(None), w1 @ w2t)
    product.prepare()  # no table kept: nothing to build
    assert not hasattr(product, "_markov_table_cache")
    ids = encode_prompt(bundled_target, "Write a poem about the sea.")
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    a_tokens, a_q = draw(drafter, bundled_target, ids, params, rows=16, seed=3)
    b_tokens, b_q = draw(product, bundled_target, ids, params, rows=16, seed=3)
    assert (a_tokens == b_tokens).all()
    torch.testing.assert_close(a_q, b_q, atol=1e-5, rtol=0)
