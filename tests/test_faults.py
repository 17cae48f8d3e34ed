"""Faults injected through wrapper drafters: a request whose drafting raises fails alone, NaN / inf drafts are
never verified, a slow drafter is paused with a back-off, and the server answers the failing request with an
error while its neighbours get their exact greedy text."""
from __future__ import annotations

import json
import socket
import threading
import time
from typing import Callable, Sequence

import httpx
import pytest
import torch
import uvicorn

import dspark
from dspark.api import encode_prompt, load_drafter
from dspark.calibration.online import OnlineCalibrator
from dspark.decoding import decode
from dspark.drafters.base import DraftBlock, Drafter, NoDrafter, RoundOutcome, drafter_gamma
from dspark.engine import Engine, EngineConfig, Request
from dspark.engine.engine import DRAFT_BACKOFF_MAX
from dspark.evaluation.bench import load_eval_prompts
from dspark.sampling import SamplingParams
from dspark.scheduling import uniform_cost_model
from dspark.serving.app import create_app
from dspark.serving.metrics import ServerMetrics
from dspark.serving.runner import EngineRunner

Rows = Sequence[Sequence[int]]


class Wrapper(Drafter):
    """Delegates everything to a real drafter; subclasses inject a fault into its proposals."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name, self.feature_layers = inner.name, tuple(inner.feature_layers)
        self.calls = self.observed = 0

    def __getattr__(self, name: str):  # gamma, max_drafts, calibration
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.inner.reset()

    def join(self, prompts, prefill_features) -> None:
        self.inner.join(prompts, prefill_features)

    def observe(self, outcome: RoundOutcome) -> None:
        self.observed += 1
        self.inner.observe(outcome)

    def select(self, rows) -> None:
        self.inner.select(rows)

    def propose(self, sequences, sampling, generators) -> DraftBlock:
        self.calls += 1
        return self.inner.propose(sequences, sampling, generators)

    def propose_rows(self, rows, sequences, sampling, generators) -> DraftBlock:
        return self.inner.propose_rows(rows, sequences, sampling, generators)


class Raising(Wrapper):
    """Raises whenever a sequence it drafts for is bad (also when proposing for single rows)."""

    def __init__(self, inner: Drafter, bad: Callable[[Sequence[int]], bool], after_inner: bool = False) -> None:
        super().__init__(inner)
        self.bad, self.after_inner = bad, after_inner
        self.raised_in_batches: list[int] = []

    def _check(self, sequences: Rows) -> None:
        if any(self.bad(s) for s in sequences):
            self.raised_in_batches.append(len(sequences))
            raise RuntimeError("injected drafting fault")

    def propose(self, sequences, sampling, generators) -> DraftBlock:
        if not self.after_inner:
            self._check(sequences)
        block = super().propose(sequences, sampling, generators)
        self._check(sequences)  # after the inner drafter changed its state (EAGLE-3, the draft model)
        return block

    def propose_rows(self, rows, sequences, sampling, generators) -> DraftBlock:
        self._check(sequences)
        return super().propose_rows(rows, sequences, sampling, generators)


def starts_with(prompt: list[int], generated: int = 0) -> Callable[[Sequence[int]], bool]:
    """True for the sequences of the request with this prompt once it has generated `generated` tokens."""
    return lambda seq: len(seq) >= len(prompt) + generated and list(seq[: len(prompt)]) == prompt


@pytest.fixture(scope="module")
def prompts(bundled_target) -> list[list[int]]:
    texts = [t for d in ("code", "prose", "math") for t in load_eval_prompts(d, 4)]
    return [encode_prompt(bundled_target, t) for t in texts]


_references: dict = {}


def standalone(target, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """The request's target-only greedy output, decoded alone."""
    key = (tuple(prompt), max_tokens, ignore_eos)
    if key not in _references:
        eos = frozenset() if ignore_eos else None
        _references[key] = decode(target, NoDrafter(), [prompt], max_new_tokens=max_tokens,
                                  eos_token_ids=eos)[0].token_ids
    return _references[key]


