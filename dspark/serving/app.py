"""The OpenAI-compatible HTTP API over an `EngineRunner`: completions, chat, models, health, metrics.

Responses follow OpenAI's shapes plus a top-level `speculation` field (τ, rounds, draft and accepted tokens,
accepted drafts per position). Streams are server-sent events (`data: {json}`, then `data: [DONE]`); with
`stream_options.include_usage` a last chunk with no choices carries the usage. Every error is an OpenAI
error object; FastAPI's 422 never reaches a client. A client that disconnects cancels its request.
/openapi.json documents the request and response bodies (`dspark.serving.openapi`); the endpoints read raw
JSON and check it themselves (`dspark.serving.protocol`), off the event loop.
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.engine import QueueFull, Request, RequestOutput
from dspark.serving.metrics import ServerMetrics
from dspark.serving.openapi import (HEALTH_OPERATION, METRICS_OPERATION, MODELS_OPERATION, generation_operation,
                                    install_openapi, package_version)
from dspark.serving.protocol import (APIError, GenerationRequest, ServedModel, error_body, parse_chat,
                                     parse_completion, parse_json)
from dspark.serving.runner import EngineRunner, ShuttingDown

log = logging.getLogger("dspark.serving")

MAX_BODY_BYTES = 1 << 20
ENGINE_FIELDS = ("prompt", "max_tokens", "max_draft", "stop")  # first words of the engine's ValueErrors


class ErrorResponse(JSONResponse):
    """A JSON error object, ASCII-escaped: whatever text an error quotes, rendering it cannot fail."""

    def render(self, content: Any) -> bytes:
        """The body as compact ASCII JSON."""
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class EventStream(StreamingResponse):
    """A server-sent-event response that always closes its generator (so a gone client cancels its request)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        """Send the stream; close the generator however sending ends."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def create_app(runner: EngineRunner, model_name: str, metrics: ServerMetrics | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, retry_after: int = 1) -> FastAPI:
    """The FastAPI app serving `runner`'s engine as `model_name` (the runner is started by its owner).

    metrics: served at /metrics when given. max_body_bytes: larger bodies get 413. retry_after: seconds
    suggested by a 429 when the waiting queue is full.
    """
    engine = runner.engine
    # The engine thread decodes with the target's tokenizer; requests are encoded here with a copy of it
    # (a Rust tokenizer must not be mutably borrowed from two threads at once).
    tokenizer = copy.deepcopy(engine.target.tokenizer)
    served = ServedModel(model_name, tokenizer, engine.context_limit, engine.target.vocab_size)
    started = int(time.time())
    # Request checking (parsing up to max_body_bytes of JSON, tokenizing the prompt, rendering the chat template)
    # runs off the event loop, one request at a time: a huge prompt does not stall the other clients' streams,
    # and the tokenizer copy is only ever used from this one thread.
    checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-check")
    app = FastAPI(title="dspark", version=package_version(), docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  description="OpenAI-compatible completions and chat completions with speculative decoding.")
    install_openapi(app, served)

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, err: APIError) -> JSONResponse:
        return ErrorResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: HTTPRequest, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return ErrorResponse(error_body(f"{param}: {first.get('msg', 'invalid request')}", param=param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: HTTPRequest, err: StarletteHTTPException) -> JSONResponse:
        return ErrorResponse(error_body(str(err.detail)), status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def internal_error(_: HTTPRequest, err: Exception) -> JSONResponse:
        log.exception("request failed", exc_info=err)
        return ErrorResponse(error_body(f"internal error: {type(err).__name__}: {err}", "server_error"), 500)

    async def check(parse, http: HTTPRequest) -> GenerationRequest:
        """The checked request of `http`'s body (APIError otherwise)."""
        raw = await read_body(http, max_body_bytes)
        return await asyncio.get_running_loop().run_in_executor(checker, lambda: parse(parse_json(raw), served))

    async def generate(http: HTTPRequest, gen: GenerationRequest, chat: bool) -> Response:
        """Run one checked request; answer with an SSE stream or one JSON object."""
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stream = await submit(runner, gen.to_request(request_id), retry_after)
        head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model_name}
        if gen.stream:
            return EventStream(events(stream, head, chat, gen.include_usage), headers={"Cache-Control": "no-cache"})
        result = await collect_unless_disconnected(http, stream)
        if result is None:  # the client left; nobody reads this
            return Response(status_code=499)
        req, text = result
        if req.finish_reason in ("error", "cancelled"):
            raise failure(req)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                  else {"index": 0, "text": text})
        head["object"] = "chat.completion" if chat else "text_completion"
        return JSONResponse({**head, "choices": [{**choice, "logprobs": None, "finish_reason": req.finish_reason}],
                             "usage": usage(req), "speculation": req.speculation_stats()})

    @app.post("/v1/completions", openapi_extra=generation_operation("CompletionRequest", "Completion"))
    async def completions(http: HTTPRequest) -> Response:
        """OpenAI /v1/completions."""
        return await generate(http, await check(parse_completion, http), chat=False)

    @app.post("/v1/chat/completions", openapi_extra=generation_operation("ChatCompletionRequest", "ChatCompletion"))
    async def chat_completions(http: HTTPRequest) -> Response:
        """OpenAI /v1/chat/completions (messages rendered with the chat template)."""
        return await generate(http, await check(parse_chat, http), chat=True)

    @app.get("/v1/models", response_model=None, openapi_extra=MODELS_OPERATION)
    async def models() -> dict:
        """The one served model."""
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "dspark", "max_model_len": served.context_limit}]}

    @app.get("/health", openapi_extra=HEALTH_OPERATION)
    async def health() -> JSONResponse:
        """200 while serving; 503 once shutting down or when the engine thread is gone."""
        if not runner.accepting:
            return ErrorResponse(error_body("shutting down", "server_error", code="shutting_down"), 503)
        if not runner.alive:
            return ErrorResponse(error_body("the engine thread is not running", "server_error"), 503)
        return JSONResponse({"status": "ok"})

    if metrics is not None:
        @app.get("/metrics", response_class=Response, openapi_extra=METRICS_OPERATION)
        async def prometheus() -> Response:
            """The Prometheus text exposition."""
            return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


