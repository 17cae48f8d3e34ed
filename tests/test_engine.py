"""The continuous-batching engine: staggered arrivals stay lossless, rows join and leave, admission, stops."""
from __future__ import annotations

import pytest
import torch

import dspark
from dspark.api import encode_prompt
from dspark.decoding import decode
from dspark.drafters import NoDrafter
from dspark.drafters.base import drafter_gamma
from dspark.engine import Engine, EngineConfig, QueueFull, Request
from dspark.engine.text import TextStream
from dspark.evaluation.bench import load_eval_prompts
from dspark.sampling import SamplingParams
from dspark.scheduling import uniform_cost_model

SCHEDULERS = ["none", "fixed", "fixed:3", "threshold:0.5", "batch-table", "dspark", "dspark-async"]


@pytest.fixture(scope="module")
def prompts(bundled_target) -> list[list[int]]:
    texts = [t for d in ("code", "prose", "math") for t in load_eval_prompts(d, 11)]
    return [encode_prompt(bundled_target, t) for t in texts[:32]]


@pytest.fixture(scope="module")
def dspark_drafter(bundled_target):
    return dspark.load_drafter("dspark", bundled_target)


_reference_cache: dict = {}


def standalone(target, prompt: list[int], max_tokens: int) -> list[int]:
    """The request's target-only output, decoded alone."""
    key = (tuple(prompt), max_tokens)
    if key not in _reference_cache:
        _reference_cache[key] = decode(target, NoDrafter(), [prompt], max_new_tokens=max_tokens)[0].token_ids
    return _reference_cache[key]


def run_staggered(engine: Engine, requests: list[Request], arrivals: list[int], watch=None) -> int:
    """Add request i at step arrivals[i]; step until all finish; return the number of steps."""
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    step = 0
    while order or engine.has_work:
        while order and arrivals[order[0]] <= step:
            engine.add(requests[order.pop(0)])
        outs = engine.step()
        if watch is not None:
            watch(engine, outs)
        step += 1
        assert step < 2000, "the engine stopped making progress"
    return step


