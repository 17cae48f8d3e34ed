"""Losslessness of speculative decoding end to end, proven statistically through `decode`.

Many samples are rows of one `decode` call: the same prompt repeated, each row with its own seed. The
committed tokens' frequencies are compared with the target's exact distribution, computed by direct
forwards of the HF model (enumerating the earlier tokens) with the same temperature / top-k / top-p.

A request's first token comes from the prefill (no drafts); its first drafting round commits the second
and third. Tests with real drafters check the first three tokens jointly; the toy worlds are "primed"
(tests/lossless_worlds.py: the prompt token is followed by a known start token that behaves as token j),
so their first drafting round is as controlled as if the prompt were [j], and they check tokens 2 and 3.

Statistics. Every "must pass" check is a chi-square goodness-of-fit test (cells with expected count < 5
pooled) or a two-sided binomial z-test, each at false-alarm rate ALPHA = 1e-4; this file makes about 60
of them, so a correct implementation fails one with probability below 1% (the seeds are fixed, so a
run is reproducible). Every "must be caught" check (an anticipating policy or estimator) is set up so
that its bias is at least 9.7 standard errors, so a miss (a fluctuation of more than 5.8 standard errors
towards the target) has probability below 1e-8.

What is checked:
1. every drafter kind (n-gram, draft model, DFlash, DSpark with Markov + confidence heads, EAGLE-3) with
   its real q: joint distribution of the first three tokens, greedy rows identical to target-only greedy,
   draft limits 0..3 mixed in one batch, and the acceptance rate of draft 1 equal to Σ_x min(p, q) (each
   row's p and q given its first token);
2. toy worlds with explicit q tables: acceptance of draft 1 and conditional acceptance of draft 2 equal
   their exact expectations (this catches a verifier that drops q: still lossless, but wasteful);
3. non-anticipation: a survival estimate from the drafted token's own q(x_k) is caught (P(A) = 0.77
   instead of 0.7) while the shipped estimators pass; the paper's Appendix A world, where a global
   search without early stop gives (0.85, 0.15), is caught while fixed, threshold, dspark and
   dspark-async pass; on a staircase curve where dspark's look-ahead admits draft 1 before it sees the
   later survivals, dspark passes and the global search (0.775, 0.225) is caught;
4. random toy worlds with jagged cost curves and 4 requests per step: every shipped scheduler keeps the
   first drafting round's two tokens distributed as the target's;
5. the bundled target and DSpark drafter under every shipped scheduler at 4 concurrent requests.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2 as chi2_dist

import dspark
from dspark.api import encode_prompt
from dspark.calibration.maps import BinnedMap, Calibration, HeadLogisticMap, HeadTemperatureMap, LogisticMap
from dspark.decoding import decode, drafter_gamma
from dspark.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from dspark.drafters.block import BlockDrafter, DSparkModel
from dspark.drafters.dflash_model import DFlashConfig
from dspark.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Model
from dspark.engine import Engine, EngineConfig, Request
from dspark.sampling import SamplingParams
from dspark.scheduling import CostModel, Scheduler
from dspark.target import CausalLM
from tests.lossless_worlds import (
    HostedSteps,
    Recorder,
    TableDrafter,
    binomial_z,
    bernoulli_sum_z,
    combined_pvalue,
    exact_pair,
    exact_prefixes_sparse,
    exact_triple,
    gof_pvalue,
    jagged_cost_model,
    linear_cost_model,
    markov_target,
    next_probs,
    nth_token,
    pair_counts,
    primed,
    primed_table,
    primed_vector,
    prompt_token,
    scaled_random_qwen3,
    sparse_cells,
    start_token,
    triple_counts,
    two_sample,
    two_sided_z,
)

ALPHA = 1e-4  # false-alarm rate of each "must pass" test
Z = two_sided_z(ALPHA)  # ≈ 3.89

SHIPPED = ["fixed:2", "threshold:0.4", "batch-table:1=3,2=1,3=2,4=2", "dspark", "dspark-async"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Run this module on one intra-op thread: its work is many small ops, which two OpenMP threads do no
    faster, and on a busy machine (tests running side by side) their spin-waits made it 3× slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def seeded(params: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(params.temperature, params.top_k, params.top_p, seed)


# ------------------------------------------------------------------------------------------------------
# 1. every drafter kind with its real q, on a tiny random target with 8 tokens

VOCAB = 8
PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]  # every token occurs earlier, so the n-gram drafter always drafts after it
FEATURES = [0, 1, 2]
GROUPS = {"T1": SamplingParams(temperature=1.0), "T0.7-k5-p0.9": SamplingParams(temperature=0.7, top_k=5, top_p=0.9)}
LIMITS = (0, 1, 2, 3)
ROWS_PER_GROUP = 2000
GREEDY_ROWS = 8
KINDS = ["ngram", "draft-model", "dflash", "dspark", "eagle3"]


@pytest.fixture(scope="module")
def tiny_world():
    target = CausalLM(scaled_random_qwen3(VOCAB, layers=4, hidden=64, seed=5, head_std=0.12), feature_layers=FEATURES)
    exact = {name: exact_triple(target, PROMPT, p) for name, p in GROUPS.items()}
    greedy = decode(target, NoDrafter(), [PROMPT], SamplingParams(), max_new_tokens=4)[0].token_ids
    return target, exact, greedy


def build_drafter(kind: str, target: CausalLM):
    """A randomly initialised drafter of each kind for the tiny target (its q is whatever it reports)."""
    if kind == "ngram":
        return NgramDrafter(gamma=3)
    if kind == "draft-model":
        return DraftModelDrafter(CausalLM(scaled_random_qwen3(VOCAB, layers=1, hidden=32, seed=7, head_std=0.15)), gamma=3)
    if kind in ("dflash", "dspark"):
        heads = kind == "dspark"
        torch.manual_seed(11)
        cfg = DFlashConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           intermediate_size=128, num_hidden_layers=1, vocab_size=VOCAB, target_layer_ids=FEATURES,
                           mask_token_id=VOCAB - 1, block_size=3, markov_rank=4 if heads else 0,
                           enable_confidence_head=heads)
        model = DSparkModel(cfg)
        if heads:  # W2 starts at zero (a plain DFlash); make the Markov bias real so q_2 depends on x_1
            with torch.no_grad():
                model.markov_head.markov_w1.weight.normal_(0.0, 1.0)
                model.markov_head.markov_w2.weight.normal_(0.0, 0.7)
        return BlockDrafter(model, target, name=kind)
    assert kind == "eagle3"
    cfg = Eagle3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                       vocab_size=VOCAB, target_layer_ids=FEATURES, ttt_length=3)
    torch.manual_seed(12)
    return Eagle3Drafter(Eagle3Model(cfg), target, gamma=3)


@pytest.mark.parametrize("kind", KINDS)
def test_every_drafter_is_lossless_end_to_end(tiny_world, kind):
    """First three tokens ~ the target's joint distribution (the first from the prefill; the third a bonus
    token for rows with limit 1 whose draft passed, a corrected token or a verified draft otherwise); greedy
    rows equal target-only greedy decoding; draft 1 of the first drafting round is accepted with probability
    Σ_x min(p(x), q(x)), p and q given the row's first token."""
    target, exact, greedy_ref = tiny_world
    names = list(GROUPS)
    base = 1_000_003 * (KINDS.index(kind) + 1)
    sampled = [(names[i % 2], LIMITS[(i // 2) % len(LIMITS)]) for i in range(2 * ROWS_PER_GROUP)]
    params = [seeded(GROUPS[g], base + i) for i, (g, _) in enumerate(sampled)] + [SamplingParams()] * GREEDY_ROWS
    limits = [lim for _, lim in sampled] + [LIMITS[i % len(LIMITS)] for i in range(GREEDY_ROWS)]
    drafter = Recorder(build_drafter(kind, target))
    res = decode(target, drafter, [PROMPT] * len(params), params, max_new_tokens=4, draft_limits=limits)

    for r in res[len(sampled):]:
        assert r.token_ids == greedy_ref, kind
    block = drafter.first
    for g in names:
        rows = [i for i, (name, _) in enumerate(sampled) if name == g]
        assert gof_pvalue(triple_counts([res[i].token_ids for i in rows], VOCAB), exact[g]) > ALPHA, (kind, g)
        # acceptance of draft 1 in the first drafting round, against Σ min(p, q) of the q the drafter reported
        verified = [i for i in rows if res[i].rounds[1].draft_len >= 1]
        assert len(verified) > 0.7 * len(rows)
        pair = exact[g].sum(2)  # [x1, x2]
        betas = []
        for first in sorted({res[i].token_ids[0] for i in verified}):
            mine = [i for i in verified if res[i].token_ids[0] == first]
            p = pair[first] / pair[first].sum()  # the target's distribution of token 2 given token 1
            if block.probs is None:  # n-gram: a one-hot q on a draft looked up in the context
                betas += [float(p[int(block.tokens[i, 0])]) for i in mine]
            else:  # q depends on the context only: one q per first token
                q = block.probs[mine, 0].double()
                torch.testing.assert_close(q, q[:1].expand_as(q), atol=1e-5, rtol=1e-4)
                betas += [float(np.minimum(p, q[0].numpy()).sum())] * len(mine)
        accepted = sum(res[i].rounds[1].accepted >= 1 for i in sorted(verified, key=lambda i: res[i].token_ids[0]))
        z = bernoulli_sum_z(accepted, betas)
        assert abs(z) < Z, (kind, g, accepted / len(verified), float(np.mean(betas)))
    assert all(r.rounds[0].draft_len == 0 for r in res)  # the prefill's token
    assert {r.rounds[1].draft_len for r in res} == {0, 1, 2}  # limit 3 is capped by the token budget (4 − 1 − 1)


# ------------------------------------------------------------------------------------------------------
# 2. acceptance per position against its exact expectation, explicit q tables


def test_acceptance_per_position_matches_exact_expectation():
    """Draft 1 is accepted with probability β1 = Σ_x min(p1(x), q1(x)); given that, draft 2 is accepted with
    β2 = Σ_{x1} min(p1, q1)(x1) · Σ_x min(p2(x|x1), q2(x|x1)) / β1 (exact, from the tables and the target).

    A verifier that ignores q (treats drafts as one-hot) stays lossless but accepts with Σ_x q(x)p(x)
    instead, which this test tells apart."""
    vocab, n = 4, 2000
    g = torch.Generator().manual_seed(5)
    trans = torch.softmax(1.2 * torch.randn(vocab, vocab, generator=g), -1)
    target = markov_target(primed(trans))
    q1 = 0.5 * trans + 0.5 * torch.softmax(1.5 * torch.randn(vocab, vocab, generator=g), -1)
    q2 = 0.5 * trans + 0.5 * torch.softmax(1.5 * torch.randn(vocab, vocab, generator=g), -1)
    drafter = TableDrafter([primed_table(q1), primed_table(q2)])
    groups = {"T1": SamplingParams(temperature=1.0), "T0.7-k3": SamplingParams(temperature=0.7, top_k=3)}
    context = [prompt_token(0, vocab), start_token(0, vocab)]  # the first round drafts after token 0's twin
    params = [seeded(p, 77_000 + 2 * i + j) for i in range(n) for j, p in enumerate(groups.values())]
    res = decode(target, drafter, [context[:1]] * len(params), params, max_new_tokens=4,
                 draft_limits=[2] * len(params))
    for j, (name, p) in enumerate(groups.items()):
        rows = res[j::2]
        assert all(r.token_ids[0] == context[1] and r.rounds[1].draft_len == 2 for r in rows)
        p1 = next_probs(target, context, p).numpy()[:vocab]
        both = np.minimum(p1, q1[0].double().numpy())
        beta1 = both.sum()
        beta2 = sum(both[x] * np.minimum(next_probs(target, context + [x], p).numpy()[:vocab], q2[x].double().numpy()).sum()
                    for x in range(vocab)) / beta1
        first = sum(r.rounds[1].accepted >= 1 for r in rows)
        second = sum(r.rounds[1].accepted >= 2 for r in rows)
        assert abs(binomial_z(first, len(rows), beta1)) < Z, (name, first / len(rows), beta1)
        assert abs(binomial_z(second, first, beta2)) < Z, (name, second / first, beta2)
        counts = pair_counts([r.token_ids for r in rows], 3 * vocab, skip=1)
        assert gof_pvalue(counts, exact_pair(target, context, p)) > ALPHA


# ------------------------------------------------------------------------------------------------------
# 3a. survival estimators: the drafted token's own q(x_k) anticipates, the shipped signals do not

A_B = primed(torch.tensor([[0.7, 0.3], [0.7, 0.3]]))  # target: (0.7, 0.3) after either token
Q1 = primed_table(torch.tensor([[0.9, 0.1], [0.9, 0.1]]))  # draft 1 ~ (0.9, 0.1)
Q2 = primed_table(torch.tensor([[0.9, 0.1], [0.4, 0.6]]))  # draft 2 depends on draft 1
HEAD = [primed_vector(torch.tensor([0.8, 0.8])), primed_vector(torch.tensor([0.9, 0.3]))]  # c_1; c_2 after A, B
AB_PROMPT = [prompt_token(0, 2)]  # its first token is token 0's twin (not an end-of-sequence token)
T1 = SamplingParams(temperature=1.0)


def test_own_token_probability_estimator_is_caught():
    """Confidence c_k = q(x_k), threshold 0.5: x1 = A (q 0.9) is verified, x1 = B (q 0.1) is not and the
    target samples afresh, so P(A) = 0.9·(0.7/0.9) + 0.1·0.7 = 0.77 instead of 0.7 (n = 4000: 9.7 SE).
    A and B are end-of-sequence tokens, so each request stops after its first drafting round."""
    n = 4000
    target = markov_target(A_B)
    drafter = TableDrafter([Q1, Q2], confidences="own-q")
    params = [seeded(T1, 500_000 + i) for i in range(n)]
    res = decode(target, drafter, [AB_PROMPT] * n, params, max_new_tokens=4, scheduler="threshold:0.5",
                 eos_token_ids=frozenset({0, 1}))
    assert all(len(r.rounds) == 2 and len(r.token_ids) == 2 for r in res)
    second = np.array([r.token_ids[1] for r in res])
    assert {r.rounds[1].draft_len for r in res} == {0, 1, 2}
    assert gof_pvalue(np.bincount(second, minlength=2), np.array([0.7, 0.3])) < ALPHA
    assert abs(binomial_z(int((second == 0).sum()), n, 0.77)) < Z


@pytest.mark.parametrize("estimator", ["confidence-head", "q-signals", "binned-head", "joint-head"])
def test_shipped_survival_estimators_pass(estimator):
    """Same world, shipped estimators with threshold 0.5, where draft 2's admission depends on x1:
    the confidence head's cumprod (c_1 = 0.8; c_2 = 0.9 after A, 0.3 after B: it reads x_{k−1} only) and
    a logistic map of max q_k / entropy (q_2 depends on x_1). Tokens 2 and 3 must be (0.7, 0.3)²."""
    n = 4000
    target = markov_target(A_B)
    if estimator == "confidence-head":
        drafter = TableDrafter([Q1, Q2], confidences=HEAD)
    elif estimator == "binned-head":  # histogram bins on the head's cumprod: a_2 = 0.72 → 0.9, 0.24 → 0.2
        binned = BinnedMap(HeadTemperatureMap([1.0, 1.0]), edges=[[], [0.5]], values=[[0.8], [0.2, 0.9]])
        drafter = TableDrafter([Q1, Q2], confidences=HEAD, calibration=Calibration({1.0: binned}))
    elif estimator == "joint-head":  # sigmoid(3 + logit c_k + 10·log max q_k − 2·entropy): a_2 0.91 after A, 0.01 after B
        joint = HeadLogisticMap(head=[[0.0, 1.0]] * 2, weights=[[3.0, 1.0, 10.0, -2.0]] * 2)
        drafter = TableDrafter([Q1, Q2], confidences=HEAD, calibration=Calibration({1.0: joint}))
    else:  # c_k = sigmoid(3 + 10·log max q_k − 2·entropy(q_k)): 0.785 for q = (0.9, 0.1), 0.03 for (0.4, 0.6)
        cal = Calibration({1.0: LogisticMap(prior=[0.0, 0.0], weights=[[3.0, 10.0, -2.0], [3.0, 10.0, -2.0]])})
        drafter = TableDrafter([Q1, Q2], calibration=cal)
    offset = {"confidence-head": 0, "q-signals": 10_000, "binned-head": 20_000, "joint-head": 30_000}[estimator]
    params = [seeded(T1, 600_000 + offset + i) for i in range(n)]
    res = decode(target, drafter, [AB_PROMPT] * n, params, max_new_tokens=4, scheduler="threshold:0.5")
    lengths = {r.rounds[1].draft_len for r in res}
    assert lengths == {1, 2}  # the estimate does steer admission of draft 2
    joint = np.zeros((6, 6))
    joint[:2, :2] = np.outer([0.7, 0.3], [0.7, 0.3])
    assert gof_pvalue(pair_counts([r.token_ids for r in res], 6, skip=1), joint) > ALPHA


# ------------------------------------------------------------------------------------------------------
# 3b. the paper's Appendix A world

APPENDIX_COST = CostModel(drafted={1: [(1, 1.0), (2, 2.0), (3, 1 / 0.45)]}, plain={1: 1.0}, layout="ragged")
APPENDIX_SPECS = ["global-search", "dspark", "dspark-async", "threshold:0.7", "fixed"]
APPENDIX_ROWS = 100_000  # 20,000 per policy


def test_appendix_a_global_search_is_caught_and_shipped_policies_pass():
    """Vocabulary {A, B}; target (0.7, 0.3); draft (0.5, 0.5); c_1 = 0.8, c_2 = 0.9 after A else 0 (the
    confidence reads x_1); one request per step with SPS(1..3) = 1, 0.5, 0.45, so Θ = 1.0, 0.9, then 1.134
    after A or 0.81 after B. A global argmax over the current block verifies 2 drafts after A and none
    after B: P(A) = 0.5 + 0.5·0.7 = 0.85 (z ≈ 46 at 20,000 samples). Algorithm 1 stops at Θ1 < Θ0;
    dspark-async takes its capacity from the survivals of an earlier step of the same request; threshold
    0.7 admits draft 2 after A only (allowed: it depends on x_1, not on x_2); fixed verifies both.

    decode hosts 100,000 independent one-request steps (HostedSteps, group size 1), each scheduled by the
    real policy object on that request's survivals alone; all tokens are end-of-sequence tokens, so each
    request ends after its first drafting round (the prefill gives token 0's twin, which is not one)."""
    target = markov_target(A_B)
    half = primed_table(torch.full((2, 2), 0.5))
    drafter = TableDrafter([half, half], confidences=[primed_vector(torch.tensor([0.8, 0.8])),
                                                      primed_vector(torch.tensor([0.9, 0.0]))])
    # two earlier blocks of each request (x1 ~ (0.5, 0.5)), the stale survivals dspark-async reads
    old_first = np.random.default_rng(0).integers(0, 2, size=(APPENDIX_ROWS, 2))
    old = {0: np.array([0.8, 0.72]), 1: np.array([0.8, 0.8e-6])}

    def history(ids):
        return [np.stack([old[int(old_first[i, j])] for i in ids]) for j in range(2)]

    host = HostedSteps(APPENDIX_SPECS, gamma=2, group_size=1, history=history, memo=True)
    params = [seeded(T1, 9_000_000 + i) for i in range(APPENDIX_ROWS)]
    res = decode(target, drafter, [AB_PROMPT] * APPENDIX_ROWS, params, max_new_tokens=4, scheduler=host,
                 cost_model=APPENDIX_COST, eos_token_ids=frozenset({0, 1}), online_cost=False)
    assert all(len(r.rounds) == 2 and len(r.token_ids) == 2 for r in res)
    expected_lengths = {"global-search": {0, 2}, "dspark": {0}, "dspark-async": {0, 2}, "threshold:0.7": {1, 2},
                        "fixed": {2}}
    check_ab_first_tokens(res, APPENDIX_SPECS, expected_lengths, biased_a=0.85)


def check_ab_first_tokens(res, specs: list[str], expected_lengths: dict[str, set[int]], biased_a: float) -> None:
    """Rows of `res` take turns over `specs`; per spec the first drafting round verified the expected draft
    counts, and its token follows (0.7, 0.3), except under an anticipating policy (the global search, the width
    from the current block), whose P(A) is `biased_a`."""
    for k, spec in enumerate(specs):
        rows = res[k :: len(specs)]
        assert {r.rounds[1].draft_len for r in rows} == expected_lengths[spec], spec
        first = np.array([r.token_ids[1] for r in rows])  # the first drafting round's token
        p = gof_pvalue(np.bincount(first, minlength=2), np.array([0.7, 0.3]))
        if spec in ("global-search", "current-width"):
            assert p < ALPHA
            assert abs(binomial_z(int((first == 0).sum()), len(first), biased_a)) < Z
        else:
            assert p > ALPHA, (spec, (first == 0).mean())


def one_round_ab_steps(confidences: list[list[float]], specs: list[str], cost: CostModel, rows: int, seed: int):
    """`rows` one-request steps in the A/B world (target (0.7, 0.3), every draft (0.5, 0.5), c_k after A and B as
    given), each request ending after its first drafting round; the steps take turns over `specs`."""
    half = primed_table(torch.full((2, 2), 0.5))
    drafter = TableDrafter([half] * len(confidences),
                           confidences=[primed_vector(torch.tensor(c)) for c in confidences])
    host = HostedSteps(specs, gamma=len(confidences), group_size=1, memo=True)
    params = [seeded(T1, seed + i) for i in range(rows)]
    res = decode(markov_target(A_B), drafter, [AB_PROMPT] * rows, params, max_new_tokens=len(confidences) + 2,
                 scheduler=host, cost_model=cost, eos_token_ids=frozenset({0, 1}), online_cost=False)
    assert all(len(r.rounds) == 2 for r in res)
    return res


# A staircase: leaving the first cell costs a one-off jump (N = 2..3 at 2.7), after which a token is cheap
# (N = 4 at 2.75). Filling the cell draft 1 opens cannot beat Θ0 = 1 ((1 + 2·0.8) / 2.7 = 0.96), but the
# next cell could ((1 + 3·0.8) / 2.75 = 1.24), so dspark admits draft 1 before it sees a_2 or a_3.
STAIRCASE_COST = CostModel(drafted={1: [(1, 1.0), (3, 2.7), (4, 2.75)]}, plain={1: 1.0}, layout="ragged")
STAIRCASE_SPECS = ["global-search", "dspark"]
STAIRCASE_ROWS = 40_000  # 20,000 per policy


def test_staircase_lookahead_of_dspark_stays_lossless():
    """The Appendix A world with three drafts (c_1 = 0.8; c_2 = 0.9 and c_3 = 0.95 after A, else 0) on a
    stepped curve where dspark's look-ahead past a one-off jump admits draft 1 whatever follows: after A, A
    it verifies 3 drafts (Θ = 1.165), otherwise 2 (the cell is paid; after B the look-ahead's price, Θ 0.67
    < Θ0, with a near-zero a_2 riding along). The decision on draft 1 reads a_1 and the limits only, so the first
    token follows (0.7, 0.3). A global argmax over the current block verifies 3 after A, A and none
    otherwise: P(A) = 0.25 + 0.75·0.7 = 0.775 (23 standard errors from 0.7 at 20,000 samples), caught."""
    res = one_round_ab_steps([[0.8, 0.8], [0.9, 0.0], [0.95, 0.0]], STAIRCASE_SPECS, STAIRCASE_COST, STAIRCASE_ROWS,
                             12_000_000)
    expected_lengths = {"global-search": {0, 3}, "dspark": {2, 3}}  # the paper's stop would give {0}
    check_ab_first_tokens(res, STAIRCASE_SPECS, expected_lengths, biased_a=0.775)


# The same staircase in the padded layout, where dspark opens whole widths (`_width_cut`): width 1 opens on the
# bound of widths 2..3 at a_1 ((1 + 3·0.8) / 2.75 = 1.24 > Θ0 = 1); width 2 after A (bound (2.52 + 0.72) / 2.75
# = 1.18 > Θ1 = 0.67) and after B too, where the cell is paid and a near-zero a_2 (the calibration's floor) rides
# along; width 3 after A, A (Θ3 = 1.17 > Θ2 = 0.93), not after A, B (a_3 near zero, the next cell costs).
PADDED_STAIRCASE_COST = CostModel(drafted={1: [(1, 1.0), (3, 2.7), (4, 2.75)]}, plain={1: 1.0}, layout="padded")


def test_padded_width_cut_of_dspark_stays_lossless():
    """The staircase world in the padded layout: dspark verifies 3 drafts after A, A and 2 otherwise (each
    width opened on survivals up to it), the global argmax 3 or none (caught, P(A) = 0.775 as in the ragged
    layout). The first token follows (0.7, 0.3) under dspark."""
    res = one_round_ab_steps([[0.8, 0.8], [0.9, 0.0], [0.95, 0.0]], STAIRCASE_SPECS, PADDED_STAIRCASE_COST,
                             STAIRCASE_ROWS, 13_000_000)
    expected_lengths = {"global-search": {0, 3}, "dspark": {2, 3}}
    check_ab_first_tokens(res, STAIRCASE_SPECS, expected_lengths, biased_a=0.775)


# Drafting costs 0.3 of a step per slot: a step drafting one slot instead of two is 0.3 cheaper. At the full
# width Θ = 1, 1.8 / 1.7 = 1.06, then 2.52 / 1.72 = 1.47 after A; drafting one slot, Θ = 1 / 0.7 = 1.43 and
# 1.8 / 1.4 = 1.29.
WIDTH_COST = CostModel(drafted={1: [(1, 1.0), (2, 1.7), (3, 1.72)]}, plain={1: 1.0}, layout="ragged",
                       draft_slot={1: 0.3}, width=2)
WIDTH_SPECS = ["current-width", "dspark"]
WIDTH_ROWS = 40_000  # 20,000 per policy


def test_width_from_the_current_block_is_caught_and_dspark_passes():
    """The Appendix A world (c_1 = 0.8; c_2 = 0.9 after A, else 0) with a drafter whose slots cost: the best
    width of the block after A is 2 (Θ 1.47 > 1.43), after B 1 (a_2 = 0: the second slot buys nothing), and a
    one-slot step verifies nothing (Θ1 1.29 < Θ0 1.43). So a width chosen from the current block verifies
    2 drafts after A and none after B: P(A) = 0.5 + 0.5·0.7 = 0.85, caught. dspark chooses the width before
    drafting, from the last finished step (here each request's first: the whole block), and verifies draft
    1 after either token (Θ1 1.06 > Θ0 at the full width)."""
    res = one_round_ab_steps([[0.8, 0.8], [0.9, 0.0]], WIDTH_SPECS, WIDTH_COST, WIDTH_ROWS, 14_000_000)
    check_ab_first_tokens(res, WIDTH_SPECS, {"current-width": {0, 2}, "dspark": {1, 2}}, biased_a=0.85)


WIDTH_STEPS_REQUESTS = 1_200  # 300 per prompt


def test_dspark_choosing_its_width_across_steps_stays_lossless():
    """One dspark scheduler runs every step of a continuously batched engine (4 running requests, each
    joining while others are mid-way), over the random world of seed 4 with a drafter that drafts only the
    width asked for and a jagged cost curve whose slots cost: the width changes from step to step, chosen
    from earlier steps' survivals (those of other requests as much as the joining request's). Tokens 2 and 3
    of each prompt must follow the target's exact joint distribution."""
    target, drafter, vocab, gamma = random_world(4)
    cost = jagged_cost_model(GROUP_SIZE, gamma, "padded", np.random.default_rng(4))
    cost = CostModel(cost.drafted, cost.plain, cost.layout,
                     draft_slot={b: 0.15 * cost.plain[b] for b in cost.plain}, width=gamma)
    widths = []
    engine = Engine(target, drafter, "dspark", cost,
                    EngineConfig(max_running=GROUP_SIZE, max_waiting=WIDTH_STEPS_REQUESTS, online_cost=False,
                                 detokenize=False),
                    on_step=lambda info: widths.append(info.draft_width))
    reqs = [Request([prompt_token(i % GROUP_SIZE, vocab)], seeded(T1, 50_000_000 + i), max_tokens=4)
            for i in range(WIDTH_STEPS_REQUESTS)]
    for req in reqs:
        engine.add(req)
    while engine.has_work:
        engine.step()
    assert set(widths) - {None} == set(range(1, gamma + 1)), sorted(set(widths) - {None})  # the width moves
    parts = []
    for j in range(GROUP_SIZE):
        exact = exact_pair(target, [prompt_token(j, vocab), start_token(j, vocab)], T1)
        rows = [r.output_ids for i, r in enumerate(reqs) if i % GROUP_SIZE == j]
        parts.append((pair_counts(rows, 3 * vocab, skip=1), exact))
    assert combined_pvalue(parts) > ALPHA


# ------------------------------------------------------------------------------------------------------
# 4. random toy worlds, every shipped scheduler, 4 requests per step


def random_world(seed: int):
    """Markov target over 5 tokens (primed: prompt_token(j) starts the answer with token j's twin), a 3-draft
    table drafter near it, confidences that read x_{k−1}."""
    vocab, gamma = 5, 3
    g = torch.Generator().manual_seed(seed)
    trans = torch.softmax(1.5 * torch.randn(vocab, vocab, generator=g), -1)
    mix = torch.rand(gamma, 1, 1, generator=g) * 0.6 + 0.2
    tables = [m * trans + (1 - m) * torch.softmax(2.0 * torch.randn(vocab, vocab, generator=g), -1) for m in mix]
    conf = [0.2 + 0.75 * torch.rand(vocab, generator=g) for _ in range(gamma)]
    drafter = TableDrafter([primed_table(t) for t in tables], confidences=[primed_vector(c) for c in conf])
    return markov_target(primed(trans)), drafter, vocab, gamma


RANDOM_GROUPS = {"T1": SamplingParams(temperature=1.0), "T0.7-k3-p0.9": SamplingParams(temperature=0.7, top_k=3, top_p=0.9)}
GROUP_SIZE = 4
STEPS_PER_CELL = 250  # 4-request steps per (policy, sampling): 1,000 samples


@pytest.mark.parametrize("seed", [4, 5])
def test_random_worlds_every_shipped_scheduler(seed):
    """Requests come in steps of 4 (the first drafting rounds anchor on the twins of tokens 0, 1, 2, 3:
    different q_1 and c_1); each step is scheduled by one shipped policy with a random staircase cost curve
    (ragged or padded); dspark-async starts with two earlier steps' survivals. Tokens 2 and 3 of each prompt
    must follow the target's exact joint distribution, per policy and sampling setting (one chi-square over
    the 4 prompts: statistics and degrees of freedom add)."""
    target, drafter, vocab, gamma = random_world(seed)
    rng = np.random.default_rng(seed)
    cost = jagged_cost_model(GROUP_SIZE, gamma, ["ragged", "padded"][seed % 2], rng)
    old_rng = np.random.default_rng(seed + 100)

    def history(ids):
        return [np.cumprod(old_rng.uniform(0.2, 0.95, size=(len(ids), gamma)), axis=1) for _ in range(2)]

    host = HostedSteps(SHIPPED, gamma, GROUP_SIZE, history=history)
    names = list(RANDOM_GROUPS)
    steps = len(SHIPPED) * len(names) * STEPS_PER_CELL
    prompts, params = [], []
    for s in range(steps):
        setting = RANDOM_GROUPS[names[(s // len(SHIPPED)) % len(names)]]
        for j in range(GROUP_SIZE):
            prompts.append([prompt_token(j, vocab)])
            params.append(seeded(setting, 31_000_000 * seed + GROUP_SIZE * s + j))
    res = decode(target, drafter, prompts, params, max_new_tokens=4, scheduler=host, cost_model=cost,
                 online_cost=False)
    exact = {(name, j): exact_pair(target, [prompt_token(j, vocab), start_token(j, vocab)], RANDOM_GROUPS[name])
             for name in names for j in range(GROUP_SIZE)}
    for k, spec in enumerate(SHIPPED):
        if Scheduler(spec, gamma).needs_survival:  # the survivals do steer these policies' first steps
            first_steps = [res[GROUP_SIZE * s + j] for s in range(k, steps, len(SHIPPED)) for j in range(GROUP_SIZE)]
            assert len({r.rounds[1].draft_len for r in first_steps}) > 1, spec
        for t, name in enumerate(names):
            parts = []
            for j in range(GROUP_SIZE):
                rows = [res[GROUP_SIZE * s + j] for s in range(steps)
                        if s % len(SHIPPED) == k and (s // len(SHIPPED)) % len(names) == t]
                parts.append((pair_counts([r.token_ids for r in rows], 3 * vocab, skip=1), exact[(name, j)]))
            assert combined_pvalue(parts) > ALPHA, (seed, spec, name)


# ------------------------------------------------------------------------------------------------------
# 5. the bundled target and DSpark drafter

BUNDLED_TEXTS = ["I like", "The cat", "Hello,", "for i in"]  # 2-3 tokens: short prefills
# top-k 8: in every context enumerated here the 8th and 9th logits differ by ≥ 2e-4, far above the float32
# noise between decode's batched forwards and the direct forwards of the exact distribution
BUNDLED_SAMPLING = SamplingParams(temperature=1.0, top_k=8)
BUNDLED_STEPS = 60  # 4-request steps per policy: 240 samples per policy, 60 per prompt
BUNDLED_SPECS = ["fixed", "threshold:0.5", "batch-table", "dspark", "dspark-async"]


def pair_code(tokens) -> int:
    """Tokens 2 and 3 of a request as one category (END where the request ended earlier)."""
    return (nth_token(tokens, 1) + 1) * 1_000_000 + nth_token(tokens, 2) + 1


def test_bundled_dspark_every_shipped_scheduler():
    """4 concurrent requests (4 different prompts) per step, each step scheduled by one shipped policy over
    the bundled DSpark drafter's confidence head (its first 2 slots: the budget of the first drafting round
    with max_new_tokens 4 is 2 drafts anyway; drafting all 7 slots of an 8192-token vocabulary would triple
    the drafting time).
    Per policy: the first three tokens of each prompt (the prefill's and the first drafting round's two)
    against the target's exact joint distribution (direct forwards, top-k 8); all policies pooled: tokens 2
    and 3 (as one category) against target-only decoding (a two-sample chi-square per prompt, added up)."""
    target = dspark.load_target(dtype="float32")
    drafter = dspark.load_drafter("dspark", target, gamma=2, calibration=None)  # the raw confidence head
    cost = linear_cost_model(GROUP_SIZE, 2, per_draft=0.12)
    prompts = [encode_prompt(target, t, chat=False) for t in BUNDLED_TEXTS]
    stale_rng = np.random.default_rng(7)

    def history(ids):  # two earlier steps' survivals, so dspark-async plans from stale survivals at once
        return [np.cumprod(stale_rng.uniform(0.4, 0.9, size=(len(ids), 2)), axis=1) for _ in range(2)]

    host = HostedSteps(BUNDLED_SPECS, drafter_gamma(drafter), GROUP_SIZE, history=history)
    steps = len(BUNDLED_SPECS) * BUNDLED_STEPS
    rows = [prompts[j] for _ in range(steps) for j in range(GROUP_SIZE)]
    params = [seeded(BUNDLED_SAMPLING, 40_000_000 + i) for i in range(len(rows))]
    res = decode(target, drafter, rows, params, max_new_tokens=4, scheduler=host, cost_model=cost,
                 online_cost=False)
    exact = [exact_prefixes_sparse(target, p, BUNDLED_SAMPLING, 3, target.eos_token_ids) for p in prompts]
    for k, spec in enumerate(BUNDLED_SPECS):
        parts = []
        for j in range(GROUP_SIZE):
            mine = [res[GROUP_SIZE * s + j] for s in range(k, steps, len(BUNDLED_SPECS))]
            parts.append(sparse_cells([r.token_ids for r in mine], exact[j]))
        assert combined_pvalue(parts) > ALPHA, spec
    drafted = [r.rounds[1] for r in res if len(r.rounds) > 1]
    assert len({rs.draft_len for rs in drafted}) > 1 and sum(rs.accepted for rs in drafted) > 0

    n_ref = 200
    ref = decode(target, NoDrafter(), [p for p in prompts for _ in range(n_ref)],
                 [seeded(BUNDLED_SAMPLING, 50_000_000 + i) for i in range(GROUP_SIZE * n_ref)], max_new_tokens=3)
    stat, dof = 0.0, 0
    for j in range(GROUP_SIZE):
        spec_pairs = np.array([pair_code(res[i].token_ids) for i in range(j, len(res), GROUP_SIZE)])
        ref_pairs = np.array([pair_code(r.token_ids) for r in ref[j * n_ref : (j + 1) * n_ref]])
        s, d = two_sample(spec_pairs, ref_pairs)
        stat, dof = stat + s, dof + d
    assert dof > 0 and chi2_dist.sf(stat, dof) > ALPHA
