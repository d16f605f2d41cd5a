"""`python -m engine serve CHECKPOINT`: an OpenAI-compatible HTTP server for the engine.

It speaks what llama-server speaks (see the README's server section): SSE chunks with
`reasoning_content` / `content` deltas, a finish chunk, an optional usage chunk, `timings`
on the last chunk, `data: [DONE]`; errors as `{"error": {"code", "message", "type"}}`.
Each chunk also carries a `k3` object with the engine's per-token statistics.

Design:
* The socket is bound first, then the model loads in a background thread; until it is
  ready every route but /health and /metrics answers 503 (/health with load progress).
* One generation at a time, in a worker thread (the event loop only moves bytes). A
  second request waits its turn (FIFO, `k3_requests_deferred`); more than
  `MAX_WAITING` waiting requests get 503. Closing the connection sets a cancel event that
  the generator checks between tokens and layers, so generation stops within one token.
* Binding anything but loopback requires `--api-key`.
* Hostile input is refused before it costs anything: a body over `--max-body-mb` gets 413
  (from Content-Length, or as soon as a chunked body passes it), a client that stalls
  sending its request head or body is closed after `--read-timeout`, JSON with NaN,
  Infinity or more than MAX_JSON_DEPTH levels gets 400; parsing and tokenising run in a
  worker thread, so /health answers while a big prompt is read or a generation runs.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import math
import os
import secrets
import socket
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import psutil
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.text.chat_template import EFFORTS, ChatTemplate, TemplateError
from engine.errors import EngineError
from engine.decode.steer import DEMO_NOTICE, NEG, DemoSteer, Forced, think_to_response
from engine.decode.stats import TokenStats
from engine.text.tokenizer import Tokenizer

MAX_WAITING = 8
FINGERPRINT = "k3-engine-0.1.0"
DEFAULT_CTX = 8192
PING_SECONDS = 15.0
PUBLIC_PATHS = ("/health", "/v1/health")
LOADING_PATHS = PUBLIC_PATHS + ("/metrics",)
MAX_BODY_MB = 4.0      # a long conversation is well under 1 MB of JSON
READ_TIMEOUT = 10.0    # seconds a client may take for its request head, or stall in its body
MAX_JSON_DEPTH = 64    # a chat request nests 4 levels deep
MAX_INT = 2**31 - 1    # bound of the integer sampling fields
MIN_TEMPERATURE = 1e-6  # below it sampling is greedy in all but overflow


# ---------------------------------------------------------------------------------------
# errors in llama-server's shape

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


def error_body(code: int, message: str, kind: str | None = None, **extra: Any) -> dict:
    return {"error": {"code": code, "message": message, "type": kind or ERROR_TYPES.get(code, "server_error"), **extra}}


def error_response(code: int, message: str, kind: str | None = None, *, close: bool = False,
                   **extra: Any) -> JSONResponse:
    """`close`: end the connection after the answer (its body was not read, so the
    connection cannot carry another request)."""
    headers = {"Connection": "close"} if close else None
    return JSONResponse(error_body(code, message, kind, **extra), status_code=code, headers=headers)


class BadRequest(Exception):
    def __init__(self, message: str, code: int = 400, kind: str | None = None, **extra: Any):
        super().__init__(message)
        self.code, self.kind, self.extra = code, kind, extra


# ---------------------------------------------------------------------------------------
# what a loaded model offers the server


@dataclass
class Loaded:
    """The model side: `generate(prompt_ids, params, cancel, logits_hook)` yields
    engine.generate.GenToken-like objects (`id, seconds, index, prefill_seconds, stats`)."""

    tok: Tokenizer
    generate: Callable[..., Iterator[Any]]
    make_params: Callable[..., Any]
    n_ctx: int
    info: dict[str, Any] = field(default_factory=dict)  # for /props and /v1/models
    budget_gb: float | None = None
    source: Any = None


def _read_chars() -> int | None:
    try:
        return psutil.Process().io_counters().read_chars
    except (AttributeError, psutil.Error):
        return None


@dataclass
class LoadProgress:
    """What /health reports while the model loads. `bytes_read` counts what this process
    read since the load began (weights, via read syscalls); `checkpoint_bytes` is the size
    of the shards, so a client can show a fraction for a resident load."""

    phase: str = "starting"
    started: float = field(default_factory=time.monotonic)
    error: str | None = None
    layers_bound: int | None = None
    n_layers: int | None = None
    checkpoint_bytes: int | None = None
    _read0: int | None = field(default_factory=_read_chars)

    def as_dict(self) -> dict[str, Any]:
        read = _read_chars()
        return {
            "phase": self.phase,
            "elapsed_s": round(time.monotonic() - self.started, 3),
            "bytes_read": read - self._read0 if read is not None and self._read0 is not None else None,
            "checkpoint_bytes": self.checkpoint_bytes,
            "layers_bound": self.layers_bound,
            "n_layers": self.n_layers,
            "rss_gb": round(psutil.Process().memory_info().rss / 1e9, 3),
        }


class Metrics:
    COUNTERS = {
        "requests_total": "chat completion requests accepted",
        "requests_cancelled_total": "generations stopped because the client went away",
        "requests_failed_total": "generations that ended with an error",
        "prompt_tokens_total": "prompt tokens processed",
        "prompt_seconds_total": "seconds spent in prefill",
        "tokens_predicted_total": "tokens generated (reasoning included)",
        "tokens_predicted_seconds_total": "seconds spent generating tokens",
        "gb_read_total": "GB read from storage by generation",
    }
    GAUGES = {
        "requests_processing": "generations running now (0 or 1)",
        "requests_deferred": "requests waiting for the generation slot",
        "model_loaded": "1 once the model is ready",
        "load_seconds": "seconds the model took to load",
        "rss_gb": "resident memory of the server process in GB",
        "budget_gb": "memory budget of the plan in GB (0 = resident, no budget)",
        "last_s_per_token": "seconds of the last generated token",
        "last_true_hit_rate": "expert cache true hit rate of the last token",
    }

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, float] = {k: 0.0 for k in (*self.COUNTERS, *self.GAUGES)}

    def add(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self.values[name] += value

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self.values[name] = float(value)

    def render(self) -> str:
        self.set("rss_gb", psutil.Process().memory_info().rss / 1e9)
        lines = []
        with self._lock:
            for kind, table in (("counter", self.COUNTERS), ("gauge", self.GAUGES)):
                for name, help_text in table.items():
                    lines += [f"# HELP k3_{name} {help_text}", f"# TYPE k3_{name} {kind}",
                              f"k3_{name} {self.values[name]:.10g}"]
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# request parsing


def _refuse_constant(name: str) -> Any:
    raise BadRequest(f"the request body has {name}, which is not a JSON number; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"the number {text[:40]} is out of range; send a finite number")
    return value


def parse_json(raw: bytes) -> Any:
    """Strict JSON: no NaN / Infinity (nor 1e400, which would read as infinity), at most
    MAX_JSON_DEPTH levels of nesting. Raises BadRequest."""
    too_deep = BadRequest(f"the request body nests more than {MAX_JSON_DEPTH} levels deep")
    try:
        value = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:  # deeper than Python's own limit
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc})") from None
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise too_deep
        stack += [(child, depth + 1) for child in item]
    return value


@dataclass
class ChatRequest:
    messages: list
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: list[str]
    stream: bool
    include_usage: bool
    timings_per_token: bool
    thinking: bool
    effort: str
    reasoning_budget: int  # -1 = unlimited
    ignore_eos: bool = False


def _number(body: dict, key: str, kind: type, default: Any, lo: float, hi: float) -> Any:
    """body[key] as `kind` within [lo, hi] (bounds checked before any conversion, so a
    huge integer cannot overflow float()), or `default` when absent or null."""
    value = body.get(key)
    if value is None:
        return default
    what = "an integer" if kind is int else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and isinstance(value, float) and not value.is_integer()):
        raise BadRequest(f"'{key}' must be {what}, not {json.dumps(value)[:40]}")
    if not lo <= value <= hi:
        raise BadRequest(f"'{key}' must be {what} from {lo:g} to {hi:g}")
    return kind(value)


def parse_chat_request(body: Any, default_budget: int) -> ChatRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array of {role, content} objects")
    max_tokens = None
    for key in ("n_predict", "max_completion_tokens", "max_tokens"):  # llama-server: n_predict wins
        if body.get(key) is not None:
            max_tokens = _number(body, key, int, None, lo=-1, hi=MAX_INT)
            if max_tokens == 0:
                raise BadRequest(f"'{key}' must be at least 1 (or -1 for no limit)")
            max_tokens = None if max_tokens == -1 else max_tokens
            break
    if body.get("n") not in (None, 1):
        raise BadRequest("'n' must be 1: the engine generates one choice per request")
    if body.get("tools"):
        raise BadRequest("tool calling is not supported by the bundled engine; send no 'tools'")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or an array of strings")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object")

    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object")
    thinking, effort = True, "max"
    for key in ("enable_thinking", "thinking"):
        if key in kwargs:
            thinking = bool(kwargs[key])
    if "thinking_effort" in kwargs:
        effort = str(kwargs["thinking_effort"])
    re_effort = body.get("reasoning_effort")
    if re_effort is not None:
        if re_effort == "none":
            thinking = False
        else:
            effort = str(re_effort)
    if thinking and effort not in EFFORTS:
        raise BadRequest(
            f"reasoning effort '{effort}' is not supported by Kimi-K3; use low, high or max "
            "(or reasoning_effort 'none' to turn thinking off)"
        )
    budget = default_budget
    for key in ("reasoning_budget_tokens", "thinking_budget_tokens", "reasoning_budget"):
        if body.get(key) is not None:
            budget = _number(body, key, int, default_budget, lo=-1, hi=MAX_INT)
            break
    seed = body.get("seed")
    seed = secrets.randbits(31) if seed is None or seed == -1 else _number(body, "seed", int, 0, lo=0, hi=2**63 - 1)
    top_p = _number(body, "top_p", float, 0.95, lo=0.0, hi=1.0)
    if top_p == 0:  # the sampler keeps the smallest set of tokens reaching top_p: none
        raise BadRequest("'top_p' must be above 0 and at most 1")
    temperature = _number(body, "temperature", float, 0.6, lo=0.0, hi=100.0)
    if 0 < temperature < MIN_TEMPERATURE:  # logits / temperature would overflow to inf
        raise BadRequest(f"'temperature' must be 0 (greedy) or from {MIN_TEMPERATURE:g} to 100")
    return ChatRequest(
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=_number(body, "top_k", int, 0, lo=0, hi=MAX_INT),
        seed=seed,
        stop=[s for s in stop if s],
        stream=bool(body.get("stream", False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        timings_per_token=bool(body.get("timings_per_token", False)),
        thinking=thinking,
        effort=effort,
        reasoning_budget=budget,
        ignore_eos=bool(body.get("ignore_eos", False)),
    )


class StopScanner:
    """Holds back text that could be the start of a stop string; reports a match."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.buf += text
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[: min(hits)], ""
            return out, True
        cut = max(0, len(self.buf) - self.hold)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


