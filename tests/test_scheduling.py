"""Verification schedulers and the step-cost model: policies, Algorithm 1, capacity, budgets, online correction."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from dspark.decoding import StepInfo, decode
from dspark.drafters.ngram import NgramDrafter
from dspark.sampling import SamplingParams
from dspark.scheduling import (
    CostModel,
    Scheduler,
    admission_order,
    best_capacity,
    best_width,
    cap_to_budget,
    prefix_schedule,
    step_tokens,
    threshold_lengths,
    top_capacity,
    uniform_cost_model,
)
from dspark.step_overhead import StepOverhead


def appendix_a_cost() -> CostModel:
    """The paper's Appendix A curve: SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45 (seconds = 1 / SPS)."""
    return CostModel({1: [(1, 1.0), (2, 2.0), (3, 1 / 0.45)]}, {1: 1.0}, "ragged")


def test_step_tokens_layouts():
    assert step_tokens(np.array([0, 3, 1]), "ragged") == 3 + 4
    assert step_tokens(np.array([0, 3, 1]), "padded") == 3 * 4


def test_cost_lookup_keeps_steps_and_extrapolates():
    cost = CostModel({4: [(4, 1.0), (8, 1.0), (12, 2.0), (16, 2.5)]}, {4: 0.8}, "ragged")
    assert cost.cost(4, 5) == 1.0  # rounds up inside the flat segment
    assert cost.cost(4, 9) == 2.0  # past the cliff: the next profiled cell, no smoothing across it
    assert cost.cost(4, 20) == pytest.approx(2.5 + 0.5 / 4 * 4)  # linear past the table
    assert cost.cost(3, 8) == 1.0  # fewer requests: the next profiled batch
    assert cost.cost(8, 16) == pytest.approx(2 * cost.cost(4, 8))  # beyond the largest batch: scaled
    assert cost.plain_cost(4) == 0.8


def test_cost_model_rejects_bad_tables():
    with pytest.raises(ValueError, match="B=1 N=2"):
        CostModel({1: [(1, 1.0), (2, -1.0)]}, {1: 1.0})
    with pytest.raises(ValueError, match="layout"):
        CostModel({1: [(1, 1.0)]}, {1: 1.0}, "paged")
    with pytest.raises(ValueError, match="'plain'"):
        CostModel.from_dict({"drafted": {"1": [[1, 1.0]]}})
    cost = uniform_cost_model()
    again = CostModel.from_dict(cost.to_dict())
    assert again.cost(16, 40) == cost.cost(16, 40) and again.plain_cost(16) == cost.plain_cost(16)


def test_admission_order_is_by_survival_then_position():
    a = np.array([[0.9, 0.9, 0.5], [0.95, 0.4, 0.4]])
    rows, pos, vals = admission_order(a, [3, 2])
    assert list(zip(rows.tolist(), pos.tolist())) == [(1, 1), (0, 1), (0, 2), (0, 3), (1, 2)]
    assert vals.tolist() == [0.95, 0.9, 0.9, 0.5, 0.4]
    rows, pos, _ = admission_order(a, [0, 1])  # limits cut candidates
    assert list(zip(rows.tolist(), pos.tolist())) == [(1, 1)]


def test_appendix_a_algorithm_1_stops_early_and_global_search_does_not():
    cost = appendix_a_cost()
    lengths, theta = prefix_schedule([[0.8, 0.72]], [2], cost)
    assert lengths.tolist() == [0] and theta == pytest.approx(1.0)  # Θ1 = 0.9 < Θ0 = 1.0: stop
    capacity, theta = best_capacity([[0.8, 0.72]], [2], cost)
    assert capacity == 2 and theta == pytest.approx(2.52 * 0.45)  # the anticipating global maximum


def brute_force_best(a: np.ndarray, limits, cost: CostModel) -> float:
    """The best Θ over every prefix-length assignment."""
    best = 0.0
    for lens in itertools.product(*[range(int(l) + 1) for l in limits]):
        lens = np.array(lens)
        tau = len(lens) + sum(a[r, : lens[r]].sum() for r in range(len(lens)))
        best = max(best, tau / cost.cost(len(lens), step_tokens(lens, cost.layout)))
    return best


@pytest.mark.parametrize("layout", ["ragged", "padded"])
def test_algorithm_1_finds_the_optimum_on_a_concave_curve(layout):
    rng = np.random.default_rng(0)
    cost = uniform_cost_model(gamma=4, batches=(1, 2, 4), per_token=0.15, layout=layout)
    for _ in range(20):
        a = np.cumprod(rng.uniform(0.2, 1.0, size=(3, 4)), 1)
        lengths, theta = prefix_schedule(a, [4, 4, 4], cost)
        tau = 3 + sum(a[r, : lengths[r]].sum() for r in range(3))
        assert theta == pytest.approx(tau / cost.cost(3, step_tokens(lengths, layout)))
        # ragged: Θ is unimodal along the path; padded: along the widths. Either way the early stop is the optimum
        assert theta == pytest.approx(brute_force_best(a, [4, 4, 4], cost))


def test_padded_steps_open_whole_widths_where_one_confident_row_would_widen_every_row():
    """Eight requests, one confident (survivals 0.95^k) and seven not; each width costs a quarter of a step
    more. Opening widths one at a time finds the best padded step (width 2, Θ 12.54). Admitting single
    candidates bounds each wider cell by the confident row's next survival (0.7–0.9), as if every row would
    fill it that well, and widens all eight rows to 7 (Θ 9.12): in the padded layout the cut reads whole
    columns (the paths' admission is kept for the ragged layout and as `by_width=False`)."""
    num = 8
    cost = CostModel({num: [(num * (1 + w), 1.0 + 0.25 * w) for w in range(8)]}, {num: 0.9}, "padded")
    strong, weak = np.cumprod([0.95] * 7), np.cumprod([0.8, 0.6, 0.5, 0.3, 0.3, 0.3, 0.3])
    a = np.vstack([strong] + [weak] * (num - 1))
    by_width = [(num + a[:, :w].sum()) / (1.0 + 0.25 * w) for w in range(8)]
    lengths, theta = prefix_schedule(a, [7] * num, cost)
    assert lengths.tolist() == [2] * num and theta == pytest.approx(max(by_width)) == pytest.approx(12.5417, abs=1e-4)
    path_lengths, path_theta = prefix_schedule(a, [7] * num, cost, by_width=False)
    assert path_lengths.tolist() == [7] * num and path_theta == pytest.approx(by_width[7])
    assert path_theta < 0.75 * theta


