"""`python -m engine serve CHECKPOINT`: an OpenAI-compatible HTTP server for the engine —
the routes, the body limits and the uvicorn wiring. The wire format is protocol.py, the
generation worker worker.py.

It speaks what llama-server speaks (see the README's server section): SSE chunks with
`reasoning_content` / `content` deltas, a finish chunk, an optional usage chunk, `timings`
on the last chunk, `data: [DONE]`; errors as `{"error": {"code", "message", "type"}}`.
Each chunk also carries a `k3` object with the engine's per-token statistics.

Design:
* The socket is bound first, then the model loads in a background thread; until it is
  ready every route but /health and /metrics answers 503 (/health with load progress).
* A silent stream (a long prefill) gets an SSE comment every PING_SECONDS, and says so in
  the PING_HEADER of its response: a client tells a stopped server from a slow one.
* One generation at a time, in a worker thread (the event loop only moves bytes). A
  second request waits its turn (FIFO, `k3_requests_deferred`); more than
  `MAX_WAITING` waiting requests get 503. Closing the connection sets a cancel event that
  the generator checks between tokens and layers, so generation stops within one token.
* Binding anything but loopback requires `--api-key`. Several keys are several users:
  a request resumes only the kept states its own key made (snapshots.py).
* Hostile input is refused before it costs anything: a body over `--max-body-mb` gets 413
  (from Content-Length, or as soon as a chunked body passes it), a client that stalls
  sending its request head or body is closed after `--read-timeout` (a body dripped in
  slower than MIN_BODY_RATE on average, once that time is up, too), JSON with NaN,
  Infinity or more than MAX_JSON_DEPTH levels gets 400; parsing and tokenising run in a
  worker thread, so /health answers while a big prompt is read or a generation runs.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.decode.stats import TokenStats
from engine.decode.steer import DEMO_NOTICE
from engine.errors import EngineError
from engine.serve.protocol import (
    FINGERPRINT,
    Answer,
    BadRequest,
    ChatRequest,
    ChunkIds,
    Event,
    error_body,
    parse_chat_request,
    parse_json,
)
from engine.serve.snapshots import owner_of
from engine.serve.worker import (
    Job,
    Loaded,
    LoadProgress,
    LoadSettings,
    Metrics,
    k3_record,
    load_engine,
    run_job,
)
from engine.text.chat_template import EFFORTS, ChatTemplate, Rendered, TemplateError

MAX_WAITING = 8
DEFAULT_CTX = 8192
PING_SECONDS = 15.0    # a silent stream gets an SSE comment this often (a long prefill)
# Announces PING_SECONDS on every stream, so a client can tell a stopped server (no byte
# for a few pings) from a slow one; a server that sends no such header promises nothing.
PING_HEADER = "X-K3-Ping-Seconds"
PUBLIC_PATHS = ("/health", "/v1/health")
LOADING_PATHS = PUBLIC_PATHS + ("/metrics",)
MAX_BODY_MB = 4.0      # a long conversation is well under 1 MB of JSON
READ_TIMEOUT = 10.0    # seconds a client may take for its request head, or stall in its body
# Past its first READ_TIMEOUT seconds a body must keep up this average rate: a client
# dripping a byte now and then never stalls, but must not hold a connection for ever.
MIN_BODY_RATE = 16 * 2**10  # bytes/s: a 4 MiB body may take READ_TIMEOUT + 256 s
OWNER = "k3.owner"  # the scope key of the request's owner (snapshots.owner_of)
STATE_GB = 16.0        # on disk: ~20 real-model conversations of a few thousand tokens
SNAPSHOT_GB = 2.0      # real model: ~3 kept states of ~0.63 GB (KDA state) + their latent cache


def error_response(code: int, message: str, kind: str | None = None, *, close: bool = False,
                   **extra: Any) -> JSONResponse:
    """`close`: end the connection after the answer (its body was not read, so the
    connection cannot carry another request)."""
    headers = {"Connection": "close"} if close else None
    return JSONResponse(error_body(code, message, kind, **extra), status_code=code, headers=headers)


# ---------------------------------------------------------------------------------------
# the service


class Service:
    def __init__(self, *, model_name: str, steer_demo: bool, reasoning_budget: int,
                 api_keys: list[str], info: dict[str, Any] | None = None,
                 max_body_mb: float = MAX_BODY_MB, read_timeout: float = READ_TIMEOUT,
                 ping_seconds: float = PING_SECONDS) -> None:
        self.model_name = model_name
        self.ping_seconds = ping_seconds
        self.max_body_mb = max_body_mb
        self.read_timeout = read_timeout
        self.steer_demo = steer_demo
        self.reasoning_budget = reasoning_budget
        self.api_keys = api_keys
        self.static_info = info or {}
        self.progress = LoadProgress()
        self.loaded: Loaded | None = None
        self.template: ChatTemplate | None = None
        self.metrics = Metrics()
        self.created = int(time.time())
        self.waiting = 0
        self._slot = asyncio.Lock()
        self._running: Job | None = None

    # -- loading ------------------------------------------------------------------------
    def set_loaded(self, loaded: Loaded) -> None:
        self.template = ChatTemplate(loaded.tok)
        self.loaded = loaded
        self.progress.phase = "ready"
        self.metrics.set("model_loaded", 1)
        self.metrics.set("load_seconds", time.monotonic() - self.progress.started)
        self.metrics.set("budget_gb", loaded.budget_gb or 0.0)

    def cancel_running(self) -> None:
        if self._running is not None:
            self._running.cancel.set()

    # -- ASGI app -----------------------------------------------------------------------
    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/models", self.models, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
            Route("/props", self.props, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/apply-template", self.apply_template, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/chat/completions", self.chat, methods=["POST"]),
        ]

        async def http_error(request: Request, exc: HTTPException) -> Response:
            msg = "File Not Found" if exc.status_code == 404 else str(exc.detail)
            return error_response(exc.status_code, msg)

        app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
        return self._guard(app)

    def _guard(self, app: Callable) -> Callable:
        """API key, loading and body checks in front of every route (pure ASGI: streams
        pass). The route gets the body already read, within its limits."""

        async def guarded(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            path = scope.get("path", "")
            refusal = None
            owner = self._owner(scope) if self.api_keys else ""
            scope[OWNER] = owner
            if owner is None and path not in PUBLIC_PATHS:
                refusal = BadRequest("Invalid API Key", 401)
            elif self.loaded is None and path not in LOADING_PATHS:
                refusal = BadRequest("Loading model", 503)
            else:
                try:
                    body = await self._read_body(scope, receive)
                except BadRequest as exc:
                    refusal = exc
            if refusal is not None:
                refuse = error_response(refusal.code, str(refusal), close=True)
                return await refuse(scope, receive, send)
            if body is None:
                return None  # the client went away while sending

            replayed = False

            async def replay():
                nonlocal replayed
                if replayed:
                    return await receive()  # from now on: only the disconnect
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            return await app(scope, replay, send)

        return guarded

    async def _read_body(self, scope: dict, receive: Callable) -> bytes | None:
        """The whole body, or BadRequest 413 once it passes the limit (by Content-Length
        before a byte is read, else while counting) and 408 when the client stalls or
        drips it in slower than MIN_BODY_RATE."""
        limit = int(self.max_body_mb * 2**20)
        too_large = BadRequest(
            f"the request body is larger than the server's limit of {self.max_body_mb:g} MiB; "
            "send a shorter conversation (or start the server with a larger --max-body-mb)",
            413,
        )
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and int(length) > limit:  # h11 has checked it is a number
            raise too_large
        chunks, size, more = [], 0, True
        start = time.monotonic()
        while more:
            # Each byte so far buys 1/MIN_BODY_RATE s beyond the first read_timeout seconds.
            left = start + self.read_timeout + size / MIN_BODY_RATE - time.monotonic()
            with anyio.move_on_after(max(0.0, min(self.read_timeout, left))) as waited:
                message = await receive()
            if waited.cancelled_caught:
                if left < self.read_timeout:
                    raise BadRequest(
                        f"the request body came too slowly ({size} bytes in "
                        f"{time.monotonic() - start:.0f} s); send it in one go", 408)
                raise BadRequest(
                    f"the request body stalled for {self.read_timeout:g} s; send it in one go", 408
                )
            if message["type"] == "http.disconnect":
                return None
            size += len(message.get("body", b""))
            if size > limit:
                raise too_large
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        return b"".join(chunks)

    def _owner(self, scope: dict) -> str | None:
        """Whose the request is: the digest of the API key it carries (snapshots.owner_of),
        None when it carries none of the server's keys."""
        headers = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])
        }
        given = headers.get("x-api-key") or ""
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        # every key compared, in constant time, so the time says nothing about which matched
        matched = [k for k in self.api_keys if hmac.compare_digest(given.encode(), k.encode())]
        return owner_of(matched[0]) if matched else None

    # -- routes -------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.progress.error:
            return error_response(500, self.progress.error)
        if self.loaded is None:
            body = error_body(503, "Loading model")
            body["progress"] = self.progress.as_dict()
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_route(self, request: Request) -> Response:
        self.metrics.set("requests_deferred", self.waiting)
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    def _owned_by(self) -> str:
        return DEMO_NOTICE if self.steer_demo else "k3-engine"

    async def models(self, request: Request) -> Response:
        loaded = self.loaded
        entry = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": self._owned_by(),
            "meta": {
                "n_vocab": loaded.tok.vocab_size,
                "n_ctx": loaded.n_ctx,
                **loaded.info.get("meta", {}),
            },
        }
        if self.steer_demo:
            entry["description"] = DEMO_NOTICE
        return JSONResponse({"object": "list", "data": [entry]})

    async def props(self, request: Request) -> Response:
        loaded = self.loaded
        body = {
            "model_alias": self.model_name,
            "model_path": loaded.info.get("checkpoint"),
            "owned_by": self._owned_by(),
            "demo": self.steer_demo,
            "description": DEMO_NOTICE
            if self.steer_demo
            else "Kimi-K3 on the bundled numpy engine",
            "total_slots": 1,
            "default_generation_settings": {
                "n_ctx": loaded.n_ctx,
                "params": {
                    "temperature": 0.6,
                    "top_p": 0.95,
                    "top_k": 0,
                    "reasoning_budget_tokens": self.reasoning_budget,
                },
            },
            "chat_template": "Kimi-K3 XTML (engine/text/chat_template.py)",
            "chat_template_caps": {"supports_thinking": True, "thinking_efforts": list(EFFORTS)},
            "bos_token": "[BOS]",
            "eos_token": "[EOS]",
            "end_token_ids": list(self.template.end_ids()),
            "build_info": FINGERPRINT,
            "memory_plan": loaded.info.get("memory_plan"),
            "prompt_reuse": {
                **(loaded.info.get("prompt_reuse") or {}),
                "replies_not_round_trip": int(
                    self.metrics.values["replies_not_round_trip_total"]),
            },
            "budget_gb": loaded.budget_gb,
            "load_seconds": self.metrics.values["load_seconds"],
            "is_sleeping": False,
        }
        return JSONResponse(body)

    async def _json(self, request: Request, then: Callable[[Any], Any] = lambda body: body) -> Any:
        """The body parsed (and passed through `then`) in a worker thread: a big body
        costs the event loop nothing."""
        raw = await request.body()
        return await run_in_threadpool(lambda: then(parse_json(raw)))

    def _prompt(self, body: Any) -> tuple[ChatRequest, Rendered]:
        """The request and its prompt, rendered from the request alone (worker thread:
        tokenising takes seconds for a megabyte)."""
        req = parse_chat_request(body, self.reasoning_budget)
        try:
            return req, self.template.render_full(req.messages, thinking=req.thinking,
                                                  effort=req.effort)
        except TemplateError as exc:
            raise BadRequest(str(exc)) from exc

    async def tokenize(self, request: Request) -> Response:
        """llama-server's /tokenize: {"content"} -> {"tokens"} (specials stay text)."""

        def encode(body: Any) -> list[int]:
            if not isinstance(body, dict) or not isinstance(body.get("content"), str):
                raise BadRequest("'content' must be a string")
            return self.loaded.tok.encode(body["content"])

        try:
            return JSONResponse({"tokens": await self._json(request, encode)})
        except BadRequest as exc:
            return error_response(exc.code, str(exc))

    async def detokenize(self, request: Request) -> Response:
        def decode(body: Any) -> str:
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens
            ):
                raise BadRequest("'tokens' must be an array of integers")
            return self.loaded.tok.decode(tokens)

        try:
            return JSONResponse({"content": await self._json(request, decode)})
        except BadRequest as exc:
            return error_response(exc.code, str(exc))

    async def apply_template(self, request: Request) -> Response:
        """The XTML prompt a chat request would be given, as text (llama-server's route)."""

        def as_text(body: Any) -> dict[str, Any]:
            ids = self._prompt(body)[1].ids
            return {"prompt": self.loaded.tok.decode(ids), "n_tokens": len(ids)}

        try:
            return JSONResponse(await self._json(request, as_text))
        except BadRequest as exc:
            return error_response(exc.code, str(exc))

    async def chat(self, request: Request) -> Response:
        loaded, template = self.loaded, self.template
        owner = request.scope[OWNER]
        try:
            req, rendered = await self._json(request, self._prompt)
            prompt = rendered.ids
            if len(prompt) >= loaded.n_ctx:
                raise BadRequest(
                    f"request ({len(prompt)} tokens) exceeds the available context size "
                    f"({loaded.n_ctx} tokens), try increasing it",
                    kind="exceed_context_size_error",
                    n_prompt_tokens=len(prompt),
                    n_ctx=loaded.n_ctx,
                )
        except BadRequest as exc:
            return error_response(exc.code, str(exc), exc.kind, **exc.extra)
        room = loaded.n_ctx - len(prompt)
        job = Job(req, prompt, max_new=min(req.max_tokens or room, room), owner=owner,
                  reply_ends=rendered.reply_ends, partial=rendered.partial)

        if self.waiting >= MAX_WAITING:
            return error_response(
                503,
                f"the engine is busy and {self.waiting} requests are already waiting; retry later",
            )
        self.waiting += 1
        try:
            got = await self._acquire(request)
        finally:
            self.waiting -= 1
        if not got:
            return Response(status_code=499)  # the client left while waiting: nobody reads this
        self.metrics.add("requests_total")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                job.cancel.set()

        def work() -> None:
            try:
                run_job(job, loaded, template, self.metrics, self.steer_demo, emit)
            finally:
                self._running = None
                try:
                    loop.call_soon_threadsafe(self._slot.release)
                except RuntimeError:
                    pass

        self._running = job
        threading.Thread(target=work, name="k3-generate", daemon=True).start()
        answer = Answer(
            ChunkIds(self.model_name),
            req,
            job.timings,
            job.usage,
            lambda last: self._final_k3(job, last),
        )
        if req.stream:
            return EventStream(self._sse(answer, queue), job.cancel, self.ping_seconds)
        return await self._collect(job, answer, queue, request)

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

    # -- responses ----------------------------------------------------------------------
    def _final_k3(self, job: Job, last: TokenStats | None) -> dict[str, Any]:
        return replace(
            last or k3_record(None, self.loaded.budget_gb),
            reasoning_tokens=job.reasoning_tokens,
            gb_read_prefill=job.gb_read_prefill,
            note=job.empty_answer_note(),
            demo=DEMO_NOTICE if self.steer_demo else None,
        ).k3()

    async def _sse(self, answer: Answer, queue: asyncio.Queue) -> AsyncIterator[str]:
        first = k3_record(None, self.loaded.budget_gb).k3()
        yield answer.ids.sse({"role": "assistant", "content": None}, k3=answer.k3(first))
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), timeout=self.ping_seconds)
            except TimeoutError:
                yield ":\n\n"  # keep-alive comment while a long prefill runs
                continue
            # Whatever else is already waiting goes out in the same write: under load the
            # loop keeps up with the generator instead of costing it one wake-up per token.
            out = event.sse(answer)
            while not event.ends and not queue.empty():
                event = queue.get_nowait()
                out += event.sse(answer)
            if out:
                yield out
            if event.ends:
                return

    async def _collect(
        self, job: Job, answer: Answer, queue: asyncio.Queue, request: Request
    ) -> Response:
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

    def __init__(self, chunks: AsyncIterator[str], cancel: threading.Event,
                 ping_seconds: float) -> None:
        super().__init__(
            chunks,
            status_code=200,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                     PING_HEADER: f"{ping_seconds:g}"},
        )
        self.chunks, self.cancel = chunks, cancel

    async def __call__(self, scope, receive, send) -> None:
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


