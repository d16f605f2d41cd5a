"""A read-only `$K3TUI_HOME`: `config set`, `chat` and `pack` ended in raw OSError tracebacks
(EROFS from chmod or mkdir); each is now one sentence naming the folder and the next step,
and what only reads (`k3tui jobs`, `config path`) still works.

The home is made read-only for real: a read-only bind mount in a private mount namespace
(`unshare -rm`, which needs no root), so even root cannot write it; where unshare is not
allowed, a non-root user gets a 0555 folder instead.
"""

from __future__ import annotations

import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

RO_MOUNT = 'mount --bind -o ro "$0" "$0" && exec "$@"'


def _readonly_prefix(home: Path) -> list[str]:
    if shutil.which("unshare"):
        probe = subprocess.run(["unshare", "-rm", "sh", "-c", RO_MOUNT + "", str(home),
                                "sh", "-c", f"! touch '{home}/probe' 2>/dev/null"],
                               capture_output=True)
        if probe.returncode == 0:
            return ["unshare", "-rm", "sh", "-c", RO_MOUNT, str(home)]
    if os.geteuid() != 0:
        for d in (home, *[p for p in home.rglob("*") if p.is_dir()]):
            d.chmod(0o555)
        return []
    pytest.skip("no way to make a read-only folder here (unshare refused, and root ignores "
                "modes)")


@pytest.fixture
def readonly(tmp_path):
    """Run `k3tui ARGS` with the test's home read-only; (returncode, output)."""
    home = Path(os.environ["K3TUI_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    home.chmod(0o755)                     # looser than k3tui's 0700: it used to chmod first
    prefix = _readonly_prefix(home)

    def run(*args: str, tty: bool = False) -> tuple[int, str]:
        argv = [*prefix, sys.executable, "-m", "k3tui", *args]
        if tty:
            return _run_in_pty(argv)
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL, cwd=tmp_path)
        return p.returncode, p.stdout + p.stderr
    yield run
    for d in (home, *[p for p in home.rglob("*") if p.is_dir()]):
        d.chmod(0o700)


def _run_in_pty(argv: list[str], timeout: float = 120) -> tuple[int, str]:
    """`k3tui chat` wants a terminal: give it one, read until it exits."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:             # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=10), out.decode(errors="replace").replace("\r\n", "\n")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def _one_sentence(rc: int, out: str) -> None:
    home = os.environ["K3TUI_HOME"]
    assert rc == 1 and "Traceback" not in out, out
    first, step = out.strip().splitlines()
    # Read-only file system (the mount), or Permission denied (a 0555 folder)
    assert first.startswith(f"k3tui: Cannot write in k3tui's folder {home} ("), out
    assert step == ("  next: make it writable, or point K3TUI_HOME at another folder "
                    "(`export K3TUI_HOME=/path/to/folder`)"), out


def test_config_set_in_a_read_only_home(readonly):
    _one_sentence(*readonly("config", "set", "chat.temperature", "0.5"))


def test_chat_in_a_read_only_home(readonly):
    _one_sentence(*readonly("chat", "--demo", tty=True))
    _one_sentence(*readonly("chat", "--demo", "--smoke"))


@pytest.mark.parametrize("how", ["--detach", "--foreground"])
def test_pack_in_a_read_only_home(readonly, tiny_a, tmp_path, how):
    _one_sentence(*readonly("pack", str(tiny_a), str(tmp_path / "trunk"), how))


def test_reading_works_in_a_read_only_home(readonly):
    rc, out = readonly("jobs")
    assert (rc, out) == (0, "No jobs. Start one with `k3tui download` or `k3tui pack`.\n")
    rc, out = readonly("config", "path")
    assert rc == 0 and out.startswith(f"root              {os.environ['K3TUI_HOME']}\n"), out