def mixed_requests(prompts, n: int, seed: int = 0) -> list[Request]:
    """Greedy (even) and sampled (odd) requests of different lengths."""
    lengths = [6, 11, 17, 24]
    return [
        Request(prompts[i], SamplingParams() if i % 2 == 0 else SamplingParams(1.0, seed=seed + i),
                max_tokens=lengths[i % len(lengths)])
        for i in range(n)
    ]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_staggered_arrivals_greedy_identical_every_scheduler(scheduler, bundled_target, dspark_drafter, prompts):
    """32 requests arriving over time (chunked prefill, a waiting queue, mixed greedy / sampled neighbours):
    every greedy request's output equals its standalone target-only output."""
    gamma = drafter_gamma(dspark_drafter)
    cost = uniform_cost_model(gamma, per_token=0.05, draft_share=0.3)  # capacity binds: rows get cut
    config = EngineConfig(max_running=12, prefill_chunk=24)
    engine = Engine(bundled_target, dspark_drafter, scheduler, cost, config)
    requests = mixed_requests(prompts, 32)
    arrivals = [i // 3 for i in range(32)]
    peak = []
    run_staggered(engine, requests, arrivals, lambda e, _: peak.append(len(e.running) + len(e.prefilling)))
    assert max(peak) == 12  # the queue was used and admission held the limit
    for req in requests:
        assert req.finish_reason in ("stop", "length")
        if req.sampling.greedy:
            assert req.output_ids == standalone(bundled_target, req.prompt_ids, req.max_tokens), req.request_id
        else:
            assert 0 < len(req.output_ids) <= req.max_tokens
    drafts = [r.draft_len for req in requests for r in req.rounds]
    if scheduler == "none":
        assert max(drafts) == 0
        # no upkeep for drafts never made: no target features, no drafter context
        assert isinstance(engine.drafter, NoDrafter) and not engine.want_features
    elif scheduler in ("dspark", "dspark-async", "threshold:0.5"):
        cut = [r for req in requests for r in req.rounds if r.available and 0 < r.draft_len < r.available]
        assert cut or scheduler == "dspark-async", "the scheduler never verified part of a block"
        assert max(drafts) > 0
    elif scheduler == "fixed:3":  # the drafter drafts the 3 slots fixed:3 can verify, not the whole block
        assert max(r.available or 0 for req in requests for r in req.rounds) == 3 == max(drafts)
    assert engine.target.batch_size == 0 and engine.reserved == 0


@pytest.mark.parametrize("name", ["ngram", "draft-model", "dflash", "dspark-rnn", "eagle3"])
def test_staggered_arrivals_every_drafter(name, bundled_target, prompts):
    """Rows join every kind of drafter's state between steps and leave it when done."""
    drafter = dspark.load_drafter(name, bundled_target)
    engine = Engine(bundled_target, drafter, "fixed", config=EngineConfig(max_running=5, prefill_chunk=16))
    requests = mixed_requests(prompts[5:17], 12, seed=3)
    run_staggered(engine, requests, [i // 2 for i in range(12)])
    for req in requests:
        if req.sampling.greedy:
            assert req.output_ids == standalone(bundled_target, req.prompt_ids, req.max_tokens), (name, req.request_id)
    assert any(r.accepted > 0 for req in requests for r in req.rounds), name


def test_seeded_sampled_request_ignores_its_neighbours(bundled_target, dspark_drafter, prompts):
    """A seeded sampled request gives the same tokens alone and among other requests, under the schedulers
    whose decision for a row never reads the batch (adaptive ones trade that for throughput: their ℓ_r
    depends on the neighbours, so only the distribution is the same; a replay of the same arrivals is)."""
    for scheduler in ("fixed", "none"):
        alone = Engine(bundled_target, dspark_drafter, scheduler).run(
            [Request(prompts[4], SamplingParams(1.0, top_p=0.9, seed=11), max_tokens=20)])[0]
        engine = Engine(bundled_target, dspark_drafter, scheduler, config=EngineConfig(prefill_chunk=8))
        target = Request(prompts[4], SamplingParams(1.0, top_p=0.9, seed=11), max_tokens=20)
        others = mixed_requests(prompts[10:16], 6, seed=40)
        run_staggered(engine, others[:3] + [target] + others[3:], [0, 0, 1, 2, 2, 3, 5])
        assert target.output_ids == alone.output_ids, scheduler
    replays = []
    for _ in range(2):
        config = EngineConfig(prefill_chunk=8, online_cost=False)
        engine = Engine(bundled_target, dspark_drafter, "dspark", uniform_cost_model(7, per_token=0.05), config)
        reqs = mixed_requests(prompts[10:17], 7, seed=40)
        run_staggered(engine, reqs, [0, 0, 1, 2, 2, 3, 5])
        replays.append([r.output_ids for r in reqs])
    assert replays[0] == replays[1]


def test_cancel_frees_the_row_in_the_next_step(bundled_target, dspark_drafter, prompts):
    engine = Engine(bundled_target, dspark_drafter, "fixed")
    requests = [Request(prompts[i], max_tokens=40) for i in range(3)]
    for req in requests:
        engine.add(req)
    engine.step()
    engine.step()
    reserved = engine.reserved
    engine.cancel(requests[1].request_id)
    outs = engine.step()
    assert requests[1].finish_reason == "cancelled" and requests[1].state == "finished"
    assert any(o.request is requests[1] and o.finished for o in outs)
    assert requests[1] not in engine.running
    assert engine.target.batch_size == 2 and engine.drafter.ctx.lengths.shape[0] == 2
    assert engine.reserved == reserved - engine._reservation(requests[1])
    while engine.has_work:
        engine.step()
    for i in (0, 2):  # the neighbours are untouched
        assert requests[i].output_ids == standalone(bundled_target, prompts[i], 40)
    waiting = Request(prompts[3], max_tokens=5)
    engine2 = Engine(bundled_target, dspark_drafter, "fixed", config=EngineConfig(max_running=1))
    engine2.add(Request(prompts[2], max_tokens=5))
    engine2.add(waiting)
    engine2.cancel(waiting.request_id)
    engine2.step()
    assert waiting.finish_reason == "cancelled" and not engine2.waiting


def test_short_prompts_joining_beside_a_long_one_are_not_padded_to_it(bundled_target, dspark_drafter, prompts):
    """A long prompt and two short ones arrive together with nothing running: the first pass feeds the short
    ones whole at their width, not all three padded to the long one; the short requests join and decode in
    that step, the long one finishes its prompt in later passes, and every greedy output is its standalone
    output."""
    long_prompt = sum((prompts[i] for i in range(6, 12)), [])[:300]
    short = [prompts[0][:20], prompts[1][:24]]
    infos = []
    engine = Engine(bundled_target, dspark_drafter, "fixed", config=EngineConfig(prefill_chunk=256),
                    on_step=infos.append)
    requests = [Request(long_prompt, max_tokens=8), *(Request(p, max_tokens=8) for p in short)]
    for req in requests:
        engine.add(req)
    engine.step()
    first = infos[0]
    assert first.prefill_slots == 3 * 24 and first.prefill_tokens == 24 + 20 + 24
    assert all(r.output_ids for r in requests[1:]) and requests[0].state == "prefilling" and not requests[0].output_ids
    while engine.has_work:
        engine.step()
    assert sum(i.prefill_tokens for i in infos) == len(long_prompt) + 44
    assert all(i.prefill_slots <= 256 for i in infos[1:])  # once requests run, passes keep to the budget
    for req, prompt in zip(requests, [long_prompt, *short]):
        assert req.output_ids == standalone(bundled_target, prompt, 8)


def test_long_prompt_prefills_in_chunks_without_stalling_running_requests(bundled_target, dspark_drafter, prompts):
    # no EOS: the short requests keep running for the whole prefill
    engine = Engine(bundled_target, dspark_drafter, "fixed", config=EngineConfig(prefill_chunk=16),
                    eos_token_ids=frozenset())
    short = [Request(prompts[i], max_tokens=120) for i in range(2)]
    long_prompt = sum((prompts[i] for i in range(6, 12)), [])[:300]
    late = Request(long_prompt, max_tokens=8)
    for req in short:
        engine.add(req)
    engine.step()
    engine.add(late)
    prefill_steps = 0
    while late.state in ("waiting", "prefilling"):
        before = [len(r.output_ids) for r in short]
        infos = []
        engine.on_step = infos.append
        engine.step()
        prefill_steps += 1
        assert infos[0].prefill_tokens <= infos[0].prefill_slots <= 16
        assert all(len(r.output_ids) > b for r, b in zip(short, before) if not r.finished)  # never stalled
    assert prefill_steps >= (len(long_prompt) - 1) // 16
    while engine.has_work:
        engine.step()
    reference = decode(bundled_target, NoDrafter(), [long_prompt], max_new_tokens=8, eos_token_ids=frozenset())
    assert late.output_ids == reference[0].token_ids


def test_admission_limits_and_bad_requests(bundled_target, dspark_drafter, prompts):
    reserve = len(prompts[0]) + 10 + drafter_gamma(dspark_drafter) + 1
    config = EngineConfig(max_running=8, max_waiting=3, kv_budget_tokens=2 * reserve + 5)
    engine = Engine(bundled_target, dspark_drafter, "fixed", config=config)
    reqs = [Request(prompts[0], max_tokens=10) for _ in range(3)]
    for r in reqs:
        engine.add(r)
    with pytest.raises(QueueFull, match="limit 3"):
        engine.add(Request(prompts[0], max_tokens=10))
    engine.step()
    assert len(engine.running) + len(engine.prefilling) == 2 and len(engine.waiting) == 1  # the KV budget binds
    while engine.has_work:
        engine.step()
    assert all(r.finish_reason in ("stop", "length") for r in reqs)
    limit = bundled_target.model.config.max_position_embeddings
    with pytest.raises(ValueError, match="context"):
        engine.add(Request(prompts[0], max_tokens=limit))
    with pytest.raises(ValueError, match="KV budget"):
        engine.add(Request(prompts[0], max_tokens=3 * reserve))
    with pytest.raises(ValueError, match="empty"):
        engine.add(Request([], max_tokens=3))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add(Request([10**7], max_tokens=3))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add(Request(prompts[0], max_tokens=0))
    with pytest.raises(ValueError, match="max_running"):
        EngineConfig(max_running=0)


def test_speculation_off_and_draft_cap_per_request(bundled_target, dspark_drafter, prompts):
    engine = Engine(bundled_target, dspark_drafter, "fixed")
    off = Request(prompts[0], max_tokens=16, speculate=False)
    capped = Request(prompts[1], max_tokens=16, max_draft=2)
    free = Request(prompts[2], max_tokens=16)
    engine.run([off, capped, free])
    assert all(r.draft_len == 0 for r in off.rounds) and len(off.rounds) == 16
    assert max(r.draft_len for r in capped.rounds) == 2
    assert max(r.draft_len for r in free.rounds) > 2
    for req in (off, capped, free):
        assert req.output_ids == standalone(bundled_target, req.prompt_ids, 16)


def test_ignore_eos_and_stop_token_ids_beside_neighbours(bundled_target, dspark_drafter, prompts):
    eos_first = encode_prompt(bundled_target, "def add(a, b):", chat=False)  # greedy: EOS comes first
    through = decode(bundled_target, NoDrafter(), [eos_first], max_new_tokens=20, eos_token_ids=frozenset())[0]
    ref = standalone(bundled_target, prompts[3], 24)
    stop_id = ref[9]
    engine = Engine(bundled_target, dspark_drafter, "fixed")
    plain = Request(eos_first, max_tokens=20)
    ignoring = Request(eos_first, max_tokens=20, ignore_eos=True)
    stopped = Request(prompts[3], max_tokens=24, stop_token_ids=frozenset({stop_id}))
    neighbour = Request(prompts[4], max_tokens=24)
    engine.run([plain, ignoring, stopped, neighbour])
    assert plain.finish_reason == "stop" and plain.output_ids == through.token_ids[:1]
    assert ignoring.finish_reason == "length" and ignoring.output_ids == through.token_ids
    assert ignoring.output_ids[0] in bundled_target.eos_token_ids  # it went on past an EOS
    assert sum(r.accepted for r in ignoring.rounds) > 0  # with drafts accepted, so verify saw the EOS too
    assert stopped.finish_reason == "stop" and stopped.output_ids == ref[: ref.index(stop_id) + 1]
    assert neighbour.output_ids == standalone(bundled_target, prompts[4], 24)


def test_stop_strings_across_token_boundaries(bundled_target, dspark_drafter, prompts):
    tok = bundled_target.tokenizer
    ref = standalone(bundled_target, prompts[0], 24)
    pieces = [tok.decode(ref[:n], skip_special_tokens=True) for n in range(len(ref) + 1)]
    # a stop string that starts inside token 8's text and ends inside token 10's
    a, b = pieces[7], pieces[10]
    start = len(a) + max(0, (len(pieces[8]) - len(a)) // 2)
    stop = b[start : len(pieces[9]) + 1]
    assert len(stop) >= 2
    engine = Engine(bundled_target, dspark_drafter, "fixed")
    req = Request(prompts[0], max_tokens=24, stop=[stop, "never-in-the-text"])
    engine.add(req)
    deltas = []
    while engine.has_work:
        deltas += [o.text for o in engine.step() if o.request is req]
    full = pieces[-1]
    assert req.finish_reason == "stop"
    assert req.text == full[: full.find(stop)]
    assert "".join(deltas) == req.text  # the stream never sent the start of the stop string
    assert req.output_ids == ref[: len(req.output_ids)]
    assert stop in tok.decode(req.output_ids) and stop not in tok.decode(req.output_ids[:-1])


def test_text_stream_holds_back_incomplete_characters(bundled_target):
    tok = bundled_target.tokenizer
    ids = tok("é漢字 ok", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok)
    out = ""
    for n in range(1, len(ids) + 1):
        delta, hit = stream.update(ids[:n])
        assert "\ufffd" not in delta and not hit
        out += delta
    out += stream.flush()
    assert out == "é漢字 ok"


def test_decode_runs_through_the_engine(bundled_target, dspark_drafter, prompts):
    """decode is the engine with every request arriving at once: same results as a hand-driven engine."""
    params = [SamplingParams(), SamplingParams(1.0, seed=5)]
    res = decode(bundled_target, dspark_drafter, prompts[:2], params, max_new_tokens=12)
    reqs = Engine(bundled_target, dspark_drafter, "fixed").run(
        [Request(prompts[i], params[i], max_tokens=12) for i in range(2)])
    assert [r.token_ids for r in res] == [r.output_ids for r in reqs]
    assert [len(r.rounds) for r in res] == [len(r.rounds) for r in reqs]
    assert torch.equal(bundled_target.lengths, torch.zeros(0, dtype=torch.long))


def test_cache_compaction_while_decoding_keeps_outputs(bundled_target, prompts, monkeypatch):
    """Both batched caches compacted mid-run (small slack, staggered rows, many rollbacks): the target's KV
    cache and the drafter's context cache; every greedy output stays equal to its standalone decoding."""
    from dspark.drafters.block import ContextCache
    from dspark.target import CausalLM

    calls = {"target": 0, "context": 0}
    target_compact, context_compact = CausalLM.compact, ContextCache.compact

    def counted(name, original):
        def compact(self):
            calls[name] += 1
            return original(self)
        return compact

    monkeypatch.setattr(CausalLM, "compact", counted("target", target_compact))
    monkeypatch.setattr(ContextCache, "compact", counted("context", context_compact))
    monkeypatch.setattr(ContextCache.__init__, "__defaults__", (2,))  # compact_slack of every new context cache
    target = bundled_target.empty_like()
    target.compact_slack = 2
    drafter = dspark.load_drafter("dspark", target)
    engine = Engine(target, drafter, "fixed")
    requests = [Request(p, max_tokens=n) for p, n in zip(prompts[:6], (24, 9, 30, 16, 24, 12))]
    run_staggered(engine, requests, [0, 0, 2, 3, 5, 8])
    assert calls["target"] > 0 and calls["context"] > 0
    for req in requests:
        assert req.output_ids == standalone(bundled_target, req.prompt_ids, req.max_tokens)


def test_engine_outputs_stay_lossless_with_segments_everywhere(monkeypatch, bundled_target, dspark_drafter, prompts):
    """Every attention call split wherever rows start apart (a kernel call priced at one slot): staggered
    requests of mixed lengths, greedy beside sampled, drafted and rolled back; every greedy output equals its
    standalone target-only decoding."""
    import dspark.attention as attention

    monkeypatch.setattr(attention, "SEGMENT_CALL_SLOTS", 1)
    seen = []
    real = attention.row_segments
    monkeypatch.setattr(attention, "row_segments", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    engine = Engine(bundled_target, dspark_drafter, "fixed", config=EngineConfig(max_running=6, prefill_chunk=16))
    requests = mixed_requests(prompts[:14], 14, seed=5)
    run_staggered(engine, requests, [i // 2 for i in range(14)])
    assert any(len(runs) > 1 for runs in seen)
    for req in requests:
        if req.sampling.greedy:
            assert req.output_ids == standalone(bundled_target, req.prompt_ids, req.max_tokens), req.request_id



def test_the_engine_sorts_its_rows_by_where_their_text_starts_and_stays_lossless(monkeypatch, bundled_target,
                                                                                 dspark_drafter, prompts):
    """Long and short prompts arriving in turn leave the running rows out of order of their first slots (a row
    leaving is filled by the last one). The engine sorts them (target cache, drafter state, requests) where
    attention's row segments then read fewer slots, and every greedy output equals its standalone decoding;
    with `sort_rows` off nothing is reordered."""
    import dspark.attention as attention
    import dspark.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "SORT_EVERY", 1)
    monkeypatch.setattr(engine_module, "SORT_GAIN", 0.01)
    monkeypatch.setattr(attention, "SEGMENT_CALL_SLOTS", 200)  # a kernel call costs what a row does here
    long_prompt = max(prompts, key=len) * 2
    mixed = [long_prompt if i % 3 == 0 else p for i, p in enumerate(prompts[:20])]
    for sort in (True, False):
        engine = Engine(bundled_target, dspark_drafter, "fixed",
                        config=EngineConfig(max_running=8, prefill_chunk=64, sort_rows=sort))
        requests = [Request(p, SamplingParams() if i % 2 == 0 else SamplingParams(1.0, seed=i),
                            max_tokens=(12, 20, 28, 36)[i % 4]) for i, p in enumerate(mixed)]
        unsorted = []
        run_staggered(engine, requests, [i // 6 for i in range(20)],
                      lambda eng, _: unsorted.append(eng.rows.groups[0].first_slots().tolist()))
        if sort:
            assert engine.row_sorts > 0
        else:
            assert engine.row_sorts == 0 and any(first != sorted(first) for first in unsorted)
        for req in requests:
            if req.sampling.greedy:
                assert req.output_ids == standalone(bundled_target, req.prompt_ids, req.max_tokens), req.request_id

def test_the_kv_budget_bounds_the_slots_the_cache_allocates(bundled_target, dspark_drafter, prompts):
    """Rows are padded to the widest: mixed long and short requests arriving over time must never make the
    target's caches (decoding and prefilling rows together) allocate more slots than kv_budget_tokens, and
    every greedy output stays its standalone output."""
    from dspark.serving.metrics import kv_cache_size

    gamma = drafter_gamma(dspark_drafter)
    long_prompt = [t for p in prompts[:6] for t in p][:300]
    chosen = [long_prompt, prompts[1], prompts[2], long_prompt[:150], prompts[4], prompts[5], prompts[6]]
    lengths = [24, 8, 30, 16, 12, 28, 20]
    widest = max(len(p) + m + gamma + 1 for p, m in zip(chosen, lengths))
    budget = 3 * widest  # room for three rows at the widest reservation
    config = EngineConfig(max_running=8, kv_budget_tokens=budget, prefill_chunk=64)
    engine = Engine(bundled_target, dspark_drafter, "fixed", config=config)
    requests = [Request(p, max_tokens=m) for p, m in zip(chosen, lengths)]
    seen = {"slots": 0, "rows": 0}

    def watch(engine, _outs) -> None:
        seen["slots"] = max(seen["slots"], kv_cache_size(engine)[0])
        seen["rows"] = max(seen["rows"], len(engine.running) + len(engine.prefilling))
        assert kv_cache_size(engine)[0] <= budget

    run_staggered(engine, requests, [0, 0, 1, 3, 3, 9, 12], watch)
    for req, p, m in zip(requests, chosen, lengths):
        assert req.output_ids == standalone(bundled_target, p, m)
    assert seen["rows"] == 3 and seen["slots"] > widest  # the budget binds, and the cache does use it
    unlimited = Engine(bundled_target, dspark_drafter, "fixed", config=EngineConfig(max_running=8))
    assert bundled_target.max_width is None  # a new engine drops the width limit the last one set
    again = [Request(p, max_tokens=m) for p, m in zip(chosen, lengths)]
    run_staggered(unlimited, again, [0] * len(again))
    assert [r.output_ids for r in again] == [r.output_ids for r in requests]


def test_the_rate_guard_switches_drafting_off_by_whole_steps_and_stays_lossless(bundled_target, dspark_drafter,
                                                                                 prompts):
    """With windows of one step and a scheduler that always calls itself unsure, the rate guard alternates
    drafting and plain windows from measured rates. Its mode for a step is fixed when the step starts, before
    the drafter runs (it reads only earlier steps: non-anticipating), a plain-mode step never calls the
    drafter, and every greedy output is its standalone output."""
    from dspark.engine.rate_guard import RateGuard

    engine = Engine(bundled_target, dspark_drafter, "dspark", uniform_cost_model(drafter_gamma(dspark_drafter)),
                    EngineConfig(max_running=8))
    engine.rate_guard = RateGuard(window_seconds=1e-9, min_steps=1, max_gap=1, settle_seconds=0.0)
    engine.scheduler.UNSURE_GAIN = 1e9  # always unsure: the guard keeps exploring
    seen = []
    propose = dspark_drafter.propose

    def spy(*args, **kwargs):
        seen.append(("propose", engine.rate_guard.drafting))
        return propose(*args, **kwargs)

    engine.on_step = lambda info: seen.append(("step", engine.rate_guard.drafting, info.drafted))
    dspark_drafter.propose = spy
    try:
        requests = [Request(prompts[i], max_tokens=[9, 14, 20][i % 3]) for i in range(12)]
        run_staggered(engine, requests, [i // 2 for i in range(12)])
    finally:
        del dspark_drafter.propose
    steps = [s for s in seen if s[0] == "step"]
    assert all(mode for kind, mode, *_ in seen if kind == "propose")  # the drafter runs only in drafting mode
    assert all(mode or not drafted for _, mode, drafted in steps)
    assert engine.rate_guard.plain_windows > 0 and any(drafted for *_, drafted in steps)
    for req in requests:
        assert req.output_ids == standalone(bundled_target, req.prompt_ids, req.max_tokens)


def test_the_rate_guard_is_only_for_adaptive_schedulers_and_is_opt_in(bundled_target, dspark_drafter):
    cost = uniform_cost_model(drafter_gamma(dspark_drafter))
    on = EngineConfig(rate_guard=True)
    assert Engine(bundled_target, dspark_drafter, "dspark", cost, on).rate_guard is not None
    assert Engine(bundled_target, dspark_drafter, "dspark-async", cost, on).rate_guard is not None
    assert Engine(bundled_target, dspark_drafter, "fixed", cost, on).rate_guard is None
    assert Engine(bundled_target, dspark_drafter, "dspark", cost).rate_guard is None  # off by default


@pytest.mark.parametrize("fuse", [True, False])
def test_a_joining_prompt_rides_in_the_running_rows_pass(fuse, bundled_target, dspark_drafter, prompts):
    """Beside running requests a new prompt is fed in the round's own target pass (one model call in the
    step, not two): its first token is committed in that step and it decodes from the next one. Unfused, the
    step makes two calls and the request also runs that step's round."""
    infos = []
    engine = Engine(bundled_target, dspark_drafter, "fixed", config=EngineConfig(fuse_prefill=fuse),
                    on_step=infos.append, eos_token_ids=frozenset())
    running, joining = Request(prompts[0], max_tokens=30), Request(prompts[1], max_tokens=30)
    engine.add(running)
    engine.step()
    assert bundled_target.packs  # (decided once per model, by a check of its own passes)
    calls = []
    hook = bundled_target.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        engine.add(joining)
        outs = engine.step()
    finally:
        hook.remove()
    assert len(calls) == (1 if fuse else 2)
    step = infos[-1]
    assert step.fused_prefill is fuse and step.batch == (1 if fuse else 2)
    assert step.prefill_tokens == len(prompts[1])
    new = {o.request.request_id: o.token_ids for o in outs}
    assert len(new[joining.request_id]) == 1 if fuse else len(new[joining.request_id]) > 1
    engine.step()
    assert infos[-1].batch == 2  # both decode now
    while engine.has_work:
        engine.step()
    for req, prompt in ((running, prompts[0]), (joining, prompts[1])):
        ref = decode(bundled_target, NoDrafter(), [prompt], max_new_tokens=30, eos_token_ids=frozenset())
        assert req.output_ids == ref[0].token_ids


@pytest.mark.parametrize("fuse_probes", [False, True])
def test_a_plain_probe_measures_a_plain_round_without_a_prefill_chunk(fuse_probes, bundled_target, dspark_drafter,
                                                                      prompts):
    """A plain probe exists to measure what a plain round costs; a chunk fed in its pass would leave the cost
    model only the round less an estimated share of the chunk (at 64 clients chunks of 17-72 ms rode in plain
    rounds of about 55). So a probe's chunk goes in a pass of its own after the round (`fuse_plain_probes` keeps
    the old behaviour), and drafted rounds still carry theirs."""
    cost = uniform_cost_model(drafter_gamma(dspark_drafter), range(1, 9))
    infos, probes = [], []
    engine = Engine(bundled_target, dspark_drafter, "dspark", cost,
                    EngineConfig(max_running=8, prefill_chunk=16, fuse_plain_probes=fuse_probes),
                    eos_token_ids=frozenset())
    engine.on_step = lambda info: (infos.append(info), probes.append(engine.scheduler.plain_probes))
    requests = [Request(prompts[i % len(prompts)], SamplingParams(temperature=0.0), max_tokens=6 + 3 * i)
                for i in range(8)]
    run_staggered(engine, requests, [0, 1, 2, 3, 4, 5, 6, 7])
    beside = [info for i, info in enumerate(infos) if probes[i] > (probes[i - 1] if i else 0) and info.prefill_tokens]
    assert beside, "no plain probe met a prefill chunk"
    assert not any(info.drafted for info in beside)
    if fuse_probes:  # as before: probes carry the chunk where the step fuses
        assert any(info.fused_prefill for info in beside)
    else:
        assert not any(info.fused_prefill for info in beside)
    assert any(info.fused_prefill and info.drafted for info in infos)  # drafted rounds still carry chunks
    for req in requests:  # lossless either way
        ref = decode(bundled_target, NoDrafter(), [req.prompt_ids], max_new_tokens=req.max_tokens,
                     eos_token_ids=frozenset())
        assert req.output_ids == ref[0].token_ids


def test_fused_and_separate_prefill_commit_the_same_tokens(bundled_target, dspark_drafter, prompts):
    """Staggered greedy and seeded sampled requests, chunked prompts (a small chunk budget): every request
    commits the same tokens whether its prefill chunks ride in the rounds' passes or run in their own."""
    outputs = []
    for fuse in (True, False):
        engine = Engine(bundled_target, dspark_drafter, "fixed",
                        config=EngineConfig(max_running=4, prefill_chunk=12, fuse_prefill=fuse))
        requests = mixed_requests(prompts, 10, seed=3)
        fused = []
        engine.on_step = lambda info, f=fused: f.append(info.fused_prefill)
        run_staggered(engine, requests, [0, 0, 1, 2, 2, 4, 7, 7, 9, 12])
        assert any(fused) is fuse
        outputs.append([req.output_ids for req in requests])
    assert outputs[0] == outputs[1]


def test_a_fixed_k_engine_has_only_k_slots_drafted(bundled_target, prompts):
    drafter = dspark.load_drafter("dspark", bundled_target)  # its own: the spy must not leak into other tests
    gamma, widths, propose = drafter_gamma(drafter), [], drafter.propose

    def spy(*args):
        block = propose(*args)
        widths.append(block.tokens.shape[1])
        return block

    drafter.propose = spy
    cost = uniform_cost_model(gamma=gamma, batches=(1, 2, 3), layout="padded")
    ids = prompts[:3]
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=3)]
    # one drafter serves engines of every policy in turn, as `dspark bench` does: each call gets its engine's limit
    for spec, width in (("fixed:2", 2), ("fixed", gamma), ("dspark", gamma), ("fixed:1", 1)):
        widths.clear()
        res = decode(bundled_target, drafter, ids, params, 12, scheduler=spec, cost_model=cost)
        assert widths and set(widths) == {width}  # fixed:K drafts the K slots it can verify, no more
        for r in range(2):  # greedy rows stay identical to target-only decoding
            assert res[r].token_ids == standalone(bundled_target, ids[r], 12)
        assert all(s.draft_len <= width for r in res for s in r.rounds)
    assert drafter.draft_limit == 1  # the last engine's
    assert dspark.scheduling.Scheduler("fixed:3", gamma).draft_limit == 3
    assert dspark.scheduling.Scheduler("dspark", gamma).draft_limit is None


@pytest.mark.parametrize("name", ["eagle3", "draft-model", "dflash"])
def test_every_model_drafter_drafts_only_the_slots_asked_for(bundled_target, prompts, name):
    """EAGLE-3 and the draft model pay a forward pass per slot, DFlash a head and a sample: each drafts only
    `draft_limit` slots (here fixed:2's), its q as wide; greedy rows stay identical to target-only decoding,
    sampled ones follow their seeds (the same tokens when drafted 2 wide twice)."""
    drafter = dspark.load_drafter(name, bundled_target)
    widths, propose = [], drafter.propose

    def spy(*args):
        block = propose(*args)
        widths.append((block.tokens.shape[1], None if block.probs is None else block.probs.shape[1],
                       int(block.lengths.max())))
        return block

    drafter.propose = spy
    ids = prompts[:3]
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=5)]
    res = decode(bundled_target, drafter, ids, params, 12, scheduler="fixed:2")
    assert widths and {(w, n) for w, _, n in widths} == {(2, 2)}
    assert 2 in {q for _, q, _ in widths} <= {2, None}  # q for 2 slots (none once only greedy rows run)
    for r in range(2):
        assert res[r].token_ids == standalone(bundled_target, ids[r], 12)
    again = decode(bundled_target, drafter, ids, params, 12, scheduler="fixed:2")
    assert again[2].token_ids == res[2].token_ids


@pytest.mark.parametrize("spec", ["dspark", "dspark-async"])
def test_an_adaptive_engine_narrows_its_drafted_width_where_slots_cost(bundled_target, prompts, spec):
    """Each drafted slot costs a seventh of a plain step: the policy drafts the whole block until it has planned
    a step, then the width its last planned step found fastest (narrower here), chosen before drafting; the
    cost model prices every drafted step at its width; greedy rows stay identical to target-only decoding."""
    drafter = dspark.load_drafter("dspark", bundled_target)
    gamma, widths, limits, propose = drafter_gamma(drafter), [], [], drafter.propose
    infos = []

    def spy(*args):
        limits.append(drafter.draft_limit)  # what the engine asked for, before the call
        block = propose(*args)
        widths.append(block.tokens.shape[1])
        return block

    drafter.propose = spy
    cost = uniform_cost_model(gamma=gamma, batches=(1, 2, 3), layout="padded", draft_share=1.0, slot_fraction=1.0)
    ids = prompts[:3]
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=3)]
    res = decode(bundled_target, drafter, ids, params, 24, scheduler=spec, cost_model=cost, on_step=infos.append,
                 online_cost=False)  # the table as it is, so the predictions can be checked after the run
    assert widths[0] == gamma and limits[0] is None  # nothing planned yet: the whole block
    assert min(widths) < gamma  # narrowed
    assert widths == [gamma if w is None else w for w in limits]
    assert [i.draft_width for i in infos if i.drafted] == widths
    for info in infos:  # the prediction prices the step at its drafted width
        if info.drafted:
            width_cost = cost.cost(info.batch, info.tokens, info.draft_width) - cost.overhead.fixed(info.batch)
            assert info.predicted_seconds == pytest.approx(width_cost)
    for r in range(2):
        assert res[r].token_ids == standalone(bundled_target, ids[r], 24)
    assert all(max(i.lengths) <= i.draft_width for i in infos if i.drafted)