def test_padded_width_cut_is_the_best_width_and_respects_limits_and_budget():
    """Random non-increasing survivals, limits and a linear padded curve (Θ over the widths is then unimodal):
    the width cut's Θ is the best over every width, each row verifies min(limit, width), and a token budget
    caps the width (N = B·(1 + width) ≤ budget) without opening a width past it."""
    rng = np.random.default_rng(11)
    for trial in range(200):
        num, gamma = int(rng.integers(1, 9)), int(rng.integers(1, 8))
        per_width = rng.uniform(0.02, 0.6)
        cost = CostModel({num: [(num * (1 + w), 1.0 + per_width * w) for w in range(gamma + 1)]}, {num: 1.0},
                         "padded")
        a = np.cumprod(rng.uniform(0.1, 1.0, size=(num, gamma)), 1)
        lim = rng.integers(0, gamma + 1, size=num)
        budget = None if trial % 3 else int(rng.integers(num, num * (gamma + 1) + 1))
        top = int(lim.max(initial=0))
        if budget is not None:
            top = min(top, budget // num - 1)
        thetas = [(num + sum(a[r, : min(lim[r], w)].sum() for r in range(num))) / (1.0 + per_width * w)
                  for w in range(top + 1)]
        lengths, theta = prefix_schedule(a, lim, cost, budget)
        width = int(lengths.max(initial=0))
        assert lengths.tolist() == np.minimum(lim, width).tolist()
        assert theta == pytest.approx(max(thetas))
        if budget is not None:
            assert step_tokens(lengths, "padded") <= max(budget, num)


def test_admitted_sets_are_prefixes_and_respect_limits_and_budget():
    rng = np.random.default_rng(1)
    cost = uniform_cost_model(gamma=7, batches=(8,), per_token=0.01, layout="ragged")
    for _ in range(30):
        a = np.cumprod(rng.uniform(0.3, 1.0, size=(8, 7)), 1)
        limits = rng.integers(0, 8, size=8)
        for budget in (None, 20):
            lengths, _ = prefix_schedule(a, limits, cost, budget)
            assert (lengths <= limits).all()
            if budget is not None:
                assert step_tokens(lengths, "ragged") <= budget
            top = top_capacity(a, limits, 10)
            assert (top <= limits).all() and top.sum() == min(10, int(limits.sum()))
            # top-capacity admits by survival: every admitted survival ≥ every refused one
            admitted = [a[r, k] for r in range(8) for k in range(top[r])]
            refused = [a[r, k] for r in range(8) for k in range(top[r], limits[r])]
            if admitted and refused:
                assert min(admitted) >= max(refused)


def test_threshold_and_budget_caps():
    a = np.array([[0.9, 0.8, 0.3, 0.2], [0.4, 0.3, 0.2, 0.1]])
    assert threshold_lengths(a, [4, 4], 0.5).tolist() == [2, 0]
    assert threshold_lengths(a, [1, 4], 0.35).tolist() == [1, 1]
    assert cap_to_budget(np.array([4, 4, 1]), 9, "ragged").tolist() == [3, 2, 1]
    assert cap_to_budget(np.array([4, 2]), 6, "padded").tolist() == [2, 2]


@pytest.mark.parametrize("spec, message", [
    ("fastest", "unknown scheduler 'fastest'"),
    ("threshold:0", r"θ in \(0, 1\], got 0.0"),
    ("threshold:1.5", r"θ in \(0, 1\], got 1.5"),
    ("threshold:x", "needs a number"),
    ("fixed:9", r"K in \[0, 7\]"),
    ("batch-table:4=9", "K in"),
    ("dspark:3", "takes no parameter"),
])
def test_bad_scheduler_names_fail_naming_the_value(spec, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(spec, gamma=7)


def test_batch_table_follows_the_batch_size():
    s = Scheduler("batch-table:1=7,4=3,16=1", gamma=7)
    assert s.plan(None, [7, 7]).lengths == [7, 7]
    assert s.plan(None, [7] * 5).lengths == [3] * 5
    assert s.plan(None, [7] * 20).lengths == [1] * 20


def test_async_capacity_comes_from_survivals_two_steps_old():
    cost = uniform_cost_model(gamma=4, batches=(2,), per_token=0.2, layout="ragged")
    s = Scheduler("dspark-async", gamma=4)
    high = np.full((2, 4), 0.95).cumprod(1)
    low = np.full((2, 4), 0.3).cumprod(1)
    first = s.plan(high, [4, 4], cost, request_ids=[0, 1])  # no history: Algorithm 1
    assert first.lengths == prefix_schedule(high, [4, 4], cost)[0].tolist()
    s.plan(low, [4, 4], cost, request_ids=[0, 1])
    third = s.plan(low, [4, 4], cost, request_ids=[0, 1])  # capacity from `high`, admitted by `low`
    assert third.capacity == best_capacity(high, [4, 4], cost)[0]
    assert sum(third.lengths) == third.capacity


def test_dspark_backs_off_when_drafting_does_not_pay_then_probes():
    # drafting costs 10 plain steps: even perfect drafts of 7 cannot pay
    cost = CostModel({1: [(n, 10.0) for n in range(1, 9)]}, {1: 1.0}, "ragged")
    s = Scheduler("dspark", gamma=7)
    a = np.ones((1, 7))
    pattern = []
    for _ in range(40):
        d = s.wants_drafts(1)
        pattern.append(d)
        if d:
            s.plan(a, [7], cost)
    # one drafted step; after it the last survivals predict no gain, so no probe is paid for
    assert pattern == [True] + [False] * 39 and s.skipped_steps == 39
    for n in range(1, 9):  # drafting changes: drafted steps now cost what a plain step does (measured
        for _ in range(20):  # beside the plain steps of the pause, which cost what the table says)
            cost.observe(1, n, 1.0, drafted=True)
            cost.observe(1, 1, 1.0, drafted=False)
    assert s.dormant  # the back-off's probes were judged ahead: a sleeping drafter could sleep through them
    later = [s.wants_drafts(1) for _ in range(300)]
    # the next due probe is taken: drafting is predicted to pay again where the back-offs of 4, 16 and 64 steps
    # that followed the drafted step would have ended without looking ahead (step 85); the policy was dormant
    # there (a drafter may be asleep), so the probe comes `wake_lead` steps later, for the drafter to wake first
    assert 40 + later.index(True) == 1 + 4 + 16 + 64 + s.wake_lead


def test_a_few_hard_steps_do_not_lock_drafting_out():
    """At a small batch a drafted step's survival is noisy: a short run of hard rounds turns the smoothed gain
    negative and drafting pauses, but the probe gate reads the workload's typical survival, so the next due
    probe is taken (a gate on the last hard step's survivals kept drafting off for hundreds of steps)."""
    cost = CostModel({2: [(n, 1.0 + 0.1 * n) for n in range(2, 17)]}, {2: 1.0}, "ragged")
    s = Scheduler("dspark", gamma=7)
    good = np.full((2, 7), 0.9).cumprod(1)  # about 4 drafts per request for 1.8 plain steps: pays
    hard = np.full((2, 7), 0.1).cumprod(1)  # nothing pays
    for _ in range(40):
        assert s.wants_drafts(2)
        s.plan(good, [7, 7], cost)
    steps = 0
    while s.wants_drafts(2):  # hard rounds until the smoothed gain turns negative
        s.plan(hard, [7, 7], cost)
        steps += 1
        assert steps < 20
    paused = 1
    while not s.wants_drafts(2):
        paused += 1
        assert paused < 50, "a few hard steps locked drafting out"
    assert paused == 4  # the first back-off (4 steps), then the probe
    plan = s.plan(good, [7, 7], cost)  # a good probe: drafting goes on
    assert sum(plan.lengths) > 0 and s.wants_drafts(2)


def test_online_correction_changes_the_schedule_within_bounded_steps():
    """An injected clock: the machine's drafted steps become 4x slower; the schedule must follow."""
    cost = uniform_cost_model(gamma=7, batches=(4,), draft_share=0.2, per_token=0.01, layout="padded")
    s = Scheduler("dspark", gamma=7)
    a = np.full((4, 7), 0.5).cumprod(1)
    assert sum(s.plan(a, [7] * 4, cost).lengths) > 0 and s._skip == 0
    changed_at = None
    for step in range(1, 30):
        lengths = [3] * 4
        n = step_tokens(np.array(lengths), "padded")
        cost.observe(4, n, 4.0 * cost._base_many(4, np.array([n]))[0][0], drafted=True)  # injected clock
        cost.observe(4, 4, cost.plain[4], drafted=False)
        s._backoff, s._skip, s._gain = 4, 0, None
        s.plan(a, [7] * 4, cost)
        if s._skip > 0:
            changed_at = step
            break
    assert changed_at is not None and changed_at <= 10
    assert cost.cost(4, 16) > 1.5 * cost._base_many(4, np.array([16]))[0][0]


def test_a_machine_wide_slowdown_does_not_stop_drafting():
    """Only drafted steps run (the policy drafts every step), and the whole machine becomes 3x slower (other
    load): plain steps would be 3x slower too, so drafting still pays and must go on. A correction that
    scaled the measured kind alone would compare 3x drafted costs with 1x plain costs and stop drafting."""
    cost = CostModel({4: [(n, 2.0) for n in range(4, 33, 4)]}, {4: 1.0}, "padded")
    s = Scheduler("dspark", gamma=7)
    a = np.full((4, 7), 0.9).cumprod(1)  # about 5.3 tokens per request and step for 2 plain steps: pays
    for _ in range(30):
        if not s.wants_drafts(4):  # a plain probe: plain steps are 3x slower too
            cost.observe(4, 4, 3 * 1.0, drafted=False)
            continue
        lengths = s.plan(a, [7] * 4, cost).lengths
        assert sum(lengths) > 0
        cost.observe(4, step_tokens(np.array(lengths), "padded"), 3 * 2.0, drafted=True)
    assert cost.plain_cost(4) > 2.5 and s.skipped_steps == 0 and s.drafted_steps >= 28
    # and when plain steps are measured unchanged beside them, drafting alone got 3x dearer: now it stops
    for _ in range(30):
        cost.observe(4, 4, 1.0, drafted=False)
        cost.observe(4, 32, 3 * 2.0, drafted=True)
    assert cost.cost(4, 32) / cost.plain_cost(4) > 5
    s._backoff, s._skip, s._gain = 4, 0, None
    s.plan(a, [7] * 4, cost)
    assert s._skip > 0


def served_world(spec: str, drafted_ratio: float, plain_ratio: float, steps: int = 400) -> tuple[float, float, int]:
    """An injected clock: 16 requests whose survivals are 0.75^k, a profile in which drafting pays 1.23x, and
    a served machine on which drafted rounds take `drafted_ratio` and plain rounds `plain_ratio` times the
    profile. Returns (expected committed tokens per second, share of drafted steps, plain probes)."""
    shape = dict(gamma=7, batches=(16,), draft_share=1.0, per_token=0.01, layout="padded")
    table, cost = uniform_cost_model(**shape), uniform_cost_model(**shape)
    s = Scheduler(spec, gamma=7)
    a = np.full((16, 7), 0.75).cumprod(1)
    tokens = seconds = drafted = 0.0
    for _ in range(steps):
        if s.wants_drafts(16):
            lengths = np.array(s.plan(a, [7] * 16, cost).lengths)
            n = step_tokens(lengths, "padded")
            took = table.cost(16, n) * drafted_ratio
            cost.observe(16, n, took, drafted=True)
            tokens += 16 + sum(a[r, :k].sum() for r, k in enumerate(lengths))
            drafted += 1
        else:
            took = table.plain_cost(16) * plain_ratio
            cost.observe(16, 16, took, drafted=False)
            tokens += 16
        seconds += took
    return tokens / seconds, drafted / steps, s.plain_probes


def test_recurring_trends_within_bursts_do_not_ratchet_the_correction_of_rows_not_measured_lately():
    """An injected clock over 40 bursts of 16 requests (40 steps) and 4 requests (10 steps), in which drafted
    rounds get cheaper along each burst (1.3x to 1.0x the profile) and plain ones take 1.1x; a plain step of
    64 requests was measured 4 times at the start. The correction of that cell must still price it near what it
    took, and drafting (which pays 1.17x here) must go on in every burst. Before the level was a mean of
    bounded terms, summing each row's changes while measured drove it to -4 in log (pricing that plain step
    at 2% of its cost), and at 16 clients in process the same drift stopped drafting for bursts at a time."""
    shape = dict(gamma=7, batches=(4, 16, 64), draft_share=1.0, per_token=0.01, layout="padded")
    table, cost = uniform_cost_model(**shape), uniform_cost_model(**shape)
    for _ in range(4):
        cost.observe(64, 64, 1.1 * table.plain_cost(64), drafted=False)
    s = Scheduler("dspark", gamma=7)
    shares, rates = [], []
    for _ in range(40):
        for rows, steps in ((16, 40), (4, 10)):
            a = np.full((rows, 7), 0.75).cumprod(1)
            tokens = seconds = drafted = 0.0
            for i in range(steps):
                if s.wants_drafts(rows):
                    lengths = np.array(s.plan(a, [7] * rows, cost).lengths)
                    n = step_tokens(lengths, "padded")
                    took = table.cost(rows, n) * (1.3 - 0.3 * i / (steps - 1))
                    cost.observe(rows, n, took, drafted=True)
                    tokens += rows + sum(a[r, :k].sum() for r, k in enumerate(lengths))
                    drafted += 1
                else:
                    took = 1.1 * table.plain_cost(rows)
                    cost.observe(rows, rows, took, drafted=False)
                    tokens += rows
                seconds += took
            if rows == 16:
                shares.append(drafted / steps)
                rates.append(tokens / seconds)
    plain_rate = 16 / (1.1 * table.plain_cost(16))
    assert 0.7 < cost.plain_cost(64) / (1.1 * table.plain_cost(64)) < 1.3
    assert min(shares) > 0.9 and min(rates) > 1.1 * plain_rate


def test_plain_probes_catch_a_server_that_inflates_drafted_rounds_more_than_plain_ones():
    """Measured under HTTP load on the EPYC machine: drafted rounds ran 2.31x the profile, plain ones 1.69x.
    A policy that only ever measured drafted steps priced plain ones at the drafted inflation and drafted
    every step at 0.90x of plain decoding here; plain probes measure the plain cost and the policy stays at
    plain speed. Where the inflation is the same for both, drafting pays and goes on (few probes)."""
    plain, _, _ = served_world("none", 2.31, 1.69)
    fixed, _, _ = served_world("fixed:7", 2.31, 1.69)
    adaptive, share, probes = served_world("dspark", 2.31, 1.69)
    assert fixed < 0.92 * plain
    assert adaptive >= 0.97 * plain and share < 0.1 and probes >= 1
    plain, _, _ = served_world("none", 2.0, 2.0)
    fixed, _, _ = served_world("fixed:7", 2.0, 2.0)
    adaptive, share, probes = served_world("dspark", 2.0, 2.0)
    assert fixed > 1.15 * plain
    assert adaptive >= 0.98 * fixed and share > 0.9 and probes <= 400 / 30


def phased_world(spec: str, phases: list[tuple[int, int, float, float, float]], slow_from: int | None = None):
    """An injected clock over loads that change: each phase (rows, steps, survival ratio s, drafted_ratio,
    plain_ratio) runs `rows` requests with survivals s^k on a served machine whose drafted and plain rounds
    take those multiples of the profile; from step `slow_from` on (counted over all phases) the whole machine
    is 2x slower. Returns per phase (expected committed tokens per second, share of drafted steps), the
    scheduler and the cost model."""
    shape = dict(gamma=7, batches=(4, 64), draft_share=1.0, per_token=0.01, layout="padded")
    table, cost = uniform_cost_model(**shape), uniform_cost_model(**shape)
    s, out, step = Scheduler(spec, gamma=7), [], 0
    for rows, steps, surv, drafted_ratio, plain_ratio in phases:
        a = np.full((rows, 7), surv).cumprod(1)
        tokens = seconds = drafted = 0.0
        for _ in range(steps):
            slow = 2.0 if slow_from is not None and step >= slow_from else 1.0
            if s.wants_drafts(rows):
                lengths = np.array(s.plan(a, [7] * rows, cost).lengths)
                n = step_tokens(lengths, "padded")
                took = table.cost(rows, n) * drafted_ratio * slow
                cost.observe(rows, n, took, drafted=True)
                tokens += rows + sum(a[r, :k].sum() for r, k in enumerate(lengths))
                drafted += 1
            else:
                took = table.plain_cost(rows) * plain_ratio * slow
                cost.observe(rows, rows, took, drafted=False)
                tokens += rows
            seconds += took
            step += 1
        out.append((tokens / seconds, drafted / steps))
    return out, s, cost


def test_costs_learned_at_high_load_do_not_leak_into_a_lower_load():
    """A load sweep's server: 4 clients (drafting pays 1.4x), then 64 (served drafted rounds 3.5x the profile,
    plain ones 1.7x: drafting does not pay), then 4 clients again. Measured in a sweep here: after the 64-client
    cells the policy hardly drafted at 4 clients (τ 1.09, 0.71x of fixed K = 7), while on a fresh server it
    drafted. The drafted inflation learned at 64 rows carried to the stale 4-row cells through their step kind,
    so the probe gate predicted no gain there and never measured; the costs of a row now move only with the
    machine-wide drift measured since it was last seen."""
    phases = [(4, 300, 0.7, 2.0, 2.0), (64, 400, 0.75, 3.5, 1.7), (4, 300, 0.7, 2.0, 2.0)]
    plain, _, _ = phased_world("none", phases)
    fixed, _, _ = phased_world("fixed:7", phases)
    adaptive, _, _ = phased_world("dspark", phases)
    assert fixed[0][0] > 1.3 * plain[0][0] and fixed[1][0] < 0.5 * plain[1][0]  # the world is as described
    for phase in (0, 2):
        assert adaptive[phase][0] >= 0.97 * fixed[phase][0] and adaptive[phase][1] > 0.9
    assert adaptive[1][0] >= 0.95 * plain[1][0] and adaptive[1][1] < 0.05


def test_a_slowdown_seen_at_one_load_moves_the_costs_of_another():
    """The same sweep, with the whole machine becoming 2x slower halfway through the 64-client phase: the 4-row
    costs, not measured since, follow the drift the 64-row steps measured (both kinds), and drafting goes on
    when the load drops (it still pays 1.4x)."""
    phases = [(4, 300, 0.7, 2.0, 2.0), (64, 400, 0.75, 3.5, 1.7)]
    _, _, steady = phased_world("dspark", phases)
    _, _, slowed = phased_world("dspark", phases, slow_from=500)
    assert slowed.plain_cost(4) == pytest.approx(2 * steady.plain_cost(4), rel=0.1)
    assert slowed.cost(4, 32) == pytest.approx(2 * steady.cost(4, 32), rel=0.1)
    out, _, _ = phased_world("dspark", phases + [(4, 300, 0.7, 2.0, 2.0)], slow_from=500)
    fixed, _, _ = phased_world("fixed:7", phases + [(4, 300, 0.7, 2.0, 2.0)], slow_from=500)
    assert out[2][0] >= 0.97 * fixed[2][0] and out[2][1] > 0.9


def test_a_kind_keeps_its_own_offset_while_only_the_other_kind_runs():
    """Drafted rounds measured at 2.3x the table and plain ones at 1.7x; then only plain steps run (the policy
    stopped drafting). The drafted cost must stay at 2.3x: following a level made of whatever ran last would
    pull it to 1.7x, and the policy would probe drafting again and again. A machine-wide slowdown seen by the
    plain steps still moves both."""
    cost = uniform_cost_model(gamma=7, batches=(16,), per_token=0.01, layout="padded")
    table_d, table_p = cost.cost(16, 64), cost.plain_cost(16)
    for _ in range(40):
        cost.observe(16, 64, 2.3 * table_d, drafted=True)
    for _ in range(8):
        cost.observe(16, 16, 1.7 * table_p, drafted=False)
    for _ in range(200):
        cost.observe(16, 16, 1.7 * table_p, drafted=False)
    assert cost.cost(16, 64) == pytest.approx(2.3 * table_d, rel=0.03)
    assert cost.plain_cost(16) == pytest.approx(1.7 * table_p, rel=0.03)
    for _ in range(40):
        cost.observe(16, 16, 2 * 1.7 * table_p, drafted=False)  # everything 2x slower
    assert cost.cost(16, 64) == pytest.approx(2 * 2.3 * table_d, rel=0.05)


def test_a_noisy_bump_in_the_profile_does_not_stop_admission():
    """This machine's profile at batch 1 (ms): N = 5 13.1, N = 6 16.3, N = 7 14.2, N = 8 14.0. A pass over 6
    tokens cannot cost more than one over 8: the bump is noise, and with Algorithm 1's early stop it cut every
    block at 4 drafts (τ 1.85 against fixed K = 7's 2.84 at one client). Costs are priced non-decreasing in N,
    as measured table and as online-corrected cells."""
    ms = [13.1, 12.4, 13.0, 13.5, 13.1, 16.3, 14.2, 14.0]
    cost = CostModel({1: [(n + 1, s / 1e3) for n, s in enumerate(ms)]}, {1: 0.0107}, "padded")
    assert cost.cost(1, 6) == pytest.approx(0.0140) and cost.cost(1, 2) == pytest.approx(0.0124)
    assert cost.to_dict()["drafted"]["1"][5] == [6, pytest.approx(0.0163)]  # the profile is kept as measured
    survival = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]])
    assert prefix_schedule(survival, [7], cost)[0].tolist() == [7]
    for _ in range(20):  # a cell measured dear online stays priced at most at a larger cell's cost
        cost.observe(1, 3, 0.030, drafted=True)
        cost.observe(1, 8, 0.014, drafted=True)
    assert cost.cost(1, 3) <= cost.cost(1, 8) + 1e-12
    seconds = cost.cost_many(1, np.arange(1, 9))
    assert np.all(np.diff(seconds) >= -1e-12)