# ---------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint folder (config.json + safetensors shards)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="folder with tiktoken.model + tokenizer_config.json (default: the checkpoint)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8080, help="port (0 = any free port; default 8080)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("K3_API_KEY"),
        metavar="KEY",
        help="require this key (comma-separated for several; default $K3_API_KEY, "
        "which keeps it out of `ps`); needed off loopback",
    )
    parser.add_argument("--model-name", default=None, metavar="NAME", help="model id in responses")
    parser.add_argument(
        "--ctx-size",
        type=int,
        default=DEFAULT_CTX,
        metavar="N",
        help=f"context tokens per conversation (default {DEFAULT_CTX})",
    )
    parser.add_argument(
        "--reasoning-budget",
        type=int,
        default=-1,
        metavar="N",
        help="default max tokens of thinking before the answer is forced (-1 = no limit)",
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=MAX_BODY_MB,
        metavar="MB",
        help=f"largest request body in MiB; bigger ones get 413 (default {MAX_BODY_MB:g})",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=READ_TIMEOUT,
        metavar="S",
        help="seconds a client may take to send a request's headers, or stall in "
        f"its body, before the connection is closed (default {READ_TIMEOUT:g}); after "
        f"them a body must average {MIN_BODY_RATE // 1024} KiB/s",
    )
    parser.add_argument(
        "--steer-demo",
        action="store_true",
        help="demo for random-weight models: readable words in a scripted think/answer shape",
    )
    parser.add_argument(
        "--snapshot-gb",
        type=float,
        default=SNAPSHOT_GB,
        metavar="X",
        help="GB of conversation states kept between turns, so a follow-up prefills only "
        f"what is new (0 = off; default {SNAPSHOT_GB:g}; the memory plan counts it)",
    )
    parser.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="folder where conversation states are also kept on disk, so a restarted server "
        "resumes them (0700, files 0600; default: none, states end with the process)",
    )
    parser.add_argument(
        "--state-gb",
        type=float,
        default=STATE_GB,
        metavar="X",
        help=f"GB the state folder may hold, least recently used out (default {STATE_GB:g})",
    )
    parser.add_argument("--debug-load-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--debug-token-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    # tests: mid-answer checkpoints every N tokens, and a generation that stops after N tokens
    # (as if the server were killed there)
    parser.add_argument("--debug-checkpoint-every", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--debug-hang-after", type=int, default=0, help=argparse.SUPPRESS)
    # tests: pings often enough that a client's stall window is short
    parser.add_argument("--debug-ping-seconds", type=float, default=PING_SECONDS,
                        help=argparse.SUPPRESS)
    from engine.weights.planner import add_memory_arguments

    add_memory_arguments(parser)


def h11_with_head_deadline(seconds: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose next request head has not fully
    arrived `seconds` after it opened or after its last answer. uvicorn itself only times
    out a keep-alive connection that sends nothing at all after a response: a client that
    connects and never sends, or sends half a request line, would hold a socket forever."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _expire(self) -> None:
            # IDLE: no complete request head since the timer was armed (a request being
            # answered is past IDLE; a stalled body is the route's 408)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadline


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _fail(message: str, code: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def main(args: argparse.Namespace) -> int:
    api_keys = [k.strip() for k in (args.api_key or "").split(",") if k.strip()]
    if not is_loopback(args.host) and not api_keys:
        return _fail(
            f"refusing to bind {args.host} without --api-key: anyone who can reach it could use "
            "the model; pass --api-key KEY, or bind 127.0.0.1 and tunnel (ssh -L)",
            2,
        )
    checkpoint = Path(args.checkpoint).expanduser()
    if not (checkpoint / "config.json").is_file():
        return _fail(
            f"{checkpoint} has no config.json; pass the checkpoint folder "
            "(with the safetensors shards)"
        )
    tok_dir = Path(args.tokenizer).expanduser() if args.tokenizer else checkpoint
    if not (tok_dir / "tiktoken.model").is_file():
        return _fail(
            f"{tok_dir} has no tiktoken.model; pass --tokenizer DIR with tiktoken.model and "
            "tokenizer_config.json (for a synthesised model: python -m engine synth writes them)"
        )
    if args.ctx_size < 16:
        return _fail("--ctx-size must be at least 16 tokens", 2)
    if not (0 < args.max_body_mb < 2**20 and 0 < args.read_timeout < 86400):
        return _fail("--max-body-mb and --read-timeout must be positive numbers", 2)
    if not 0 < args.debug_ping_seconds <= 3600:
        return _fail("--debug-ping-seconds must be from 0 to 3600 seconds", 2)
    try:
        sock = socket.create_server(
            (args.host.strip("[]"), args.port),
            family=socket.AF_INET6 if ":" in args.host else socket.AF_INET,
        )
    except OSError as exc:
        return _fail(
            f"cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); "
            "pick another --port or stop the program using it"
        )
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host

    name = args.model_name or (DEMO_NOTICE if args.steer_demo else checkpoint.resolve().name)
    service = Service(
        model_name=name,
        steer_demo=args.steer_demo,
        reasoning_budget=args.reasoning_budget,
        api_keys=api_keys,
        max_body_mb=args.max_body_mb,
        read_timeout=args.read_timeout,
        ping_seconds=args.debug_ping_seconds,
    )

    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            print(f"listening on http://{url_host}:{port}", flush=True)

        async def shutdown(self, sockets=None) -> None:
            service.cancel_running()  # end a running stream now, not after the grace period
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(
        service.app(),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
        timeout_keep_alive=5,
        http=h11_with_head_deadline(args.read_timeout),
    )
    server = Server(config)
    failed: list[str] = []

    def load() -> None:
        try:
            if args.debug_load_delay:
                service.progress.phase = "debug-delay"
                time.sleep(args.debug_load_delay)
            settings = LoadSettings.from_args(args)
            loaded = load_engine(checkpoint, tok_dir, settings, service.progress, args.ctx_size)
            service.set_loaded(loaded)
            print(
                f"model ready in {service.metrics.values['load_seconds']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        except Exception as exc:  # noqa: BLE001 - any load failure ends the server with one sentence
            if not isinstance(exc, EngineError):
                traceback.print_exc(file=sys.stderr)
            failed.append(
                str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
            )
            service.progress.error = failed[-1]
            server.should_exit = True

    threading.Thread(target=load, name="k3-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        service.cancel_running()
    if failed:
        return _fail(f"the model failed to load: {failed[-1]}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(argparse.ArgumentParser().parse_args()))
