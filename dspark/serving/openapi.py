"""The server's OpenAPI document: the request and response bodies the endpoints read and write.

The endpoints read raw JSON (so every error is an OpenAI error object, never FastAPI's 422); this module only
documents those bodies, for /openapi.json. The schemas say what `protocol.py` accepts, exactly where JSON Schema
can say it: the one served model, token ids inside the vocabulary, the ranges of every number, at most 4 stop
strings, stream_options only with stream true, the output-changing OpenAI fields dspark refuses (accepted only
with the value that leaves them unused). What it cannot say: the prompt's length in tokens plus max_tokens must
fit the context (400 naming prompt, messages or max_tokens otherwise). A JSON null means the default.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from dspark.serving.protocol import MAX_STOP, ROLES, SEED_RANGE, UNSUPPORTED, ServedModel

ERROR_STATUSES = {
    "400": "invalid request: the error names the field (param) and the accepted values",
    "404": "model_not_found: another model than the served one",
    "413": "request_too_large: the body is over the server's size limit",
    "429": "queue_full: the waiting queue is full; retry after Retry-After seconds",
    "500": "internal error while decoding",
    "503": "shutting_down: the server is shutting down (a cancelled request too), or its engine thread is gone",
}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def component_schemas(served: ServedModel) -> dict[str, dict[str, Any]]:
    """The JSON Schemas of the request and response bodies, by component name."""
    token_id = {"type": "integer", "minimum": 0, "maximum": served.vocab_size - 1}
    limit = served.context_limit
    max_prompt = {} if limit is None else {"maxItems": limit - 1}
    token_ids = {"type": "array", "items": token_id, "minItems": 1, **max_prompt}
    tokens = {"type": "integer", "minimum": 1, **({} if limit is None else {"maximum": limit - 1})}
    text = {"type": "string", "minLength": 1}
    sampling = {
        "model": {"type": "string", "enum": [served.name], "description": "the served model (see /v1/models)"},
        "max_tokens": _nullable({**tokens, "description": "tokens to generate at most; the prompt and these "
                                                           "must fit the model's context"}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": 2**31 - 1,
                            "description": "-1 or 0: off"}),
        "seed": _nullable({"type": "integer", "minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1] - 1}),
        "stop": _nullable({"anyOf": [text, {"type": "array", "items": text, "maxItems": MAX_STOP}]}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "properties": {
            "include_usage": _nullable({"type": "boolean"})}, "description": "only with stream true"}),
        "n": _nullable({"type": "integer", "enum": [1], "description": "one choice per request"}),
        "speculation": _nullable({"type": "boolean", "description": "false: decode without drafts"}),
        "max_draft": _nullable({"type": "integer", "minimum": 0,
                                "description": "verified drafts per round at most"}),
        "workload": _nullable({"type": "string", "minLength": 1, "maxLength": 64,
                               "description": "the label this request's rounds are calibrated under online"}),
        "ignore_eos": _nullable({"type": "boolean", "description": "generate exactly max_tokens"}),
    }
    for name, unused in UNSUPPORTED.items():
        sampling[name] = {"enum": list(unused), "description": "not implemented by dspark: only the value that "
                                                               "leaves it unused is accepted"}
    stream_options_need_stream = {
        "if": {"properties": {"stream_options": {"type": "object"}}, "required": ["stream_options"]},
        "then": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
    }
    completion_request = {
        "type": "object", "required": ["model", "prompt"], **stream_options_need_stream,
        "properties": {
            "prompt": {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": 1}, token_ids,
                                 {"type": "array", "items": token_ids, "minItems": 1, "maxItems": 1}],
                       "description": "one prompt: a string, token ids, or a batch of one of either"},
            **sampling,
        },
    }
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": list(ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}}}
    chat_request = {
        "type": "object", "required": ["model", "messages"], **stream_options_need_stream,
        "properties": {
            "messages": {"type": "array", "items": message, "minItems": 1},
            "max_completion_tokens": _nullable({**tokens, "description": "as max_tokens (which it overrides); "
                                                                          "default: the rest of the context"}),
            **sampling,
        },
    }
    count = {"type": "integer", "minimum": 0}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {"prompt_tokens": count, "completion_tokens": count, "total_tokens": count}}
    speculation = {"type": "object",
                   "required": ["tau", "rounds", "draft_tokens", "accepted_tokens", "accepted_per_position"],
                   "properties": {"tau": {"type": "number"}, "rounds": count, "draft_tokens": count,
                                  "accepted_tokens": count, "accepted_per_position": {"type": "array", "items": count}}}
    finish = {"type": "string", "enum": ["stop", "length"]}

    def result(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
        choice = {"type": "object", "required": ["index", "logprobs", "finish_reason", *choice],
                  "properties": {"index": count, "logprobs": {"type": "null"}, "finish_reason": finish, **choice}}
        return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage", "speculation"],
                "properties": {"id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
                               "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                               "usage": usage, "speculation": speculation}}

    def chunk(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
        choice = {"type": "object", "required": ["index", "logprobs", "finish_reason", *choice],
                  "properties": {"index": count, "logprobs": {"type": "null"},
                                 "finish_reason": {"enum": ["stop", "length", None]}, **choice}}
        return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                "properties": {"id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
                               "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                               "usage": {"anyOf": [usage, {"type": "null"}]}, "speculation": speculation}}

    def events(chunk_schema: dict[str, Any]) -> dict[str, Any]:
        """One server-sent event: a chunk, an error object (the request failed mid-stream), or [DONE]."""
        return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"anyOf": [chunk_schema, _ref("Error")]}}]}}}

    delta = {"type": "object", "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}
    assistant = {"type": "object", "required": ["role", "content"],
                 "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}
    error = {"type": "object", "required": ["error"], "additionalProperties": False, "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string", "minLength": 1},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
    model = {"type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len"],
             "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                            "owned_by": {"type": "string"}, "max_model_len": {"type": ["integer", "null"]}}}
    return {
        "CompletionRequest": completion_request,
        "ChatCompletionRequest": chat_request,
        "Completion": result("text_completion", {"text": {"type": "string"}}),
        "ChatCompletion": result("chat.completion", {"message": assistant}),
        "CompletionEvent": events(chunk("text_completion", {"text": {"type": "string"}})),
        "ChatCompletionEvent": events(chunk("chat.completion.chunk", {"delta": delta})),
        "ModelList": {"type": "object", "required": ["object", "data"],
                      "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": model}}},
        "Health": {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}},
        "Error": error,
    }


def _errors(*statuses: str) -> dict[str, Any]:
    return {s: {"description": ERROR_STATUSES[s], "content": {"application/json": {"schema": _ref("Error")}}}
            for s in statuses}


def generation_operation(request: str, response: str) -> dict[str, Any]:
    """The openapi_extra of a generation endpoint: its JSON body and its answers (JSON, SSE, errors).

    The text/event-stream schema describes one event (as OpenAPI 3.2's itemSchema does).
    """
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "the result, or with stream true server-sent events (data: chunk JSON, then "
                                   "data: [DONE])",
                    "content": {"application/json": {"schema": _ref(response)},
                                "text/event-stream": {"schema": _ref(f"{response}Event")}}},
            **_errors("400", "404", "413", "429", "500", "503"),
        },
    }


MODELS_OPERATION = {"responses": {"200": {"description": "the served model",
                                          "content": {"application/json": {"schema": _ref("ModelList")}}}}}
HEALTH_OPERATION = {"responses": {"200": {"description": "serving",
                                          "content": {"application/json": {"schema": _ref("Health")}}},
                                  **_errors("503")}}
METRICS_OPERATION = {"responses": {"200": {"description": "the Prometheus text exposition",
                                           "content": {"text/plain": {"schema": {"type": "string"}}}}}}


def package_version() -> str:
    """dspark's installed version ("unknown" when run from a tree that is not installed)."""
    try:
        return version("dspark")
    except PackageNotFoundError:
        return "unknown"


def install_openapi(app: FastAPI, served: ServedModel) -> None:
    """Serve the document at /openapi.json with the body schemas of `served` as components."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(component_schemas(served))
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
