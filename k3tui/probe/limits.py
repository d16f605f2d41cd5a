"""The one confinement check: does a memory limit really apply to a process we start?

A transient systemd user scope is trusted only when the limit reads back from inside the scope
(user units silently ignore limits without memory delegation); a cgroup v2 subtree only when
its memory.max reads back. The kernel keeps memory.max in whole pages, so a limit reads back
rounded down to a page: that is "applies" too. The probe (`k3tui doctor`, the plan) and the
llama-server launcher both ask here, so they never disagree.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# How to get a memory limit that holds where none can be set now: the one sentence that
# `k3tui plan`, `k3tui doctor` and llama-server's start-up state.
ISOLATION_NEXT = ("on systemd: `loginctl enable-linger $USER` and a cgroup v2 boot with user "
                  "memory delegation")
READ_BACK = ["sh", "-c", 'cat "/sys/fs/cgroup$(sed -n "s/^0:://p" /proc/self/cgroup)/memory.max"']
# A helper run: the finished process, or None when the command is absent or cannot start.
Runner = Callable[[list[str]], "subprocess.CompletedProcess | None"]


def page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4096


def reads_back(text: str | None, limit_bytes: int) -> bool:
    """Whether a memory.max value shows `limit_bytes` applied (the kernel rounds it down to a
    whole page)."""
    value = (text or "").strip()
    if not value.isdigit():
        return False
    return int(value) in (limit_bytes, limit_bytes - limit_bytes % page_size())


def systemd_prefix(limit_bytes: int, systemd_run: Sequence[str] = ("systemd-run",)) -> list[str]:
    """The wrapper that starts a command in a user scope with that limit and no swap."""
    return [*systemd_run, "--user", "--scope", "--quiet", "-p", f"MemoryMax={limit_bytes}",
            "-p", "MemorySwapMax=0", "--"]


def check_systemd_scope(run: Runner, limit_bytes: int,
                        systemd_run: Sequence[str] = ("systemd-run",)) -> tuple[bool, str]:
    """Start a scope with the limit, read its memory.max from inside: (applies, why)."""
    try:
        res = run(systemd_prefix(limit_bytes, systemd_run) + READ_BACK)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"systemd-run --user --scope failed: {exc}"
    if res is None:
        return False, "systemd-run is not available"
    out = (res.stdout or "").strip()
    if res.returncode != 0:
        msg = (res.stderr or out).strip().splitlines()
        return False, f"systemd-run --user --scope failed: {msg[-1] if msg else res.returncode}"
    if not reads_back(out, limit_bytes):
        return False, (f"systemd-run ran, but the scope's memory.max read "
                       f"{out.splitlines()[-1] if out else 'nothing'} (limits are silently "
                       "ignored)")
    return True, "systemd-run --user --scope applies MemoryMax (read back from the scope)"


# --- cgroup v2 paths -------------------------------------------------------------------------


def cgroup2_mount(proc: Path = Path("/proc")) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (None on v1-only machines)."""
    try:
        mountinfo = (proc / "self" / "mountinfo").read_text()
    except OSError:
        return None
    mount = next((line.split(" - ")[0].split()[4] for line in mountinfo.splitlines()
                  if " - cgroup2 " in line), None)
    return Path(mount) if mount else None


def cgroup_v2_path(pid: int | str = "self", proc: Path = Path("/proc")) -> str | None:
    """The `0::` entry of /proc/PID/cgroup."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    return next((line[3:] for line in text.splitlines() if line.startswith("0::")), None)


def own_cgroup_v2_dir(proc: Path = Path("/proc")) -> Path | None:
    """This process's cgroup v2 directory (None on v1-only machines)."""
    mount, rel = cgroup2_mount(proc), cgroup_v2_path("self", proc)
    if mount is None or rel is None:
        return None
    return mount / rel.lstrip("/")


def pid_reads_back(pid: int, limit_bytes: int, *, timeout_s: float = 2.0) -> bool:
    """Whether a running process's own cgroup shows the limit (polled: a wrapper moves the
    process into its cgroup just after it starts)."""
    mount = cgroup2_mount()
    if mount is None:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rel = cgroup_v2_path(pid)
        with contextlib.suppress(OSError):
            if rel is not None and reads_back(
                    (mount / rel.lstrip("/") / "memory.max").read_text(), limit_bytes):
                return True
        time.sleep(0.1)
    return False


def oom_kill_seen(pid: int | None, cgroup_dir: Path | None = None,
                  kmsg: Path = Path("/dev/kmsg")) -> bool | None:
    """Whether the kernel OOM-killed `pid`: its cgroup's `oom_kill` count (memory.events,
    or memory.oom_control on cgroup v1) is above 0, or the kernel log names the pid in an
    OOM kill. None when neither can be read (a SIGKILL then has no known sender)."""
    import re

    checked = False
    for name in ("memory.events", "memory.oom_control"):
        with contextlib.suppress(OSError, UnicodeError):
            text = (cgroup_dir / name).read_text() if cgroup_dir is not None else ""
            if m := re.search(r"^oom_kill (\d+)$", text, re.M):
                if int(m.group(1)) > 0:
                    return True
                checked = True
    if pid is None:
        return False if checked else None
    said = re.compile(rf"(Killed process {pid}\b|oom-kill:.*\bpid={pid}\b)".encode())
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False if checked else None
    try:
        for _ in range(100_000):  # the ring buffer holds far fewer records than this
            try:
                if said.search(os.read(fd, 8192)):
                    return True
            except BlockingIOError:
                break
            except OSError:  # EPIPE: a record was overwritten while reading; go on
                continue
        return False
    finally:
        os.close(fd)
