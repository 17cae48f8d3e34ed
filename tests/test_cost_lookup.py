"""How a step-cost table is read between its profiled points: rounded up (a GPU engine's captured sizes) or
interpolated (a CPU, whose steps grow with every row and token)."""
from __future__ import annotations

import numpy as np
import pytest

from dspark.profiling import StepProfile
from dspark.scheduling import CostModel, Scheduler, lookup_for, prefix_schedule


def cpu_like(lookup: str) -> CostModel:
    """Rows of 32 and 64 requests whose steps cost a fixed part plus a part per query token (as on a CPU),
    profiled at widths 0..4 (N = B·(1 + w))."""
    drafted = {b: [(b * (1 + w), 0.010 + 0.0001 * b + 0.0002 * b * (1 + w)) for w in range(5)] for b in (32, 64)}
    return CostModel(drafted, {32: 0.012, 64: 0.020}, "padded", lookup=lookup)


def test_linear_lookup_interpolates_tokens_within_a_row_and_rows_at_the_same_width():
    step, linear = cpu_like("step"), cpu_like("linear")
    # within the 64-row: halfway between N = 192 and 256
    assert linear.cost(64, 224) == pytest.approx((step.cost(64, 192) + step.cost(64, 256)) / 2)
    assert step.cost(64, 224) == step.cost(64, 256)  # step lookup rounds up
    # 48 requests, 4 tokens a row: halfway between the 32- and 64-row steps of width 3
    assert linear.cost(48, 192) == pytest.approx((linear.cost(32, 128) + linear.cost(64, 256)) / 2)
    # profiled points read the same either way
    for b, n in ((32, 96), (64, 320)):
        assert linear.cost(b, n) == pytest.approx(step.cost(b, n))
    assert linear.plain_cost(48) == pytest.approx((0.012 + 0.020) / 2)
    assert step.plain_cost(48) == pytest.approx(0.020)
    # past the largest row: scaled, as with step lookup
    assert linear.cost(128, 512) == pytest.approx(2 * linear.cost(64, 256))


def test_linear_lookup_prices_a_wider_step_between_profiled_batches():
    """50 requests verifying 4 drafts a row (N = 250) against 3 (N = 200): with step lookup both round up to the
    64-row cell N = 256 and the fourth draft of every row is free; a CPU pays for its 50 more tokens."""
    step, linear = cpu_like("step"), cpu_like("linear")
    assert step.cost(50, 250) == step.cost(50, 200)
    truth = lambda b, n: 0.010 + 0.0001 * b + 0.0002 * n  # noqa: E731 (the table's own law)
    assert linear.cost(50, 250) - linear.cost(50, 200) == pytest.approx(truth(50, 250) - truth(50, 200))
    assert linear.cost(50, 250) == pytest.approx(truth(50, 250))
    # so a plan that widens every row only where the survivals pay for it: at 0.2 the fourth drafts do not
    a = np.tile([0.9, 0.8, 0.7, 0.2], (50, 1))
    lengths, _ = prefix_schedule(a, [4] * 50, linear)
    assert set(lengths.tolist()) == {3}
    lengths, _ = prefix_schedule(a, [4] * 50, step)
    assert set(lengths.tolist()) == {4}


def test_linear_lookup_keeps_rows_monotone_and_learns_a_slowdown_between_rows():
    linear = cpu_like("linear")
    grid = np.arange(48, 48 * 6)
    seconds = linear.cost_many(48, grid)
    assert (np.diff(seconds) >= 0).all()
    assert linear.cell_end_many(48, np.array([100, 150])).tolist() == [100, 150]  # every token costs
    before = linear.cost(48, 192)
    for _ in range(40):  # served steps of 48 rows run 1.5x the table
        linear.observe(48, 192, 1.5 * linear._base_many(48, np.array([192]))[0][0], drafted=True)
        linear.observe(48, 48, 1.5 * 0.016, drafted=False)
    assert linear.cost(48, 192) == pytest.approx(1.5 * before, rel=0.05)
    assert linear.plain_cost(48) == pytest.approx(1.5 * 0.016, rel=0.05)
    assert (np.diff(linear.cost_many(48, grid)) >= 0).all()


def test_the_per_slot_drafting_cost_is_interpolated_between_profiled_batches():
    drafted = {b: [(b * (1 + w), 0.01 * b * (1 + w)) for w in range(3)] for b in (16, 32)}
    kw = dict(draft_slot={16: 0.001, 32: 0.003}, width=2)
    step = CostModel(drafted, {16: 0.1, 32: 0.2}, "padded", lookup="step", **kw)
    linear = CostModel(drafted, {16: 0.1, 32: 0.2}, "padded", lookup="linear", **kw)
    assert step.width_saving(24, 1) == pytest.approx(0.003)
    assert linear.width_saving(24, 1) == pytest.approx(0.002)


def test_the_lookup_follows_the_device_and_bad_values_fail():
    assert lookup_for("cpu") == "linear" and lookup_for("cuda:0") == "step" and lookup_for("mps") == "step"
    with pytest.raises(ValueError, match="lookup"):
        CostModel({1: [(1, 1.0)]}, {1: 1.0}, lookup="cubic")
    for device, lookup in (("cpu", "linear"), ("cuda", "step")):
        profile = StepProfile(cpu_like("step"), {"device": device, "context_len": 256})
        assert profile.cost.lookup == lookup


def test_an_adaptive_scheduler_plans_with_either_lookup():
    """The scheduler's own paths (plan, width choice, probe gate) run on an interpolated table."""
    sched = Scheduler("dspark", 4)
    a = np.tile([0.95, 0.9, 0.85, 0.8], (50, 1))
    for lookup in ("step", "linear"):
        plan = sched.plan(a, [4] * 50, cpu_like(lookup))
        assert list(plan.lengths) == [4] * 50 and plan.expected_throughput > 0
