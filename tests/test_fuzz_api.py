"""The API under bad input: schemathesis fuzzing of the server's own OpenAPI document, and hand-written bad requests.

A real uvicorn server (the bundled target and DSpark drafter) in a background thread. Schemathesis generates
bodies from /openapi.json, schema-valid (positive) and schema-violating (negative), and checks every answer:
no 5xx, every status and body as documented (every error an OpenAI error object), valid data accepted, invalid
data rejected, and an answer within REQUEST_TIMEOUT seconds. Positive cases generate at most fuzz_hooks.CAP
tokens (the fuzzing is about the request checks, not decoding). benchmarks/fuzz_api.py runs the same with a
long budget and the coverage phase (every boundary value of every field).
"""
from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from dspark.engine import EngineConfig
from dspark.serving.app import create_app
from fuzz_hooks import ERROR_KEYS, error_objects  # also registers the before_call hook capping generation
from test_serve import MODEL, Served, build

REQUEST_TIMEOUT = 60.0  # seconds: a hang fails the case
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server():
    runner, metrics = build("dspark", EngineConfig(max_running=8))
    runner.start()
    served = Served(create_app(runner, MODEL, metrics, max_body_bytes=BODY_LIMIT))
    served.engine = runner.engine
    yield served
    served.stop()
    runner.shutdown(drain=False)