# ---------------------------------------------------------------------- request plumbing
async def read_body(http: HTTPRequest, limit: int) -> bytes:
    """The raw body; APIError 413 once it passes `limit` bytes."""
    too_large = APIError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")
    length = http.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def submit(runner: EngineRunner, req: Request, retry_after: int) -> AsyncIterator[RequestOutput]:
    """Queue the request; map refusals to 503 (shutting down), 429 (queue full) and 400 (engine checks)."""
    try:
        return await runner.submit(req)
    except ShuttingDown as err:
        raise APIError(503, str(err), type="server_error", code="shutting_down") from None
    except QueueFull as err:
        raise APIError(429, f"the server is busy: {err}; retry later", type="rate_limit_error",
                       code="queue_full", headers={"Retry-After": str(retry_after)}) from None
    except ValueError as err:
        word = str(err).split(" ", 1)[0].strip(":,")
        raise APIError(400, str(err), word if word in ENGINE_FIELDS else None) from None


async def collect_unless_disconnected(http: HTTPRequest,
                                      stream: AsyncIterator[RequestOutput]) -> tuple[Request, str] | None:
    """The finished request and its text; None (the request cancelled) when the client disconnects first."""
    async def collect() -> tuple[Request, str]:
        parts, last = [], None
        async for out in stream:
            parts.append(out.text)
            last = out
        return last.request, "".join(parts)

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    collecting, watching = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()  # cancels the engine request
    return collecting.result() if collecting.done() and not collecting.cancelled() else None


def failure(req: Request) -> APIError:
    """The error a request that ended in "error" or "cancelled" answers with."""
    if req.finish_reason == "cancelled":
        return APIError(503, "the request was cancelled: the server is shutting down", type="server_error",
                        code="cancelled")
    return APIError(500, req.error or "internal error while decoding", type="server_error")


def usage(req: Request) -> dict:
    """OpenAI usage counts of a finished request."""
    prompt, completion = len(req.prompt_ids), len(req.output_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def events(stream: AsyncIterator[RequestOutput], head: dict, chat: bool,
                 include_usage: bool) -> AsyncIterator[str]:
    """The SSE chunks of one request: deltas, the finish chunk (with `speculation`), usage, [DONE]."""
    extra = {"usage": None} if include_usage else {}

    def chunk(text: str | None, finish: str | None, **more) -> str:
        if chat:
            choice = {"index": 0, "delta": {} if text is None else {"content": text}}
        else:
            choice = {"index": 0, "text": text or ""}
        return sse({**head, "choices": [{**choice, "logprobs": None, "finish_reason": finish}], **extra, **more})

    try:
        if chat:
            yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], **extra})
        async for out in stream:
            req = out.request
            if out.finished and req.finish_reason in ("error", "cancelled"):
                yield sse(failure(req).body())
                break
            if out.finished:
                yield chunk(out.text or None, req.finish_reason, speculation=req.speculation_stats())
                if include_usage:
                    yield sse({**head, "choices": [], "usage": usage(req)})
            elif out.text:
                yield chunk(out.text, None)
        yield sse("[DONE]")
    finally:
        await stream.aclose()
