"""OpenAI-compatible streaming chat client shared by every backend.

`stream_chat` posts one chat completion with `stream: true` and turns the SSE chunks into
the typed events of `k3tui.backends.events`. It is written against what llama-server and
the bundled engine really send (docs/reference/llama-server.md): comment pings (`:`),
repeated role chunks, several keys in one delta, `timings` on every chunk when
`timings_per_token` is asked for, usage in a trailing `choices: []` chunk, and errors
mid-stream as `data: {"error": …}` without `[DONE]`.

Cancelling = closing the async generator (`aclose()`): that closes the response, which
closes the connection, which makes llama-server cancel the task.

A backend can go silent without closing the connection (its process stopped by SIGSTOP
or Ctrl+Z, a frozen host): the read timeout is long, because a token may take minutes.
So silence is judged by what a backend promises: the bundled engine announces its
keep-alive interval (PING_HEADER) and is stalled after STALL_PINGS of them without a
byte. llama-server announces nothing (whether it pings through a long prefill depends on
its build and flags), so a silence there is never judged by time: only the state of a
process k3tui started (stopped) tells. A request queued behind another one gets no
response head, and no pings, until its turn: that wait too is judged by the process only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from k3tui.backends.events import (
    BackendError,
    ContentDelta,
    Finished,
    ReasoningDelta,
    StreamEvent,
    TokenIds,
    TokenStats,
    Waiting,
)
from k3tui.backends.transport import describe_transport_error, ssl_error
from k3tui.textsafe import clean
from k3tui.units import KiB, MiB

if TYPE_CHECKING:
    from k3tui.config import ChatSection

# A streamed token can take minutes on the bundled engine at a small budget, and
# llama-server pings only every 30 s, so the read timeout is generous; connect is not.
READ_TIMEOUT_S = 900.0
CONNECT_TIMEOUT_S = 10.0
LOADING_POLL_S = 1.0  # /health polls while a server loads its model
# One SSE event holds one chunk (a token's delta, its timings and `k3`: about 1 kB); an
# error answer is one sentence. More than these is a broken or hostile server.
MAX_EVENT_BYTES = MiB
MAX_ERROR_BYTES = 64 * KiB
MAX_ERROR_CHARS = 500  # of a server's error message shown to the user
MAX_FIGURE = 1e15  # a count, a time in ms, a size in GB: anything larger is not one
MAX_TOKENS_PER_CHUNK = 4096  # what one chunk's cumulative predicted_n may add
MAX_TOKEN_ID = 2**31 - 1  # a token id is an int32 in every tokenizer k3tui talks to
MAX_MODELS_BYTES = 16 * MiB  # /v1/models of a hosted API with hundreds of models
PING_HEADER = "x-k3-ping-seconds"  # the engine's keep-alive interval (engine/serve/scheduler.py)
STALL_PINGS = 3  # keep-alives missed in a row before an announcing backend counts as stalled
MAX_PING_S = 3600.0  # an announced interval longer than this is not believed
PROCESS_CHECK_S = 5.0  # silence after which (and as often as) a local process's state is read


def parse_json(raw: str | bytes) -> Any:
    """`json.loads` for what a server wrote: nesting too deep for Python (10^5 `[`) is a
    ValueError like any other unreadable JSON, never a RecursionError."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


class StreamTooLarge(Exception):
    """An SSE line or event longer than MAX_EVENT_BYTES."""


TOO_LARGE = ("The backend sent an event larger than 1 MiB without ending it; the stream was "
             "closed.", "check that the URL points at an OpenAI-compatible server and look at "
             "its log (the answer so far is kept)")


