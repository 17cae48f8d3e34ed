"""The OpenAI-compatible server, over real HTTP: the official client, errors, metrics, disconnects, 429, 503."""
from __future__ import annotations

import json
import platform
import signal
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

import dspark
from dspark.api import encode_prompt, load_drafter
from dspark.calibration.online import OnlineCalibrator
from dspark.decoding import decode
from dspark.drafters.base import NoDrafter, drafter_gamma
from dspark.engine import Engine, EngineConfig
from dspark.engine.steplog import read_step_log
from dspark.serving.app import create_app
from dspark.serving.metrics import ServerMetrics
from dspark.serving.runner import EngineRunner

MODEL = "target"
CODE = "def fib(n):"
HAIKU = "Write a haiku about the sea."
LONG = "Count from 1 to 500: 1, 2, 3,"  # greedy: no EOS within 400 tokens, as a completion or as a chat turn


def wait_for(condition, what: str, limit: float = 60.0) -> None:
    """Poll until condition() holds (a deadline only against hangs; nothing is asserted about time)."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


class Served:
    """An app on a real uvicorn server in a background thread, on a free port."""

    def __init__(self, app) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "the server to start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()


def build(drafter_name: str, config: EngineConfig, calibrate: bool = False):
    """A fresh target (its own KV cache), drafter, engine with metrics, and runner (not started)."""
    target = dspark.load_target(dtype="float32")
    drafter = NoDrafter() if drafter_name == "none" else load_drafter(drafter_name, target)
    calibrator = OnlineCalibrator(drafter.calibration, drafter_gamma(drafter)) if calibrate else None
    metrics = ServerMetrics()
    engine = Engine(target, drafter, "fixed", config=config, online_calibration=calibrator,
                    on_step=metrics.observe_step)
    metrics.watch(engine)
    return EngineRunner(engine, on_outputs=metrics.observe_outputs), metrics


@pytest.fixture(scope="module")
def server():
    runner, metrics = build("dspark", EngineConfig(max_running=8), calibrate=True)
    runner.start()
    served = Served(create_app(runner, MODEL, metrics, max_body_bytes=4096))
    served.runner, served.engine = runner, runner.engine
    yield served
    served.stop()
    runner.shutdown(drain=False)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


_references: dict = {}


def reference(target, prompt: str | list[int], chat: bool, max_tokens: int) -> tuple[list[int], str, list[int]]:
    """(prompt ids, target-only greedy text, its token ids) of a prompt decoded alone."""
    key = (str(prompt), chat, max_tokens)
    if key not in _references:
        ids = prompt if isinstance(prompt, list) else encode_prompt(target, prompt, chat=chat)
        out = decode(target, NoDrafter(), [ids], max_new_tokens=max_tokens)[0].token_ids
        _references[key] = ids, target.tokenizer.decode(out, skip_special_tokens=True), out
    return _references[key]


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    """The /metrics samples as {(name, sorted labels): value}."""
    text = httpx.get(f"{base}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# ---------------------------------------------------------------------- the official client
def test_completion_greedy_equals_target_only_decoding(client, bundled_target):
    ids, text, out = reference(bundled_target, CODE, chat=False, max_tokens=40)
    resp = client.completions.create(model=MODEL, prompt=CODE, max_tokens=40, temperature=0)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == MODEL
    assert resp.choices[0].text == text
    assert resp.choices[0].finish_reason == ("length" if len(out) == 40 else "stop")
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), len(out))
    assert resp.usage.total_tokens == len(ids) + len(out)
    spec = resp.model_extra["speculation"]
    assert spec["rounds"] >= 1 and spec["draft_tokens"] > 0  # the DSpark drafter drafted
    assert spec["tau"] == pytest.approx(len(out) / spec["rounds"], abs=1e-3)
    assert sum(spec["accepted_per_position"][:1]) <= spec["rounds"]
    assert spec["accepted_tokens"] == sum(spec["accepted_per_position"])


def test_completion_from_token_ids_and_streaming(client, bundled_target):
    ids, text, out = reference(bundled_target, CODE, chat=False, max_tokens=40)
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0)
    assert resp.choices[0].text == text and resp.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model=MODEL, prompt=CODE, max_tokens=40, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == resp.choices[0].finish_reason
    assert chunks[-1].model_extra["speculation"]["rounds"] >= 1
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_chat_greedy_equals_target_only_decoding(client, bundled_target):
    ids, text, out = reference(bundled_target, HAIKU, chat=True, max_tokens=32)
    messages = [{"role": "user", "content": HAIKU}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content == text
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), len(out))
    parts = [{"type": "text", "text": HAIKU}]  # content as text parts renders the same prompt
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                          max_completion_tokens=32, temperature=0)
    assert resp.choices[0].message.content == text and resp.usage.prompt_tokens == len(ids)


def test_chat_streaming_with_usage_chunk(client, bundled_target):
    ids, text, out = reference(bundled_target, HAIKU, chat=True, max_tokens=32)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": HAIKU}], max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, finish, last = chunks
    assert "".join(c.choices[0].delta.content or "" for c in body + [finish]) == text
    assert finish.choices[0].finish_reason == ("length" if len(out) == 32 else "stop")
    assert finish.model_extra["speculation"]["draft_tokens"] > 0
    assert all(c.usage is None for c in body + [finish])
    assert last.choices == [] and last.usage.completion_tokens == len(out)
    assert (last.usage.prompt_tokens, last.usage.total_tokens) == (len(ids), len(ids) + len(out))


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(client, bundled_target, stream):
    _, text, out = reference(bundled_target, CODE, chat=False, max_tokens=40)
    stop = text[12:16]
    assert text.find(stop) > 0
    expected = text[: text.find(stop)]
    if stream:
        chunks = list(client.completions.create(model=MODEL, prompt=CODE, max_tokens=40, temperature=0,
                                                stop=[stop, "@@never@@"], stream=True))
        got, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        resp = client.completions.create(model=MODEL, prompt=CODE, max_tokens=40, temperature=0, stop=stop)
        got, finish = resp.choices[0].text, resp.choices[0].finish_reason
        assert resp.usage.completion_tokens < len(out)
    assert (got, finish) == (expected, "stop")


def test_seeded_sampling_repeats_and_dspark_fields(client, bundled_target):
    kw = dict(model=MODEL, prompt=HAIKU, max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    _, text, _ = reference(bundled_target, CODE, chat=False, max_tokens=24)
    plain = client.completions.create(model=MODEL, prompt=CODE, max_tokens=24, temperature=0,
                                      extra_body={"speculation": False})
    assert plain.choices[0].text == text and plain.model_extra["speculation"]["draft_tokens"] == 0
    capped = client.completions.create(model=MODEL, prompt=CODE, max_tokens=24, temperature=0,
                                       extra_body={"max_draft": 2, "top_k": -1, "workload": "code"})
    spec = capped.model_extra["speculation"]
    assert capped.choices[0].text == text
    assert 0 < spec["draft_tokens"] <= 2 * spec["rounds"] and len(spec["accepted_per_position"]) <= 2


def test_ignore_eos_generates_exactly_max_tokens(client, bundled_target):
    prompt = "def add(a, b):"  # greedy: EOS right away
    ids = encode_prompt(bundled_target, prompt, chat=False)
    stops = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert (stops.usage.completion_tokens, stops.choices[0].finish_reason) == (1, "stop")
    out = decode(bundled_target, NoDrafter(), [ids], max_new_tokens=12, eos_token_ids=frozenset())[0].token_ids
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert (full.usage.completion_tokens, full.choices[0].finish_reason) == (12, "length")
    assert full.choices[0].text == bundled_target.tokenizer.decode(out, skip_special_tokens=True)


def test_the_load_benchmarks_requests_end_at_eos_unless_told_otherwise(server):
    import argparse
    import asyncio
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "serve_sweep", Path(__file__).resolve().parent.parent / "benchmarks" / "serve_sweep.py")
    serve_sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_sweep)

    async def served(ignore_eos: bool) -> int:
        client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)
        try:
            args = argparse.Namespace(max_tokens=60, length_spread=0.0, ignore_eos=ignore_eos)
            record = await serve_sweep.one_request(client, MODEL, "What is 2 + 2?", args, 0.0, seed=0)
        finally:
            await client.close()
        assert record["start"] <= record["first"] <= record["end"]
        return record["tokens"]

    assert 1 <= asyncio.run(served(False)) < 60  # the chat answer ends at EOS (about 50 tokens), as a user's does
    assert asyncio.run(served(True)) == 60  # --ignore-eos: exactly the asked length


def test_64_concurrent_streaming_clients_all_complete_correctly(server, bundled_target):
    """64 clients stream at once into a server that runs 8 rows: every one completes with its standalone
    target-only greedy text, and the engine ends idle with nothing reserved."""
    import asyncio

    from dspark.evaluation.bench import load_eval_prompts

    texts = [t for d in ("code", "prose", "math") for t in load_eval_prompts(d, 22)][:64]
    ids = [encode_prompt(bundled_target, t, chat=False) for t in texts]
    outs = decode(bundled_target, NoDrafter(), ids, max_new_tokens=8)  # batched target-only: equal to alone
    expected = [bundled_target.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]

    async def one(client, text: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(client, t) for t in texts))
        finally:
            await client.close()

    got = asyncio.run(all_of_them())
    assert got == expected
    wait_for(lambda: not server.engine.has_work, "the engine to go idle")
    assert server.engine.reserved == 0 and not server.engine.running


# ---------------------------------------------------------------------- errors, over plain HTTP
def long_prompt(n: int) -> list[int]:
    return [5] * n


ERRORS = [
    ("completions", {"prompt": "hi"}, 400, "model"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400, "n"),
    ("completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo"),
    ("completions", {"model": MODEL, "prompt": "hi", "logprobs": 1}, 400, "logprobs"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": "0.5"}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("completions", {"model": MODEL, "prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completions", {"model": MODEL, "prompt": "hi", "stop": 3}, 400, "stop"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("completions", {"model": MODEL, "prompt": "hi", "speculation": "yes"}, 400, "speculation"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_draft": -1}, 400, "max_draft"),
    ("completions", {"model": MODEL, "prompt": "hi", "workload": ""}, 400, "workload"),
    ("chat/completions", {"model": MODEL}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0].role"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0].content"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3}, 400, "n"),
    ("chat/completions", {"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
]


@pytest.mark.parametrize("path, body, status, param", ERRORS, ids=[f"{i}-{e[-1]}" for i, e in enumerate(ERRORS)])
def test_bad_requests_get_openai_error_objects(server, path, body, status, param):
    r = httpx.post(f"{server.base}/v1/{path}", json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["code"] == ("model_not_found" if status == 404 else None)


@pytest.mark.parametrize("path, field", [("completions", "max_tokens"), ("chat/completions", "max_completion_tokens")])
def test_prompt_plus_max_tokens_over_the_context(server, path, field):
    context = server.engine.context_limit
    body = {"model": MODEL, field: context - 3}
    if path == "completions":
        body["prompt"] = long_prompt(10)
    else:
        body["messages"] = [{"role": "user", "content": "hello there"}]
    r = httpx.post(f"{server.base}/v1/{path}", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field and str(context) in error["message"] and str(context - 3) in error["message"]


def test_malformed_bodies_and_routes(server):
    for raw in (b"{not json", b"[1, 2]", b'{"temperature": NaN}'):
        r = httpx.post(f"{server.base}/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] is None
        assert "body" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base}/v1/completions", json={"model": MODEL, "prompt": "x" * 5000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(f"{server.base}/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(f"{server.base}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_models_and_health(server):
    models = httpx.get(f"{server.base}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == server.engine.context_limit
    assert httpx.get(f"{server.base}/health").status_code == 200


def test_metrics_count_what_was_served(server, client):
    before = scrape(server.base)
    resp = client.completions.create(model=MODEL, prompt=CODE, max_tokens=24, temperature=0,
                                     extra_body={"workload": "code"})
    stats = scrape(server.base)

    def value(name: str, **labels) -> float:
        return stats[(name, tuple(sorted(labels.items())))]

    def delta(name: str) -> float:
        return stats[(name, ())] - before.get((name, ()), 0.0)

    spec = resp.model_extra["speculation"]  # the only request in flight: the counters moved by its stats
    assert delta("dspark:generation_tokens_total") == resp.usage.completion_tokens
    assert delta("dspark:prompt_tokens_total") == resp.usage.prompt_tokens
    # rows of decoding steps and the prefill's pass, which committed the first token: τ reads the same both ways
    assert delta("dspark:decode_rounds_total") == spec["rounds"]
    assert delta("dspark:spec_decode_num_draft_tokens_total") == spec["draft_tokens"]
    assert delta("dspark:spec_decode_num_accepted_tokens_total") == spec["accepted_tokens"]

    for name in ("dspark:prompt_tokens_total", "dspark:decode_rounds_total", "dspark:generation_tokens_total",
                 "dspark:spec_decode_num_drafts_total",
                 "dspark:spec_decode_num_draft_tokens_total", "dspark:spec_decode_num_accepted_tokens_total",
                 "dspark:time_to_first_token_seconds_count", "dspark:inter_token_latency_seconds_count",
                 "dspark:e2e_request_latency_seconds_count", "dspark:step_time_seconds_count",
                 "dspark:verified_tokens_per_step_count"):
        assert value(name) > 0, name
    assert value("dspark:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert value("dspark:request_success_total", finished_reason="length") > 0
    assert value("dspark:num_requests_running") == 0 and value("dspark:num_requests_waiting") == 0
    assert ("dspark:scheduler_capacity", ()) in stats
    assert 0 <= value("dspark:calibration_ece", workload="code") <= 1
    assert value("dspark:spec_decode_num_accepted_tokens_total") <= value("dspark:spec_decode_num_draft_tokens_total")
    assert value("dspark:spec_decode_num_drafts_total") <= value("dspark:decode_rounds_total")


# ---------------------------------------------------------------------- disconnects and failures
def test_client_leaving_a_stream_cancels_its_request(server):
    engine, before = server.engine, scrape(server.base)
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 1000,
            "temperature": 0, "stream": True}
    with httpx.Client() as http, http.stream("POST", f"{server.base}/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        seen = [line for line, _ in zip(lines, range(3)) if line.startswith("data:")]
        request = engine.running[0]
        assert request.max_tokens == 1000 and len(seen) >= 2
    wait_for(lambda: request.finished and not engine.has_work, "the cancelled request to leave")
    assert request.finish_reason == "cancelled" and len(request.output_ids) < 1000
    assert engine.running == [] and engine.prefilling == []
    key = ("dspark:request_success_total", (("finished_reason", "cancelled"),))
    wait_for(lambda: scrape(server.base).get(key, 0) == before.get(key, 0) + 1, "the cancellation metric")


def test_client_leaving_a_plain_request_cancels_it(server):
    engine = server.engine
    body = json.dumps({"model": MODEL, "prompt": LONG, "max_tokens": 1000, "temperature": 0}).encode()
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: engine.running and engine.running[0].output_ids, "the request to decode")
        request = engine.running[0]
    wait_for(lambda: request.finished and not engine.has_work, "the cancelled request to leave")
    assert request.finish_reason == "cancelled" and len(request.output_ids) < 1000


def test_failing_engine_step_answers_errors_and_keeps_serving(server, client):
    engine, real = server.engine, server.engine.step
    fails = []

    def flaky():
        req = engine.running[0] if engine.running else None
        if req is not None and req.output_ids and len(fails) < 2 and req.request_id not in fails:
            fails.append(req.request_id)
            raise RuntimeError("injected fault")
        return real()

    engine.step = flaky
    try:
        body = {"model": MODEL, "prompt": CODE, "max_tokens": 30, "temperature": 0}
        r = httpx.post(f"{server.base}/v1/completions", json=body)
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["type"] == "server_error" and "injected fault" in error["message"]
        with httpx.stream("POST", f"{server.base}/v1/completions", json={**body, "stream": True}) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]" and "injected fault" in json.loads(events[-2])["error"]["message"]
        wait_for(lambda: not engine.has_work, "the failed requests' rows to be freed")
    finally:
        engine.step = real
    assert len(fails) == 2 and server.runner.alive and server.runner.errors == 2
    resp = client.completions.create(model=MODEL, prompt=CODE, max_tokens=8, temperature=0)
    assert resp.usage.completion_tokens == 8 or resp.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------- admission and shutdown
def sse_events(response: httpx.Response) -> list[str]:
    """The data payloads of an SSE response, read to its end."""
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_full_queue_answers_429_and_shutdown_503():
    runner, metrics = build("none", EngineConfig(max_running=1, max_waiting=2))
    served = Served(create_app(runner, MODEL, metrics, retry_after=2))  # runner not started: requests stay queued
    body = {"model": MODEL, "prompt": CODE, "max_tokens": 6, "temperature": 0, "stream": True}
    url, waiting = f"{served.base}/v1/completions", runner.engine.waiting
    try:
        with httpx.Client() as a, httpx.Client() as b, a.stream("POST", url, json=body) as first, \
                b.stream("POST", url, json=body) as second:
            assert first.status_code == second.status_code == 200 and len(waiting) == 2
            r = httpx.post(url, json={**body, "stream": False})
            assert r.status_code == 429 and r.headers["retry-after"] == "2"
            assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
            runner.stop_accepting()
            r = httpx.post(url, json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            assert httpx.get(f"{served.base}/health").status_code == 503
            runner.cancel(waiting[1].request_id)
            runner.shutdown(drain=True)  # the first request still runs to its end
            done, cancelled = sse_events(first), sse_events(second)
        assert done[-1] == "[DONE]" and json.loads(done[-2])["choices"][0]["finish_reason"] in ("length", "stop")
        assert cancelled[-1] == "[DONE]" and json.loads(cancelled[-2])["error"]["code"] == "cancelled"
        assert not runner.alive and not runner.engine.has_work
    finally:
        served.stop()


def test_dspark_serve_exits_cleanly_on_sigterm(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "dspark.cli", "serve", "--drafter", "ngram", "--scheduler", "fixed",
                             "--dtype", "float32", "--port", str(port), "--served-model-name", "m",
                             "--shutdown-timeout", "600",  # the drain must not depend on how busy the machine is
                             "--step-log", str(tmp_path / "steps.jsonl")],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                return httpx.get(f"{base}/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, "dspark serve to start", limit=120)
        body = {"model": "m", "prompt": LONG, "max_tokens": 200, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            proc.send_signal(signal.SIGTERM)  # mid-stream: the running request still finishes
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 200
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
        text = (tmp_path / "serve.log").read_text()
        assert "Waiting for connections to close" in text  # it drained
        frozen = re.search(r"; (\d+) objects frozen out of garbage collection", text)  # models out of gc's walk
        assert frozen and int(frozen.group(1)) > 10_000, text
        if platform.libc_ver()[0] == "glibc":  # freed blocks kept for the next step (`dspark.host_memory`)
            assert "; freed memory kept for reuse)" in text, text
        steps = read_step_log(tmp_path / "steps.jsonl")  # --step-log: every step of the request, flushed at exit
        # the prefill commits the first token; every step's round commits a token per row and its accepted drafts
        assert 1 + sum(s["batch"] + s["accepted"] for s in steps) == 200 and all(s["batch"] == 1 for s in steps)
        assert sum(s["prefill_tokens"] for s in steps) == json.loads(events[-2])["usage"]["prompt_tokens"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_serving_threads_leave_a_core_to_the_http_server_on_a_cpu():
    import torch

    from dspark.arguments import serving_threads

    assert serving_threads("cpu", None) == max(1, torch.get_num_threads() - 1)
    assert serving_threads("cpu", 3) == 3 and serving_threads("cuda", 2) == 2
    assert serving_threads("cuda", None) is None and serving_threads("cuda:1", None) is None
