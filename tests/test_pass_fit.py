"""What target passes cost beyond the table, fitted online (the context's slots, a fused prefill chunk), and how
the cost model and the engine use it."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import dspark
from dspark.api import encode_prompt
from dspark.engine import Engine, EngineConfig, Request
from dspark.evaluation.bench import load_eval_prompts
from dspark.pass_fit import PassFit
from dspark.sampling import SamplingParams
from dspark.scheduling import uniform_cost_model

SLOT, CHUNK, OWN = 4e-7, 1.7e-4, 0.004  # the law's seconds per query token per slot, per prompt token, and a fused
# pass's own fixed part


def loaded_pass(rng: np.random.Generator, fused: bool | None = None) -> tuple[float, int, int, int, int, bool]:
    """A target pass of a loaded step drawn at random, priced by a known law, with 5% noise."""
    batch = int(rng.integers(32, 65))
    tokens = batch * int(rng.integers(1, 9))
    slots = int(rng.integers(100, 600))
    fused = bool(rng.integers(0, 2)) if fused is None else fused
    prompt = int(rng.integers(8, 257)) if fused else 0
    seconds = 0.003 + 2e-4 * batch + 8e-5 * tokens + SLOT * tokens * slots + CHUNK * prompt + OWN * fused
    return seconds * float(rng.normal(1.0, 0.05)), batch, tokens, slots, prompt, fused


def test_the_context_and_chunk_slopes_are_recovered_from_noisy_passes() -> None:
    rng = np.random.default_rng(0)
    fit = PassFit()
    for _ in range(400):
        fit.observe(*loaded_pass(rng))
    assert fit.slot_seconds == pytest.approx(SLOT, rel=0.1)
    assert fit.chunk_seconds(200) == pytest.approx(200 * CHUNK + OWN, rel=0.1)
    assert fit.chunk_seconds(200) - fit.chunk_seconds(100) == pytest.approx(100 * CHUNK, rel=0.1)


def test_a_fused_pass_own_part_counts_only_where_unfused_passes_tell_it_apart() -> None:
    """The chunk's share holds the fused pass's own fixed part while both kinds of pass are common; with every
    pass fused that part cannot be told from every pass's fixed part, and only the per-token slope is read."""
    rng = np.random.default_rng(4)
    mixed, fused_only = PassFit(), PassFit()
    for _ in range(400):
        mixed.observe(*loaded_pass(rng))
        fused_only.observe(*loaded_pass(rng, fused=True))
    assert mixed.chunk_seconds(0) == pytest.approx(OWN, rel=0.25)
    assert fused_only.chunk_seconds(0) == 0.0
    assert fused_only.chunk_seconds(200) == pytest.approx(200 * CHUNK, rel=0.1)
    for _ in range(150):  # unfused passes only from now on: the share of fused ones falls below MIXED
        mixed.observe(*loaded_pass(rng, fused=False))
    assert mixed.chunk_seconds(0) == 0.0


def test_the_fit_follows_a_change_of_machine_speed() -> None:
    """Forgetting: after the machine gets twice as slow, both slopes double."""
    rng = np.random.default_rng(1)
    fit = PassFit()
    for _ in range(300):
        fit.observe(*loaded_pass(rng))
    for _ in range(500):
        seconds, *rest = loaded_pass(rng)
        fit.observe(2 * seconds, *rest)
    assert fit.slot_seconds == pytest.approx(2 * SLOT, rel=0.15)
    assert fit.chunk_seconds(100) == pytest.approx(2 * (100 * CHUNK + OWN), rel=0.15)


def test_nothing_is_read_until_it_has_varied() -> None:
    fit = PassFit(min_steps=16)
    assert fit.slot_seconds is None and fit.chunk_seconds(100) is None
    rng = np.random.default_rng(2)
    for _ in range(40):  # unfused passes only: no chunk share
        fit.observe(*loaded_pass(rng, fused=False))
    assert fit.slot_seconds is not None and fit.chunk_seconds(100) is None
    for _ in range(40):  # fused, every chunk the same size: its slope cannot be told from the fused pass's own part
        seconds, batch, tokens, slots, _, _ = loaded_pass(rng, fused=True)
        fit.observe(seconds, batch, tokens, slots, 128, True)
    assert fit.chunk_seconds(100) is None
    for _ in range(20):
        fit.observe(*loaded_pass(rng, fused=True))
    assert fit.chunk_seconds(100) is not None
    same = PassFit(min_steps=16)
    for _ in range(40):  # one batch, one width, one context: N·S never varies
        same.observe(0.05, 64, 256, 300, 0, False)
    assert same.slot_seconds is None