def requests_for(prompts: list[list[int]], seed: int = 0) -> list[Request]:
    """Greedy (even) and sampled (odd) requests of different lengths."""
    return [Request(p, SamplingParams() if i % 2 == 0 else SamplingParams(1.0, seed=seed + i),
                    max_tokens=(14, 20, 9, 17)[i % 4]) for i, p in enumerate(prompts)]


def run(engine: Engine, requests: list[Request], arrivals: list[int], watch=None) -> None:
    """Add request i at step arrivals[i] and step until all finish (watch(outputs) after each step)."""
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    step = 0
    while order or engine.has_work:
        while order and arrivals[order[0]] <= step:
            engine.add(requests[order.pop(0)])
        outputs = engine.step()
        if watch is not None:
            watch(outputs)
        step += 1
        assert step < 500, "the engine stopped making progress"


def assert_neighbours_exact(target, requests: list[Request], skip: set[int] = frozenset()) -> None:
    for i, req in enumerate(requests):
        if i in skip:
            continue
        assert req.finish_reason in ("stop", "length"), (i, req.finish_reason, req.error)
        if req.sampling.greedy:
            assert req.output_ids == standalone(target, req.prompt_ids, req.max_tokens, req.ignore_eos), i
        else:
            assert 0 < len(req.output_ids) <= req.max_tokens


# ---------------------------------------------------------------------- a request whose drafting raises
@pytest.mark.parametrize("name", ["ngram", "draft-model", "dflash", "dspark", "eagle3"])
def test_request_whose_drafting_raises_fails_alone(name, bundled_target, prompts):
    """Mid-generation, drafting raises for one request: it finishes with "error", every other request
    (greedy and sampled, arriving before and after) finishes normally with its exact greedy output, and
    drafting goes on for them (each drafter kind's per-row state stays consistent)."""
    inner = dspark.load_drafter(name, bundled_target)
    requests = requests_for(prompts[:5], seed=7)
    bad = requests[2]
    bad.max_tokens = 30
    requests[1].max_tokens = 30  # a neighbour still decoding when the fault comes (drafted in the same call)
    drafter = Raising(inner, starts_with(bad.prompt_ids, generated=4), after_inner=name in ("eagle3", "draft-model"))
    engine = Engine(bundled_target, drafter, "fixed", config=EngineConfig(max_running=4, prefill_chunk=32))
    at_failure: dict[int, int] = {}

    def watch(outputs) -> None:
        if bad.finished and not at_failure:
            at_failure.update({i: len(req.rounds) for i, req in enumerate(requests)})

    run(engine, requests, [0, 0, 1, 1, 6], watch)
    assert bad.finish_reason == "error" and "injected drafting fault" in bad.error
    assert 4 <= len(bad.output_ids) < 30
    assert max(drafter.raised_in_batches) > 1 and engine.request_errors == 1
    assert_neighbours_exact(bundled_target, requests, skip={2})
    after = [r for i, req in enumerate(requests) if i != 2 for r in req.rounds[at_failure[i]:]]
    assert after and any(r.draft_len > 0 for r in after)  # drafting went on for the rows that stayed
    assert any(r.accepted > 0 for r in after) or name == "ngram", name
    assert engine.target.batch_size == 0 and engine.reserved == 0


