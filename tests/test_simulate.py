"""The trace-driven scheduler simulator on hand-made and random synthetic traces (no models)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dspark.calibration.maps import ConstantMap, HeadTemperatureMap
from dspark.evaluation.simulate import (
    OutcomeOracle,
    Trace,
    TraceRequest,
    concurrency_sweep,
    format_concurrency_table,
    gpu_cost_model,
    plot_concurrency_sweep,
    plot_threshold_sweep,
    simulate,
    threshold_sweep,
    trace_from_results,
)
from dspark.scheduling import CostModel, Scheduler, uniform_cost_model

GAMMA = 7


def synthetic_trace(num_requests: int = 24, rounds: int = 30, seed: int = 0, domain: str = "synthetic") -> Trace:
    """Rounds whose confidence logits are the true conditional acceptance probabilities (a calibrated head).

    Rounds are a mixture of easy (c ≈ 0.9), middling and hard (c ≈ 0.15) blocks, so survivals differ
    between rows and positions and an informed scheduler has something to choose.
    """
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_requests):
        level = rng.choice([0.92, 0.6, 0.15], size=(rounds, 1), p=[0.4, 0.3, 0.3])
        c = np.clip(level * rng.uniform(0.85, 1.05, size=(rounds, GAMMA)), 0.02, 0.98)
        hits = rng.random((rounds, GAMMA)) < c
        accepted = np.cumprod(hits, axis=1).sum(1)
        sig = np.full((rounds, GAMMA, 3), np.nan, np.float32)
        sig[..., 0] = np.log(c) - np.log1p(-c)
        requests.append(TraceRequest.build(accepted, gamma=GAMMA, signals=sig))
    return Trace(requests, temperature=0.0, gamma=GAMMA, domain=domain, drafter="synthetic")


def exact_map() -> HeadTemperatureMap:
    return HeadTemperatureMap([1.0] * GAMMA)


def test_min_l_a_accounting_on_a_hand_made_trace():
    r0 = TraceRequest.build([3, 0, 2], available=[3, 3, 3], gamma=4, tokens=6)
    r1 = TraceRequest.build([1, 2, 0], available=[2, 2, 2], gamma=4, tokens=6)
    trace = Trace([r0, r1], temperature=0.0, gamma=4)
    cost = uniform_cost_model(gamma=4, batches=(1, 2, 4))
    res = simulate(trace, "fixed:2", cost, ConstantMap([0.5] * 4), concurrency=2, steps=3)
    # step 1: r0 verifies 2 of limit 3, accepts min(2,3)=2 -> 3 tokens; r1 verifies 2, accepts 1 -> 2 tokens
    # step 2: r0 (3 left) verifies 2, accepts 0 -> 1; r1 (4 left) verifies 2, accepts 2 -> 3
    # step 3: r0 (2 left) limit 1, accepts 1 -> 2 (done); r1 (1 left) limit 0 -> 1 (done)
    seconds = 2 * cost.cost(2, 2 + 4) + cost.cost(2, 2 + 1)
    assert res.tokens == 12 and res.steps == 3 and res.finished == 2
    assert res.seconds == pytest.approx(seconds)
    assert res.tokens_per_s == pytest.approx(12 / seconds)
    assert res.tau == pytest.approx(2.0)
    assert res.verified_per_step == pytest.approx(9 / 3)
    assert res.wasted_per_step == pytest.approx(3 / 3)
    assert res.draft_share == 1.0
    assert res.per_user_median == pytest.approx(6 / seconds)
    assert res.per_user_p10 == pytest.approx(6 / seconds)


def test_none_is_plain_decoding():
    trace = synthetic_trace(6, 10)
    cost = uniform_cost_model()
    for batch in (1, 4, 32):
        res = simulate(trace, "none", cost, exact_map(), concurrency=batch, steps=50)
        assert res.tau == 1.0 and res.draft_share == 0.0 and res.verified_per_step == 0.0
        assert res.tokens_per_s == pytest.approx(batch / cost.plain_cost(batch))


def test_full_acceptance_commits_a_whole_block_per_round():
    trace = Trace([TraceRequest.build([7] * 5, gamma=7) for _ in range(3)], 0.0, 7)
    res = simulate(trace, "fixed:7", uniform_cost_model(), ConstantMap([0.5] * 7), concurrency=2)
    assert res.tau == pytest.approx(8.0) and res.wasted_per_step == 0.0
    assert res.verified_per_step == pytest.approx(2 * 7)
    assert res.per_user_median == pytest.approx(8 / uniform_cost_model().cost(2, 2 * 8))


def test_a_first_round_without_drafts_is_consumed_by_a_plain_step():
    """Recorded requests start with the prefill's round, which offers no drafts: a plain step is that round.
    (Until this was fixed, round pointers moved only on drafted steps, so every request stayed at its first
    round and no scheduler ever drafted.)"""
    reqs = [TraceRequest.build([0, 7, 7, 7], available=[0, 7, 7, 7], gamma=7, tokens=25) for _ in range(3)]
    trace = Trace(reqs, 0.0, 7)
    for batch in (1, 2):
        res = simulate(trace, "fixed:7", uniform_cost_model(), ConstantMap([0.5] * 7), concurrency=batch, steps=8)
        # per request (in lockstep): a plain step for its first round, then three drafted rounds of 8 tokens
        # (25 tokens: finished), then the next request the same
        assert res.draft_share == pytest.approx(6 / 8)
        assert res.tokens == 2 * 25 * batch and res.finished == 2 * batch
        assert res.tau == pytest.approx(50 / 8)
        assert res.verified_per_step == pytest.approx(7 * batch * 6 / 8)


class PlanOnly(Scheduler):
    """DSpark's per-step plan without its back-off (never skips drafting)."""

    adaptive = False