def test_bad_measurements_are_ignored() -> None:
    rng = np.random.default_rng(3)
    fit = PassFit()
    for _ in range(100):
        fit.observe(*loaded_pass(rng))
    before = (fit.slot_seconds, fit.chunk_seconds(1), fit.steps)
    for seconds in (math.nan, math.inf, 0.0, -1.0):
        fit.observe(seconds, 64, 256, 300, 100, True)
    fit.observe(0.05, 0, 256, 300)  # no rows
    assert (fit.slot_seconds, fit.chunk_seconds(1), fit.steps) == before
    with pytest.raises(ValueError, match="alpha"):
        PassFit(alpha=0.0)


def test_the_cost_model_prices_and_reads_steps_at_their_context() -> None:
    """A step of N query tokens over S slots costs s·N·(S - reference) beyond its cell, drafted and plain alike
    (so drafted steps rise N / B times as fast); a measurement is read back at the reference context, so a step
    measured at the priced figure leaves the correction where it was."""
    cost = uniform_cost_model(gamma=7, batches=(1, 2, 4, 8, 16, 32, 64), layout="padded")
    base_d, base_p = cost.cost(64, 448), cost.plain_cost(64)
    cost.set_context(1e-7, 400)
    assert base_d == cost.cost(64, 448) and base_p == cost.plain_cost(64)  # no reference context: no term
    cost.reference_slots = 256
    assert cost.cost(64, 448) == pytest.approx(base_d + 1e-7 * 448 * 144)
    assert cost.plain_cost(64) == pytest.approx(base_p + 1e-7 * 64 * 144)
    cost.set_context(1e-7, 200)  # a shorter context is cheaper, by at most half
    assert cost.cost(64, 448) == pytest.approx(base_d - 1e-7 * 448 * 56)
    cost.set_context(1.0, 0)
    assert cost.cost(64, 448) == pytest.approx(0.5 * base_d) and cost.plain_cost(64) == pytest.approx(0.5 * base_p)
    cost.set_context(1e-7, 400)
    priced = cost.cost(64, 448)
    for _ in range(5):
        cost.observe(64, 448, priced, True, slots=400)
    assert cost.cost(64, 448) == pytest.approx(priced)
    cost.set_context(None, 400)
    assert cost.cost(64, 448) == pytest.approx(base_d)


@pytest.mark.parametrize("fit", [True, False])
def test_fused_rounds_reach_the_online_correction_less_their_chunk(fit, bundled_target):
    """Staggered requests whose prompts ride in the rounds' passes: with `pass_fit`, once the chunk's share is
    fitted every fused round is observed at its seconds less that share, each at its context; without it, no
    fused round is observed and no context is priced. Unfused rounds are observed as measured either way."""
    texts = [t for d in ("code", "prose", "math") for t in load_eval_prompts(d, 8)]
    prompts = [encode_prompt(bundled_target, t) for t in texts[:24]]
    drafter = dspark.load_drafter("dspark", bundled_target)
    cost = uniform_cost_model(gamma=7, batches=(1, 2, 4, 8), layout="padded")
    cost.reference_slots = 64
    engine = Engine(bundled_target, drafter, "dspark", cost_model=cost,
                    config=EngineConfig(max_running=6, prefill_chunk=24, pass_fit=fit))
    observed, infos, contexts = [], [], []
    observe, set_context = cost.observe, cost.set_context
    cost.observe = lambda batch, tokens, seconds, drafted, width=None, slots=None: (
        observed.append((batch, tokens, seconds, drafted, slots)), observe(batch, tokens, seconds, drafted, width, slots))
    cost.set_context = lambda per_slot, slots: (contexts.append(per_slot), set_context(per_slot, slots))
    engine.on_step = infos.append
    pending = [Request(p, SamplingParams(), max_tokens=12) for p in prompts]
    step = 0
    while pending or engine.has_work:
        if pending and step % 2 == 0:
            engine.add(pending.pop(0))
        engine.step()
        step += 1
        assert step < 2000
    fused = [i for i in infos if i.fused_prefill]
    assert len(fused) >= 20
    want = []
    for info in infos:
        if not info.fused_prefill:
            want.append((info.batch, info.tokens, info.seconds, info.drafted, info.kv_slots))
        elif fit and info.chunk_seconds is not None:
            want.append((info.batch, info.tokens, max(info.seconds - info.chunk_seconds, 0.5 * info.seconds),
                         info.drafted, info.kv_slots))
    assert observed == want
    took_off = [i for i in fused if i.chunk_seconds is not None]
    if fit:
        assert len(took_off) >= 5 and all(i.chunk_seconds >= 0 for i in took_off)
        assert any(c is not None for c in contexts)  # rounds were priced at their context once it was fitted
        # the engine's fit (public for benchmarks) saw every round's pass, the fused ones as fused
        assert engine.pass_fit.steps == len(infos) and engine.pass_fit.fused_steps == len(fused)
        assert engine.pass_fit.chunk_seconds(10) is not None
    else:
        assert not took_off and not contexts
        assert engine.pass_fit.steps == 0


