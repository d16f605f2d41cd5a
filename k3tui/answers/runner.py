"""The runner: a detached process that answers a backend's queued turns, one at a time.

It is a job (k3tui/jobs.py: its own session, a state file, a log, `k3tui jobs` lists it)
whose target is the backend, so one runner per backend exists at a time; `ensure_runner`
starts it when a turn is queued. It holds the stream, not the terminal: the backend ends a
generation when its client goes away, and this client goes away only when the answer is
done or stopped. Every token is written to the store (a batch at most FLUSH_S old).

A backend that dies mid-answer: the runner waits for it (bounded by `wait_s`, polling
/health with backoff), then continues the answer in partial mode with the ids so far,
which the bundled engine continues exactly as the uninterrupted run. A backend that does
not come back ends the turn failed, with why. A runner that is killed leaves its turn
running; the next runner of that backend adopts it and continues it the same way.

Leaving is race-free: the runner releases the backend's lock, then looks at the queue once
more. A turn queued before that look is seen; one queued after it finds the lock free and
starts a new runner (`ensure_runner`).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from k3tui.answers.store import Turn, TurnStore
from k3tui.backends.events import (
    BackendError,
    ContentDelta,
    Finished,
    ReasoningDelta,
    TokenIds,
    TokenStats,
)
from k3tui.errors import K3Error

ON_DONE_TIMEOUT_S = 60.0
FLUSH_S = 1.0           # at most this much of an answer is lost with the machine
WAIT_BACKEND_S = 600.0  # how long a backend that went away is waited for, per answer
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
KIND = "answers"


def runner_target(backend: str) -> str:
    return f"answers for {backend}"


def ensure_runner(backend: str, wait_s: float | None = None) -> str | None:
    """Start the backend's runner job; None when one already runs (it takes the new turn:
    see the module's note on leaving)."""
    from k3tui.jobs import k3tui_argv, start_job

    argv = k3tui_argv("answers", "run", "--backend", backend)
    if wait_s is not None:
        argv += ["--wait-backend", str(wait_s)]
    try:
        return start_job(KIND, argv, runner_target(backend))
    except K3Error as exc:
        if exc.exit_code != 2:          # not "already running": the jobs folder failed
            raise
        return None


@dataclass
class _Progress:
    """The answer as far as it has come, and whether the store has all of it."""

    reasoning: str
    content: str
    ids: list[int]
    tokens: int
    first_token: float | None
    dirty: bool = False
    events: list[Any] = field(default_factory=list)


def _partial(p: _Progress) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": p.content, "partial": True}
    if p.reasoning:
        msg["reasoning_content"] = p.reasoning
    if p.ids:
        msg["k3_token_ids"] = list(p.ids)
    return msg


def _api_key(settings: dict[str, Any]) -> str | None:
    """The key by the name the turn recorded (never the key itself: the store is not a
    secrets file); the configured endpoint's may also be the one `k3tui setup` stored."""
    if settings.get("api_key_credential") == "server_api_key":   # a shared service's
        from k3tui.config import load_credentials

        return load_credentials().get("server_api_key") or None
    env = settings.get("api_key_env")
    env = env if isinstance(env, str) else ""
    if settings.get("configured_key"):
        from k3tui.backends.endpoint import resolve_api_key

        return resolve_api_key(env)[0]
    return os.environ.get(env) if env else None