# ---------------------------------------------------------------------------------------
# one generation, in a worker thread


@dataclass
class Job:
    req: ChatRequest
    prompt_ids: list[int]
    max_new: int
    cancel: threading.Event = field(default_factory=threading.Event)
    # filled by the worker
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    prompt_s: float = 0.0
    predicted_s: float = 0.0
    content_chars: int = 0
    finish: str | None = None


def k3_record(tok_event: Any, budget_gb: float | None) -> TokenStats:
    """A token's statistics with what the server knows added: the RSS (measured here when
    the generator does not report it) and the plan's budget. None: before the first token."""
    stats = tok_event.stats if tok_event is not None else TokenStats()
    rss = stats.rss_gb if stats.rss_gb is not None else psutil.Process().memory_info().rss / 1e9
    budget = stats.budget_gb if stats.budget_gb is not None else budget_gb
    return replace(stats, rss_gb=rss, budget_gb=budget)


def run_job(job: Job, loaded: Loaded, template: ChatTemplate, metrics: Metrics, steer_demo: bool,
            emit: Callable[[tuple], None]) -> None:
    """Generate for `job`, emitting ("token", k3, reasoning, content) items, then
    ("end", finish_reason) or ("error", message). Runs in a worker thread."""
    req, tok = job.req, loaded.tok
    parser = template.parser(thinking=req.thinking)
    forced = Forced()
    steer = DemoSteer(tok, parser, forced, seed=req.seed) if steer_demo else None
    budget = req.reasoning_budget
    end_ids = list(template.end_ids())

    def hook(generated, logits):
        f = forced.take(logits)
        if f is not None:
            return f
        if req.ignore_eos:  # llama-server's knob: keep generating to max_tokens
            logits = logits.copy()
            logits[end_ids] = NEG
        if budget >= 0 and parser.in_reasoning and not parser.in_tag and parser.reasoning_tokens >= budget:
            forced.push(think_to_response(tok))
            return forced.take(logits)
        return steer(generated, logits) if steer else logits

    scanners = {"reasoning": StopScanner(req.stop), "content": StopScanner(req.stop)}
    finish = "length"
    metrics.set("requests_processing", 1)
    gen = None
    try:
        params = loaded.make_params(
            max_tokens=job.max_new, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
            seed=req.seed, stop_ids=tuple(end_ids),
        )
        gen = loaded.generate(job.prompt_ids, params, cancel=job.cancel, logits_hook=hook)
        for t in gen:
            if job.cancel.is_set():
                break
            if t.prefill_seconds is not None and job.completion_tokens == 0:
                job.prompt_s = float(t.prefill_seconds)
                metrics.add("prompt_tokens_total", len(job.prompt_ids))
                metrics.add("prompt_seconds_total", job.prompt_s)
            job.completion_tokens += 1
            # the first token's `seconds` includes the prefill, which timings count apart
            seconds = max(0.0, float(t.seconds) - float(t.prefill_seconds or 0.0))
            job.predicted_s += seconds
            metrics.add("tokens_predicted_total")
            metrics.add("tokens_predicted_seconds_total", seconds)
            k3 = k3_record(t, loaded.budget_gb)
            if k3.gb_read:
                metrics.add("gb_read_total", k3.gb_read)
            metrics.set("last_s_per_token", float(t.seconds))
            if k3.true_hit_rate is not None:
                metrics.set("last_true_hit_rate", k3.true_hit_rate)
            was_reasoning = parser.in_reasoning
            delta = parser.feed(int(t.id))
            if was_reasoning:
                job.reasoning_tokens += 1
            reasoning, hit_r = scanners["reasoning"].push(delta.reasoning)
            content, hit_c = scanners["content"].push(delta.content)
            job.content_chars += len(content)
            emit(("token", k3, reasoning, content))
            if parser.done:
                finish = "stop"
                break
            if hit_r or hit_c:
                finish = "stop"
                break
            if job.completion_tokens >= job.max_new:
                break
        if job.cancel.is_set():
            finish = "cancelled"
        else:
            tail = parser.finish()
            reasoning = scanners["reasoning"].push(tail.reasoning)[0] + scanners["reasoning"].flush()
            content = scanners["content"].push(tail.content)[0] + scanners["content"].flush()
            if reasoning or content:
                job.content_chars += len(content)
                emit(("token", None, reasoning, content))
        job.finish = finish
        if finish == "cancelled":
            metrics.add("requests_cancelled_total")
            emit(("cancelled",))
        else:
            emit(("end", finish))
    except Exception as exc:  # noqa: BLE001 - reported to the client as an error chunk
        if job.cancel.is_set():
            job.finish = "cancelled"
            metrics.add("requests_cancelled_total")
            emit(("cancelled",))
        else:
            metrics.add("requests_failed_total")
            if isinstance(exc, EngineError):
                message = str(exc)
            else:
                traceback.print_exc(file=sys.stderr)
                message = f"generation failed: {type(exc).__name__}: {exc}"
            emit(("error", message))
    finally:
        if gen is not None and hasattr(gen, "close"):
            try:
                gen.close()
            except Exception:  # noqa: BLE001 - closing a failed generator
                pass
        metrics.set("requests_processing", 0)


