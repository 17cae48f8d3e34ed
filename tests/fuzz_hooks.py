"""Schemathesis hooks shared by tests/test_fuzz_api.py and benchmarks/fuzz_api.py (SCHEMATHESIS_HOOKS=fuzz_hooks).

- before_call: a schema-valid (positive) case generates at most CAP tokens: its max_tokens and
  max_completion_tokens are capped, and set when absent (chat's default is the rest of the context). The
  fuzzing is about the request checks, not about decoding. A negative case is sent as generated (its invalid
  part may be exactly that number).
- error_objects: a check that every 4xx/5xx answer is exactly an OpenAI error object.
- after_call: with FUZZ_API_LOG=PATH set, one line per request to PATH (JSON: operation, phase, mode, status,
  seconds) for benchmarks/fuzz_api.py's per-operation counts.
"""
from __future__ import annotations

import json
import os
import time

import schemathesis

CAP = 4
ERROR_KEYS = {"message", "type", "param", "code"}
_sent: dict[int, float] = {}  # id(case) -> when before_call ran


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    """Cap the generation of a positive case at CAP tokens."""
    body, meta = case.body, case.meta
    _sent[id(case)] = time.perf_counter()
    if not isinstance(body, dict) or meta is None or not meta.generation.mode.is_positive:
        return
    given = False
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            body[name] = min(int(value), CAP)
            given = True
    if not given:
        body["max_tokens"] = CAP


@schemathesis.hook
def after_call(context, case, response) -> None:
    """Log the request when FUZZ_API_LOG names a file."""
    path = os.environ.get("FUZZ_API_LOG")
    start = _sent.pop(id(case), None)
    if not path:
        return
    meta = case.meta
    line = {"operation": case.operation.label, "phase": meta.phase.name.value if meta else None,
            "mode": meta.generation.mode.value if meta else None, "status": response.status_code,
            "seconds": None if start is None else round(time.perf_counter() - start, 4)}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


@schemathesis.check
def error_objects(ctx, response, case) -> None:
    """Every 4xx/5xx answer is exactly {"error": {message, type, param, code}} (message and type non-empty)."""
    if response.status_code < 400:
        return None
    body = json.loads(response.content)
    assert isinstance(body, dict) and set(body) == {"error"}, f"{response.status_code} is not an error object: {body}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_KEYS, f"the error object has keys {sorted(error)}"
    assert isinstance(error["message"], str) and error["message"], "the error has no message"
    assert isinstance(error["type"], str) and error["type"], "the error has no type"
    assert all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")), error
    return None
