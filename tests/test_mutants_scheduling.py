"""Tests written to kill surviving mutants of the scheduling policies (benchmarks/mutation_test.sh).

Small hand-computed cases of the pure policies in `dspark.scheduling`: boundaries (a survival equal to θ, a batch
equal to a table key, a token budget met exactly), empty and one-candidate inputs, the token budget in every
policy that takes one, and Algorithm 1's cut on stepped cost curves (cells, plateaus, the room bound).
"""
from __future__ import annotations

import numpy as np
import pytest

from dspark.scheduling import (
    CostModel,
    Scheduler,
    _path,
    _plateau_room,
    admission_order,
    batch_table_lengths,
    cap_to_budget,
    best_capacity,
    fixed_lengths,
    prefix_schedule,
    step_tokens,
    threshold_lengths,
    top_capacity,
)


def ragged(cells: dict[int, list[tuple[int, float]]], plain: float = 1.0) -> CostModel:
    return CostModel(cells, {b: plain for b in cells}, "ragged")


def linear(num: int, gamma: int, per_draft: float, layout: str = "ragged") -> CostModel:
    """Each verified draft costs `per_draft` of a plain step (profiled at every token count)."""
    top = num * (gamma + 1) if layout == "ragged" else num * (gamma + 1)
    return CostModel({num: [(n, 1.0 + per_draft * (n - num)) for n in range(num, top + 1)]}, {num: 1.0}, layout)


# ------------------------------------------------------------------------------------------------------
# the simple policies


def test_policy_lengths_are_integer_counts():
    """Every policy returns integer draft counts (numpy int64), also for limits given as floats."""
    a = np.array([[0.9, 0.6, 0.2], [0.8, 0.1, 0.05]])
    for limits in ([3, 1], np.array([3.0, 1.0])):
        for lengths in (fixed_lengths(2, limits), threshold_lengths(a, limits, 0.5),
                        batch_table_lengths({1: 3, 2: 2}, limits)):
            assert lengths.dtype == np.int64 and lengths.tolist() == [2, 1], (limits, lengths)
    plan = Scheduler("fixed:2", gamma=3).plan(None, [3, 1])
    assert plan.lengths == [2, 1] and all(type(n) is int for n in plan.lengths)


def test_an_empty_batch_sends_no_tokens():
    assert step_tokens(np.array([], dtype=np.int64), "ragged") == 0
    assert step_tokens(np.array([], dtype=np.int64), "padded") == 0


def test_threshold_admits_a_survival_equal_to_theta_and_handles_tiny_blocks():
    assert threshold_lengths(np.array([[0.5, 0.4]]), [2], 0.5).tolist() == [1]  # a ≥ θ, not a > θ
    assert threshold_lengths(np.array([[0.9]]), [1], 0.5).tolist() == [1]  # one row, one draft
    empty = threshold_lengths(np.zeros((2, 0)), [0, 0], 0.5)  # no row drafted anything
    assert empty.tolist() == [0, 0] and empty.dtype == np.int64


def test_batch_table_key_equal_to_the_batch_and_batches_below_every_key():
    table = {2: 3, 4: 1}
    assert batch_table_lengths(table, [5] * 4).tolist() == [1] * 4  # B = 4 uses the entry of 4
    assert batch_table_lengths(table, [5] * 3).tolist() == [3] * 3
    assert batch_table_lengths(table, [5]).tolist() == [3]  # below the smallest key: that key's K


# ------------------------------------------------------------------------------------------------------
# admission order


def test_admission_order_of_one_candidate_and_of_no_candidates():
    rows, pos, vals = admission_order(np.array([[0.7]]), [1])
    assert (rows.tolist(), pos.tolist(), vals.tolist()) == ([0], [1], [0.7])
    rows, pos, vals = admission_order(np.zeros((2, 0)), [0, 0])
    assert (len(rows), len(pos), len(vals)) == (0, 0, 0)
    assert rows.dtype == np.int64 and pos.dtype == np.int64 and vals.dtype == np.float64