def test_a_back_off_decided_at_high_load_ends_when_the_load_drops():
    """At 64 requests drafting does not pay and the policy backs off, up to 256 steps; when the load drops to one
    request (where drafting pays 2x), it must draft at once, not sit out a back-off decided for 64 rows (in a
    load sweep that back-off outlasted a whole one-client cell: τ 1.00 where fixed K = 7 reached 3.15)."""
    drafted = {b: [(n, 1.0 + (0.2 + 0.05 * n) * (b >= 32)) for n in range(b, 8 * b + 1)] for b in (1, 64)}
    cost = CostModel(drafted, {1: 1.0, 64: 1.0}, "padded")
    s = Scheduler("dspark", gamma=7)
    high, low = np.full((64, 7), 0.5).cumprod(1), np.full((1, 7), 0.8).cumprod(1)
    for _ in range(300):  # long enough for the back-off to reach its maximum
        if s.wants_drafts(64):
            s.plan(high, [7] * 64, cost)
    assert s.skipped_steps > 250 and s._skip > 0
    skipped = s.skipped_steps  # a batch hovering at its client count (63, 64, 33) keeps the back-off
    assert not any(s.wants_drafts(rows) for rows in (63, 64, 33, 64)) and s.skipped_steps == skipped + 4
    assert s.wants_drafts(1)
    assert sum(s.plan(low, [7], cost).lengths) == 7 and s.wants_drafts(1) and s.wants_drafts(1)
    for _ in range(10):  # back at 64 rows: after a few drafted steps the policy backs off again
        if s.wants_drafts(64):
            s.plan(high, [7] * 64, cost)
    assert s._skip > 0 and not s.wants_drafts(64)