OTHERS = [f"fixed:{k}" for k in range(1, GAMMA + 1)] + [f"threshold:{t}" for t in (0.2, 0.4, 0.6, 0.8)] + ["none"]


@pytest.mark.parametrize("concurrency", [1, 8, 64])
def test_dspark_is_at_least_every_fixed_and_threshold_policy(concurrency):
    """The plan (without back-off) at every concurrency; the full policy where back-off does not bite."""
    trace = synthetic_trace()
    cost = uniform_cost_model()
    best = max(simulate(trace, spec, cost, exact_map(), concurrency, steps=300).tokens_per_s for spec in OTHERS)
    plan = simulate(trace, PlanOnly("dspark", GAMMA), cost, exact_map(), concurrency, steps=300).tokens_per_s
    assert plan >= 0.99 * best
    if concurrency > 1:  # batch 1: see test_dspark_back_off_at_batch_one
        assert simulate(trace, "dspark", cost, exact_map(), concurrency, steps=300).tokens_per_s >= 0.99 * best


def test_dspark_back_off_at_batch_one():
    trace = synthetic_trace()
    cost = uniform_cost_model()
    best = simulate(trace, "dspark", cost, exact_map(), 1, steps=300).tokens_per_s
    assert best >= 0.99 * simulate(trace, "fixed:7", cost, exact_map(), 1, steps=300).tokens_per_s


def test_dspark_falls_back_to_plain_decoding_when_drafting_never_pays():
    trace = synthetic_trace(8, 40)
    cost = uniform_cost_model(draft_share=1.5)  # drafting costs 1.5 plain steps: never worth it here
    none = simulate(trace, "none", cost, ConstantMap([0.4] * GAMMA), concurrency=4, steps=1500).tokens_per_s
    res = simulate(trace, "dspark", cost, ConstantMap([0.4] * GAMMA), concurrency=4, steps=1500)
    assert res.tokens_per_s >= 0.95 * none
    assert res.draft_share < 0.05


