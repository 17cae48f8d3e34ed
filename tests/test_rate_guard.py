"""The rate guard: drafting on or off for whole windows, chosen from measured throughput, at each load."""
from __future__ import annotations

import random

import pytest

from dspark.engine.rate_guard import RateGuard


def simulate(guard: RateGuard, rate: dict[bool, float], steps: int = 4000, rows: int = 64, noise: float = 0.0,
             unsure: bool = True, seed: int = 0, greedy: float = 0.0, transient: dict[bool, tuple[float, float]] | None = None
             ) -> tuple[float, float]:
    """Feed the guard steps of 0.1 s whose committed tokens follow each mode's true rate (± noise per step);
    for transient[mode][0] seconds after a switch into `mode` it runs at transient[mode][1] × its rate. Return
    (share of time spent drafting, achieved tokens / s)."""
    rng = random.Random(seed)
    seconds = tokens = drafting_time = 0.0
    mode, since_switch = guard.drafting, 0.0
    for _ in range(steps):
        step = 0.1
        if guard.drafting != mode:
            mode, since_switch = guard.drafting, 0.0
        length, factor = (transient or {}).get(mode, (0.0, 1.0))
        slow = factor if since_switch < length else 1.0
        since_switch += step
        got = rate[guard.drafting] * slow * step * (1 + rng.uniform(-noise, noise))
        drafting_time += step if guard.drafting else 0.0
        seconds += step
        tokens += got
        guard.record(step, int(round(got)), rows, unsure, greedy)
    return drafting_time / seconds, tokens / seconds


def test_when_plain_decoding_is_faster_the_guard_turns_drafting_off():
    share, achieved = simulate(RateGuard(), {True: 500.0, False: 560.0})
    assert share < 0.15
    assert achieved > 0.98 * 560.0 * (1 - 0.5 * 0.15)  # close to plain decoding's rate


def test_when_drafting_is_faster_the_guard_keeps_it_and_explores_rarely():
    share, achieved = simulate(RateGuard(), {True: 600.0, False: 500.0})
    assert share > 0.9 and achieved > 0.98 * 600.0 * 0.9


def test_noisy_windows_still_settle_on_the_faster_mode():
    for seed in range(5):
        share, _ = simulate(RateGuard(), {True: 500.0, False: 550.0}, noise=0.3, seed=seed)
        assert share < 0.25, seed


def test_the_transient_after_a_switch_does_not_decide():
    """A switch into plain decoding costs its first second 40% of its rate (a plain window inherits drafting's
    queue of prompts to prefill): counted, plain decoding's windows look slower than drafting's; the guard
    compares the steady rates and settles on plain decoding."""
    slow_start = {False: (1.0, 0.6)}
    share, _ = simulate(RateGuard(), {True: 500.0, False: 560.0}, transient=slow_start)
    assert share < 0.2
    share, _ = simulate(RateGuard(settle_seconds=0.0), {True: 500.0, False: 560.0}, transient=slow_start)
    assert share > 0.5  # counting the transient, the guard keeps drafting


def test_a_confident_cost_model_pays_for_no_plain_window():
    guard = RateGuard()
    share, _ = simulate(guard, {True: 900.0, False: 400.0}, unsure=False)
    assert share == 1.0 and guard.plain_windows == 0


def test_loads_are_judged_apart():
    guard = RateGuard()
    simulate(guard, {True: 300.0, False: 100.0}, rows=2, steps=2000)
    simulate(guard, {True: 500.0, False: 560.0}, rows=64, steps=2000)
    assert guard.rates(2)[True] > guard.rates(2)[False] and guard.rates(64)[False] > guard.rates(64)[True]
    share, _ = simulate(guard, {True: 300.0, False: 100.0}, rows=2, steps=1000)
    assert share > 0.9  # back at the light load, drafting is still the choice there


def test_greedy_and_sampled_loads_are_judged_apart():
    """Sampled requests (plain decoding faster) and greedy ones (drafting faster) take turns at the same
    number of rows, 60 s each: what the guard learnt of one does not decide for the other."""
    guard = RateGuard()
    shares = {0.0: [], 1.0: []}
    for turn in range(6):
        greedy = float(turn % 2)
        rate = {True: 500.0, False: 600.0} if greedy == 0.0 else {True: 900.0, False: 600.0}
        shares[greedy].append(simulate(guard, rate, steps=600, greedy=greedy)[0])
    assert all(share < 0.35 for share in shares[0.0][1:]) and all(share > 0.8 for share in shares[1.0][1:])
    assert guard.rates(64, 0.0)[False] > guard.rates(64, 0.0)[True]
    assert guard.rates(64, 1.0)[True] > guard.rates(64, 1.0)[False]


def test_a_window_needs_its_time_and_its_steps_and_an_idle_one_is_dropped():
    guard = RateGuard(window_seconds=1.0, min_steps=3)
    guard.record(2.0, 100, 8)
    guard.record(2.0, 100, 8)
    assert guard.windows == 0  # two steps are not a window, however long
    guard.discard()
    guard.record(0.4, 10, 8)
    guard.record(0.4, 10, 8)
    guard.record(0.4, 10, 8)
    assert guard.windows == 1 and guard.rates(8) == {True: pytest.approx(30 / 1.2)}


@pytest.mark.parametrize("bad", [dict(window_seconds=0), dict(min_steps=0), dict(margin=1.0), dict(smoothing=0),
                                 dict(max_gap=0), dict(settle_seconds=-1)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="RateGuard"):
        RateGuard(**bad)