def empty_answer_note(job: Job) -> str | None:
    """Why the content is empty when the token limit ran out inside the reasoning."""
    if job.finish == "length" and job.content_chars == 0:
        if job.reasoning_tokens:
            return (
                f"max_tokens ({job.max_new}) ran out while the model was still reasoning "
                f"({job.reasoning_tokens} reasoning tokens), so the answer is empty: raise "
                "max_tokens, or set reasoning_budget_tokens below max_tokens so thinking stops "
                "in time to answer"
            )
        return f"max_tokens ({job.max_new}) ran out before any answer text was produced"
    return None


# ---------------------------------------------------------------------------------------
# the service


class Service:
    def __init__(self, *, model_name: str, steer_demo: bool, reasoning_budget: int,
                 api_keys: list[str], info: dict[str, Any] | None = None,
                 max_body_mb: float = MAX_BODY_MB, read_timeout: float = READ_TIMEOUT) -> None:
        self.model_name = model_name
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
            if self.api_keys and path not in PUBLIC_PATHS and not self._authorised(scope):
                refusal = BadRequest("Invalid API Key", 401)
            elif self.loaded is None and path not in LOADING_PATHS:
                refusal = BadRequest("Loading model", 503)
            else:
                try:
                    body = await self._read_body(scope, receive)
                except BadRequest as exc:
                    refusal = exc
            if refusal is not None:
                return await error_response(refusal.code, str(refusal), close=True)(scope, receive, send)
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
        before a byte is read, else while counting) and 408 when the client stalls."""
        limit = int(self.max_body_mb * 2**20)
        too_large = BadRequest(
            f"the request body is larger than the server's limit of {self.max_body_mb:g} MiB; "
            "send a shorter conversation (or start the server with a larger --max-body-mb)", 413)
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and int(length) > limit:  # h11 has checked it is a number
            raise too_large
        chunks, size, more = [], 0, True
        while more:
            with anyio.move_on_after(self.read_timeout) as waited:
                message = await receive()
            if waited.cancelled_caught:
                raise BadRequest(f"the request body stalled for {self.read_timeout:g} s; "
                                 "send it in one go", 408)
            if message["type"] == "http.disconnect":
                return None
            size += len(message.get("body", b""))
            if size > limit:
                raise too_large
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        return b"".join(chunks)

    def _authorised(self, scope: dict) -> bool:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-api-key") or ""
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return any(hmac.compare_digest(given.encode(), k.encode()) for k in self.api_keys)

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
            "meta": {"n_vocab": loaded.tok.vocab_size, "n_ctx": loaded.n_ctx, **loaded.info.get("meta", {})},
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
            "description": DEMO_NOTICE if self.steer_demo else "Kimi-K3 on the bundled numpy engine",
            "total_slots": 1,
            "default_generation_settings": {
                "n_ctx": loaded.n_ctx,
                "params": {"temperature": 0.6, "top_p": 0.95, "top_k": 0,
                           "reasoning_budget_tokens": self.reasoning_budget},
            },
            "chat_template": "Kimi-K3 XTML (engine/text/chat_template.py)",
            "chat_template_caps": {"supports_thinking": True, "thinking_efforts": list(EFFORTS)},
            "bos_token": "[BOS]",
            "eos_token": "[EOS]",
            "end_token_ids": list(self.template.end_ids()),
            "build_info": FINGERPRINT,
            "memory_plan": loaded.info.get("memory_plan"),
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

    def _prompt(self, body: Any) -> tuple[ChatRequest, list[int]]:
        """The request and its prompt ids (worker thread: tokenising takes seconds for a
        megabyte)."""
        req = parse_chat_request(body, self.reasoning_budget)
        try:
            return req, self.template.render(req.messages, thinking=req.thinking, effort=req.effort)
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
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise BadRequest("'tokens' must be an array of integers")
            return self.loaded.tok.decode(tokens)

        try:
            return JSONResponse({"content": await self._json(request, decode)})
        except BadRequest as exc:
            return error_response(exc.code, str(exc))

    async def apply_template(self, request: Request) -> Response:
        """The XTML prompt a chat request would be given, as text (llama-server's route)."""

        def as_text(body: Any) -> dict[str, Any]:
            ids = self._prompt(body)[1]
            return {"prompt": self.loaded.tok.decode(ids), "n_tokens": len(ids)}

        try:
            return JSONResponse(await self._json(request, as_text))
        except BadRequest as exc:
            return error_response(exc.code, str(exc))

    async def chat(self, request: Request) -> Response:
        loaded, template = self.loaded, self.template
        try:
            req, prompt = await self._json(request, self._prompt)
            if len(prompt) >= loaded.n_ctx:
                raise BadRequest(
                    f"request ({len(prompt)} tokens) exceeds the available context size "
                    f"({loaded.n_ctx} tokens), try increasing it",
                    kind="exceed_context_size_error", n_prompt_tokens=len(prompt), n_ctx=loaded.n_ctx,
                )
        except BadRequest as exc:
            return error_response(exc.code, str(exc), exc.kind, **exc.extra)
        room = loaded.n_ctx - len(prompt)
        job = Job(req, prompt, max_new=min(req.max_tokens or room, room))

        if self.waiting >= MAX_WAITING:
            return error_response(503, f"the engine is busy and {self.waiting} requests are already waiting; retry later")
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

        def emit(item: tuple) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
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
        ids = ChunkIds(self.model_name)
        if req.stream:
            return EventStream(self._sse(job, queue, ids, request), job.cancel)
        return await self._collect(job, queue, ids, request)

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
    def _timings(self, job: Job) -> dict[str, Any]:
        prompt_ms = job.prompt_s * 1000.0
        pred_ms = job.predicted_s * 1000.0
        n_p, n = len(job.prompt_ids), job.completion_tokens
        return {
            "cache_n": 0,
            "prompt_n": n_p,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / n_p if n_p else 0.0,
            "prompt_per_second": n_p / job.prompt_s if job.prompt_s else 0.0,
            "predicted_n": n,
            "predicted_ms": pred_ms,
            "predicted_per_token_ms": pred_ms / n if n else 0.0,
            "predicted_per_second": n / job.predicted_s if job.predicted_s else 0.0,
        }

    def _usage(self, job: Job) -> dict[str, Any]:
        n_p, n = len(job.prompt_ids), job.completion_tokens
        return {
            "completion_tokens": n,
            "prompt_tokens": n_p,
            "total_tokens": n_p + n,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": job.reasoning_tokens},
        }

    def _final_k3(self, job: Job, last: TokenStats | None) -> dict[str, Any]:
        return replace(last or k3_record(None, self.loaded.budget_gb),
                       reasoning_tokens=job.reasoning_tokens, note=empty_answer_note(job) or None,
                       demo=DEMO_NOTICE if self.steer_demo else None).k3()

    async def _sse(self, job: Job, queue: asyncio.Queue, ids: ChunkIds, request: Request) -> AsyncIterator[str]:
        yield ids.sse({"role": "assistant", "content": None}, k3=k3_record(None, self.loaded.budget_gb).k3())
        state: dict[str, Any] = {"k3": None}
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=PING_SECONDS)
            except TimeoutError:
                yield ":\n\n"  # keep-alive comment while a long prefill runs
                continue
            # Whatever else is already waiting goes out in the same write: under load the
            # loop keeps up with the generator instead of costing it one wake-up per token.
            out, done = self._sse_item(job, ids, item, state)
            while not done and not queue.empty():
                more, done = self._sse_item(job, ids, queue.get_nowait(), state)
                out += more
            if out:
                yield out
            if done:
                return

    def _sse_item(self, job: Job, ids: ChunkIds, item: tuple, state: dict[str, Any]) -> tuple[str, bool]:
        """SSE text for one worker event, and whether the stream ends with it."""
        req = job.req
        if item[0] == "token":
            _, k3, reasoning, content = item
            state["k3"] = k3 or state["k3"]
            extra: dict[str, Any] = {"k3": state["k3"].k3() if state["k3"] else None}
            if req.timings_per_token:
                extra["timings"] = self._timings(job)
            out = ids.sse({"reasoning_content": reasoning}, **extra) if reasoning else ""
            if content:
                out += ids.sse({"content": content}, **extra)
            return out, False
        if item[0] == "end":
            final = {"k3": self._final_k3(job, state["k3"])}
            if not req.include_usage or req.timings_per_token:
                final["timings"] = self._timings(job)
            out = ids.sse({}, finish_reason=item[1], **final)
            if req.include_usage:
                out += ids.sse(None, usage=self._usage(job), timings=self._timings(job), k3=final["k3"])
            return out + "data: [DONE]\n\n", True
        if item[0] == "error":
            return f"data: {json.dumps(error_body(500, item[1]))}\n\n", True
        return "", True  # cancelled: the client is gone

    async def _collect(self, job: Job, queue: asyncio.Queue, ids: ChunkIds, request: Request) -> Response:
        reasoning, content, last_k3 = [], [], None
        checked = time.monotonic()
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=0.25)
            except TimeoutError:
                item = None
            if time.monotonic() - checked >= 0.25:  # nobody waits for the answer: stop
                checked = time.monotonic()
                if await request.is_disconnected():
                    job.cancel.set()
            if item is None:
                continue
            if item[0] == "token":
                last_k3 = item[1] or last_k3
                reasoning.append(item[2])
                content.append(item[3])
            elif item[0] == "end":
                message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
                if "".join(reasoning):
                    message["reasoning_content"] = "".join(reasoning)
                body = ids.base("chat.completion")
                body.update(
                    choices=[{"finish_reason": item[1], "index": 0, "message": message}],
                    usage=self._usage(job), timings=self._timings(job), k3=self._final_k3(job, last_k3),
                )
                return JSONResponse(body)
            elif item[0] == "error":
                return error_response(500, item[1])
            else:
                return Response(status_code=499)


