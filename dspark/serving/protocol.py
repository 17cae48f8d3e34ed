"""OpenAI request bodies → checked generation requests; the OpenAI error object.

`parse_completion` reads a /v1/completions body, `parse_chat` a /v1/chat/completions body (messages rendered
with the target tokenizer's chat template). Both raise `APIError` naming the offending field. Fields OpenAI
defines that change the output and that dspark does not implement (echo, logprobs, penalties, ...) are
refused rather than ignored; other unknown fields are ignored. A JSON null means "the default", as in OpenAI.
An integer field takes 2 or 2.0 (integers as JSON Schema counts them, as pydantic-based servers do), never
true; every string must be Unicode text (a lone surrogate escape such as "\\ud800" is refused naming its
field); max_tokens overridden by max_completion_tokens is still checked.
dspark's own fields: `top_k` (-1 or 0: off), `speculation` (false: decode without drafts), `max_draft`
(verified drafts per round at most), `workload` (the label its rounds are calibrated under online) and, as in
vLLM, `ignore_eos` (generate exactly max_tokens, EOS or not).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from dspark.engine import Request
from dspark.sampling import SEED_RANGE, SamplingParams  # SEED_RANGE: what torch.Generator.manual_seed takes

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP = 4
ROLES = ("system", "user", "assistant")
GREEDY_BELOW = 1e-5  # temperatures this small decode greedily (dividing logits by them would overflow)
# Output-changing OpenAI fields dspark does not implement, with the values that leave them unused.
UNSUPPORTED = {
    "echo": (None, False), "logprobs": (None, False), "top_logprobs": (None, 0), "suffix": (None, ""),
    "best_of": (None, 1), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}


class APIError(Exception):
    """An error answered as OpenAI does: an HTTP status and {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        """The OpenAI error object."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """Return {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None) -> APIError:
    """A 400 invalid_request_error naming `param`."""
    return APIError(400, message, param)


@dataclass
class ServedModel:
    """What request checking needs to know about the served target."""

    name: str
    tokenizer: Any
    context_limit: int | None
    vocab_size: int


@dataclass
class GenerationRequest:
    """A checked request: token-id prompt, sampling, limits, streaming options and dspark's extras."""

    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    speculate: bool = True
    max_draft: int | None = None
    workload: str | None = None
    ignore_eos: bool = False

    def to_request(self, request_id: str) -> Request:
        """The engine request, under `request_id`."""
        return Request(self.prompt_ids, self.sampling, self.max_tokens, stop=self.stop, speculate=self.speculate,
                       max_draft=self.max_draft, workload=self.workload, request_id=request_id,
                       ignore_eos=self.ignore_eos)


# ---------------------------------------------------------------------- the body
def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; APIError 400 naming the body when it is not one."""
    def no_constants(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError) as err:
        raise invalid(f"the request body is not valid JSON: {err}", None) from None
    except RecursionError:
        raise invalid("the request body is not valid JSON: it is nested too deeply", None) from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}", None)
    _check_unicode(body)
    return body


def _check_unicode(body: dict) -> None:
    """Raise 400 naming the field when a string (or key) holds a lone UTF-16 surrogate.

    JSON lets a string escape half of a surrogate pair (\\ud800) alone; such a string is not Unicode text: it
    cannot be tokenized, encoded as UTF-8, or echoed back in an error.
    """
    def path(parent: str | None, key: str | int) -> str:
        if parent is None:
            return str(key)
        return f"{parent}[{key}]" if isinstance(key, int) else f"{parent}.{key}"

    # Depth-first in document order; a path is spelled out only for containers and for the culprit.
    stack: list[tuple[str | None, str | int, Any]] = [(None, "", body)]
    while stack:
        parent, key, value = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                where = path(parent, key)
                at = next(i for i, c in enumerate(value) if 0xD800 <= ord(c) <= 0xDFFF)
                raise invalid(f"{where} is not valid Unicode: a lone surrogate {json.dumps(value[at])} at character "
                              f"{at} (strings must be text that UTF-8 can encode)", where)
            continue
        where = None if value is body else path(parent, key)
        if isinstance(value, list):
            stack.extend((where, i, v) for i, v in reversed(list(enumerate(value))) if isinstance(v, (str, list, dict)))
        elif isinstance(value, dict):
            for k in value:
                if _has_surrogate(k):
                    raise invalid(f"{where or 'the request body'} has a key that is not valid Unicode: "
                                  f"{json.dumps(k)[:80]}", where)
            stack.extend((where, k, v) for k, v in reversed(value.items()) if isinstance(v, (str, list, dict)))


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _short(value: Any) -> str:
    """`value` as JSON, cut to 80 characters (for error messages)."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise invalid(f"{name} must be {what}, got {_short(value)}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = _get(body, name, (int, float), "a number")
    if value is None:
        return default
    # An integer too large for a float is out of range, not an error (math.isfinite would overflow on it).
    ok = (isinstance(value, int) or math.isfinite(value)) and (value > low if low_open else value >= low) \
        and value <= high
    if not ok:
        raise invalid(f"{name} must be a number in {'(' if low_open else '['}{low:g}, {high:g}], "
                      f"got {_short(value)}", name)
    return float(value)


def _whole(value: Any) -> int | None:
    """`value` as an int when it is a JSON integer (2 or 2.0, as JSON Schema counts them, not true); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _integer(body: dict, name: str, low: int | None = None, high: int | None = None) -> int | None:
    raw = body.get(name)
    if raw is None:
        return None
    value = _whole(raw)
    if value is None:
        raise invalid(f"{name} must be an integer, got {_short(raw)}", name)
    if (low is not None and value < low) or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise invalid(f"{name} must be an integer {bound}, got {_short(value)}", name)
    return value


def _flag(body: dict, name: str, default: bool) -> bool:
    value = _get(body, name, (bool,), "a boolean")
    return default if value is None else value


def check_model(body: dict, served: ServedModel) -> None:
    """Raise 400 without a model and 404 model_not_found for another model than the served one."""
    model = _get(body, "model", (str,), "a string")
    if model is None:
        raise invalid("you must give the model parameter (the served model is "
                      f"{served.name!r}, see /v1/models)", "model")
    if model != served.name:
        shown = model if len(model) <= 80 else model[:77] + "..."
        raise APIError(404, f"The model `{shown}` does not exist; this server serves `{served.name}`.",
                       "model", code="model_not_found")


def _check_unsupported(body: dict) -> None:
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise invalid(f"n must be 1: dspark returns one choice per request, got {n}", "n")
    for name, unused in UNSUPPORTED.items():
        value = body.get(name)
        if not any(value is u or (value == u and isinstance(value, bool) == isinstance(u, bool)) for u in unused):
            raise invalid(f"{name} is not supported by dspark (got {_short(value)})", name)


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP:
        raise invalid(f"stop takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
    return tuple(stops)


def _max_tokens(body: dict, names: tuple[str, ...], served: ServedModel) -> tuple[int | None, str]:
    """The first of `names` given (a positive integer) and its name.

    The ones it overrides must be valid too (positive, under the context length): a bad value is refused,
    never silently ignored.
    """
    chosen: tuple[int | None, str] = (None, names[0])
    for name in names:
        if chosen[0] is None:
            chosen = (_integer(body, name, 1), name) if body.get(name) is not None else chosen
        else:
            limit = served.context_limit
            _integer(body, name, 1, None if limit is None else limit)
    return chosen


def _common(body: dict, served: ServedModel, prompt_ids: list[int], max_tokens: int | None, max_name: str,
            prompt_name: str) -> GenerationRequest:
    """Sampling, stops, stream options and dspark's extras; the context check."""
    top_k = _integer(body, "top_k", -1, 2**31)
    seed = _integer(body, "seed", *SEED_RANGE)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    sampling = SamplingParams(temperature=0.0 if temperature < GREEDY_BELOW else temperature,
                              top_k=0 if top_k in (None, -1) else top_k,
                              top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), seed=seed)
    stream = _flag(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("stream_options must be an object", "stream_options")
        if not stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        include_usage = options.get("include_usage")
        if include_usage is not None and not isinstance(include_usage, bool):
            raise invalid(f"stream_options.include_usage must be a boolean, got {_short(include_usage)}",
                          "stream_options.include_usage")
        include_usage = bool(include_usage)
    workload = _get(body, "workload", (str,), "a string")
    if workload is not None and not 0 < len(workload) <= 64:
        raise invalid("workload must be a label of 1 to 64 characters", "workload")
    limit = served.context_limit
    prompt = "the prompt" if prompt_name == "prompt" else f"the prompt rendered from {prompt_name}"
    if limit is not None and len(prompt_ids) >= limit:  # too long whatever max_tokens is: the prompt's fault
        raise invalid(f"This model's maximum context length is {limit} tokens; {prompt} has "
                      f"{len(prompt_ids)} tokens, leaving none to generate", prompt_name)
    if max_tokens is None:  # the rest of the context
        if limit is None:
            raise invalid(f"{max_name} is required: the model's context length is unknown", max_name)
        max_tokens = limit - len(prompt_ids)
    if limit is not None and len(prompt_ids) + max_tokens > limit:
        raise invalid(f"This model's maximum context length is {limit} tokens; {prompt} has "
                      f"{len(prompt_ids)} tokens and {max_name} is {max_tokens} "
                      f"({len(prompt_ids) + max_tokens} in all)", max_name)
    return GenerationRequest(
        prompt_ids=prompt_ids, sampling=sampling, max_tokens=max_tokens,
        stop=_stop(body), stream=stream, include_usage=include_usage,
        speculate=_flag(body, "speculation", True), max_draft=_integer(body, "max_draft", 0), workload=workload,
        ignore_eos=_flag(body, "ignore_eos", False))


def _encode(served: ServedModel, text: str) -> list[int]:
    return list(served.tokenizer(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------- the two endpoints
def completion_prompt(body: dict, served: ServedModel) -> list[int]:
    """The prompt's token ids: a string, a list of one string, token ids or a list of one token-id list."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt is empty", "prompt")
        if served.tokenizer is None:
            raise invalid("the served model has no tokenizer: send the prompt as token ids", "prompt")
        return _encode(served, prompt)
    ids = [_whole(t) for t in prompt] if isinstance(prompt, list) else []
    if ids and None not in ids:
        bad = [t for t in ids if not 0 <= t < served.vocab_size]
        if bad:
            raise invalid(f"prompt has token ids outside the vocabulary [0, {served.vocab_size}): "
                          f"{_short(bad[:5])}", "prompt")
        return ids
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid(f"prompt holds {len(prompt)} prompts; dspark takes one prompt per request", "prompt")
    raise invalid("prompt is required: a non-empty string, a list of one string, or a list of token ids", "prompt")


def parse_completion(body: dict, served: ServedModel) -> GenerationRequest:
    """Check a /v1/completions body; return the generation request (max_tokens defaults to 16)."""
    check_model(body, served)
    _check_unsupported(body)
    prompt_ids = completion_prompt(body, served)
    max_tokens, name = _max_tokens(body, ("max_tokens",), served)
    return _common(body, served, prompt_ids, max_tokens or COMPLETION_MAX_TOKENS, name, "prompt")


def chat_messages(body: dict) -> list[dict[str, str]]:
    """The messages as [{role, content}] with text parts joined by newlines."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages is required: a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where} must be an object with role and content", where)
        if m.get("role") not in ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {_short(m.get('role'))}",
                          f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise invalid(f"{where}.content parts must be {{\"type\": \"text\", \"text\": ...}} (dspark takes "
                              f"text only)", f"{where}.content")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise invalid(f"{where}.content must be a string or a list of text parts", f"{where}.content")
        out.append({"role": m["role"], "content": content})
    return out


def parse_chat(body: dict, served: ServedModel) -> GenerationRequest:
    """Check a /v1/chat/completions body; render the messages with the chat template (generation prompt on).

    max_tokens / max_completion_tokens default to the rest of the context, as in OpenAI.
    """
    check_model(body, served)
    _check_unsupported(body)
    messages = chat_messages(body)
    tok = served.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise invalid("the served model has no chat template: use /v1/completions", "messages")
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # noqa: BLE001 - a template's own checks (jinja exceptions) are the client's error
        raise invalid(f"messages do not fit the model's chat template: {err}", "messages") from None
    max_tokens, name = _max_tokens(body, ("max_completion_tokens", "max_tokens"), served)
    if max_tokens is None:
        name = "max_tokens"
    return _common(body, served, _encode(served, text), max_tokens, name, "messages")