def test_admission_order_skips_zero_survivals():
    rows, pos, vals = admission_order(np.array([[0.9, 0.0], [0.0, 0.0]]), [2, 2])
    assert (rows.tolist(), pos.tolist(), vals.tolist()) == ([0], [1], [0.9])


# ------------------------------------------------------------------------------------------------------
# the token budget along the admission path


def test_prefix_schedule_budget_met_exactly_and_budget_that_everything_fits():
    a = np.full((2, 3), 0.9).cumprod(1)
    cost = linear(2, 3, per_draft=0.01)  # drafting always pays: Algorithm 1 takes every candidate
    assert prefix_schedule(a, [3, 3], cost)[0].tolist() == [3, 3]
    assert prefix_schedule(a, [3, 3], cost, token_budget=100)[0].tolist() == [3, 3]
    lengths, _ = prefix_schedule(a, [3, 3], cost, token_budget=4)  # N = 2 + Σℓ ≤ 4: exactly two drafts
    assert lengths.tolist() == [1, 1]


def test_prefix_schedule_with_no_room_for_drafts_plans_a_plain_step():
    a = np.full((2, 3), 0.9).cumprod(1)
    cost = linear(2, 3, per_draft=0.01)
    lengths, theta = prefix_schedule(a, [3, 3], cost, token_budget=2)
    assert lengths.tolist() == [0, 0]
    assert theta == pytest.approx(2 / cost.cost(2, 2))


def test_best_capacity_and_top_capacity_respect_the_token_budget():
    a = np.full((2, 3), 0.9).cumprod(1)
    cost = linear(2, 3, per_draft=0.01)
    assert best_capacity(a, [3, 3], cost)[0] == 6
    assert best_capacity(a, [3, 3], cost, token_budget=5)[0] == 3
    assert top_capacity(a, [3, 3], 6, cost).tolist() == [3, 3]
    for budget, want in ((2, [0, 0]), (3, [1, 0]), (5, [2, 1]), (7, [3, 2]), (100, [3, 3])):
        assert top_capacity(a, [3, 3], 6, cost, token_budget=budget).tolist() == want, budget
    assert top_capacity(a, [3, 3], 2, cost, token_budget=7).tolist() == [1, 1]  # the capacity binds first
    # without a cost model the budget cannot be counted in its layout and is not applied
    assert top_capacity(a, [3, 3], 6, None, token_budget=3).tolist() == [3, 3]


def test_top_capacity_zero_admits_nothing():
    a = np.full((2, 3), 0.9).cumprod(1)
    assert top_capacity(a, [3, 3], 0).tolist() == [0, 0]
    assert top_capacity(a, [3, 3], -2).tolist() == [0, 0]
    assert top_capacity(a, [3, 3], 3).tolist() == [2, 1]


def test_padded_plain_step_costs_one_column():
    """With nothing admitted a padded step sends N = B tokens (one column), not B·2."""
    cost = CostModel({2: [(2, 1.0), (4, 3.0), (6, 3.5)]}, {2: 1.0}, "padded")
    lengths, theta = prefix_schedule(np.array([[0.1], [0.1]]), [1, 1], cost)
    assert lengths.tolist() == [0, 0]
    assert theta == pytest.approx(2 / 1.0)


# ------------------------------------------------------------------------------------------------------
# Algorithm 1 on stepped curves


def test_plateau_room_ragged_counts_the_cell_within_the_limits():
    cost = ragged({2: [(2, 1.0), (4, 1.5), (6, 2.0)]})
    tokens = np.array([3, 4, 5, 6])
    assert _plateau_room(np.array([2, 2]), tokens, cost).tolist() == [2, 2, 4, 4]
    assert _plateau_room(np.array([1, 1]), tokens[:2], cost).tolist() == [2, 2]


