"""The drafter sleeps through an adaptive scheduler's long back-offs: no upkeep, no drafter rows, still lossless."""
from __future__ import annotations

import numpy as np
import pytest

import dspark
from dspark.api import encode_prompt
from dspark.decoding import decode
from dspark.drafters import NoDrafter
from dspark.engine import Engine, EngineConfig, Request
from dspark.evaluation.bench import load_eval_prompts
from dspark.scheduling import CostModel, Scheduler, prefix_schedule
from dspark.serving.metrics import ServerMetrics

NO_EOS: frozenset[int] = frozenset()


def pays_only_below(rows: int, gamma: int = 7) -> CostModel:
    """Drafted steps cost 1.02x a plain step per verified draft at 1-2 requests (drafting pays) and 5x at 4
    and more (it never does)."""
    drafted = {b: [(n, 1.0 + (0.02 * (n - b) if b < rows else 4.0)) for n in range(b, (gamma + 1) * b + 1)]
               for b in (1, 2, 4, 8)}
    return CostModel(drafted, {b: 1.0 for b in drafted}, "padded")


def test_the_scheduler_turns_dormant_deep_in_a_back_off_and_counts_idle_steps() -> None:
    cost = pays_only_below(2)
    s = Scheduler("dspark", gamma=7)
    survival = np.full((4, 7), 0.6).cumprod(1)
    seen = []
    for _ in range(200):
        if s.wants_drafts(4):
            s.plan(survival, [7] * 4, cost)
        seen.append(s.dormant)
    assert any(seen) and s.skipped_steps > 150  # back-offs of 4, 16, 64, then 256 steps
    while s.dormant:  # idle steps count the back-off down without probing (or extend it: next test)
        skip = s._skip
        s.idle_step(4)
        assert s._skip in (skip - 1, skip - 1 + s.max_backoff)
    assert 0 < s._skip <= s.max_backoff // 4  # awake ahead of the probe
    s.idle_step(1)  # the load dropped over 2x: the back-off ends, and an idle step starts no probe
    assert s._skip == 0 and not s.dormant and s.wants_drafts(1)
    assert not Scheduler("fixed", gamma=7).dormant


def test_a_back_off_where_drafting_cannot_pay_is_dormant_from_its_first_step() -> None:
    """The probes ending a back-off are judged as soon as they are within `wake_lead` steps, from the step that
    decides it: where the typical survivals predict no gain at this batch size, the back-off is known to be
    long at once, so the drafter sleeps from then on (it stayed awake through 4 + 16 + 64 steps before)."""
    s = Scheduler("dspark", gamma=7)
    survival = np.full((4, 7), 0.6).cumprod(1)
    assert s.wants_drafts(4)
    s.plan(survival, [7] * 4, pays_only_below(2))
    assert s.dormant and s._skip > s.wake_lead
    # where the typical survivals (smoothed over many steps) still predict a gain, a run of hard steps that
    # turns the gain negative backs off for 4 steps, awake
    dear = CostModel({b: [(n, 1.1 + 0.02 * (n - b)) for n in range(b, 8 * b + 1)] for b in (1, 2, 4, 8)},
                     {b: 1.0 for b in (1, 2, 4, 8)}, "padded")
    paying = Scheduler("dspark", gamma=7)
    for _ in range(3):
        paying.plan(np.full((4, 7), 0.9).cumprod(1), [7] * 4, dear)
    hard = 0
    while paying._skip == 0:
        paying.plan(np.full((4, 7), 0.05).cumprod(1), [7] * 4, dear)
        hard += 1
        assert hard < 50
    assert paying._skip == 4 and not paying.dormant


def test_the_drafter_wakes_only_for_probes_that_run() -> None:
    """Where the typical survivals predict that drafting cannot pay, a long back-off's probe is skipped; that
    is decided where the back-off enters its last `wake_lead` steps, so every window in which a sleeping
    drafter is awake ends in a drafted step (before, every other window woke it for a skipped probe)."""
    cost = pays_only_below(2)
    s = Scheduler("dspark", gamma=7)
    survival = np.full((4, 7), 0.6).cumprod(1)
    windows, awake, drafted = [], 0, False
    for _ in range(4000):
        if s.dormant:
            if awake:
                windows.append((awake, drafted))
            awake, drafted = 0, False
            s.idle_step(4)  # the engine's step while the drafter sleeps: no row can draft
            continue
        awake += 1
        if s.wants_drafts(4):
            drafted = True
            s.plan(survival, [7] * 4, cost)
    woke = windows[1:]  # the first window is the warm-up's short back-offs
    assert len(woke) >= 5 and all(d for _, d in woke)
    assert all(n <= s.wake_lead + 2 for n, _ in woke)  # awake for the lead, the probe and its decision
    assert s.drafted_steps <= 4000 // (2 * s.max_backoff) + 4  # one probe per 2 * max_backoff steps


