"""A started backend: where to reach it, its process, its log, and how to stop it.

Shared by the llama-server supervisor, the bundled-engine launcher and remote endpoints
(which have no process). Also the one place that turns "the process died" into a
`BackendError` with the last log lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3tui.backends.events import BackendError, StreamEvent
from k3tui.units import KiB, gib, memory_size

STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class LoadProgress:
    """One progress report while a backend loads (`/health` still 503) or before it starts."""

    elapsed_s: float
    read_bytes: int | None = None  # storage bytes the server process has read so far
    rss_bytes: int | None = None
    total_bytes: int | None = None  # model size on disk, when known
    message: str = ""
    # risks to keep in view while it loads (e.g. no memory limit); shown once, not in `line()`
    warnings: tuple[str, ...] = ()

    def line(self) -> str:
        parts = [f"loading {self.elapsed_s:5.1f} s"]
        if self.read_bytes is not None:
            read = f"read {memory_size(self.read_bytes, 2, 0)}"
            if self.total_bytes:
                read += f" of {memory_size(self.total_bytes, 2, 0)}"
            parts.append(read)
        if self.rss_bytes is not None:
            parts.append(f"RSS {memory_size(self.rss_bytes, 2, 0)}")
        if self.message:
            parts.append(self.message)
        return ", ".join(parts)


ProgressCallback = Callable[[LoadProgress], None]


def tail_lines(path: Path | None, n: int = 20) -> str:
    """The last n lines of a log file ("" when there is none)."""
    if path is None or not path.is_file():
        return ""
    with open(path, "rb") as fh:
        fh.seek(0, 2)
        size = fh.tell()
        fh.seek(max(0, size - 64 * KiB))
        text = fh.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-n:])


def describe_exit(returncode: int, *, memory_limit_bytes: int | None = None,
                  oom_killed: bool | None = None) -> str:
    """Why a process ended, in words a user can act on. `oom_killed`: what the kernel log
    or the cgroup's OOM count says (None: neither could be read)."""
    if returncode == -signal.SIGKILL:
        if not oom_killed:
            sender = ("not by the out-of-memory killer (the kernel log shows no OOM kill): by "
                      "a user or another program" if oom_killed is False else
                      "by a user, another program or the out-of-memory killer (the kernel log "
                      "is not readable here to tell)")
            return f"was killed with SIGKILL, {sender}; k3tui does not restart it"
        limit = (f" (the memory limit was {gib(memory_limit_bytes)})"
                 if memory_limit_bytes else "")
        return (f"was killed by the out-of-memory killer{limit}; k3tui does not restart it")
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was stopped by {name}"
    return f"exited with code {returncode}"


@dataclass
class RunningBackend:
    kind: str  # "bundled" | "llama-server" | "remote"
    base_url: str  # without /v1
    api_key: str | None
    model: str
    pid: int | None = None
    log_path: Path | None = None
    command: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # warnings shown before use
    memory_limit_bytes: int | None = None
    cgroup_dir: Path | None = None  # the cgroup k3tui made for it: its OOM count is there
    rpc_workers: list[str] = field(default_factory=list)  # a pool's workers, host:port each
    process: subprocess.Popen | None = field(default=None, repr=False)
    on_stop: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _story: str = field(default="", repr=False)  # exit_reason of a process that has ended

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def stopped_pid(self) -> int | None:
        """The pid of the backend's process, or of one under it (a wrapper may fork the
        server), that is stopped (SIGSTOP, Ctrl+Z): alive, but silent until continued."""
        import psutil

        if self.process is None or self.process.poll() is not None:
            return None
        try:
            top = psutil.Process(self.process.pid)
            for proc in (top, *top.children(recursive=True)):
                with contextlib.suppress(psutil.Error):
                    if proc.status() == psutil.STATUS_STOPPED:
                        return proc.pid
        except psutil.Error:  # it ended meanwhile: the connection says so
            pass
        return None

    def log_tail(self, n: int = 20) -> str:
        return tail_lines(self.log_path, n)

    def failure(self) -> BackendError | None:
        """A BackendError with the log tail when the process has ended, else None."""
        if self.process is None or self.process.poll() is None:
            return None
        why = self.exit_reason()
        step = f"read its log ({self.log_path}) and start it again with `k3tui serve`" \
            if self.log_path else "start it again"
        if self.rpc_workers and "; worker " in why:
            step = "start that worker again (`k3tui worker` on its machine), then " + step
        return BackendError(f"The {self.kind} backend {why}.", step, log_tail=self.log_tail())

    def exit_reason(self) -> str:
        """Why the process ended; an OOM kill only when the kernel or the cgroup says so;
        the head of a pool names the workers it lost (asked once, when it has ended)."""
        if self._story:
            return self._story
        code = self.process.returncode if self.process is not None else 0
        oom = None
        if code == -signal.SIGKILL:
            from k3tui.probe.limits import oom_kill_seen

            oom = oom_kill_seen(self.pid, self.cgroup_dir)
        story = describe_exit(code, memory_limit_bytes=self.memory_limit_bytes, oom_killed=oom)
        if self.rpc_workers:
            from k3tui.backends.llama.rpc import pool_story

            story += pool_story(self.rpc_workers, self.log_tail(50))
        if self.process is not None and self.process.poll() is not None:
            self._story = story
        return story

    def wait(self, timeout: float | None = None) -> int | None:
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; idempotent. Descendants too, in case a
        wrapper (systemd-run, sh) forked instead of exec'ing the server."""
        import psutil

        proc = self.process
        if proc is not None and proc.poll() is None:
            try:
                children = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                children = []
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for child in children:
                with contextlib.suppress(psutil.Error):
                    child.terminate()
            _, alive = psutil.wait_procs(children, timeout=grace_s)
            for child in alive:
                with contextlib.suppress(psutil.Error):
                    child.kill()
        while self.on_stop:
            self.on_stop.pop()()

    async def chat(self, messages: list[dict[str, Any]],
                   **kwargs: Any) -> AsyncIterator[StreamEvent]:
        """`stream_chat` against this backend; a dead process turns errors into its story."""
        from k3tui.backends.openai_stream import stream_chat

        kwargs.setdefault("api_key", self.api_key)
        kwargs.setdefault("model", self.model)
        if self.process is not None:  # a silent answer: is the process stopped?
            kwargs.setdefault("stopped_pid", self.stopped_pid)
        if self.kind == "llama-server":  # its prompt cache: a follow-up prefills what is new
            kwargs["extra"] = {"cache_prompt": True, **(kwargs.get("extra") or {})}
        async for event in stream_chat(self.base_url, messages, **kwargs):
            if isinstance(event, BackendError):
                event = await self._explain(event)
            yield event

    async def _explain(self, event: BackendError) -> BackendError:
        # The connection usually breaks a moment before the exit status is visible (longer
        # on a loaded machine). A server still alive after 5 s, or stopped, is reported as
        # it is.
        deadline = time.monotonic() + 5.0
        while self.process is not None and self.process.poll() is None \
                and self.stopped_pid() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        dead = self.failure()
        if dead is None:
            return event
        return BackendError(f"{event.message} {dead.message}", dead.next_step, dead.log_tail)