def test_plateau_room_padded_counts_the_widest_width_of_the_same_cost():
    # widths 1 and 2 cost the same (1.5): a step of width 1 can hold min(lim, 2) drafts per row
    cost = CostModel({2: [(2, 1.0), (4, 1.5), (6, 1.5), (8, 2.5)]}, {2: 1.0}, "padded")
    lim = np.array([2, 1])
    tokens = np.array([4, 4, 6])
    room = _plateau_room(lim, tokens, cost)
    assert room.tolist() == [3, 3, 3]
    widths = cost.cost_many(2, 2 * (1 + np.arange(3)))  # the widths priced once, as `_path` does
    assert _plateau_room(lim, tokens, cost, widths).tolist() == [3, 3, 3]
    lim3 = np.array([3, 3])
    tokens3 = np.array([4, 4, 6, 6, 8, 8])
    assert _plateau_room(lim3, tokens3, cost).tolist() == [4, 4, 4, 4, 6, 6]


def test_one_candidate_that_pays_is_admitted():
    cost = ragged({1: [(1, 1.0), (2, 1.1)]})
    lengths, theta = prefix_schedule(np.array([[0.9]]), [1], cost)
    assert lengths.tolist() == [1] and theta == pytest.approx(1.9 / 1.1)


def test_a_candidate_that_can_only_tie_is_not_admitted():
    """Θ0 = 1/1; the one candidate gives (1 + 0.5)/1.5 = 1 at best: it cannot raise Θ, so the cut is before it."""
    cost = ragged({1: [(1, 1.0), (2, 1.5)]})
    lengths, theta = prefix_schedule(np.array([[0.5]]), [1], cost)
    assert lengths.tolist() == [0] and theta == 1.0


def test_candidates_inside_an_already_paid_cell_are_free():
    """One cell holds drafts 1..3 (N = 2..4 cost 2.0). Draft 1 opens it (its room bound, (1 + 3·0.6)/2 = 1.4,
    beats Θ0 = 1); drafts 2 and 3 then cost nothing more and are admitted although their own bound is lower
    than Θ0 (only a candidate that opens a costlier cell is checked)."""
    cost = ragged({1: [(1, 1.0), (4, 2.0)]})
    lengths, theta = prefix_schedule(np.array([[0.6, 0.05, 0.04]]), [3], cost)
    assert lengths.tolist() == [3]
    assert theta == pytest.approx((1 + 0.6 + 0.05 + 0.04) / 2.0)


# ------------------------------------------------------------------------------------------------------
# cap_to_budget and Scheduler.plan


def test_cap_to_budget_shortens_a_single_row_and_down_to_no_drafts():
    assert cap_to_budget(np.array([5]), 3, "ragged").tolist() == [2]  # N = 1 + ℓ ≤ 3
    assert cap_to_budget(np.array([1, 1, 1]), 3, "ragged").tolist() == [0, 0, 0]  # only the anchors fit
    assert cap_to_budget(np.array([3, 3, 3]), 7, "ragged").tolist() == [2, 1, 1]  # ties: the later row first
    assert cap_to_budget(np.array([3, 3, 3]), 7, "padded").tolist() == [1, 1, 1]


def test_none_policy_plans_nothing():
    assert Scheduler("none", gamma=3).plan(None, [3, 2]).lengths == [0, 0]


@pytest.mark.parametrize("spec", ["fixed", "batch-table:1=3", "threshold:0.5"])
def test_simple_policies_cap_to_the_budget_in_the_cost_models_layout(spec):
    a = np.full((3, 3), 0.9).cumprod(1)
    survival = a if spec.startswith("threshold") else None
    sched = Scheduler(spec, gamma=3)
    assert sched.plan(survival, [3, 3, 3]).lengths == [3, 3, 3]
    assert sched.plan(survival, [3, 3, 3], linear(3, 3, 0.01, "ragged"), token_budget=7).lengths == [2, 1, 1]
    assert sched.plan(survival, [3, 3, 3], None, token_budget=7).lengths == [1, 1, 1]  # no cost model: padded


def test_policies_that_need_survivals_or_costs_say_so():
    with pytest.raises(ValueError, match=r"^scheduler 'threshold:0.5' needs survival estimates$"):
        Scheduler("threshold:0.5", gamma=3).plan(None, [3])
    with pytest.raises(ValueError, match=r"^scheduler 'dspark' needs a cost model$"):
        Scheduler("dspark", gamma=3).plan(np.full((1, 3), 0.5), [3])