def _fail_once(obj, attr: str, at_call: int) -> None:
    """Make obj.attr raise on its at_call-th call (once): a fault deep inside a drafter's proposal."""
    real, calls = getattr(obj, attr), [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call:
            raise RuntimeError("injected fault inside the drafter")
        return real(*args, **kwargs)

    setattr(obj, attr, flaky)


@pytest.mark.parametrize("name", ["eagle3", "draft-model"])
def test_drafter_state_survives_a_raise_inside_propose(name, bundled_target, prompts):
    """A fault halfway through a stateful drafter's proposal (after it changed its caches): the step raises (no
    single row reproduces it), the drafter's state is usable, and decoding goes on exact, with drafts accepted."""
    drafter = dspark.load_drafter(name, bundled_target)
    gamma = drafter_gamma(drafter)
    if name == "eagle3":  # _step runs once for the pending pairs, then γ - 1 chained steps per proposal
        _fail_once(drafter, "_step", gamma + 3)
    else:  # the draft model's forward runs γ times per proposal
        _fail_once(drafter.lm, "forward", gamma + 2)
    engine = Engine(bundled_target, drafter, "fixed")
    reqs = [engine.add(Request(p, max_tokens=16)) for p in prompts[:2]]
    raised, rounds_before = 0, None
    while engine.has_work:
        if name == "eagle3":
            before = (drafter.lengths.clone(), [list(t) for t in drafter.pending_toks])
        try:
            engine.step()
        except RuntimeError as err:
            assert "injected fault inside" in str(err)
            raised += 1
            rounds_before = [len(r.rounds) for r in reqs]
            if name == "eagle3":  # restored: nothing fed, the pairs still pending
                assert torch.equal(drafter.lengths, before[0]) and drafter.pending_toks == before[1]
            else:  # emptied: the next proposal feeds every row anew
                assert drafter.fed == [[]] * len(engine.running) and drafter.lm.batch_size == len(engine.running)
    assert raised == 1 and engine.request_errors == 0
    assert_neighbours_exact(bundled_target, reqs)
    assert any(r.accepted > 0 for req, n in zip(reqs, rounds_before) for r in req.rounds[n:])


def test_unattributable_drafting_error_fails_the_step(bundled_target, prompts):
    """A drafting error no single row reproduces, or from a drafter that cannot draft for a subset, is
    raised from step() (the server's runner then fails that step's requests)."""
    class BatchOnly(Wrapper):
        def propose(self, sequences, sampling, generators):
            if len(sequences) > 1:
                raise RuntimeError("injected batch fault")
            return super().propose(sequences, sampling, generators)

    class NoRows(Raising):
        propose_rows = Drafter.propose_rows

    ngram = dspark.load_drafter("ngram", bundled_target)
    for drafter in (BatchOnly(ngram), NoRows(ngram, lambda seq: True)):
        engine = Engine(bundled_target, drafter, "fixed")
        for p in prompts[:2]:
            engine.add(Request(p, max_tokens=8))
        with pytest.raises(RuntimeError, match="injected"):
            for _ in range(5):
                engine.step()
        assert engine.request_errors == 0


def test_every_row_failing_empties_the_batch(bundled_target, prompts):
    engine = Engine(bundled_target, Raising(dspark.load_drafter("ngram", bundled_target), lambda seq: True), "fixed")
    reqs = [engine.add(Request(p, max_tokens=8)) for p in prompts[:3]]
    while engine.has_work:
        engine.step()
    assert [r.finish_reason for r in reqs] == ["error"] * 3 and engine.request_errors == 3
    assert engine.target.batch_size == 0 and engine.reserved == 0


# ---------------------------------------------------------------------- NaN / inf drafts
class NonFinite(Wrapper):
    """Writes NaN into the probabilities of one request's rows and inf into another's confidences; and NaN
    past a capped request's drafts (padding, which must not count)."""

    def __init__(self, inner: Drafter, nan_probs, inf_conf, nan_padding) -> None:
        super().__init__(inner)
        self.tests = (nan_probs, inf_conf, nan_padding)
        self.injected = 0

    def propose(self, sequences, sampling, generators) -> DraftBlock:
        block = super().propose(sequences, sampling, generators)
        nan_probs, inf_conf, nan_padding = self.tests
        for r, seq in enumerate(sequences):
            if nan_probs(seq):
                block.probs[r, 1, 3] = float("nan")
                self.injected += 1
            if inf_conf(seq):
                block.confidences[r, 0] = float("inf")
                self.injected += 1
            if nan_padding(seq):
                block.confidences[r, -1] = float("nan")
        return block


def test_nonfinite_drafts_are_never_verified(bundled_target, prompts):
    """Under the dspark scheduler with online calibration: the rows with NaN probabilities (sampled, T 1)
    or inf confidences (greedy) verify no drafts and still decode exactly; the others draft as usual; the
    online calibrator sees only finite rounds and keeps serving finite survivals."""
    inner = dspark.load_drafter("dspark", bundled_target)
    gamma = drafter_gamma(inner)
    requests = requests_for(prompts[:6], seed=21)
    nan_req, inf_req, capped = requests[1], requests[2], requests[4]
    assert not nan_req.sampling.greedy and inf_req.sampling.greedy
    capped.max_draft = 2
    drafter = NonFinite(inner, starts_with(nan_req.prompt_ids), starts_with(inf_req.prompt_ids),
                        starts_with(capped.prompt_ids))
    calibrator = OnlineCalibrator(inner.calibration, gamma, refit_every=8, min_rounds=8)
    config = EngineConfig(max_running=6, online_cost=False)
    engine = Engine(bundled_target, drafter, "dspark", uniform_cost_model(gamma, per_token=0.01), config,
                    online_calibration=calibrator)
    run(engine, requests, [0, 0, 0, 1, 1, 2])
    assert_neighbours_exact(bundled_target, requests)
    assert inf_req.rounds and all(r.draft_len == 0 and r.available == 0 for r in inf_req.rounds)  # inf at draft 1
    # NaN at draft 2: every block that reaches it is dropped; only a round whose budget (tokens left) cut the
    # block to one draft, at the end of the request, may verify that draft (the NaN is padding then)
    late = [i for i, r in enumerate(nan_req.rounds) if r.available > 0]
    assert nan_req.rounds and all(nan_req.rounds[i].available == 1 for i in late)
    assert all(i >= len(nan_req.rounds) - 2 for i in late), [(r.draft_len, r.available) for r in nan_req.rounds]
    assert 0 < engine.nonfinite_drafts <= drafter.injected
    assert any(r.available > 0 for r in capped.rounds)  # NaN past its 2 drafts is padding
    others = [r for i, req in enumerate(requests) if i not in (1, 2) for r in req.rounds]
    assert any(r.accepted > 0 for r in others)
    assert calibrator.counts["observed"] > 0 and sum(calibrator.rejected.values()) == 0
    signals = torch.rand(4, gamma, 3)
    survival = calibrator.survival(signals, torch.full((4,), gamma), [0.0, 0.0, 1.0, 1.0])
    assert bool(torch.isfinite(survival).all()) and float(survival.max()) <= 1.0


# ---------------------------------------------------------------------- a slow drafter
class Slow(Wrapper):
    """Sleeps in the proposals whose (1-based) call number `slow` picks."""

    def __init__(self, inner: Drafter, slow: Callable[[int], bool], seconds: float) -> None:
        super().__init__(inner)
        self.slow, self.seconds = slow, seconds

    def propose(self, sequences, sampling, generators) -> DraftBlock:
        if self.slow(self.calls + 1):
            time.sleep(self.seconds)
        return super().propose(sequences, sampling, generators)


def slow_engine(target, drafter: Drafter, timeout: float) -> tuple[Engine, list[bool]]:
    drafted: list[bool] = []
    engine = Engine(target, drafter, "fixed", config=EngineConfig(draft_timeout=timeout),
                    on_step=lambda info: drafted.append(info.drafted))
    return engine, drafted


def test_slow_drafter_is_paused_with_a_doubling_back_off(bundled_target, prompts):
    """Every call is slower than the timeout: the drafter is called on rounds 0, 2, 5, 10, 19, … only,
    observes every round, and the output is exactly the target's."""
    drafter = Slow(dspark.load_drafter("ngram", bundled_target), lambda n: True, 0.25)
    engine, drafted = slow_engine(bundled_target, drafter, timeout=0.1)
    reqs = [Request(prompts[0], max_tokens=20, ignore_eos=True)]
    engine.run(reqs)
    assert_neighbours_exact(bundled_target, reqs)
    calls = [i for i, d in enumerate(drafted) if d]
    expected, pause, at = [], 0, 0
    while at < len(drafted):
        expected.append(at)
        pause = min(DRAFT_BACKOFF_MAX, max(1, 2 * pause))
        at += pause + 1
    assert calls == expected[: len(calls)]
    assert len(calls) >= sum(i < len(drafted) - 1 for i in expected)  # the last round may have nothing to draft
    assert len(calls) >= 3 and drafter.calls == engine.draft_timeouts == len(calls)
    assert drafter.observed == len(drafted)  # paused rounds still reach the drafter


def test_back_off_resets_after_a_call_within_the_limit(bundled_target, prompts):
    """Calls 1 and 4 are slow: one round is skipped after each (the back-off went back to one round after the
    fast calls in between); every other round drafts."""
    drafter = Slow(dspark.load_drafter("ngram", bundled_target), lambda n: n in (1, 4), 0.6)
    engine, drafted = slow_engine(bundled_target, drafter, timeout=0.5)  # fast n-gram calls take microseconds
    reqs = [Request(prompts[1], max_tokens=14, ignore_eos=True)]
    engine.run(reqs)
    assert_neighbours_exact(bundled_target, reqs)
    assert [i for i, d in enumerate(drafted[:-1]) if not d] == [1, 5]
    assert engine.draft_timeouts == 2 and drafter.observed == len(drafted)
    with pytest.raises(ValueError, match="draft_timeout"):
        EngineConfig(draft_timeout=0)


# ---------------------------------------------------------------------- over HTTP
MODEL = "target"


class Served:
    """An app on a real uvicorn server in a background thread, on a free port."""

    def __init__(self, app) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()


def test_server_answers_the_failing_request_with_an_error_and_serves_the_others(bundled_target, prompts):
    """Drafting raises for one request (its prompt ends with a marker token): it gets a 500 OpenAI error
    object (plain) or an error event (streamed), while 3 concurrent requests get their exact greedy text."""
    target = dspark.load_target(dtype="float32")  # its own KV cache
    marked = prompts[0] + [prompts[1][-1]]
    drafter = Raising(load_drafter("dspark", target), starts_with(marked, generated=3))
    metrics = ServerMetrics()
    engine = Engine(target, drafter, "fixed", config=EngineConfig(max_running=8), on_step=metrics.observe_step)
    metrics.watch(engine)
    runner = EngineRunner(engine, on_outputs=metrics.observe_outputs)
    runner.start()
    served = Served(create_app(runner, MODEL, metrics))
    url = f"{served.base}/v1/completions"
    good = [(prompts[i], 24 + 4 * i) for i in (3, 5, 7)]
    results: dict = {}

    def post(key, prompt: list[int], max_tokens: int, stream: bool = False) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        with httpx.Client(timeout=120) as client:
            if stream:
                with client.stream("POST", url, json=body) as r:
                    results[key] = (r.status_code, [x[6:] for x in r.iter_lines() if x.startswith("data: ")])
            else:
                r = client.post(url, json=body)
                results[key] = (r.status_code, r.json())

    try:
        for stream in (False, True):
            jobs = [threading.Thread(target=post, args=(("bad", stream), marked, 30, stream))]
            jobs += [threading.Thread(target=post, args=((i, stream), p, n, stream)) for i, (p, n) in enumerate(good)]
            for job in jobs:
                job.start()
            for job in jobs:
                job.join()
        status, body = results[("bad", False)]
        assert status == 500 and body["error"]["type"] == "server_error"
        assert "injected drafting fault" in body["error"]["message"]
        status, events = results[("bad", True)]
        assert status == 200 and events[-1] == "[DONE]"
        assert "injected drafting fault" in json.loads(events[-2])["error"]["message"]
        tok = target.tokenizer
        for i, (p, n) in enumerate(good):
            text = tok.decode(standalone(bundled_target, p, n), skip_special_tokens=True)
            status, body = results[(i, False)]
            assert status == 200 and body["choices"][0]["text"] == text, i
            status, events = results[(i, True)]
            chunks = [json.loads(e) for e in events[:-1]]
            assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks) == text, i
        assert max(drafter.raised_in_batches) > 1  # it failed beside its neighbours, in one batch
        assert runner.errors == 0 and engine.request_errors == 2
        scraped = httpx.get(f"{served.base}/metrics").text
        assert "dspark:engine_request_errors_total 2.0" in scraped
        assert 'dspark:request_success_total{finished_reason="error"} 2.0' in scraped
    finally:
        served.stop()
        runner.shutdown(drain=False)