def test_online_correction_is_bounded_against_garbage():
    cost = uniform_cost_model(gamma=3, batches=(1,), layout="ragged")
    before = cost.cost(1, 3)
    for bad in (float("nan"), float("inf"), -1.0, 0.0):
        cost.observe(1, 3, bad, drafted=True)
    assert cost.cost(1, 3) == before
    cost.observe(1, 3, 1e9, drafted=True)  # one stall: clamped to 20x, moved by alpha
    assert cost.cost(1, 3) < before * 20 ** cost.alpha * 1.0001


def test_one_stalled_step_moves_the_correction_as_a_2x_step_and_two_in_a_row_move_it_fully():
    """A single step 7x its estimate (a 200 ms garbage collection inside a 30 ms step) is taken as a 2x step; the
    same deviation twice in a row is a lasting change and is learned as measured."""
    def warmed() -> CostModel:
        cost = uniform_cost_model(gamma=3, batches=(1,), layout="ragged")
        for _ in range(8):  # settled on the table
            cost.observe(1, 3, cost.cost(1, 3), drafted=True)
        return cost

    cost = warmed()
    before = cost.cost(1, 3)
    cost.observe(1, 3, 7.0 * before, drafted=True)
    stalled = cost.cost(1, 3)
    assert before < stalled <= before * 2.0 ** cost.alpha * 1.0001 and cost.stalls == 1
    cost.observe(1, 3, before, drafted=True)  # back to normal: the stall is forgotten as usual
    assert cost.cost(1, 3) < stalled
    lasting = warmed()
    for _ in range(2):
        lasting.observe(1, 3, 7.0 * before, drafted=True)
    assert lasting.cost(1, 3) > before * 2.0 ** (2 * lasting.alpha)  # the second step is taken as it is
    assert lasting.stalls == 1
    fast = warmed()
    fast.observe(1, 3, 0.1 * before, drafted=True)  # a step far faster than its estimate alike
    assert fast.cost(1, 3) >= before * 0.5 ** fast.alpha * 0.9999