@pytest.fixture(scope="module")
def api_schema(server):
    # The coverage phase (every boundary value of every field, ~400 cases per operation) runs in
    # benchmarks/fuzz_api.py; here the examples and fuzzing phases, positive and negative data.
    # A body over the server's size limit is answered 413 before it is read, valid or not (a documented
    # answer of every operation): schemathesis's own lists of statuses that reject negative data and accept
    # positive data, each with 413 added (a 420 KB schema-violating body failed a CI run without it).
    config = schemathesis.Config.from_dict({
        "phases": {"coverage": {"enabled": False}},
        "checks": {
            "negative_data_rejection": {"expected-statuses": [
                "400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]},
            "positive_data_acceptance": {"expected-statuses": [
                "2xx", "3xx", "401", "403", "404", "409", "413", "429", "5xx"]},
        },
    })
    return schemathesis.openapi.from_url(f"{server.base}/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_fuzz_openapi_schema(case, server):
    case.call_and_validate(base_url=server.base, timeout=REQUEST_TIMEOUT, additional_checks=[error_objects])


def test_openapi_document_describes_the_bodies(server):
    doc = httpx.get(f"{server.base}/openapi.json").json()
    schemas = doc["components"]["schemas"]
    request = schemas["CompletionRequest"]
    assert request["required"] == ["model", "prompt"] and request["properties"]["model"]["enum"] == [MODEL]
    limit = server.engine.context_limit
    assert request["properties"]["max_tokens"]["anyOf"][0]["maximum"] == limit - 1
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        assert set(op["responses"]) == {"200", "400", "404", "413", "429", "500", "503"}
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert op["responses"]["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    assert schemas["Error"]["properties"]["error"]["required"] == ["message", "type", "param", "code"]


# ---------------------------------------------------------------------- hand-written bad requests
def bad(path: str, body, status: int, param: str | None, says: str = "", code: str | None = None):
    """One bad request: body (a dict sent as ASCII JSON, or raw bytes), the status, the error's param and code,
    and text its message must hold (the field and the accepted range)."""
    return pytest.param(path, body, status, param, says, code, id=f"{path.split('/')[0]}-{param}-{says or status}")


C, CHAT = "completions", "chat/completions"
HI = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
USER = [{"role": "user", "content": "hi"}]
TALK = {"model": MODEL, "messages": USER, "max_tokens": 2}
BAD = [
    # malformed and truncated JSON, not an object, nested too deeply, invalid UTF-8
    bad(C, b"{not json", 400, None, "not valid JSON"),
    bad(C, b'{"model": "target", "prompt": "hi"', 400, None, "not valid JSON"),
    bad(C, b'{"model": "target", "prompt": "hi", "max_tokens": 2', 400, None, "not valid JSON"),
    bad(CHAT, b"", 400, None, "not valid JSON"),
    bad(C, b'{"model": "target", "prompt": "hi", "temperature": NaN}', 400, None, "NaN is not valid JSON"),
    bad(C, b'{"model": "target", "prompt": "hi", "max_tokens": Infinity}', 400, None, "Infinity is not valid JSON"),
    bad(C, b"[1, 2]", 400, None, "must be a JSON object, got list"),
    bad(C, b'"prompt"', 400, None, "must be a JSON object, got str"),
    bad(C, b'{"prompt": ' + b"[" * 60_000, 400, None, "nested too deeply"),  # RecursionError: was a 500
    bad(C, b'{"model": "target", "prompt": "caf\xe9 \xff"}', 400, None, "not valid JSON"),
    bad(CHAT, b'\xff\xfe{\x00', 400, None, "not valid JSON"),
    # lone surrogates: not Unicode text (they crashed the tokenizer and the error rendering: 500)
    bad(C, b'{"model": "target", "prompt": "a\\ud800b"}', 400, "prompt", "lone surrogate"),
    bad(C, b'{"model": "target", "prompt": ["\\udfff"]}', 400, "prompt[0]", "lone surrogate"),
    bad(CHAT, b'{"model": "target", "messages": [{"role": "user", "content": "\\udc00"}]}', 400,
        "messages[0].content", "lone surrogate"),
    bad(CHAT, b'{"model": "target", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
        400, "messages[0].content[0].text", "lone surrogate"),
    bad(C, b'{"model": "target", "prompt": "hi", "stop": ["ok", "\\ud800"]}', 400, "stop[1]", "lone surrogate"),
    bad(C, b'{"model": "\\ud800", "prompt": "hi"}', 400, "model", "lone surrogate"),
    bad(C, b'{"model": "target", "prompt": "hi", "workload": "w\\udbff"}', 400, "workload", "lone surrogate"),
    bad(C, b'{"model": "target", "prompt": "hi", "\\ud800": 1}', 400, None, "key that is not valid Unicode"),
    # wrong types
    bad(C, {"model": MODEL, "prompt": 5}, 400, "prompt", "a non-empty string, a list of one string, or a list of token ids"),
    bad(C, {"model": MODEL, "prompt": [1, "a"]}, 400, "prompt", "token ids"),
    bad(C, {"model": MODEL, "prompt": [1, 2.5]}, 400, "prompt", "token ids"),
    bad(C, {"model": MODEL, "prompt": [True, False]}, 400, "prompt", "token ids"),
    bad(C, {"model": 5, "prompt": "hi"}, 400, "model", "model must be a string"),
    bad(CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages", "non-empty list of {role, content}"),
    bad(CHAT, {"model": MODEL, "messages": ["hi"]}, 400, "messages[0]", "object with role and content"),
    bad(CHAT, {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages[0].content", "string or a list"),
    bad(C, {**HI, "temperature": "0.5"}, 400, "temperature", "temperature must be a number"),
    bad(C, {**HI, "max_tokens": "8"}, 400, "max_tokens", "max_tokens must be an integer"),
    bad(C, {**HI, "max_tokens": 2.5}, 400, "max_tokens", "max_tokens must be an integer"),
    bad(C, {**HI, "max_tokens": True}, 400, "max_tokens", "max_tokens must be an integer"),
    bad(C, {**HI, "seed": 1.5}, 400, "seed", "seed must be an integer"),
    bad(C, {**HI, "top_k": "5"}, 400, "top_k", "top_k must be an integer"),
    bad(C, {**HI, "stream": "yes"}, 400, "stream", "stream must be a boolean"),
    bad(C, {**HI, "stream": True, "stream_options": []}, 400, "stream_options", "stream_options must be an object"),
    bad(C, {**HI, "stream": True, "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage",
        "must be a boolean"),
    bad(C, {**HI, "ignore_eos": "true"}, 400, "ignore_eos", "ignore_eos must be a boolean"),
    bad(C, {**HI, "n": "1"}, 400, "n", "n must be an integer"),
    # huge, negative, zero max_tokens; max_completion_tokens; the one overridden is checked too
    bad(C, {**HI, "max_tokens": 10**30}, 400, "max_tokens", "maximum context length is 2048"),
    bad(C, {**HI, "max_tokens": 1e300}, 400, "max_tokens", "maximum context length is 2048"),
    bad(C, {**HI, "max_tokens": -5}, 400, "max_tokens", "max_tokens must be an integer >= 1"),
    bad(C, {**HI, "max_tokens": 0}, 400, "max_tokens", "max_tokens must be an integer >= 1"),
    bad(CHAT, {**TALK, "max_completion_tokens": -1}, 400, "max_completion_tokens", "must be an integer >= 1"),
    bad(CHAT, {**TALK, "max_completion_tokens": 10**6}, 400, "max_completion_tokens", "maximum context length"),
    bad(CHAT, {**TALK, "max_completion_tokens": 2, "max_tokens": 0}, 400, "max_tokens", "in [1, 2048)"),
    bad(CHAT, {**TALK, "max_completion_tokens": 2, "max_tokens": 5000}, 400, "max_tokens", "in [1, 2048)"),
    # sampling out of range
    bad(C, {**HI, "temperature": -1}, 400, "temperature", "[0, 2]"),
    bad(C, {**HI, "temperature": 2.01}, 400, "temperature", "[0, 2]"),
    bad(C, {**HI, "temperature": 10**400}, 400, "temperature", "[0, 2]"),  # too big for a float: was a 500
    bad(C, b'{"model": "target", "prompt": "hi", "temperature": 1e400}', 400, "temperature", "[0, 2]"),  # inf
    bad(C, {**HI, "top_p": 0}, 400, "top_p", "(0, 1]"),
    bad(C, {**HI, "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    bad(C, {**HI, "top_p": -(10**400)}, 400, "top_p", "(0, 1]"),
    bad(C, {**HI, "top_k": -2}, 400, "top_k", "[-1, 2147483648)"),
    bad(C, {**HI, "top_k": 2**31}, 400, "top_k", "[-1, 2147483648)"),
    bad(C, {**HI, "seed": 2**64}, 400, "seed", "seed must be an integer in"),
    bad(C, {**HI, "max_draft": -1}, 400, "max_draft", "max_draft must be an integer >= 0"),
    bad(C, {**HI, "n": 2}, 400, "n", "n must be 1"),
    bad(C, {**HI, "best_of": 3}, 400, "best_of", "best_of is not supported"),
    # the model
    bad(C, {"model": "gpt-4", "prompt": "hi"}, 404, "model", "gpt-4", code="model_not_found"),
    bad(CHAT, {"model": "x" * 5000, "messages": USER}, 404, "model", "...", code="model_not_found"),
    bad(C, {"prompt": "hi"}, 400, "model", "you must give the model parameter"),
    # empty and enormous prompts, prompts over the context
    bad(C, {"model": MODEL, "prompt": ""}, 400, "prompt", "prompt is empty"),
    bad(C, {"model": MODEL, "prompt": [""]}, 400, "prompt", "prompt is empty"),
    bad(C, {"model": MODEL, "prompt": []}, 400, "prompt", "prompt is required"),
    bad(C, {"model": MODEL, "prompt": [[]]}, 400, "prompt", "prompt is required"),
    bad(C, {"model": MODEL, "prompt": [[1], [2]]}, 400, "prompt", "one prompt per request"),
    bad(C, {"model": MODEL, "prompt": [-1, 3]}, 400, "prompt", "outside the vocabulary [0, 8192)"),
    bad(C, {"model": MODEL, "prompt": [8192]}, 400, "prompt", "outside the vocabulary [0, 8192)"),
    bad(C, {"model": MODEL, "prompt": "hello " * 5000}, 400, "prompt", "leaving none to generate"),
    bad(C, {"model": MODEL, "prompt": [5] * 2048, "max_tokens": 1}, 400, "prompt", "the prompt has 2048 tokens"),
    bad(C, {"model": MODEL, "prompt": [5] * 2040, "max_tokens": 9}, 400, "max_tokens", "max_tokens is 9"),
    bad(C, {"model": MODEL, "prompt": [5] * 2040}, 400, "max_tokens", "max_tokens is 16"),  # the default
    bad(CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 3000}]}, 400, "messages",
        "rendered from messages has"),
    bad(CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 200}], "max_tokens": 1500}, 400,
        "max_tokens", "max_tokens is 1500"),
    bad(C, {"model": MODEL, "prompt": "x" * (BODY_LIMIT + 1)}, 413, None, f"limit of {BODY_LIMIT} bytes",
        code="request_too_large"),
    # stop lists and labels
    bad(C, {**HI, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4 strings, got 5"),
    bad(C, {**HI, "stop": ["x"] * 1000}, 400, "stop", "at most 4 strings, got 1000"),
    bad(C, {**HI, "stop": [""]}, 400, "stop", "non-empty string"),
    bad(C, {**HI, "stop": ""}, 400, "stop", "non-empty string"),
    bad(C, {**HI, "stop": ["a", 3]}, 400, "stop", "non-empty string"),
    bad(C, {**HI, "workload": "w" * 65}, 400, "workload", "1 to 64 characters"),
    bad(C, {**HI, "stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed when stream is true"),
]


def post(base: str, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # ASCII: escapes lone surrogates
    return httpx.post(f"{base}/v1/{path}", content=content, headers={"content-type": "application/json"},
                      timeout=REQUEST_TIMEOUT, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None, says: str, code: str | None) -> dict:
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error = body["error"]
    assert error["param"] == param and error["code"] == code, error
    assert error["type"] == "invalid_request_error" and says in error["message"], error
    if param is not None:  # the message names the field
        assert param.split("[")[0] in error["message"], error
    return error


@pytest.mark.parametrize("path, body, status, param, says, code", BAD)
def test_bad_request_gets_an_openai_error_naming_the_field(server, path, body, status, param, says, code):
    assert_error(post(server.base, path, body), status, param, says, code)


STREAMED = [case for case in BAD if isinstance(case.values[1], dict) and case.values[2] != 413][::4]


@pytest.mark.parametrize("path, body, status, param, says, code", STREAMED)
def test_bad_streaming_request_fails_before_the_stream_starts(server, path, body, status, param, says, code):
    with httpx.stream("POST", f"{server.base}/v1/{path}", content=json.dumps({**body, "stream": True}).encode(),
                      headers={"content-type": "application/json"}, timeout=REQUEST_TIMEOUT) as r:
        r.read()
    if param == "stream":  # "stream": True replaced the bad value
        assert r.status_code == 200
        return
    assert_error(r, status, param, says, code)


def test_chunked_body_over_the_limit_is_413(server):
    def chunks():
        yield b'{"model": "target", "prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(f"{server.base}/v1/completions", content=chunks(), timeout=REQUEST_TIMEOUT)
    assert "content-length" not in r.request.headers  # sent chunked: the limit is counted while reading
    assert_error(r, 413, None, "exceeds the limit", "request_too_large")


def test_the_server_still_serves_after_the_bad_requests(server):
    r = post(server.base, C, {**HI, "temperature": 0, "max_tokens": 3, "stop": ["\U0001F600"],
                                "prompt": "caf\u00e9 \U0001F600 \u0000"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{server.base}/health").status_code == 200
    assert server.engine.running == [] and server.engine.waiting.__len__() == 0
