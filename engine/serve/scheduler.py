"""One generation at a time: the slot, the queue before it, and cancellation.

A generation runs in a worker thread (the event loop only moves bytes) and hands its
events to the loop through a queue. A second request waits its turn (FIFO, counted as
`k3_requests_deferred`); more than MAX_WAITING waiting requests get 503. A client that
leaves — while waiting, while its stream is written, or while a whole answer is being
collected — sets the job's cancel event, which the generator checks between tokens and
layers, so generation stops within one token.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Callable

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.serve.protocol import Answer, BadRequest, Event
from engine.serve.worker import Job

MAX_WAITING = 8
# Announces the keep-alive interval on every stream, so a client can tell a stopped server
# (no byte for a few pings) from a slow one; a server that sends no such header promises nothing.
PING_HEADER = "X-K3-Ping-Seconds"


class Scheduler:
    def __init__(self) -> None:
        self.waiting = 0
        self.running: Job | None = None
        self._slot = asyncio.Lock()

    def cancel_running(self) -> None:
        if self.running is not None:
            self.running.cancel.set()

    async def start(self, job: Job, request: Request,
                    run: Callable[[Callable[[Event], None]], None]) -> asyncio.Queue | None:
        """Wait for the slot, then run `run(emit)` in a worker thread; the queue its events
        arrive on, or None when the client left while waiting. BadRequest 503 when too many
        wait already."""
        if self.waiting >= MAX_WAITING:
            raise BadRequest(
                f"the engine is busy and {self.waiting} requests are already waiting; "
                "retry later", 503)
        self.waiting += 1
        try:
            got = await self._acquire(request)
        finally:
            self.waiting -= 1
        if not got:
            return None
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                job.cancel.set()

        def work() -> None:
            try:
                run(emit)
            finally:
                self.running = None
                try:
                    loop.call_soon_threadsafe(self._slot.release)
                except RuntimeError:
                    pass

        self.running = job
        threading.Thread(target=work, name="k3-generate", daemon=True).start()
        return queue

    async def _acquire(self, request: Request) -> bool:
        """Wait for the generation slot; give up if the client disconnects meanwhile."""
        task = asyncio.ensure_future(self._slot.acquire())
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return True
            if await request.is_disconnected():
                task.cancel()
                try:
                    await task
                    self._slot.release()  # acquired just as we cancelled
                except asyncio.CancelledError:
                    pass
                return False


async def collect(job: Job, answer: Answer, queue: asyncio.Queue, request: Request) -> Response:
    """A whole (non-streamed) answer; cancels the job when the client has left."""
    checked = time.monotonic()
    while True:
        try:
            event = await asyncio.wait_for(queue.get(), timeout=0.25)
        except TimeoutError:
            event = None
        if time.monotonic() - checked >= 0.25:  # nobody waits for the answer: stop
            checked = time.monotonic()
            if await request.is_disconnected():
                job.cancel.set()
        if event is None:
            continue
        result = event.collect(answer)
        if result is not None:
            status, body = result
            if body is None:
                return Response(status_code=status)
            return JSONResponse(body, status_code=status)


class EventStream(StreamingResponse):
    """SSE body that watches for the client going away while it streams, and then sets
    the generation's cancel event at once (not only at the next write)."""

    def __init__(self, chunks: AsyncGenerator[str, None], cancel: threading.Event,
                 ping_seconds: float) -> None:
        super().__init__(
            chunks,
            status_code=200,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                     PING_HEADER: f"{ping_seconds:g}"},
        )
        self.chunks, self.cancel = chunks, cancel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watch(scope_to_cancel: anyio.CancelScope) -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.cancel.set()
                    scope_to_cancel.cancel()
                    return

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, tg.cancel_scope)
                await send(
                    {
                        "type": "http.response.start",
                        "status": self.status_code,
                        "headers": self.raw_headers,
                    }
                )
                async for chunk in self.chunks:
                    await send(
                        {"type": "http.response.body", "body": chunk.encode(), "more_body": True}
                    )
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except OSError:
            pass
        finally:
            # Normal end: the job already finished. Otherwise the client left mid-stream.
            self.cancel.set()
            await self.chunks.aclose()