def test_the_stalls_the_cost_model_absorbed_are_exported(qwen3_target):
    """`dspark:engine_cost_stalls_total` counts the step times the engine's cost model took as stalls."""
    from dspark.engine import Engine
    from dspark.serving.metrics import ServerMetrics

    cost = uniform_cost_model(gamma=4, batches=(1,), layout="padded")
    engine = Engine(qwen3_target, NgramDrafter(gamma=4), "dspark", cost_model=cost)
    metrics = ServerMetrics()
    metrics.watch(engine)
    assert "dspark:engine_cost_stalls_total 0.0" in metrics.render().decode()
    for _ in range(4):
        cost.observe(1, 2, cost.cost(1, 2), drafted=True)
    cost.observe(1, 2, 10.0 * cost.cost(1, 2), drafted=True)
    assert engine.cost_stalls == 1 and "dspark:engine_cost_stalls_total 1.0" in metrics.render().decode()
    assert Engine(qwen3_target, NgramDrafter(gamma=4), "fixed").cost_stalls == 0  # no cost model: none


def test_decode_with_drafting_that_never_pays_stays_at_plain_speed(qwen3_target):
    """Modeled on an injected cost where a drafted step costs 3 plain steps (random-weight target: n-gram
    drafts are nearly never accepted): the adaptive policy must stay within 3% of plain decoding (it
    probes rarely), while fixed drafting is far slower."""
    cost = CostModel({b: [(n, 3.0) for n in range(b, 8 * b + 1)] for b in (1, 2, 4)}, {1: 1.0, 2: 1.0, 4: 1.0},
                     "padded")
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6, 4, 5], [7, 8, 7, 8, 7, 8, 7, 8]]

    def modeled(spec: str) -> float:
        steps: list[StepInfo] = []
        results = decode(qwen3_target, NgramDrafter(gamma=4), prompts, SamplingParams(), 200, scheduler=spec,
                         cost_model=cost, on_step=steps.append, online_cost=False, eos_token_ids=frozenset())
        seconds = sum(cost.cost(s.batch, s.tokens) if s.drafted else cost.plain_cost(s.batch) for s in steps)
        return sum(len(r.token_ids) for r in results) / seconds

    plain, adaptive, fixed = modeled("none"), modeled("dspark"), modeled("fixed:4")
    assert adaptive >= 0.97 * plain
    assert fixed < 0.8 * plain


def test_decode_scheduler_lengths_and_limits(qwen3_target):
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2]] * 3
    out = decode(qwen3_target, NgramDrafter(gamma=4), prompts, SamplingParams(), 20, scheduler="fixed:2",
                 draft_limits=[0, 1, 4])
    for r, cap in zip(out, [0, 1, 2]):
        assert max(s.draft_len for s in r.rounds) <= cap
    assert max(s.draft_len for s in out[2].rounds) == 2
    with pytest.raises(ValueError, match="needs a cost model"):
        decode(qwen3_target, NgramDrafter(gamma=4), prompts, SamplingParams(), 5, scheduler="dspark")
    with pytest.raises(ValueError, match="draft_limits"):
        decode(qwen3_target, NgramDrafter(gamma=4), prompts, SamplingParams(), 5, draft_limits=[1])


@pytest.mark.parametrize("spec", ["none", "fixed", "threshold:0.5", "batch-table", "dspark", "dspark-async"])
def test_an_empty_batch_plans_nothing(spec):
    cost = uniform_cost_model(7, (1, 2))
    plan = Scheduler(spec, gamma=7).plan(np.zeros((0, 7)), [], cost)
    assert plan.lengths == []


def test_step_overhead_is_part_of_every_cost_and_learned_online():
    """Work every step pays outside its round (prefill chunk, bookkeeping, the wait for the next step) is added
    to drafted and plain costs alike, as the engine measured it."""
    cost = CostModel({1: [(1, 1.3), (2, 1.7), (3, 2.1), (4, 2.5)]}, {1: 1.0}, "ragged")
    assert cost.overhead.fixed(1) == 0.0
    for _ in range(200):
        cost.observe_overhead(3.0, 1, 2)
    cost.observe_overhead(float("nan"), 1, 2)  # ignored
    cost.observe_overhead(-1.0, 1, 2)  # ignored
    assert cost.overhead.fixed(1) == pytest.approx(3.0, rel=1e-3)
    assert cost.cost(1, 2) == pytest.approx(1.7 + 3.0, rel=1e-3)
    assert cost.plain_cost(1) == pytest.approx(1.0 + 3.0, rel=1e-3)


def test_step_overhead_that_grows_with_committed_tokens_is_not_priced_as_fixed():
    """Outside-the-round time of 13 ms + 0.55 ms per committed token (what 64 served clients measured): the
    costs carry the 13 ms only. The mean per step (13 + 0.55·T̄ ms) would price the per-token part as a fixed
    cost that longer blocks amortise, and drafting would look better than it is."""
    cost = uniform_cost_model(gamma=7, batches=(64,), per_token=0.001)
    rng = np.random.default_rng(0)
    for _ in range(400):
        tokens = int(rng.integers(64, 300))
        cost.observe_overhead(0.013 + 0.00055 * tokens + rng.normal(0, 0.001), 64, tokens)
    assert cost.overhead.per_token == pytest.approx(0.00055, rel=0.1)
    assert cost.overhead.fixed(64) == pytest.approx(0.013, abs=0.002)
    assert cost.plain_cost(64) == pytest.approx(1.0 + 0.064 + cost.overhead.fixed(64))


def test_prefills_are_priced_per_committed_token_not_per_step():
    """A step's prefill serves requests that finished in earlier steps, so it does not vary with the step's own
    tokens: a regression would call it fixed. Over time it is paid per committed token (requests of 64 tokens
    whose prefill costs 64 ms: 1 ms per token); the fixed part keeps only the 5 ms of bookkeeping."""
    over = StepOverhead()
    rng = np.random.default_rng(1)
    finished = 0
    for _ in range(600):
        tokens = int(rng.integers(100, 200))
        prefill = 0.064 * finished  # the requests that finished at the previous step are prefilled now
        over.observe(0.005 + prefill, 64, tokens, prefill_seconds=prefill)
        finished = rng.binomial(tokens, 1 / 64)
    assert over.fixed(64) == pytest.approx(0.005, abs=1e-4)
    assert over.prefill_per_token == pytest.approx(0.001, rel=0.2)
    assert over.predict(64, 150) == pytest.approx(0.005 + 150 * over.prefill_per_token)


def test_the_per_token_overhead_does_not_change_which_step_is_faster():
    """A step's true rate T / (C + a + b·T) ranks any two choices as T / (C + a) does, so the scheduler's Θ
    (which adds a alone) picks the truly faster step; adding the mean a + b·T̄ instead can flip the order."""
    a, b = 0.013, 0.00055
    choices = [(64, 0.05), (150, 0.15), (250, 0.25)]  # (committed tokens, round seconds)
    truth = [t / (c + a + b * t) for t, c in choices]
    fixed_only = [t / (c + a) for t, c in choices]
    assert np.argmax(truth) == np.argmax(fixed_only)
    assert np.argsort(truth).tolist() == np.argsort(fixed_only).tolist()
    mean = a + b * 150
    with_mean = [t / (c + mean) for t, c in choices]
    assert np.argmax(with_mean) != np.argmax(truth)  # the old pricing prefers the longest block here


def test_step_overhead_fit_falls_back_to_the_mean_and_keeps_slopes_nonnegative():
    """Plain steps commit one token per row, so rows and tokens cannot be told apart: the whole overhead stays
    priced per step (as the mean). A fit that would give a negative slope drops that feature."""
    over = StepOverhead()
    for rows in (8, 16, 32, 8, 16, 32, 8, 16, 32, 8):
        over.observe(0.002 + 0.0001 * rows, rows, rows)
    assert over.per_token == 0.0
    assert over.predict(16, 16) == pytest.approx(0.002 + 0.0016, rel=1e-6)
    shrinking = StepOverhead()
    for tokens in range(10, 60):
        shrinking.observe(0.05 - 0.0005 * tokens, 16, tokens)  # more tokens, less time: no negative slope
    assert shrinking.per_token == 0.0 and shrinking.per_row == 0.0
    assert shrinking.fixed(16) == pytest.approx(np.mean([0.05 - 0.0005 * t for t in range(10, 60)]), rel=0.2)
    with pytest.raises(ValueError, match="intercept"):
        StepOverhead(intercept=-1.0)
    with pytest.raises(ValueError, match="alpha"):
        StepOverhead(alpha=0.0)