def api_base(base_url: str) -> str:
    """`http://h:p`, `http://h:p/`, `http://h:p/v1` and `http://h:p/v1/` → `http://h:p/v1`."""
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def server_root(base_url: str) -> str:
    """The URL without `/v1`, where llama-server serves `/health`, `/slots`, `/metrics`."""
    url = base_url.rstrip("/")
    return url.removesuffix("/v1")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def build_request(messages: list[dict[str, Any]], *, model: str | None = None,
                  max_tokens: int | None = None, temperature: float | None = None,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body: usage in the stream and per-token timings for the latency pane."""
    body: dict[str, Any] = {
        "model": model or "k3",
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "timings_per_token": True,
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    if extra:
        body.update(extra)
    return body


def chat_settings(chat: ChatSection) -> dict[str, Any]:
    """`stream_chat`'s keyword arguments from a config's [chat] section, so every backend
    (started by k3tui or given by --url) is asked for the same answer length, temperature
    and thinking."""
    return {"max_tokens": chat.max_tokens, "temperature": chat.temperature,
            "extra": {"chat_template_kwargs": {"thinking": chat.thinking,
                                               "thinking_effort": chat.thinking_effort}}}


def iter_sse_data(lines: list[str]) -> list[str]:
    """Data payloads of complete SSE events in `lines` (for tests and tools)."""
    parser = SSEParser()
    out: list[str] = []
    for line in lines:
        payload = parser.feed(line)
        if payload is not None:
            out.append(payload)
    tail = parser.flush()
    if tail is not None:
        out.append(tail)
    return out


class SSEParser:
    """Line-fed SSE framing: `data:` fields joined until a blank line; comments ignored."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._size = 0

    def feed(self, line: str) -> str | None:
        """Raises StreamTooLarge once the event's data passes MAX_EVENT_BYTES."""
        line = line.rstrip("\r")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None  # comment ping
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            self._size += len(value) + 1
            if self._size > MAX_EVENT_BYTES:
                raise StreamTooLarge
            self._data.append(value)
        return None  # event:, id:, retry: carry nothing a chat client needs

    def flush(self) -> str | None:
        if not self._data:
            return None
        payload = "\n".join(self._data)
        self._data, self._size = [], 0
        return payload


def _number(value: object) -> int | float | None:
    """A finite JSON number of sane size (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not abs(value) <= MAX_FIGURE:  # NaN fails this too
        return None
    return value


def _count(value: object) -> int | None:
    """A non-negative integer of sane size, else None."""
    return value if isinstance(value, int) and _number(value) is not None and value >= 0 \
        else None


def _figures(obj: object, nested: bool = False) -> dict[str, Any]:
    """The numbers of a server's `timings` or `usage` object (`nested`: and of its
    `…_details` objects, like usage.prompt_tokens_details); every other value is dropped,
    so whoever reads them may do arithmetic."""
    if not isinstance(obj, dict):
        return {}
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if (number := _number(value)) is not None:
            out[key] = number
        elif nested and isinstance(value, dict) and key.endswith("_details"):
            out[key] = _figures(value)
    return out


K3_TEXT = ("note", "demo")  # the `k3` fields that are sentences; every other is a number


def _k3(obj: object) -> dict[str, Any]:
    """The engine's `k3` object: numbers and nulls, its sentences cleaned and cut short;
    a value of any other type is dropped."""
    if not isinstance(obj, dict):
        return {}
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if key in K3_TEXT:
            if isinstance(value, str):
                out[key] = clean(value)[:MAX_ERROR_CHARS]
        elif value is None or (value := _number(value)) is not None:
            out[key] = value
    return out


def _token_ids(k3: Any) -> tuple[int, ...]:
    """`k3.token_ids` when it is a list of at most MAX_TOKENS_PER_CHUNK token ids; anything
    else is no ids (a reply without ids is still a reply, just not sent back as ids)."""
    ids = k3.get("token_ids") if isinstance(k3, dict) else None
    if not isinstance(ids, list) or len(ids) > MAX_TOKENS_PER_CHUNK or not all(
            type(i) is int and 0 <= i <= MAX_TOKEN_ID for i in ids):
        return ()
    return tuple(ids)


@dataclass
class _Turn:
    """What one answer accumulated so far; decides the final event."""

    max_tokens: int | None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    content_chars: int = 0
    reasoning_chars: int = 0
    last_predicted_n: int = 0
    last_predicted_ms: float = 0.0
    done: bool = False


class ChunkInterpreter:
    """Turns decoded JSON chunks into events; pure, so captured streams test it directly."""

    def __init__(self, *, max_tokens: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.turn = _Turn(max_tokens=max_tokens)
        self.clock = clock

    def data(self, payload: str) -> list[StreamEvent]:
        if payload.strip() == "[DONE]":
            self.turn.done = True
            return []
        try:
            chunk = parse_json(payload)
        except ValueError:  # not JSON, a 5000-digit number, 10^5 `[`
            return [BackendError("The backend sent a chunk that is not JSON.",
                                 "check the backend log; the answer so far is kept",
                                 log_tail=payload[:300])]
        if not isinstance(chunk, dict):
            return []
        if "error" in chunk:
            return [error_event(chunk["error"])]
        return self.chunk(chunk)

    def chunk(self, chunk: dict[str, Any]) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        texts = 0
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            # Several keys may share one delta: emit every one, reasoning first.
            for key in ("reasoning_content", "reasoning"):
                text = delta.get(key)
                if isinstance(text, str) and text:
                    events.append(ReasoningDelta(text))
                    self.turn.reasoning_chars += len(text)
                    texts += 1
            text = delta.get("content")
            if isinstance(text, str) and text:
                events.append(ContentDelta(text))
                self.turn.content_chars += len(text)
                texts += 1
            finish = choice.get("finish_reason")
            if isinstance(finish, str) and finish:
                self.turn.finish_reason = clean(finish)[:64]
        if isinstance(chunk.get("usage"), dict):
            self.turn.usage = _figures(chunk["usage"], nested=True)
        timings = _figures(chunk.get("timings")) or None
        if timings:
            self.turn.timings = timings
        ids = _token_ids(chunk.get("k3"))
        if ids:
            events.append(TokenIds(ids))
        if texts:
            events.append(self._stats(timings, _k3(chunk.get("k3"))))
        return events

    def _stats(self, timings: dict[str, Any] | None, k3: dict[str, Any]) -> TokenStats:
        """`timings` and `k3` already checked (`_figures`, `_k3`): numbers only."""
        tokens, backend_ms, prompt_ms, prompt_tokens = 1, None, None, None
        if timings:
            n = _count(timings.get("predicted_n")) or 0
            ms = timings.get("predicted_ms") or 0.0
            if 0 < n - self.turn.last_predicted_n <= MAX_TOKENS_PER_CHUNK:
                tokens = n - self.turn.last_predicted_n
                backend_ms = (ms - self.turn.last_predicted_ms) / tokens
            self.turn.last_predicted_n, self.turn.last_predicted_ms = n, ms
            prompt_ms = timings.get("prompt_ms")
            prompt_tokens = _count(timings.get("prompt_n"))
        if backend_ms is None and k3.get("s_per_token") is not None:
            backend_ms = 1000.0 * k3["s_per_token"]
        return TokenStats(arrival_s=self.clock(), tokens=tokens, backend_ms=backend_ms,
                          prompt_ms=prompt_ms, prompt_tokens=prompt_tokens, k3=k3)

    def end(self) -> StreamEvent:
        """The last event once the stream closed: Finished, or an error if it was cut."""
        turn = self.turn
        if turn.finish_reason is None and not turn.done:
            return BackendError(
                "The backend closed the connection before the answer finished.",
                "the backend may have crashed or run out of memory; check its log "
                "(the answer so far is kept)")
        return Finished(turn.finish_reason, dict(turn.usage or {}), dict(turn.timings or {}),
                        note=finish_note(turn))


def finish_note(turn: _Turn) -> str:
    if turn.finish_reason == "stop" and turn.content_chars == 0 and turn.reasoning_chars > 0:
        return ("The model ended its turn after reasoning, without writing an answer "
                "(finish_reason stop, no response text). Press ctrl+r to regenerate, or "
                "rephrase the prompt.")
    if turn.finish_reason != "length":
        return ""
    budget = f"max_tokens={turn.max_tokens}" if turn.max_tokens else "the token limit"
    if turn.content_chars == 0 and turn.reasoning_chars > 0:
        return (f"The model spent the whole budget ({budget}) reasoning and never reached "
                "an answer: max_tokens counts reasoning tokens too. Raise chat.max_tokens "
                "(`k3tui config set chat.max_tokens 8192`) or lower chat.thinking_effort; with "
                "llama-server, also keep llama_server.reasoning_budget well below max_tokens "
                "so thinking stops in time to answer.")
    if turn.content_chars == 0:
        return (f"The answer hit {budget} before any text was produced; raise chat.max_tokens "
                "(`k3tui config set chat.max_tokens 8192`).")
    return (f"The answer was cut at {budget}; raise chat.max_tokens for longer answers "
            "(`k3tui config set chat.max_tokens 8192`).")


def error_event(err: object, status: int | None = None) -> BackendError:
    """A llama-server/OpenAI error object (or text) as one sentence plus the next step."""
    if isinstance(err, dict):
        message = str(err.get("message") or err)
        kind = str(err.get("type") or "")
        code = err.get("code", status)
    else:
        message, kind, code = str(err), "", status
    message = message.strip()
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS].rstrip() + "…"
    message = message.rstrip(".") + "."
    retry = True
    if kind == "exceed_context_size_error":  # the same conversation overflows again
        retry = False
        step = ("edit the last message shorter (ctrl+e) or start a new chat (ctrl+n); with "
                "llama-server, llama_server.ctx_size in the config sets the context")
    elif code == 401 or kind == "authentication_error":
        retry = False
        step = ("check the API key: `k3tui chat --url URL --api-key-env NAME` reads it from "
                "$NAME; for the configured endpoint, run `k3tui setup` again")
    elif (code == 503 or kind == "unavailable_error") and _is_loading(message):
        step = "the model is still loading; wait and send again"
    elif code == 503 or kind == "unavailable_error":
        step = "the backend is busy with other requests; wait a moment and send again"
    elif code == 404:
        step = "check the backend URL (it must serve /v1/chat/completions)"
    else:
        step = "check the backend log; the answer so far is kept"
    return BackendError(f"The backend reported an error: {message}", step, retry=retry)


_T = TypeVar("_T")


class Stalled(Exception):
    """The backend went silent; `event` says so."""

    def __init__(self, event: BackendError) -> None:
        super().__init__(event.message)
        self.event = event


@dataclass
class Silence:
    """How long one answer may stay silent. `stopped_pid`: for a backend process k3tui
    started, the pid of its process (or of one under it) that is stopped, else None;
    `window_s`: STALL_PINGS keep-alives, once the response announced its interval."""

    stopped_pid: Callable[[], int | None] | None = None
    check_s: float = PROCESS_CHECK_S
    ping_s: float | None = None
    last: float = field(default_factory=time.monotonic)

    @property
    def window_s(self) -> float | None:
        return STALL_PINGS * self.ping_s if self.ping_s is not None else None

    def announced(self, resp: httpx.Response) -> None:
        try:
            ping = float(resp.headers.get(PING_HEADER, ""))
        except ValueError:
            return
        if 0 < ping <= MAX_PING_S:  # NaN fails this too
            self.ping_s = ping

    def wait_s(self) -> float | None:
        """How long to wait for the next bytes before judging; None: for ever."""
        waits = [self.check_s] if self.stopped_pid is not None else []
        if self.window_s is not None:
            waits.append(max(0.0, self.last + self.window_s - time.monotonic()))
        return min(waits) if waits else None

    def judge(self) -> None:
        """Raise Stalled when the silence so far means the backend stopped answering."""
        pid = self.stopped_pid() if self.stopped_pid is not None else None
        kept = "the answer so far is kept"
        if pid is not None:
            raise Stalled(BackendError(
                f"The backend stopped answering: its process (pid {pid}) is stopped, "
                "suspended by SIGSTOP or Ctrl+Z.",
                f"resume it with `kill -CONT {pid}` (or `fg` in the terminal that suspended "
                f"it) and press ctrl+r to ask again; {kept}"))
        window = self.window_s
        if window is not None and time.monotonic() - self.last >= window:
            raise Stalled(BackendError(
                f"The backend stopped answering: nothing came for {window:g} s although it "
                f"sends a keep-alive every {self.ping_s:g} s.",
                "check that it still runs (a suspended process, a frozen machine or a broken "
                f"network), then press ctrl+r to ask again; {kept}"))

    async def wait(self, step: Awaitable[_T]) -> _T:
        """`step`'s result; Stalled when the backend goes silent first (`step` is then
        cancelled). Silence is judged while waiting, without cancelling the read."""
        task = asyncio.ensure_future(step)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.wait_s())
                if done:
                    self.last = time.monotonic()
                    return task.result()
                self.judge()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


async def stream_chat(base_url: str, messages: list[dict[str, Any]], *,
                      api_key: str | None = None, model: str | None = None,
                      max_tokens: int | None = None, temperature: float | None = None,
                      extra: dict[str, Any] | None = None, client: httpx.AsyncClient | None = None,
                      verify: bool | ssl.SSLContext = True,
                      clock: Callable[[], float] = time.monotonic,
                      stopped_pid: Callable[[], int | None] | None = None,
                      check_s: float = PROCESS_CHECK_S) -> AsyncGenerator[StreamEvent, None]:
    """Stream one answer as events; the last event is `Finished` or `BackendError`.

    `verify` is the TLS policy of the client made here (ignored when `client` is given).
    `stopped_pid`: for a backend process k3tui started, which of its processes is stopped
    (None: none), read after `check_s` s of silence and as often while it lasts.
    """
    url = api_base(base_url) + "/chat/completions"
    body = build_request(messages, model=model, max_tokens=max_tokens,
                         temperature=temperature, extra=extra)
    own = client is None
    http = client or httpx.AsyncClient(
        timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S), verify=verify)
    interp = ChunkInterpreter(max_tokens=body.get("max_tokens"), clock=clock)
    try:
        try:
            while True:
                silence = Silence(stopped_pid, check_s)
                request = http.build_request("POST", url, json=body, headers=_headers(api_key))
                resp = await silence.wait(http.send(request, stream=True))
                try:
                    if resp.status_code == 200:
                        silence.announced(resp)
                        async for event in _read_answer(resp, interp, silence):
                            yield event
                            if isinstance(event, BackendError):
                                return
                        break
                    raw = await _read_error_body(resp)
                finally:
                    await resp.aclose()
                if resp.status_code != 503 or not _is_loading(raw):
                    yield _http_error(resp.status_code, raw)
                    return
                # Up but still loading (a chat started beside a loading server): wait for
                # /health, then send the prompt; Esc cancels the wait as it stops a stream.
                yield Waiting("the model is still loading; your prompt is sent when it is "
                              "ready (Esc cancels)")
                while not (state := await health(base_url, api_key=api_key, client=http)).ok:
                    if state.status is None:
                        yield BackendError("The backend stopped answering while it loaded "
                                           f"({state.detail}).",
                                           "check that it is still running, then send again")
                        return
                    await asyncio.sleep(LOADING_POLL_S)
        except httpx.ConnectError as exc:
            if ssl_error(exc) is not None:  # not a dead server: say why
                yield BackendError(*describe_transport_error(exc, server_root(base_url)))
                return
            yield BackendError(f"Could not connect to the backend at {server_root(base_url)}.",
                               "start it with `k3tui serve`, or check the URL in the config")
            return
        except Stalled as stalled:
            yield stalled.event
            return
        except httpx.TimeoutException:
            yield BackendError(
                f"The backend did not answer within {READ_TIMEOUT_S:.0f} s.",
                "check that it is still running (its log says what it is doing)")
            return
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            yield BackendError("The connection to the backend broke in the middle of the answer.",
                               "the backend may have crashed; check its log (the answer so "
                               "far is kept)", log_tail=str(exc))
            return
        yield interp.end()
    finally:
        if own:
            await http.aclose()


_LINE_END = re.compile(rb"\r\n|\r|\n")


async def sse_lines(resp: httpx.Response, silence: Silence | None = None) -> AsyncIterator[str]:
    """The lines of an SSE body as the SSE spec reads them: UTF-8 whatever the charset
    says (bytes that are not become U+FFFD), split at CR, LF or CRLF only. httpx's
    `aiter_lines` splits like `str.splitlines`, also at U+2028, U+0085, \\x1c … which JSON
    carries unescaped inside a string: a model writing one would cut its chunk in two.
    With `silence`, Stalled when the backend goes silent (keep-alive comments count)."""
    buf = bytearray()
    chunks = resp.aiter_bytes()
    while True:
        try:
            chunk = await (silence.wait(chunks.__anext__()) if silence else chunks.__anext__())
        except StopAsyncIteration:
            break
        buf += chunk
        start = 0
        while (end := _LINE_END.search(buf, start)) is not None:
            if end.group() == b"\r" and end.end() == len(buf):
                break  # a CR that the next chunk may turn into CRLF
            if end.start() - start > MAX_EVENT_BYTES:
                raise StreamTooLarge
            yield buf[start:end.start()].decode("utf-8", "replace")
            start = end.end()
        del buf[:start]
        if len(buf) > MAX_EVENT_BYTES:  # no line end in sight
            raise StreamTooLarge
    if buf:
        yield bytes(buf).removesuffix(b"\r").decode("utf-8", "replace")


async def _read_answer(resp: httpx.Response, interp: ChunkInterpreter,
                       silence: Silence) -> AsyncIterator[StreamEvent]:
    """The SSE body of a 200 answer as events, until the turn is done."""
    parser = SSEParser()
    try:
        async for line in sse_lines(resp, silence):
            payload = parser.feed(line)
            if payload is None:
                continue
            for event in interp.data(payload):
                yield event
            if interp.turn.done:
                return
    except StreamTooLarge:
        yield BackendError(*TOO_LARGE)
        return
    tail = parser.flush()
    if tail is not None:
        for event in interp.data(tail):
            yield event


async def _read_at_most(resp: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """The body's first `limit` bytes, and whether it ended within them: a server answering
    with a gigabyte is not read to its end."""
    data = bytearray()
    async for chunk in resp.aiter_bytes():
        data += chunk
        if len(data) > limit:
            return bytes(data[:limit]), False
    return bytes(data), True


async def _read_error_body(resp: httpx.Response) -> str:
    """At most MAX_ERROR_BYTES of a refusal's body: enough for any error message."""
    data, _ = await _read_at_most(resp, MAX_ERROR_BYTES)
    return data.decode("utf-8", "replace")