def test_dspark_async_and_batch_table_run():
    trace = synthetic_trace(6, 10)
    for spec in ("dspark-async", "batch-table", "threshold:0.5"):
        res = simulate(trace, spec, uniform_cost_model(), exact_map(), concurrency=16)
        assert res.tau >= 1.0 and res.finished >= 2 * 16


def test_trace_save_load_round_trip(tmp_path):
    trace = synthetic_trace(3, 5)
    trace.requests[0].available[1] = 4
    trace.requests[0].accepted[1] = min(trace.requests[0].accepted[1], 4)
    trace.requests[0].signals[1, 4:] = np.nan
    trace.requests[1].signals[:, :, 1] = 0.25  # a sampled row's max-q channel
    path = trace.save(tmp_path / "t.json")
    back = Trace.load(path)
    assert (back.temperature, back.gamma, back.domain, back.drafter) == (0.0, GAMMA, "synthetic", "synthetic")
    for a, b in zip(trace.requests, back.requests):
        assert a.tokens == b.tokens
        np.testing.assert_array_equal(a.available, b.available)
        np.testing.assert_array_equal(a.accepted, b.accepted)
        np.testing.assert_array_equal(np.isnan(a.signals), np.isnan(b.signals))
        np.testing.assert_allclose(np.nan_to_num(a.signals), np.nan_to_num(b.signals), rtol=1e-6)
    assert not list(tmp_path.glob(".*tmp"))
    again = simulate(back, "dspark", uniform_cost_model(), exact_map(), 4, steps=40)
    assert again == simulate(trace, "dspark", uniform_cost_model(), exact_map(), 4, steps=40)


def test_malformed_trace_files_name_file_and_field(tmp_path):
    good = synthetic_trace(2, 3).to_dict()
    bad = json.loads(json.dumps(good))
    bad["requests"][1]["accepted"] = [9, 0, 0]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"bad\.json.*requests\[1\]"):
        Trace.load(path)
    del bad["gamma"]
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"bad\.json.*'gamma'"):
        Trace.load(path)
    path.write_text(json.dumps(good)[:50])
    with pytest.raises(ValueError, match=r"bad\.json.*not valid JSON"):
        Trace.load(path)
    with pytest.raises(ValueError, match="does not exist"):
        Trace.load(tmp_path / "missing.json")


def test_trace_from_decode_results_keeps_rounds():
    from dspark.decoding import GenerationResult, RoundStats

    res = GenerationResult([1, 2], token_ids=[5, 6, 7, 8], rounds=[
        RoundStats(2, 1, 2, [[0.5, float("nan"), float("nan")]] * 2), RoundStats(0, 0, 0, None),
        RoundStats(1, 0, 1, [[-1.0, float("nan"), float("nan")]])])
    trace = trace_from_results([res], gamma=3, temperature=0.0, domain="code", drafter="x")
    req = trace.requests[0]
    assert req.tokens == 4 and req.available.tolist() == [2, 0, 1] and req.accepted.tolist() == [1, 0, 0]
    assert req.signals[0, :2, 0].tolist() == [0.5, 0.5] and math.isnan(req.signals[0, 2, 0])
    cut = GenerationResult([1], token_ids=[5], rounds=[RoundStats(1, 0, 3, None)])
    with pytest.raises(ValueError, match="whole block"):
        trace_from_results([cut], 3, 0.0)


GPU = {"layout": "ragged", "base_ms": 10, "graph_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
       "per_token_ms_after": 0.02, "compute_bound_tokens": 2048, "draft_ms": 1.5, "draft_per_request_ms": 0.01,
       "per_token_ms_before": 0.005, "comment": "test curve"}


