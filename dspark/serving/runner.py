"""The engine's step loop in one background thread, bridged to asyncio: one output queue per request.

The thread steps while the engine has work and sleeps on a condition when it has none. Each step's outputs
go to their requests' asyncio queues through `loop.call_soon_threadsafe`; a consumer that stops listening
(client gone, task cancelled) cancels its request, and the engine frees the row in its next step.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from dspark.engine import Engine, Request, RequestOutput

log = logging.getLogger("dspark.serving")

OutputsCallback = Callable[[list[RequestOutput], float], None]


class ShuttingDown(RuntimeError):
    """The runner no longer accepts requests."""


@dataclass
class _Route:
    """Where one request's outputs go: an asyncio queue on its event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineRunner:
    """Owns an `Engine` and runs its `step()` in one thread; `submit` streams a request's outputs to asyncio.

    on_outputs(outputs, now) is called in the engine thread after every step (metrics); keep it cheap.
    An exception inside `engine.step()` fails that step's requests (finish_reason "error"), is logged, and
    the loop goes on serving. A request the engine fails alone (its own drafting raised) arrives as a normal
    finished output with finish_reason "error" and its `error` message; its neighbours carry on.
    """

    def __init__(self, engine: Engine, on_outputs: OutputsCallback | None = None) -> None:
        self.engine = engine
        self.on_outputs = on_outputs
        self._wake = threading.Condition()  # guards _routes, _stopping and every engine.add
        self._routes: dict[str, _Route] = {}
        self._failed: set[str] = set()  # requests already answered with an error, still being freed
        self._accepting = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.errors = 0  # steps that raised

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread (once)."""
        with self._wake:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
                self._thread.start()

    @property
    def accepting(self) -> bool:
        """True while new requests are taken."""
        return self._accepting

    @property
    def alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop_accepting(self) -> None:
        """Refuse new requests (`submit` raises ShuttingDown); running ones carry on."""
        self._accepting = False

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish (drain; at most `timeout` s) or cancel them, join."""
        self.stop_accepting()
        if not drain:
            self.cancel_all()
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self.start()  # a runner never started still has to answer what it queued
        self._thread.join(timeout if drain else None)
        if self._thread.is_alive():
            self.cancel_all()
            self._thread.join()

    # ------------------------------------------------------------------ requests
    async def submit(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Queue a request; return the stream of its outputs (the last one has finished=True).

        Raises ShuttingDown, the engine's ValueError (naming the field) or QueueFull before anything is
        queued. Closing the stream before its end (or cancelling the task reading it) cancels the request.
        """
        if not self._accepting:
            raise ShuttingDown("the server is shutting down")
        route = _Route(asyncio.get_running_loop(), asyncio.Queue())
        with self._wake:
            if request.request_id in self._routes:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self.engine.add(request)
            self._routes[request.request_id] = route
            self._wake.notify()
        return self._stream(request.request_id, route.queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:  # the consumer left early: free the row
                self.cancel(request_id)

    def cancel(self, request_id: str) -> None:
        """Cancel a request; the engine frees its row in the next step."""
        self.engine.cancel(request_id)
        with self._wake:
            self._wake.notify()

    def cancel_all(self) -> None:
        """Cancel every request in flight."""
        with self._wake:
            ids = list(self._routes)
        for request_id in ids:
            self.cancel(request_id)

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        failures = 0
        while True:
            with self._wake:
                while not self.engine.has_work and not self._stopping:
                    self._wake.wait()
                if not self.engine.has_work:
                    return
            try:
                outputs = self.engine.step()
                failures = 0
            except Exception as err:  # noqa: BLE001 - one bad step must not take the server down
                self.errors += 1
                log.exception("engine step failed")
                outputs, fresh = self._fail_step(err)
                failures = 0 if fresh else failures + 1
                if failures:  # nothing new to fail: the engine is stuck on requests already answered
                    time.sleep(min(1.0, 0.01 * 2 ** failures))
            self._dispatch(outputs)

    def _fail_step(self, err: Exception) -> tuple[list[RequestOutput], bool]:
        """Answer the failed step's requests with an error and cancel them so the engine frees their rows."""
        engine = self.engine
        with self._wake:
            victims = list(engine.prefilling) + list(engine.running) or list(engine.waiting)
        message = f"internal error while decoding: {type(err).__name__}: {err}"
        outputs, fresh = [], False
        for req in victims:
            engine.cancel(req.request_id)
            if req.request_id in self._failed:
                continue
            fresh = True
            self._failed.add(req.request_id)
            # A snapshot: the engine will still mark the original "cancelled" when it drops the row.
            failed = copy.copy(req)
            failed.finish_reason, failed.error, failed.finish_time = "error", message, time.perf_counter()
            outputs.append(RequestOutput(failed, [], "", True))
        return outputs, fresh

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Send each output to its request's queue (dropping the engine's late word on failed requests)."""
        now = time.perf_counter()
        kept = []
        for out in outputs:
            request_id = out.request.request_id
            if request_id in self._failed and out.request.finish_reason != "error":
                if out.finished:
                    self._failed.discard(request_id)
                continue
            kept.append(out)
            with self._wake:
                route = self._routes.pop(request_id, None) if out.finished else self._routes.get(request_id)
            if route is None:
                continue
            try:
                route.loop.call_soon_threadsafe(route.queue.put_nowait, out)
            except RuntimeError:  # the consumer's event loop is closed
                pass
        if self.on_outputs is not None and kept:
            try:
                self.on_outputs(kept, now)
            except Exception:  # noqa: BLE001 - metrics must never stop decoding
                log.exception("on_outputs callback failed")