@pytest.fixture(scope="module")
def prompts(bundled_target) -> list[list[int]]:
    texts = [t for d in ("code", "prose") for t in load_eval_prompts(d, 3)]
    return [encode_prompt(bundled_target, t) for t in texts]


def test_the_drafter_sleeps_at_a_load_where_drafting_never_pays_and_stays_lossless(bundled_target, prompts) -> None:
    """Four greedy requests where drafting never pays: the drafter falls asleep (no rows, no feature capture)
    and the requests running verify no drafts while it sleeps. When the load drops the drafter wakes: the
    request still running gets a context that starts there (`join_late`) and drafts again after LATE_WARMUP
    rounds, accepted; a request joining later drafts as usual. Every output equals target-only decoding."""
    drafter = dspark.load_drafter("dspark", bundled_target)
    infos = []
    engine = Engine(bundled_target, drafter, "dspark", pays_only_below(4), EngineConfig(online_cost=False),
                    eos_token_ids=NO_EOS, on_step=infos.append)
    lengths = [150, 150, 150, 260]
    early = [Request(p, max_tokens=n) for p, n in zip(prompts[:4], lengths)]
    late = Request(prompts[4], max_tokens=60)
    asleep_rows, feature_steps, survivor_asleep = [], 0, 0
    for r in early:
        engine.add(r)
    step = 0
    while engine.has_work:
        if step > 0 and sum(r.finished for r in early) == 3 and late.state == "waiting" and late not in engine.waiting:
            engine.add(late)
        engine.step()
        if engine._asleep:
            asleep_rows.append(int(drafter.ctx.lengths.numel()))
            feature_steps += engine.want_features
            survivor_asleep = len(early[3].rounds)  # its rounds up to the drafter's last sleeping step
        step += 1
        assert step < 2000
    assert engine.drafter_sleeps >= 1 and asleep_rows and max(asleep_rows) == 0 and feature_steps == 0
    metrics = ServerMetrics()
    metrics.watch(engine)
    assert f"dspark:engine_drafter_sleeps_total {float(engine.drafter_sleeps)}" in metrics.render().decode()
    assert any(s.draft_len > 0 and s.accepted > 0 for s in late.rounds)  # joined after the wake: drafted
    # the step log's view: no blind row before the first sleep; asleep rounds with every row blind; after the
    # last wake no blind row, and the survivor of the sleep drafts again with drafts accepted
    first = next(i for i, info in enumerate(infos) if info.asleep)
    woke = max(i for i, info in enumerate(infos) if info.asleep) + 1
    assert all(info.blind == 0 for info in infos[:first])
    assert any(info.asleep and info.blind == info.batch for info in infos)
    assert all(info.blind == 0 for info in infos[woke:])
    survivor = early[3].rounds  # ran through the sleep, then drafts again with drafts accepted
    assert 1 < survivor_asleep < len(survivor) - 30
    assert sum(s.draft_len > 0 and s.accepted > 0 for s in survivor[survivor_asleep:]) >= 5
    for r in [*early, late]:
        reference = decode(bundled_target, NoDrafter(), [r.prompt_ids], max_new_tokens=r.max_tokens,
                           eos_token_ids=NO_EOS)[0].token_ids
        assert r.output_ids == reference


