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
    _plateau_room,
    admission_order,
    batch_table_lengths,
    best_capacity,
    fixed_lengths,
    prefix_schedule,
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
    """Every policy returns integer draft counts (numpy int64), also for limits given as a plain list."""
    a = np.array([[0.9, 0.6, 0.2], [0.8, 0.1, 0.05]])
    for lengths in (fixed_lengths(2, [3, 1]), threshold_lengths(a, [3, 1], 0.5),
                    batch_table_lengths({1: 3, 2: 2}, [3, 1])):
        assert lengths.dtype == np.int64, lengths.dtype
    assert fixed_lengths(2, [3, 1]).tolist() == [2, 1]
    assert threshold_lengths(a, [3, 1], 0.5).tolist() == [2, 1]
    assert batch_table_lengths({1: 3, 2: 2}, [3, 1]).tolist() == [2, 1]
    plan = Scheduler("fixed:2", gamma=3).plan(None, [3, 1])
    assert plan.lengths == [2, 1] and all(type(n) is int for n in plan.lengths)


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
    seconds = cost.cost_many(2, tokens)
    assert _plateau_room(np.array([2, 2]), tokens, seconds, cost).tolist() == [2, 2, 4, 4]
    assert _plateau_room(np.array([1, 1]), tokens[:2], seconds[:2], cost).tolist() == [2, 2]


def test_plateau_room_padded_counts_the_widest_width_of_the_same_cost():
    # widths 1 and 2 cost the same (1.5): a step of width 1 can hold min(lim, 2) drafts per row
    cost = CostModel({2: [(2, 1.0), (4, 1.5), (6, 1.5), (8, 2.5)]}, {2: 1.0}, "padded")
    lim = np.array([2, 1])
    tokens = np.array([4, 4, 6])
    room = _plateau_room(lim, tokens, cost.cost_many(2, tokens), cost)
    assert room.tolist() == [3, 3, 3]
    lim3 = np.array([3, 3])
    tokens3 = np.array([4, 4, 6, 6, 8, 8])
    assert _plateau_room(lim3, tokens3, cost.cost_many(2, tokens3), cost).tolist() == [4, 4, 4, 4, 6, 6]


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