def test_gpu_curve_is_flat_within_a_graph_size_and_steps_at_boundaries():
    cost = gpu_cost_model(GPU)
    for batch in (1, 4, 16):
        for lo, hi in ((8, 16), (16, 32), (32, 64)):
            if hi < batch:
                continue
            inside = [cost.cost(batch, n) for n in range(max(lo + 1, batch), hi + 1)]
            assert max(inside) == pytest.approx(min(inside))
            assert cost.cost(batch, hi + 1) > cost.cost(batch, hi)
    # plain = the pass at N = B without drafting; drafting adds its own cost
    assert cost.plain_cost(4) == pytest.approx((10 + 0.005 * (4 - 1)) / 1000)
    assert cost.cost(4, 4) == pytest.approx(cost.plain_cost(4) + (1.5 + 0.04) / 1000)
    # linear past the compute-bound knee
    big = [cost.cost(512, n) for n in (3008, 3200, 3392)]  # multiples of the eager granularity
    assert big[1] - big[0] == pytest.approx(big[2] - big[1]) and big[1] > big[0]
    assert isinstance(cost, CostModel) and cost.layout == "ragged"
    with pytest.raises(ValueError, match="base_ms"):
        gpu_cost_model({k: v for k, v in GPU.items() if k != "base_ms"})


def test_dspark_on_a_stepped_gpu_curve():
    trace = synthetic_trace()
    cost = gpu_cost_model(GPU)
    best = simulate(trace, "dspark", cost, exact_map(), 64, steps=200).tokens_per_s
    assert best >= 0.99 * simulate(trace, "threshold:0.4", cost, exact_map(), 64, steps=200).tokens_per_s


def test_sweeps_and_plots(tmp_path):
    traces = [synthetic_trace(4, 12, seed=1, domain="a"), synthetic_trace(4, 12, seed=2, domain="b")]
    cost = uniform_cost_model()
    rows = threshold_sweep(traces, cost, exact_map(), [0.3, 0.6, 0.9], concurrency=4, steps=60)
    assert {r["domain"] for r in rows} == {"a", "b"}
    by = {(r["domain"], r["theta"]): r for r in rows if r["theta"] is not None}
    for d in ("a", "b"):  # a higher threshold never verifies more drafts
        assert by[(d, 0.3)]["verified_per_step"] >= by[(d, 0.6)]["verified_per_step"] >= by[(d, 0.9)]["verified_per_step"]
    table = concurrency_sweep(traces, ["none", "fixed:3", "dspark"], cost, exact_map(), concurrencies=(1, 8), steps=60)
    assert len(table) == 6 and all(r["speedup"] for r in table)
    assert "dspark" in format_concurrency_table(table)
    for f in (plot_threshold_sweep(rows, tmp_path / "th.png"), plot_concurrency_sweep(table, tmp_path / "c.png")):
        assert f.stat().st_size > 1000


def test_outcome_oracle_reads_the_recorded_outcome_and_bounds_the_estimate():
    """The oracle's survival is 1 for each round's accepted drafts and 0 after; fixed policies, which read no
    survival, replay identically under it, and dspark with it verifies no draft that fails and at high load
    beats dspark on the (calibrated) estimate."""
    from dspark.evaluation.simulate import _Pool

    trace = synthetic_trace()
    pool = _Pool([trace], OutcomeOracle())
    expected = (np.arange(GAMMA)[None, :] < pool.accepted[:, None]).astype(float)
    np.testing.assert_array_equal(pool.survival, expected)
    cost = gpu_cost_model(GPU)
    fixed = [simulate(trace, "fixed:3", cost, m, 64, steps=150).tokens_per_s for m in (exact_map(), OutcomeOracle())]
    assert fixed[0] == fixed[1]
    oracle = simulate(trace, "dspark", cost, OutcomeOracle(), 256, steps=150)
    estimate = simulate(trace, "dspark", cost, exact_map(), 256, steps=150)
    assert oracle.wasted_per_step == 0.0 and oracle.verified_per_step > 0
    assert oracle.tokens_per_s > estimate.tokens_per_s