class ChunkIds:
    """The fields every chunk of one completion shares."""

    def __init__(self, model: str) -> None:
        self.id = "chatcmpl-" + secrets.token_urlsafe(24)[:32]
        self.created = int(time.time())
        self.model = model

    def base(self, obj: str) -> dict[str, Any]:
        return {"created": self.created, "id": self.id, "model": self.model,
                "system_fingerprint": FINGERPRINT, "object": obj}

    def sse(self, delta: dict | None, finish_reason: str | None = None, **extra: Any) -> str:
        chunk: dict[str, Any] = {}
        chunk["choices"] = [] if delta is None else [{"finish_reason": finish_reason, "index": 0, "delta": delta}]
        chunk.update(self.base("chat.completion.chunk"))
        chunk.update(extra)
        return f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """SSE body that watches for the client going away while it streams, and then sets
    the generation's cancel event at once (not only at the next write)."""

    def __init__(self, chunks: AsyncIterator[str], cancel: threading.Event) -> None:
        super().__init__(chunks, status_code=200, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
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
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except OSError:
            pass
        finally:
            # Normal end: the job already finished. Otherwise the client left mid-stream.
            self.cancel.set()
            await self.chunks.aclose()


# ---------------------------------------------------------------------------------------
# loading the real model


def load_engine(checkpoint: Path, tokenizer_dir: Path, args: argparse.Namespace,
                progress: LoadProgress, n_ctx: int) -> Loaded:
    """Tokenizer, weight source under the memory plan, model; generation via ENG's API."""
    from engine.decode.generate import GenParams, generate
    from engine.model.transformer import load_model
    from engine.weights.streaming import open_source

    progress.phase = "tokenizer"
    progress.checkpoint_bytes = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    tok = Tokenizer.from_dir(tokenizer_dir)
    progress.phase = "weights"
    args.context_tokens = n_ctx
    source = open_source(checkpoint, args)
    progress.phase = "model"
    model = load_model(checkpoint, source)
    cfg = model.config
    progress.n_layers = getattr(cfg, "num_hidden_layers", None)
    progress.layers_bound = progress.n_layers
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is not None and vocab < tok.vocab_size:
        raise EngineError(
            f"the tokenizer has {tok.vocab_size} ids but the model only {vocab}; "
            "pass --tokenizer with the checkpoint's own tokenizer files"
        )
    plan = getattr(source, "plan", None)
    budget = plan.budget_bytes / 1e9 if plan is not None else None
    memory_plan = (
        {"mode": "streaming", "describe": plan.describe(), **plan.as_dict()}
        if plan is not None
        else {"mode": "resident", "describe": "every weight resident in RAM (no memory flag given)"}
    )
    max_pos = getattr(cfg, "max_position_embeddings", None) or n_ctx

    delay = getattr(args, "debug_token_delay", 0.0)

    def gen(prompt_ids, params, cancel=None, logits_hook=None):
        for token in generate(model, prompt_ids, params, cancel=cancel, logits_hook=logits_hook):
            if delay:  # tests: a reply slow enough to stop or kill half-way on any machine
                time.sleep(delay)
            yield token

    return Loaded(
        tok=tok,
        generate=gen,
        make_params=GenParams,
        n_ctx=min(n_ctx, max_pos),
        info={
            "checkpoint": str(checkpoint),
            "memory_plan": _jsonable(memory_plan),
            "meta": {"n_layers": getattr(cfg, "num_hidden_layers", None), "n_vocab_model": vocab},
        },
        budget_gb=budget,
        source=source,
    )


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# ---------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint folder (config.json + safetensors shards)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="folder with tiktoken.model + tokenizer_config.json (default: the checkpoint)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (0 = any free port; default 8080)")
    parser.add_argument("--api-key", default=os.environ.get("K3_API_KEY"), metavar="KEY",
                        help="require this key (comma-separated for several; default $K3_API_KEY, "
                        "which keeps it out of `ps`); needed off loopback")
    parser.add_argument("--model-name", default=None, metavar="NAME", help="model id in responses")
    parser.add_argument("--ctx-size", type=int, default=DEFAULT_CTX, metavar="N",
                        help=f"context tokens per conversation (default {DEFAULT_CTX})")
    parser.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                        help="default max tokens of thinking before the answer is forced (-1 = no limit)")
    parser.add_argument("--max-body-mb", type=float, default=MAX_BODY_MB, metavar="MB",
                        help=f"largest request body in MiB; bigger ones get 413 (default {MAX_BODY_MB:g})")
    parser.add_argument("--read-timeout", type=float, default=READ_TIMEOUT, metavar="S",
                        help="seconds a client may take to send a request's headers, or stall in "
                        f"its body, before the connection is closed (default {READ_TIMEOUT:g})")
    parser.add_argument("--steer-demo", action="store_true",
                        help="demo for random-weight models: readable words in a scripted think/answer shape")
    parser.add_argument("--debug-load-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--debug-token-delay", type=float, default=0.0, help=argparse.SUPPRESS)
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
            "the model; pass --api-key KEY, or bind 127.0.0.1 and tunnel (ssh -L)", 2)
    checkpoint = Path(args.checkpoint).expanduser()
    if not (checkpoint / "config.json").is_file():
        return _fail(f"{checkpoint} has no config.json; pass the checkpoint folder (with the safetensors shards)")
    tok_dir = Path(args.tokenizer).expanduser() if args.tokenizer else checkpoint
    if not (tok_dir / "tiktoken.model").is_file():
        return _fail(
            f"{tok_dir} has no tiktoken.model; pass --tokenizer DIR with tiktoken.model and "
            "tokenizer_config.json (for a synthesised model: python -m engine synth writes them)")
    if args.ctx_size < 16:
        return _fail("--ctx-size must be at least 16 tokens", 2)
    if not (0 < args.max_body_mb < 2**20 and 0 < args.read_timeout < 86400):
        return _fail("--max-body-mb and --read-timeout must be positive numbers", 2)
    try:
        sock = socket.create_server((args.host.strip("[]"), args.port),
                                    family=socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); "
                     "pick another --port or stop the program using it")
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host

    name = args.model_name or (DEMO_NOTICE if args.steer_demo else checkpoint.resolve().name)
    service = Service(model_name=name, steer_demo=args.steer_demo,
                      reasoning_budget=args.reasoning_budget, api_keys=api_keys,
                      max_body_mb=args.max_body_mb, read_timeout=args.read_timeout)

    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            print(f"listening on http://{url_host}:{port}", flush=True)

        async def shutdown(self, sockets=None) -> None:
            service.cancel_running()  # end a running stream now, not after the grace period
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(service.app(), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=3, timeout_keep_alive=5,
                            http=h11_with_head_deadline(args.read_timeout))
    server = Server(config)
    failed: list[str] = []

    def load() -> None:
        try:
            if args.debug_load_delay:
                service.progress.phase = "debug-delay"
                time.sleep(args.debug_load_delay)
            loaded = load_engine(checkpoint, tok_dir, args, service.progress, args.ctx_size)
            service.set_loaded(loaded)
            print(f"model ready in {service.metrics.values['load_seconds']:.1f} s", file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - any load failure ends the server with one sentence
            if not isinstance(exc, EngineError):
                traceback.print_exc(file=sys.stderr)
            failed.append(str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}")
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