def test_step_overhead_makes_longer_steps_pay():
    """Survivals 0.5, 0.25, 0.125: on round costs alone Θ peaks at one draft (1.5 / 1.7); with 3 s of work per
    step outside the round, two drafts (1.75 / 5.1) beat one (1.5 / 4.7), so Algorithm 1 admits two."""
    survival = np.array([[0.5, 0.25, 0.125]])
    cost = CostModel({1: [(1, 1.3), (2, 1.7), (3, 2.1), (4, 2.5)]}, {1: 1.0}, "ragged")
    assert prefix_schedule(survival, [3], cost)[0].tolist() == [1]
    cost.overhead = StepOverhead(intercept=3.0)
    lengths, theta = prefix_schedule(survival, [3], cost)
    assert lengths.tolist() == [2] and theta == pytest.approx(1.75 / 5.1)


@pytest.mark.parametrize("layout", ["ragged", "padded"])
def test_dspark_looks_past_a_one_off_jump_to_a_cheap_cell(layout):
    """Two requests; leaving the first cell (N ≤ 4) costs a jump to 1.6 for N = 5..6, after which N = 7..16
    cost 1.62. Filling the N = 5..6 cell alone cannot beat Θ0 (the one-cell rule stopped at 1 draft each), but
    the next cell can: Algorithm 1's look-ahead admits every draft, the global optimum here."""
    cost = CostModel({2: [(2, 1.0), (4, 1.0), (6, 1.6), (16, 1.62)]}, {2: 1.0}, layout)
    a = np.cumprod(np.full((2, 7), 0.93), 1)
    lengths, theta = prefix_schedule(a, [7, 7], cost)
    assert lengths.tolist() == [7, 7]
    assert theta == pytest.approx(brute_force_best(a, [7, 7], cost))
    assert theta == pytest.approx((2 + a.sum()) / 1.62)
    # the look-ahead bounds later survivals by the current one: when they fall fast, it stops at the cliff
    steep = np.array([[0.93, 0.05, 0.01, 0.0, 0.0, 0.0, 0.0], [0.93, 0.04, 0.01, 0.0, 0.0, 0.0, 0.0]])
    assert prefix_schedule(steep, [7, 7], cost)[0].tolist() == [1, 1]


def test_corrected_costs_are_cached_only_until_the_next_measurement():
    """cost_many reuses a row's corrected cells between measurements and sees every new one: a model queried
    before and after each measurement agrees with a fresh model fed the same measurements (never queried)."""
    def model():
        return CostModel({4: [(n, 1.0 + 0.05 * n) for n in range(4, 33, 4)], 8: [(n, 2.0 + 0.04 * n)
                                                                                 for n in range(8, 65, 8)]},
                         {4: 1.0, 8: 1.8}, "padded")

    queried = model()
    tokens = np.arange(4, 33, 4)
    rng = np.random.default_rng(5)
    measured, seen = [], []
    for step in range(30):
        batch, n = (4, int(rng.choice(tokens))) if step % 3 else (8, int(rng.choice(2 * tokens)))
        seconds = float(queried._base_many(batch, np.array([n]))[0][0]) * rng.uniform(0.5, 3.0)
        seen.append(queried.cost_many(4, tokens).copy())
        queried.cost_many(8, 2 * tokens)
        queried.observe(batch, n, seconds, drafted=True)
        measured.append((batch, n, seconds))
        fresh = model()
        for b, m, sec in measured:
            fresh.observe(b, m, sec, drafted=True)
        assert np.array_equal(queried.cost_many(4, tokens), fresh.cost_many(4, tokens))
        assert np.array_equal(queried.cost_many(8, 2 * tokens), fresh.cost_many(8, 2 * tokens))
    assert any(not np.array_equal(a, b) for a, b in zip(seen, seen[1:]))  # the measurements moved the costs


def test_planning_is_skipped_where_it_cannot_earn_its_own_time_and_rerun_now_and_then():
    """On a flat cost curve (a longer block costs nothing) Algorithm 1 verifies whole blocks, so planning only
    costs time: once its own work is measured, `plan_pays` skips it, at most PLAN_REFRESH drafted steps in a
    row. Where cutting pays (a steep curve, low survivals) planning stays, however dear it is."""
    gamma = 4
    flat = CostModel({1: [(n, 1.0) for n in range(1, 6)]}, {1: 2.0}, "padded")
    steep = CostModel({1: [(n, 1.0 + 0.5 * (n - 1)) for n in range(1, 6)]}, {1: 5.0}, "padded")
    high, low = np.array([[0.9, 0.8, 0.7, 0.6]]), np.array([[0.9, 0.5, 0.2, 0.05]])
    sched = Scheduler("dspark", gamma)
    assert sched.plan_pays([4], flat)  # nothing measured yet
    assert sched.plan(high, [4], flat).lengths == [4]
    assert sched.plan_pays([4], flat)  # own work not measured yet
    sched.observe_own_work(0.01)  # 1% of the step
    skipped = 0
    while not sched.plan_pays([4], flat):
        skipped += 1
    assert skipped == Scheduler.PLAN_REFRESH and sched.skipped_plans == skipped
    assert sched.full_plan([4, 2], flat).lengths == [4, 2]
    assert sched.full_plan([4, 4], uniform_cost_model(4, layout="ragged"), token_budget=6).lengths == [2, 2]
    sched.plan(high, [4], flat)  # the refresh plan: the advantage is still zero, so planning is skipped again
    assert not sched.plan_pays([4], flat)
    assert sched.plan_pays([4, 4, 4], flat)  # another batch bucket has no measured advantage: plan there

    cutting = Scheduler("dspark", gamma)
    lengths = cutting.plan(low, [4], steep).lengths
    assert lengths[0] < 4  # Algorithm 1 cuts: its advantage over the whole block is positive
    cutting.observe_own_work(0.05)  # planning costs 1.7% of the full block's step; cutting gains more
    assert all(cutting.plan_pays([4], steep) for _ in range(3 * Scheduler.PLAN_REFRESH))

    for spec in ("fixed:4", "threshold:0.5", "dspark-async"):
        other = Scheduler(spec, gamma)
        other.observe_own_work(1.0)
        assert other.plan_pays([4], flat)


def test_a_narrowed_width_is_planned_until_the_block_is_whole_again():
    """A skipped plan verifies the block as drafted, so it must not freeze a narrow width: on a flat cost curve
    (where planning is skipped once its own work is measured) a step with low survivals narrows the width,
    and the next steps, with high survivals, plan and widen it back to the drafter's block within as many
    steps as slots were cut; then planning is skipped again."""
    gamma = 4
    flat = CostModel({1: [(n, 1.0) for n in range(1, 6)]}, {1: 2.0}, "padded", draft_slot={1: 0.05}, width=gamma)
    high = np.array([[0.95, 0.9, 0.85, 0.8]])
    sched = Scheduler("dspark", gamma)
    sched.plan(high, [4], flat)
    sched.observe_own_work(0.01)
    assert not sched.plan_pays([4], flat)  # whole width, flat curve: the plan is skipped
    sched.plan(np.array([[0.3, 0.02, 0.01, 0.01]]), [4], flat)  # a refresh plan on a hard step narrows
    assert sched.draft_limit < gamma
    steps = 0
    while sched.draft_limit is not None and sched.draft_limit < gamma:
        assert sched.plan_pays([sched.draft_limit], flat)  # planned while narrow ...
        w = sched.draft_limit
        sched.plan(high[:, :w], [w], flat)  # ... so high survivals widen it again
        steps += 1
        assert steps <= gamma
    assert not sched.plan_pays([4], flat)  # whole again: skipped as before


def test_planning_is_not_skipped_at_a_batch_size_whose_gain_was_not_just_measured():
    """A skipped plan does not update the gain that backs drafting off, and that gain depends on the batch size:
    where the batch moved to another bucket since the last plan (a batch filling from 1 to 4 requests), the
    step plans, though planning was found not to pay at the new bucket before; once a plan ran there, it may
    be skipped there again."""
    gamma = 4
    flat = CostModel({b: [(b * n, 1.0) for n in range(1, 6)] for b in (1, 4)}, {1: 2.0, 4: 2.0}, "padded")
    high = np.array([[0.9, 0.8, 0.7, 0.6]])
    sched = Scheduler("dspark", gamma)
    sched.plan(np.repeat(high, 4, axis=0), [4] * 4, flat)
    sched.plan(high, [4], flat)  # the last plan (and gain) at one request
    sched.observe_own_work(0.01)
    assert not sched.plan_pays([4], flat)  # the same bucket: skipped
    assert sched.plan_pays([4] * 4, flat)  # planning does not pay at 4 either, but the gain is from 1 request
    sched.plan(np.repeat(high, 4, axis=0), [4] * 4, flat)
    assert not sched.plan_pays([4] * 4, flat) and sched.plan_pays([4], flat)