def _is_loading(text: str) -> bool:
    """llama-server's and the engine's 503 while the model loads ("Loading model"), not a
    busy server's 503 (an error body or its message)."""
    return "loading" in text.lower()


def _http_error(status: int, raw: str) -> BackendError:
    try:
        doc = parse_json(raw)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and "error" in doc:
        return error_event(doc["error"], status)
    return error_event({"message": f"HTTP {status}: {raw.strip()[:200] or 'no body'}",
                        "code": status}, status)


@dataclass(frozen=True)
class Health:
    """`/health` of a backend: truthy when it answers 200."""

    ok: bool
    status: int | None
    detail: str

    def __bool__(self) -> bool:
        return self.ok


async def health(base_url: str, *, api_key: str | None = None,
                 client: httpx.AsyncClient | None = None, timeout: float = 3.0) -> Health:
    """200 → ok; 503 → still loading; no connection → status None."""
    own = client is None
    http = client or httpx.AsyncClient(timeout=timeout)
    try:
        async with http.stream("GET", server_root(base_url) + "/health",
                               headers=_headers(api_key)) as resp:
            text = await _read_error_body(resp)
        detail = "ok" if resp.status_code == 200 else clean(_error_message(text))
        return Health(resp.status_code == 200, resp.status_code, detail)
    except httpx.HTTPError as exc:
        return Health(False, None, f"no answer from {server_root(base_url)}: {type(exc).__name__}")
    finally:
        if own:
            await http.aclose()


async def list_models(base_url: str, *, api_key: str | None = None,
                      client: httpx.AsyncClient | None = None,
                      timeout: float = 5.0) -> list[dict[str, Any]]:
    """The `data` entries of `/v1/models` that are objects (their `id` unchecked); raises
    httpx errors, ValueError for JSON it cannot read, StreamTooLarge past 16 MiB."""
    own = client is None
    http = client or httpx.AsyncClient(timeout=timeout)
    try:
        async with http.stream("GET", api_base(base_url) + "/models",
                               headers=_headers(api_key)) as resp:
            resp.raise_for_status()
            body, whole = await _read_at_most(resp, MAX_MODELS_BYTES)
        if not whole:
            raise StreamTooLarge(f"/v1/models is larger than {MAX_MODELS_BYTES} bytes")
        doc = parse_json(body)
        data = doc.get("data") if isinstance(doc, dict) else None
        return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
    finally:
        if own:
            await http.aclose()


def _error_message(text: str) -> str:
    try:
        doc = parse_json(text)
        return str(doc["error"]["message"])[:MAX_ERROR_CHARS]
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200]