def test_dspark_plans_every_step_by_algorithm_1_with_the_budget():
    cost = linear(2, 3, per_draft=0.01)
    sched = Scheduler("dspark", gamma=3)
    high = np.full((2, 3), 0.9).cumprod(1)
    low = np.array([[0.9, 0.02, 0.01], [0.3, 0.01, 0.005]])
    for a, budget in ((high, None), (high, 5), (low, None), (low, 4)):  # later steps have history: still Algorithm 1
        plan = sched.plan(a, [3, 3], cost, budget, request_ids=[7, 8])
        lengths, theta = prefix_schedule(a, [3, 3], cost, budget)
        assert plan.lengths == lengths.tolist() and plan.expected_throughput == theta
        assert plan.capacity == sum(plan.lengths)
    assert sched.plan(high, [3, 3], cost, 5, request_ids=[7, 8]).lengths == [2, 1]


def test_async_reads_stale_survivals_by_request_id():
    cost = linear(2, 3, per_draft=0.35)
    high, low = np.array([0.95, 0.9, 0.85]), np.array([0.3, 0.1, 0.05])
    sched = Scheduler("dspark-async", gamma=3)
    now = np.full((2, 3), 0.5).cumprod(1)
    sched.plan(np.stack([high, low]), [3, 3], cost, request_ids=[10, 11])  # the stale step
    sched.plan(now, [3, 3], cost, request_ids=[10, 11])
    plan = sched.plan(now, [3, 1], cost, request_ids=[11, 10])  # the rows swapped places
    capacity, theta = best_capacity(np.stack([low, high]), [3, 1], cost)
    assert (plan.capacity, plan.expected_throughput) == (capacity, theta)
    assert capacity != best_capacity(np.stack([high, low]), [3, 1], cost)[0]
    assert plan.lengths == top_capacity(now, [3, 1], capacity, cost).tolist()


def test_async_falls_back_to_the_mean_stale_survival_for_a_new_request():
    cost = linear(2, 3, per_draft=0.35)
    high, low = np.array([0.95, 0.9, 0.85]), np.array([0.3, 0.1, 0.05])
    sched = Scheduler("dspark-async", gamma=3)
    now = np.full((2, 3), 0.5).cumprod(1)
    sched.plan(np.stack([high, low]), [3, 3], cost, request_ids=[10, 11])
    sched.plan(now, [3, 3], cost, request_ids=[10, 12])
    plan = sched.plan(now, [3, 3], cost, request_ids=[12, 10])  # 12 has no survivals two steps old
    expected = best_capacity(np.stack([(high + low) / 2, high]), [3, 3], cost)
    assert (plan.capacity, plan.expected_throughput) == expected


def test_async_budget_bounds_capacity_and_admission():
    cost = linear(2, 3, per_draft=0.01)
    sched = Scheduler("dspark-async", gamma=3)
    a = np.full((2, 3), 0.9).cumprod(1)
    for _ in range(2):
        sched.plan(a, [3, 3], cost, request_ids=[0, 1])
    plan = sched.plan(a, [3, 3], cost, token_budget=5, request_ids=[0, 1])
    assert plan.capacity == 3 and plan.lengths == [2, 1]


def test_the_probe_prediction_reads_the_last_steps_mean_survival_per_position():
    """At 3 rows drafting cannot pay (Θ0 = 3/1.1 < 3/1): the policy backs off, and as the typical survivals
    predict no gain at 3 rows either, its probes are skipped ahead (dormant). Then, at 2 rows (less than 2x away,
    so the back-off holds), where the first skipped probe would have come (4 steps), the last step's mean
    survivals per position (0.9, 0, 0) predict a gain, so the probe is paid for, `wake_lead` steps later (a
    sleeping drafter wakes first)."""
    cost = CostModel({2: [(2, 1.01), (3, 1.2), (4, 1.4), (5, 2.5), (6, 3.0), (7, 3.5), (8, 4.0)],
                      4: [(3, 1.1), (4, 1.6), (5, 2.1), (6, 2.6), (7, 3.1), (8, 3.6), (9, 4.1), (12, 5.6)]},
                     {2: 1.0, 4: 1.0}, "ragged")
    sched = Scheduler("dspark", gamma=3)
    assert sched.wants_drafts(3)
    assert sched.plan(np.array([[0.9, 0.0, 0.0]] * 3), [3, 3, 3], cost).lengths == [0, 0, 0]
    assert sched.dormant
    wait = 4 + sched.wake_lead
    assert [sched.wants_drafts(2) for _ in range(wait + 1)] == [False] * wait + [True]