def test_planning_is_not_skipped_while_drafting_is_in_doubt():
    """The gain that backs drafting off comes from plans: while it is small (`unsure`) every step plans."""
    cost = CostModel({1: [(n, 1.0) for n in range(1, 6)]}, {1: 0.6}, "padded")  # plain steps nearly as good
    sched = Scheduler("dspark", 4)
    sched.plan(np.array([[0.5, 0.3, 0.1, 0.05]]), [4], cost)
    sched.observe_own_work(0.5)
    assert sched.unsure and sched.plan_pays([4], cost)


def test_the_typical_survival_row_reads_only_positions_rows_could_draft():
    """Rows without drafter context (limit 0) and rows near their token limit show zero survival past what they
    could draft; the typical row that gates probes averages each position over the rows that had it, so a step
    with many such rows does not talk the policy out of probing."""
    cost = uniform_cost_model(gamma=4, batches=(4,), per_token=0.05, layout="ragged")
    row = np.array([0.9, 0.8, 0.7, 0.6])
    s = Scheduler("dspark", gamma=4)
    a = np.zeros((4, 4))
    a[0], a[1, :2] = row, row[:2]  # row 1 could draft 2, rows 2-3 nothing
    s.plan(a, [4, 2, 0, 0], cost)
    assert np.allclose(s._last_mean, row)
    b = np.zeros((4, 4))
    b[:, :2] = 0.5  # every row could draft only 2: positions 3-4 keep their value (no row had them)
    s.plan(b, [2, 2, 2, 2], cost)
    w = Scheduler.SURVIVAL_SMOOTHING
    expected = np.minimum.accumulate([0.9 + w * (0.5 - 0.9), 0.8 + w * (0.5 - 0.8), 0.7, 0.6])
    assert np.allclose(s._last_mean, expected)


def test_the_gain_is_measured_afresh_when_the_batch_moves_over_2x():
    """The smoothed gain that backs drafting off is load-dependent: a batch that filled from 4 to 16 requests
    replaces it with the first step's own gain there instead of averaging it into the gain at 4 (which kept
    a filling batch drafting for several steps after drafting had stopped paying)."""
    gamma = 4
    # drafting nearly free below 8 requests; at 16 the drafter alone costs 0.3 plain steps, each draft one more
    cells = {b: [(b * n, 1.0 + 0.02 * (n - 1) if b < 8 else 1.3 + (n - 1)) for n in range(1, gamma + 2)]
             for b in (4, 8, 16)}
    cost = CostModel(cells, {b: 1.0 for b in cells}, "padded")
    good = np.full((1, gamma), 0.9).cumprod(1)
    s = Scheduler("dspark", gamma)
    for _ in range(10):
        s.plan(np.repeat(good, 4, axis=0), [gamma] * 4, cost)
    assert s._gain > 0.5 and s._skip == 0
    s.plan(np.repeat(good, 6, axis=0), [gamma] * 6, cost)  # 6 rows: within 2x of 4, smoothed
    assert s._gain > 0.5 and s._skip == 0
    s.plan(np.repeat(good, 16, axis=0), [gamma] * 16, cost)  # 16 rows: drafting costs more than it gains
    assert s._gain < 0 and s._skip > 0  # backed off at once


# ------------------------------------------------------------------------------------------------------
# the drafted width


def width_cost(slot: float = 0.1, layout: str = "ragged") -> CostModel:
    """One request, 3 slots profiled: N = 1..4 query tokens cost 1.0, 1.2, 1.4, 1.6; each drafted slot `slot`."""
    return CostModel({1: [(1, 1.0), (2, 1.2), (3, 1.4), (4, 1.6)]}, {1: 0.8}, layout, draft_slot={1: slot}, width=3)


def test_a_narrower_drafted_step_costs_its_slots_less():
    cost = width_cost(0.1)
    assert cost.cost(1, 2) == cost.cost(1, 2, 3) == pytest.approx(1.2)  # the profiled width
    assert cost.cost(1, 2, 1) == pytest.approx(1.0) and cost.width_saving(1, 1) == pytest.approx(0.2)
    assert cost.cost(1, 2, 5) == pytest.approx(1.4)  # wider than profiled: dearer
    assert cost.cost(4, 8, 1) == pytest.approx(cost.cost(4, 8) - 4 * 0.2)  # past the largest batch: B × the slot
    assert cost.cost(1, 2, 1) >= 0.5 * cost.cost(1, 2)
    assert width_cost(5.0).cost(1, 2, 1) == pytest.approx(0.6)  # a slope too steep is floored at half the cost
    plain = CostModel({1: [(1, 1.0), (2, 1.2)]}, {1: 0.8}, "ragged")  # no per-slot costs: the width is free
    assert plain.cost(1, 2, 1) == plain.cost(1, 2) and plain.width_saving(1, 1) == 0.0
    data = cost.to_dict()
    assert data["draft_slot"] == {"1": 0.1} and data["width"] == 3
    assert CostModel.from_dict(data).cost(1, 2, 1) == pytest.approx(1.0)
    assert "draft_slot" not in plain.to_dict() and CostModel.from_dict(plain.to_dict()).width is None
    with pytest.raises(ValueError, match="draft_slot B=1"):
        CostModel({1: [(1, 1.0)]}, {1: 0.8}, draft_slot={1: -0.1}, width=3)
    with pytest.raises(ValueError, match="width"):
        CostModel({1: [(1, 1.0)]}, {1: 0.8}, draft_slot={1: 0.1}, width=0)
    with pytest.raises(ValueError, match="'draft_slot'"):
        CostModel.from_dict({**data, "draft_slot": [0.1]})


def test_observing_a_narrow_step_corrects_the_profiled_width():
    """A measured step drafting 1 slot that took exactly its width's price leaves the table as it was."""
    cost = width_cost(0.1)
    for _ in range(20):
        cost.observe(1, 2, 1.0, drafted=True, width=1)
    assert cost.cost(1, 2) == pytest.approx(1.2) and cost.cost(1, 2, 1) == pytest.approx(1.0)
    slow = width_cost(0.1)
    for _ in range(40):
        slow.observe(1, 2, 2.0, drafted=True, width=1)  # twice its price: the whole drafted row doubles
    assert slow.cost(1, 2, 1) == pytest.approx(2.0, rel=0.02)


def test_best_width_prices_each_width_by_its_slots():
    """Survivals 0.9, 0.5, 0.4 for one request. Free slots: the best step (all three, Θ = 2.8 / 1.6 = 1.75 against
    2.4 / 1.4 = 1.71) needs the whole width; at 0.1 s per slot one slot wins (Θ = 1.9 / 1.0 against 2.4 / 1.3 and
    2.8 / 1.6); the width never exceeds the block's or the limits."""
    a = np.array([[0.9, 0.5, 0.4]])
    free = CostModel({1: [(1, 1.0), (2, 1.2), (3, 1.4), (4, 1.6)]}, {1: 0.8}, "ragged")
    assert best_width(a, [3], free) == 3
    assert best_width(a, [3], width_cost(0.1)) == 1
    assert best_width(a, [3], width_cost(0.02)) == 3  # 2.8 / 1.6 > 2.4 / 1.38 > 1.9 / 1.16
    assert best_width(a[:, :2], [2], free) == 2 and best_width(a, [1], free) == 1  # the limit bounds it
    assert best_width(np.zeros((1, 3)), [3], width_cost(0.1)) == 1  # nothing worth verifying: the cheapest


