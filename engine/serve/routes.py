"""The engine's HTTP routes: what llama-server speaks (see the README's server section),
answered from the loaded model. The wire format is protocol.py, the generation worker.py,
what a request must pass first limits.py, one generation at a time scheduler.py, and the
command line engine/commands/serve.py.

SSE chunks carry `reasoning_content` / `content` deltas, a finish chunk, an optional usage
chunk, `timings` on the last chunk, `data: [DONE]`; errors are `{"error": {"code",
"message", "type"}}`. Each chunk also carries a `k3` object with the engine's per-token
statistics.

The socket is bound first, then the model loads in a background thread; until it is ready
every route but /health and /metrics answers 503 (/health with load progress). A silent
stream (a long prefill) gets an SSE comment every PING_SECONDS. JSON with NaN, Infinity or
more than MAX_JSON_DEPTH levels gets 400; parsing and tokenising run in a worker thread, so
/health answers while a big prompt is read or a generation runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from engine.decode.steer import DEMO_NOTICE
from engine.serve.limits import MAX_BODY_MB, OWNER, READ_TIMEOUT, Guard, error_response
from engine.serve.protocol import (
    FINGERPRINT,
    Answer,
    BadRequest,
    ChatRequest,
    ChunkIds,
    error_body,
    parse_chat_request,
    parse_json,
)
from engine.serve.scheduler import EventStream, Scheduler, collect
from engine.serve.worker import Job, Loaded, LoadProgress, Metrics, k3_record, run_job
from engine.text.chat_template import ChatTemplate, Rendered, TemplateError
from k3vocab import EFFORTS

PING_SECONDS = 15.0    # a silent stream gets an SSE comment this often (a long prefill)


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
        self.scheduler = Scheduler()

    # -- loading ------------------------------------------------------------------------
    def set_loaded(self, loaded: Loaded) -> None:
        self.template = ChatTemplate(loaded.tok)
        self.loaded = loaded
        self.progress.phase = "ready"
        self.metrics.set("model_loaded", 1)
        self.metrics.set("load_seconds", time.monotonic() - self.progress.started)
        self.metrics.set("budget_gb", loaded.budget_gb or 0.0)

    def ready(self) -> tuple[Loaded, ChatTemplate]:
        """The loaded model and its template. Guard answers 503 until set_loaded, so every
        route but /health and /metrics runs after it: None here is a bug, not a state."""
        if self.loaded is None or self.template is None:
            raise RuntimeError("a model route ran before the model loaded")
        return self.loaded, self.template

    def cancel_running(self) -> None:
        self.scheduler.cancel_running()

    # -- ASGI app -----------------------------------------------------------------------
    def app(self) -> Guard:
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

        # starlette types a handler as taking any Exception: its mapping cannot tie the key's
        # class to the handler's argument, though it only calls this one with HTTPException.
        app = Starlette(routes=routes,
                        exception_handlers={HTTPException: http_error})  # type: ignore[dict-item]
        return Guard(app, api_keys=self.api_keys, ready=lambda: self.loaded is not None,
                     max_body_mb=self.max_body_mb, read_timeout=self.read_timeout)

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
        self.metrics.set("requests_deferred", self.scheduler.waiting)
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    def _owned_by(self) -> str:
        return DEMO_NOTICE if self.steer_demo else "k3-engine"

    async def models(self, request: Request) -> Response:
        loaded = self.ready()[0]
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
        loaded, template = self.ready()
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
            "end_token_ids": list(template.end_ids()),
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
            return req, self.ready()[1].render_full(req.messages, thinking=req.thinking,
                                                     effort=req.effort)
        except TemplateError as exc:
            raise BadRequest(str(exc)) from exc

    async def tokenize(self, request: Request) -> Response:
        """llama-server's /tokenize: {"content"} -> {"tokens"} (specials stay text)."""

        def encode(body: Any) -> list[int]:
            if not isinstance(body, dict) or not isinstance(body.get("content"), str):
                raise BadRequest("'content' must be a string")
            return self.ready()[0].tok.encode(body["content"])

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
            return self.ready()[0].tok.decode(tokens)

        try:
            return JSONResponse({"content": await self._json(request, decode)})
        except BadRequest as exc:
            return error_response(exc.code, str(exc))

    async def apply_template(self, request: Request) -> Response:
        """The XTML prompt a chat request would be given, as text (llama-server's route)."""

        def as_text(body: Any) -> dict[str, Any]:
            ids = self._prompt(body)[1].ids
            return {"prompt": self.ready()[0].tok.decode(ids), "n_tokens": len(ids)}

        try:
            return JSONResponse(await self._json(request, as_text))
        except BadRequest as exc:
            return error_response(exc.code, str(exc))

    async def chat(self, request: Request) -> Response:
        loaded, template = self.ready()
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
            room = loaded.n_ctx - len(prompt)
            job = Job(req, prompt, max_new=min(req.max_tokens or room, room), owner=owner,
                      reply_ends=rendered.reply_ends, partial=rendered.partial)
            queue = await self.scheduler.start(job, request, lambda emit: run_job(
                job, loaded, template, self.metrics, self.steer_demo, emit))
        except BadRequest as exc:
            return error_response(exc.code, str(exc), exc.kind, **exc.extra)
        if queue is None:
            return Response(status_code=499)  # the client left while waiting: nobody reads this
        self.metrics.add("requests_total")
        answer = Answer(
            ChunkIds(self.model_name),
            req,
            job.timings,
            job.usage,
            k3_record(None, loaded.budget_gb),
            lambda last: job.final_record(last, loaded.budget_gb, self.steer_demo),
        )
        if req.stream:
            return EventStream(self._sse(answer, queue), job.cancel, self.ping_seconds)
        return await collect(job, answer, queue, request)

    # -- responses ----------------------------------------------------------------------
    async def _sse(self, answer: Answer, queue: asyncio.Queue) -> AsyncGenerator[str, None]:
        yield answer.opening()
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