def test_async_admission_keeps_a_padded_budget_when_current_survivals_widen_the_step():
    """Capacity 2 comes from stale survivals spread over both rows (N = 2·2 = 4 fits the budget of 4); the current
    survivals put both drafts in row 0, which would take N = 2·3 = 6: admission stops at one draft."""
    cost = linear(2, 3, per_draft=0.01, layout="padded")
    sched = Scheduler("dspark-async", gamma=3)
    even = np.array([[0.9, 0.8, 0.7]] * 2)
    for _ in range(2):
        sched.plan(even, [3, 3], cost, request_ids=[0, 1])
    plan = sched.plan(np.array([[0.99, 0.98, 0.97], [0.1, 0.05, 0.01]]), [3, 3], cost, token_budget=4,
                      request_ids=[0, 1])
    assert plan.capacity == 2 and plan.lengths == [1, 0]


# ------------------------------------------------------------------------------------------------------
# survivors of the full run (2026-12-02)


def test_cap_to_budget_returns_integer_counts_for_float_lengths():
    """Like every policy, cap_to_budget returns int64 draft counts, also when handed floats (and also when there is
    no budget to apply)."""
    for budget, want in ((None, [3, 3, 3]), (7, [2, 1, 1])):
        out = cap_to_budget(np.array([3.0, 3.0, 3.0]), budget, "ragged")
        assert out.dtype == np.int64 and out.tolist() == want, budget


def test_path_under_a_budget_is_one_prefix_of_the_admission_order():
    """The admission path cut by a token budget keeps the same first m candidates in rows, positions and survivals,
    with the token counts and seconds of steps j = 0..m (m = 0 when only the anchors fit)."""
    a = np.full((2, 3), 0.9).cumprod(1)
    cost = linear(2, 3, per_draft=0.01)  # ragged: N = 2 + drafts
    order = admission_order(a, [3, 3])
    for budget, m in ((2, 0), (3, 1), (4, 2), (100, 6)):
        rows, pos, vals, tokens, seconds, widths = _path(a, [3, 3], cost, budget)
        assert rows.tolist() == order[0][:m].tolist(), budget
        assert pos.tolist() == order[1][:m].tolist(), budget
        assert vals.tolist() == order[2][:m].tolist(), budget
        assert tokens.tolist() == list(range(2, 2 + m + 1)) and len(seconds) == m + 1, budget
        assert widths is None  # ragged: no per-width prices


def test_a_cheap_width_beyond_every_limit_adds_no_room():
    """Widths 1-3 (N = 2-4) cost the same 1.5. With the row's limit at 2 drafts, width 3 can never be used, so
    the plateau holds two drafts, not three; and a noisy profile in which width 3 was measured cheaper than
    width 2 is priced non-decreasing (width 2 at width 3's cost), never a cheap width the limit forbids as room."""
    cost = CostModel({1: [(1, 1.0), (2, 1.5), (3, 1.5), (4, 1.5)]}, {1: 1.0}, "padded")
    tokens = np.array([2, 3])
    assert _plateau_room(np.array([2]), tokens, cost).tolist() == [2, 2]
    assert _plateau_room(np.array([1]), np.array([2]), cost).tolist() == [1]
    noisy = CostModel({1: [(1, 1.0), (2, 1.5), (3, 2.0), (4, 1.5)]}, {1: 1.0}, "padded")
    assert noisy.cost_many(1, np.array([2, 3, 4])).tolist() == [1.5, 1.5, 1.5]
    assert _plateau_room(np.array([2]), tokens, noisy).tolist() == [2, 2]
    lengths, theta = prefix_schedule(np.array([[0.4, 0.3]]), [2], noisy)
    assert lengths.tolist() == [2] and theta == pytest.approx(1.7 / 1.5)