class TurnAnswerer:
    """Answers one turn to its end: done, stopped or failed (always written)."""

    def __init__(self, store: TurnStore, turn: Turn, *, cancel: threading.Event | None = None,
                 wait_s: float = WAIT_BACKEND_S, poll_s: float = 0.5, max_minutes: int = 0):
        self.store, self.turn = store, turn
        self.cancel = cancel or threading.Event()
        self.wait_s, self.poll_s = wait_s, poll_s
        self.max_minutes = max_minutes   # chat.max_minutes; 0: no time budget
        self.p = _Progress(turn.reasoning, turn.content, list(turn.token_ids), turn.tokens,
                           turn.first_token)

    def save(self) -> None:
        if self.p.dirty:
            self.store.save_progress(self.turn, reasoning=self.p.reasoning,
                                     content=self.p.content, token_ids=self.p.ids,
                                     tokens=self.p.tokens, first_token=self.p.first_token)
            self.p.dirty = False

    def _request(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        s = self.turn.settings
        messages = self.store.request_messages(self.turn)
        max_tokens = s.get("max_tokens")
        if self.p.reasoning or self.p.content or self.p.ids:
            messages.append(_partial(self.p))
            if isinstance(max_tokens, int):     # partial mode counts new tokens only
                max_tokens = max(1, max_tokens - self.p.tokens)
        extra = dict(s.get("extra") or {})
        if isinstance(s.get("seed"), int):
            extra["seed"] = s["seed"]
        from k3tui.backends.endpoint import tls_verify

        verify = s.get("verify_tls", True)
        kwargs = {"api_key": _api_key(s), "model": s.get("model") or None,
                  "max_tokens": max_tokens, "temperature": s.get("temperature"),
                  "extra": extra, "verify": tls_verify(verify if isinstance(verify, str)
                                                       else bool(verify))}
        return messages, kwargs

    def _take(self, ev: Any) -> None:
        p = self.p
        if isinstance(ev, ReasoningDelta):
            p.reasoning += ev.text
        elif isinstance(ev, ContentDelta):
            p.content += ev.text
        elif isinstance(ev, TokenIds):
            p.ids.extend(ev.ids)
            p.tokens = len(p.ids)
        elif isinstance(ev, TokenStats) and not p.ids:
            p.tokens += ev.tokens               # a backend without ids: count its tokens
        else:
            return
        if p.first_token is None:
            p.first_token = self.store.clock()
        p.dirty = True

    async def _stream_once(self) -> Finished | BackendError:
        from k3tui.backends.openai_stream import stream_chat

        messages, kwargs = self._request()
        gen = stream_chat(self.turn.backend, messages, **kwargs)
        try:
            async for ev in gen:
                if isinstance(ev, (Finished, BackendError)):
                    return ev
                self._take(ev)
            return BackendError("The stream ended without an answer.")
        finally:
            await gen.aclose()

    def _out_of_time(self) -> bool:
        """The budget counts from the turn's first start (store clock), so a runner that
        continues it after a crash does not restart the budget."""
        started = self.turn.started
        return bool(self.max_minutes) and started is not None and \
            self.store.clock() - started >= self.max_minutes * 60

    async def _watch(self) -> tuple[str, str]:
        """Saves the answer every poll and returns the state to end in and why, when
        someone asks to stop or the time budget is spent."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.poll_s)
            if time.monotonic() - last >= FLUSH_S - self.poll_s:
                try:
                    self.save()
                except K3Error as exc:      # locked by another process, disk full: the
                    print(exc, flush=True)  # answer stays in memory; saved at the next poll
                last = time.monotonic()
            if self.cancel.is_set():
                return "stopped", "its runner was cancelled"
            if self.store.stop_is_requested(self.turn.id):
                return "stopped", "stopped by request"
            if self._out_of_time():    # ended cleanly, like max_tokens: a done answer
                return "done", (f"max_minutes: (stopped at the time budget, chat.max_minutes"
                                f" = {self.max_minutes})")

    async def run(self) -> str:
        """Answer; returns the state it ended in."""
        watch = asyncio.ensure_future(self._watch())
        try:
            return await self._answer(watch)
        finally:
            watch.cancel()

    async def _answer(self, watch: asyncio.Future) -> str:
        give_up: float | None = None    # when a backend that went away is given up on
        attempt = 0
        while True:
            tokens_before = self.p.tokens
            stream = asyncio.ensure_future(self._stream_once())
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                stream.cancel()
                await asyncio.gather(stream, return_exceptions=True)
                return self._end(*watch.result())
            ev = stream.result()
            if isinstance(ev, Finished):
                reason = ev.finish_reason or "stop"
                return self._end("done", reason + (f": {ev.note}" if ev.note else ""))
            if not ev.retry or (not self.p.tokens and give_up is None):
                # refused as asked, or never reached: said at once, not waited for
                return self._end("failed", ev.message, ev.next_step)
            if self.p.tokens > tokens_before:   # it came back and answered: a new wait
                give_up, attempt = None, 0
            now = time.monotonic()
            give_up = give_up if give_up is not None else now + self.wait_s
            if now >= give_up:
                return self._end("failed", f"{ev.message} The backend at {self.turn.backend} "
                                 f"did not come back within {self.wait_s:.0f} s.")
            if not await self._backend_back(give_up, attempt, watch):
                if watch.done():
                    return self._end(*watch.result())
                return self._end("failed", f"{ev.message} The backend at {self.turn.backend} "
                                 f"did not come back within {self.wait_s:.0f} s.")
            attempt += 1

    async def _backend_back(self, give_up: float, attempt: int, watch: asyncio.Future) -> bool:
        """Wait (with backoff) until /health says ok; False past `give_up` or when stopped."""
        from k3tui.backends.openai_stream import health

        api_key = _api_key(self.turn.settings)
        delay = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
        while True:
            pause = min(delay, max(0.0, give_up - time.monotonic()))
            done, _ = await asyncio.wait({watch}, timeout=pause)
            if done:
                return False
            if (await health(self.turn.backend, api_key=api_key)).ok:
                return True
            if time.monotonic() >= give_up:
                return False
            delay = min(delay * 2, BACKOFF_S[-1])

    def _end(self, state: str, reason: str, next_step: str = "") -> str:
        self.save()
        self.store.finish(self.turn.id, state, reason, next_step=next_step)
        return state


def _max_minutes() -> int:
    """chat.max_minutes as configured when the turn starts (0 when the config is broken:
    said in the log, the answer still runs)."""
    from k3tui.config import load_config

    try:
        return load_config().chat.max_minutes
    except K3Error as exc:
        print(f"chat.max_minutes not read: {exc}", flush=True)
        return 0


def run_on_done(turn: Turn) -> None:
    """`chat.on_done`, the user's own command (from their private config), run through the
    shell with the turn in its environment: never with text of the answer in the command
    line, so nothing a model wrote is ever run. Its output goes to the runner's log."""
    import subprocess

    from k3tui.config import load_config

    try:
        command = load_config().chat.on_done.strip()
    except K3Error as exc:
        print(f"chat.on_done not run: {exc}", flush=True)
        return
    if not command:
        return
    env = dict(os.environ, K3TUI_TURN_ID=str(turn.id),
               K3TUI_CONVERSATION=str(turn.conversation_id), K3TUI_TURN_STATE=turn.state,
               K3TUI_TURN_TOKENS=str(turn.tokens))
    try:
        done = subprocess.run(["/bin/sh", "-c", command], env=env, stdin=subprocess.DEVNULL,
                              timeout=ON_DONE_TIMEOUT_S, check=False)
        if done.returncode:
            print(f"chat.on_done exited with {done.returncode}", flush=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"chat.on_done failed: {exc}", flush=True)


def serve_queue(backend: str, *, wait_s: float = WAIT_BACKEND_S) -> int:
    """The runner job's body: answer the backend's turns until its queue is empty."""
    from k3tui.history import History
    from k3tui.jobs import JobReporter, lock_target, release_inherited_lock

    reporter = JobReporter.from_env()
    cancel = reporter.install_signals() if reporter is not None else threading.Event()
    runner = reporter.state["id"] if reporter is not None else f"pid-{os.getpid()}"
    store = TurnStore(History())
    lock_fd: int | None = None  # None: the lock inherited from start_job
    answered = 0
    while not cancel.is_set():
        turn = store.claim(backend, runner, adopt=True)
        if turn is None:
            if lock_fd is None:
                release_inherited_lock()
            else:
                os.close(lock_fd)
            if not store.has_queued(backend):
                break
            try:
                lock_fd = lock_target(runner_target(backend), "k3tui answers run", job_id=runner)
            except K3Error:
                break                           # a new runner took over the queue
            continue
        if reporter is not None:
            reporter.update(message=f"answering turn {turn.id}")
        state = asyncio.run(TurnAnswerer(store, turn, cancel=cancel, wait_s=wait_s,
                                         max_minutes=_max_minutes()).run())
        print(f"turn {turn.id}: {state}", flush=True)
        run_on_done(store.get(turn.id))
        answered += 1
    if reporter is not None:
        reporter.finish("cancelled" if cancel.is_set() else "done",
                        f"answered {answered} turn(s)")
    return 0