def test_serve_switches_the_pass_fit_with_its_flag() -> None:
    from dspark.cli import build_parser
    from dspark.serving.cli import engine_config

    parse = build_parser().parse_args
    assert engine_config(parse(["serve"])).pass_fit is True
    assert engine_config(parse(["serve", "--no-pass-fit"])).pass_fit is False
    assert engine_config(parse(["serve"])).paid_compaction is False
    assert engine_config(parse(["serve", "--paid-compaction"])).paid_compaction is True


@pytest.mark.parametrize("paid", [True, False])
def test_the_cache_is_compacted_once_its_holes_cost_what_a_compaction_does(paid, bundled_target):
    """Rent or buy: the attention the holes cost since the last compaction (s · N · holes per pass) against a
    compaction's measured price. Drafted rounds leave holes; with the rent at the price the next round starts
    on a compacted cache (and the rent is paid off), below it or without `paid_compaction` it does not; greedy
    output stays the target's own either way."""
    from dspark.decoding import decode
    from dspark.drafters import NoDrafter

    texts = [t for d in ("code", "prose") for t in load_eval_prompts(d, 2)]
    prompts = [encode_prompt(bundled_target, t) for t in texts[:4]]
    drafter = dspark.load_drafter("dspark", bundled_target)
    engine = Engine(bundled_target, drafter, "fixed", config=EngineConfig(max_running=4, paid_compaction=paid))
    requests = [engine.add(Request(p, SamplingParams(), max_tokens=24)) for p in prompts]
    target = engine.target
    while engine.has_work and target.holes < 8:
        engine.step()
    assert engine.has_work and target.holes >= 8  # drafted rounds left holes
    target.compact_seconds_per_slot = 1e-9
    price = target.compact_price()
    engine._hole_rent = 0.5 * price  # below the price: the holes stay
    before = target.compactions
    engine._compact_if_paid()
    assert target.compactions == before and target.holes >= 8
    engine._hole_rent = price
    engine._compact_if_paid()
    if paid:
        assert target.compactions == before + 1 and target.holes == 0 and engine._hole_rent == 0.0
    else:
        assert target.compactions == before and target.holes >= 8
    while engine.has_work:
        engine.step()
    for req, prompt in zip(requests, prompts):
        alone = decode(bundled_target, NoDrafter(), [prompt], max_new_tokens=24)[0].token_ids
        assert req.output_ids == alone


def test_a_compaction_is_timed_and_priced(bundled_target) -> None:
    lm = bundled_target.empty_like()
    assert lm.compact_price() is None and lm.compactions == 0
    lm.reset(2)
    lm.forward([[1, 2, 3, 4], [5, 6]])
    assert lm.holes == 0  # row 1 is padded to row 0's width: padding, not holes
    lm.forward([[7], [8, 9, 10]])
    assert lm.holes == 2  # both rows hold 5 tokens across 7 slots
    lm.compact()
    assert lm.compactions == 1 and lm.holes == 0 and lm.compact_seconds_per_slot > 0
    assert lm.compact_price() == pytest.approx(lm.compact_seconds_per_slot * 2 * lm.valid.shape[1])