def test_a_burst_after_idleness_is_probed_before_its_requests_are_admitted(bundled_target, prompts) -> None:
    """A back-off decided for the last burst says nothing of the next one: requests arriving at an idle engine
    end it before they are admitted, so the drafter wakes and holds every new row's prompt, even at a batch size
    within 2x of the back-off's, and the new load is judged afresh (here the gate still predicts no gain and
    backs off again; where it predicts one, the first step probes: the next test)."""
    drafter = dspark.load_drafter("dspark", bundled_target)
    infos = []
    engine = Engine(bundled_target, drafter, "dspark", pays_only_below(1), EngineConfig(online_cost=False),
                    eos_token_ids=NO_EOS, on_step=infos.append)
    engine.run([Request(prompts[0], max_tokens=100) for _ in range(4)])  # they finish together: no drain
    assert engine._asleep and engine.scheduler.backoff_left > engine.scheduler.wake_lead  # idle, deep in a back-off
    seen = len(infos)
    burst = [Request(p, max_tokens=30) for p in prompts[2:5]]
    engine.run(burst)
    first = infos[seen]
    assert not first.asleep and first.blind == 0  # awake before they were admitted: every row sighted
    assert engine.scheduler.backoff_left > 0  # the gate, judged afresh, still predicts no gain here
    for r in burst:
        assert r.output_ids == decode(bundled_target, NoDrafter(), [r.prompt_ids], max_new_tokens=30,
                                      eos_token_ids=NO_EOS)[0].token_ids


def test_a_fresh_batch_ends_a_back_off_that_a_similar_load_would_keep() -> None:
    """`rejudge(n, fresh=True)` (requests arriving at an idle loop) ends a back-off decided at the same batch
    size, and the next step probes where the typical survivals predict a gain; without `fresh` it goes on."""
    dear = CostModel({b: [(n, 1.1 + 0.02 * (n - b)) for n in range(b, 8 * b + 1)] for b in (1, 2, 4, 8)},
                     {b: 1.0 for b in (1, 2, 4, 8)}, "padded")
    for fresh in (False, True):
        s = Scheduler("dspark", gamma=7)
        for _ in range(3):
            s.plan(np.full((4, 7), 0.9).cumprod(1), [7] * 4, dear)
        while s.backoff_left == 0:  # hard steps turn the smoothed gain negative: a back-off of 4 at 4 requests
            s.plan(np.full((4, 7), 0.05).cumprod(1), [7] * 4, dear)
        s.rejudge(4, fresh=fresh)
        assert s.wants_drafts(4) == fresh


def test_drafter_sleep_can_be_switched_off(bundled_target, prompts) -> None:
    drafter = dspark.load_drafter("dspark", bundled_target)
    engine = Engine(bundled_target, drafter, "dspark", pays_only_below(4),
                    EngineConfig(online_cost=False, drafter_sleep=False), eos_token_ids=NO_EOS)
    engine.run([Request(p, max_tokens=120) for p in prompts[:4]])
    assert engine.drafter_sleeps == 0 and engine.scheduler.skipped_steps > 80


def test_serve_switches_drafter_sleep_with_its_flag() -> None:
    from dspark.cli import build_parser
    from dspark.serving.cli import engine_config

    parse = build_parser().parse_args
    assert engine_config(parse(["serve"])).drafter_sleep is True
    assert engine_config(parse(["serve", "--no-drafter-sleep"])).drafter_sleep is False
    config = engine_config(parse(["serve", "--rate-guard", "--no-online-cost", "--max-running", "8"]))
    assert (config.rate_guard, config.online_cost, config.max_running, config.drafter_sleep) == (True, False, 8, True)


def test_probes_that_refute_the_typical_row_close_the_gate_at_their_batch_size_only() -> None:
    """The typical survival row is a mean over steps of every size; where probes at one batch size keep finding
    much less than it predicts (measured: at 64 requests, temperature 1), the gate learns the gap per batch
    bucket, weighted by the probe's rows, and stops paying for probes there (the drafter can sleep), while at
    the batch size the row came from it still predicts a gain."""
    cost = CostModel({b: [(n, 1.2 + 0.1 * (n / b - 1)) for n in range(b, 8 * b + 1, b)] for b in (1, 16)},
                     {1: 1.0, 16: 1.0}, "padded")
    high, low = np.full((1, 7), 0.9).cumprod(1), np.full((1, 7), 0.2).cumprod(1)
    s = Scheduler("dspark", gamma=7)
    for _ in range(40):
        s.plan(high, [7], cost)
    assert s._predicted_to_pay(16)  # the row from one-request steps predicts a gain at 16 too
    probes, steps = 0, 4000
    for _ in range(steps):
        if s.dormant:  # the engine's step while the drafter sleeps
            s.idle_step(16)
            continue
        if s.wants_drafts(16):
            probes += 1
            s.plan(np.repeat(low, 16, axis=0), [7] * 16, cost)
    assert s._predicted_to_pay(1) and not s._predicted_to_pay(16)
    # the back-offs of 4, 16, 64, 256 steps, then only the probes due once per 2 * max_backoff steps (without the
    # correction the gate stays open at 16: a probe ends every back-off of 256, 19 in all)
    assert probes <= 4 + steps // (2 * s.max_backoff) + 1


