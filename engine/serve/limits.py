"""What a request must pass before a route sees it: the API key, the model being loaded,
the body's size and pace, and the request head's deadline.

Hostile input is refused before it costs anything: a body over `--max-body-mb` gets 413
(from Content-Length, or as soon as a chunked body passes it), a client that stalls
sending its request head or body is closed after `--read-timeout` (a body dripped in
slower than MIN_BODY_RATE on average, once that time is up, too). Several API keys are
several users: the guard records whose key a request carries (snapshots.owner_of), so a
request resumes only the kept states its own key made.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from typing import Any

import anyio
import h11
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.serve.protocol import BadRequest, error_body
from engine.serve.snapshots import owner_of

PUBLIC_PATHS = ("/health", "/v1/health")
LOADING_PATHS = PUBLIC_PATHS + ("/metrics",)
MAX_BODY_MB = 4.0      # a long conversation is well under 1 MB of JSON
READ_TIMEOUT = 10.0    # seconds a client may take for its request head, or stall in its body
# Past its first READ_TIMEOUT seconds a body must keep up this average rate: a client
# dripping a byte now and then never stalls, but must not hold a connection for ever.
MIN_BODY_RATE = 16 * 2**10  # bytes/s: a 4 MiB body may take READ_TIMEOUT + 256 s
OWNER = "k3.owner"  # the scope key of the request's owner (snapshots.owner_of)


def error_response(code: int, message: str, kind: str | None = None, *, close: bool = False,
                   **extra: Any) -> JSONResponse:
    """`close`: end the connection after the answer (its body was not read, so the
    connection cannot carry another request)."""
    headers = {"Connection": "close"} if close else None
    return JSONResponse(error_body(code, message, kind, **extra), status_code=code, headers=headers)


class Guard:
    """API key, loading and body checks in front of every route (pure ASGI: streams
    pass). The route gets the body already read, within its limits, and the request's
    owner in `scope[OWNER]`."""

    def __init__(self, app: ASGIApp, *, api_keys: list[str], ready: Callable[[], bool],
                 max_body_mb: float = MAX_BODY_MB, read_timeout: float = READ_TIMEOUT) -> None:
        self.app, self.api_keys, self.ready = app, api_keys, ready
        self.max_body_mb, self.read_timeout = max_body_mb, read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        refusal = None
        owner = self.owner(scope) if self.api_keys else ""
        scope[OWNER] = owner
        if owner is None and path not in PUBLIC_PATHS:
            refusal = BadRequest("Invalid API Key", 401)
        elif not self.ready() and path not in LOADING_PATHS:
            refusal = BadRequest("Loading model", 503)
        else:
            try:
                body = await self.read_body(scope, receive)
            except BadRequest as exc:
                refusal = exc
        if refusal is not None:
            refuse = error_response(refusal.code, str(refusal), close=True)
            return await refuse(scope, receive, send)
        if body is None:
            return None  # the client went away while sending

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # from now on: only the disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    async def read_body(self, scope: Scope, receive: Receive) -> bytes | None:
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

    def owner(self, scope: Scope) -> str | None:
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


def h11_with_head_deadline(seconds: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose next request head has not fully
    arrived `seconds` after it opened or after its last answer. uvicorn itself only times
    out a keep-alive connection that sends nothing at all after a response: a client that
    connects and never sends, or sends half a request line, would hold a socket forever."""

    class HeadDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        # uvicorn's H11Protocol already narrows asyncio's BaseTransport to Transport
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
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