def test_an_adaptive_policy_chooses_the_next_width_from_the_step_it_planned():
    cost = width_cost(0.1)
    for spec in ("dspark", "dspark-async"):
        s = Scheduler(spec, 3)
        assert s.draft_limit is None  # nothing planned yet: the whole block
        s.plan(np.array([[0.9, 0.5, 0.1]]), [3], cost)
        assert s.draft_limit == 1  # the best width of that step
        s.plan(np.array([[0.95]]), [1], cost)  # a one-slot block whose best width is its whole width ...
        assert s.draft_limit == 2  # ... grows by one
        s.plan(np.array([[0.99, 0.98]]), [2], width_cost(0.0))
        assert s.draft_limit == 3  # never past the drafter's block
        s.plan(np.array([[0.99, 0.98, 0.97]]), [3], width_cost(0.0))
        assert s.draft_limit == 3
        s.plan(np.array([[0.99, 0.98, 0.97]]), [1], width_cost(0.0))  # a row one token from its end ...
        assert s.draft_limit == 3  # ... does not narrow the next step's block
    for spec in ("none", "threshold:0.5", "batch-table"):
        s = Scheduler(spec, 3)
        s.plan(np.array([[0.9, 0.5, 0.1]]), [3], cost)
        assert s.draft_limit is None  # no cost-aware width: the whole block


def test_a_narrow_block_leaves_the_typical_row_past_it_alone():
    s = Scheduler("dspark", 3)
    s.plan(np.array([[0.9, 0.6, 0.3]]), [3], width_cost(0.0))
    before = s._last_mean.copy()
    s.plan(np.array([[0.5]]), [1], width_cost(0.0))
    assert s._last_mean.shape == (3,)
    assert s._last_mean[0] < before[0] and s._last_mean[1:] == pytest.approx(np.minimum(before[1:], s._last_mean[0]))


def _best_width_by_paths(a, lim, cost, token_budget=None):
    """best_width written out: each drafted width's own admission path, priced by `_priced_path` (the reference)."""
    from dspark.scheduling import _priced_path

    best, best_theta = 1, -np.inf
    order = admission_order(a, lim)
    for w in range(1, a.shape[1] + 1):
        keep = order[1] <= w
        _, _, vals, _, seconds, _ = _priced_path(*(x[keep] for x in order), np.minimum(lim, w), cost, token_budget, w)
        theta = float(np.max((len(lim) + np.concatenate([[0.0], np.cumsum(vals)])) / seconds))
        if theta > best_theta * (1 + 1e-9):
            best, best_theta = w, theta
    return best


@pytest.mark.parametrize("layout", ["ragged", "padded"])
def test_best_width_matches_pricing_each_widths_path(layout):
    """best_width prices every step once and each drafted width by its slots; it must choose what pricing each
    width's own path does, on random tables, online corrections, survivals, limits and budgets."""
    rng = np.random.default_rng(3)
    for trial in range(300):
        num, gamma = int(rng.integers(1, 20)), int(rng.integers(1, 8))
        batches = (1, 4, 16)
        slope = rng.uniform(0.0, 0.2)
        if layout == "ragged":
            cells = {b: [(b + n, 1.0 + b / 16 + slope * n ** rng.uniform(0.5, 1.5))
                         for n in range(0, 8 * b + 1, max(1, b // 2))] for b in batches}
        else:
            cells = {b: [(b * (1 + w), 1.0 + b / 16 + slope / 8 * w ** rng.uniform(0.5, 1.5)) for w in range(8)]
                     for b in batches}
        cost = CostModel(cells, {b: 0.9 + b / 20 for b in batches}, layout,
                         draft_slot={b: rng.uniform(0, 0.05) for b in batches}, width=7)
        if trial % 3 == 0:
            for _ in range(5):
                cost.observe(num, num * 3 if layout == "padded" else num + 2, rng.uniform(0.5, 3.0), drafted=True,
                             width=int(rng.integers(1, 8)))
        a = np.minimum.accumulate(rng.uniform(0.05, 1.0, (num, gamma)), axis=1)
        lim = rng.integers(0, gamma + 1, num)
        budget = None if trial % 2 else int(rng.integers(num, num * (gamma + 1) + 1))
        assert best_width(a, lim, cost, budget) == _best_width_by_paths(a, lim, cost, budget)


def test_a_close_call_measures_a_stale_plain_cost_again_before_drafting_on_it():
    """Served at 64 clients, temperature 1: one plain probe read 1.4x its neighbours, its cell went stale and
    moved with the drafted rows' level after, and plain rounds were priced at 79 ms where they took 50: a
    smoothed gain of 0.57 in log, above the unsure mark (0.41), so a policy that re-measured plain steps only
    while unsure drafted on where drafting gained nothing. Below PLAIN_CHECK_GAIN a stale plain cost is measured
    again (one plain step, at most one per stale_after measurements); a fresh one, or a gain above the mark,
    drafts."""
    cost = uniform_cost_model(gamma=7, batches=(16, 64), draft_share=1.0, per_token=0.01, layout="padded")
    cost.observe(64, 64, 1.6 * cost.plain_cost(64), drafted=False)
    for _ in range(cost.stale_after + 1):  # drafted steps only since: the plain cell is stale
        cost.observe(64, 256, cost.cost(64, 256), drafted=True)
    assert cost.plain_measured(64) and not cost.plain_measured(64, recently=True)

    def first_step(gain: float) -> tuple[bool, int]:
        s = Scheduler("dspark", gamma=7)
        s._gain, s._last_cost = gain, cost
        return s.wants_drafts(64), s.plain_probes

    close, clear = math.log(1.6), math.log1p(Scheduler.PLAIN_CHECK_GAIN) + 0.1
    assert math.log1p(Scheduler.UNSURE_GAIN) < close < math.log1p(Scheduler.PLAIN_CHECK_GAIN)
    assert first_step(close) == (False, 1)  # a plain probe
    assert first_step(clear) == (True, 0)
    cost.observe(16, 16, cost.plain_cost(16), drafted=False)  # a plain step at another batch row just now:
    assert first_step(close) == (True, 0)  # at most one check per stale_after measurements, whatever the row
    cost.observe(64, 64, cost.plain_cost(64), drafted=False)  # measured again: fresh
    assert cost.plain_measured(64, recently=True) and first_step(close) == (True, 0)


def test_a_change_of_mode_needs_the_switch_margin_either_way():
    """Hysteresis: a drafting policy backs off only once its smoothed gain falls below -SWITCH_MARGIN, and a
    probe resumes drafting only at a gain of at least +SWITCH_MARGIN (so does the gate that decides whether a probe
    is worth running). Near break-even each mode alone is level; flipping between them is what costs."""
    margin = Scheduler.SWITCH_MARGIN

    def cost(drafted_seconds: float) -> CostModel:
        # one request, plain step 1.0; a drafted step costs `drafted_seconds` (its one draft never survives, so
        # the best drafted schedule commits one token: gain = -log(drafted_seconds))
        return CostModel({1: [(1, drafted_seconds), (2, drafted_seconds + 0.5)]}, {1: 1.0}, "padded")

    def at(gain: float) -> CostModel:
        return cost(math.exp(-gain))

    hopeless = np.zeros((1, 1))
    s = Scheduler("dspark", gamma=1, max_backoff=16)
    assert s.wants_drafts(1)
    s.plan(hopeless, [1], at(-0.6 * margin))
    assert s.expected_gain == pytest.approx(-0.6 * margin) and s.backoff_left == 0  # inside the margin: drafts on
    assert s.wants_drafts(1)
    s.plan(hopeless, [1], at(-6 * margin))  # smoothed: -0.6 m + 0.3 (-6 m + 0.6 m) = -2.2 m
    assert s.expected_gain < -margin and s.backoff_left > 0

    def probe(gain: float) -> None:
        for _ in range(100):  # the back-off runs out (its gate reads the last plan's costs)
            if s.wants_drafts(1):
                break
        else:
            raise AssertionError("no probe within 100 steps")
        s.plan(hopeless, [1], at(gain))

    probe(0.6 * margin)  # a probe that gains, but less than the margin: back off again
    assert s.expected_gain == pytest.approx(0.6 * margin) and s.backoff_left > 0
    assert not s._predicted_to_pay(1)  # and the gate asks the margin of the typical row too
    probe(3 * margin)
    assert s.backoff_left == 0 and s.wants_drafts(1) and s._predicted_to_pay(1)
    s.plan(hopeless, [1], at(-0.6 * margin))  # drafting again: a small loss does not stop it
    assert s.backoff_left == 0 and s.wants_drafts(1)