def test_a_gate_correction_learned_on_a_harder_workload_is_void_once_the_workload_is_easier() -> None:
    """Probes at 16 requests close the gate there while the workload is hard (the typical row expects about 2.1
    accepted drafts); once the typical row expects over GATE_EASIER times as many (temperature 0 after 1, in the
    sweep's order), that correction no longer holds the gate and the typical row alone decides there until a
    probe learns it anew. A workload as hard or harder keeps it."""
    cost = CostModel({b: [(n, 1.2 + 0.3 * (n / b - 1)) for n in range(b, 8 * b + 1, b)] for b in (1, 16)},
                     {1: 1.0, 16: 1.0}, "padded")

    def closed_at_16(typical: np.ndarray) -> Scheduler:
        s = Scheduler("dspark", gamma=7)
        for _ in range(60):
            s.plan(typical, [7], cost)
        assert s._predicted_to_pay(16)
        low = np.repeat(np.full((1, 7), 0.05).cumprod(1), 16, axis=0)
        for _ in range(3000):  # probes at 16 requests find no gain: the gate closes there
            if s.dormant:
                s.idle_step(16)
            elif s.wants_drafts(16):
                s.plan(low, [7] * 16, cost)
        assert s.gate_bias(16) < -0.1 and not s._predicted_to_pay(16)
        return s

    s = closed_at_16(np.full((1, 7), 0.8).cumprod(1))
    learned = s.gate_bias(16)
    for _ in range(80):  # a harder workload at one request: the correction stands
        s.plan(np.full((1, 7), 0.7).cumprod(1), [7], cost)
    assert s.gate_bias(16) == learned
    for _ in range(80):  # an easier one: void, the typical row alone gates probes at 16
        s.plan(np.full((1, 7), 0.95).cumprod(1), [7], cost)
    assert float(s._last_mean.sum()) > s.GATE_EASIER * 2.2
    assert s.gate_bias(16) == 0.0 and s._predicted_to_pay(16)


def test_a_probe_judges_drafting_by_the_rows_that_could_draft() -> None:
    """Requests admitted while the drafter slept verify no drafts until they finish. A probe whose batch is
    mostly such rows must judge drafting at this load by the rows that could draft: measured over HTTP at
    temperature 1 with 8 clients, probes diluted by blind rows kept finding no gain, so the drafter slept
    where drafting paid (the served `dspark` drafted a third as much as at the previous version)."""
    cost = CostModel({b: [(n, 1.2 + 0.2 * (n / b - 1)) for n in range(b, 8 * b + 1, b)] for b in (1, 8)},
                     {1: 1.0, 8: 1.0}, "padded")
    high = np.full((8, 7), 0.9).cumprod(1)
    blind = np.array([7, 7, 0, 0, 0, 0, 0, 0])
    _, theta = prefix_schedule(high, blind, cost)
    assert theta * cost.plain_cost(8) / 8 < 1  # this step alone: drafting for two rows of eight does not pay
    s = Scheduler("dspark", gamma=7)
    for _ in range(10):
        s.plan(high, [7] * 8, cost)  # drafting pays at 8 requests with drafter context
    low = np.full((8, 7), 0.05).cumprod(1)
    while s.wants_drafts(8):  # hard steps until drafting backs off
        s.plan(low, [7] * 8, cost)
    for _ in range(10 * s.max_backoff):  # the back-off runs out and a probe comes
        if s.dormant:
            s.idle_step(8)
        elif s.wants_drafts(8):
            break
    else:
        raise AssertionError("no probe came")
    s.plan(high, blind, cost)  # the probe: six rows admitted while the drafter slept
    assert s.wants_drafts(8) and s._predicted_to_pay(8)  # drafting goes on, and the gate stays open at 8
