"""Backend text never reaches the terminal raw: the real `k3tui chat` in a real pty.

A loopback OpenAI-compatible server (hostile_server.py) streams OSC 52/0/8, CSI 2J/6n,
DCS/APC and 8-bit C1 sequences in the reasoning, the content and the model id, then
answers an error whose message is Rich markup. Every byte the app writes to the pty is
read; none of the sequences' payloads may be among them, and the chat must keep running.
"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time

from hostile_server import FORBIDDEN, VISIBLE, HostileServer
from tui_helpers import REPO_ROOT


class PtyApp:
    """A process on a fresh pty; a thread drains everything it writes."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 110, 0, 0))
        self.master = master
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     cwd=REPO_ROOT, start_new_session=True, close_fds=True)
        os.close(slave)
        self.output = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self.output += data

    def seen(self) -> bytes:
        with self._lock:
            return bytes(self.output)

    def wait_for(self, needle: bytes, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.seen():
            assert self.proc.poll() is None, \
                f"the chat exited ({self.proc.returncode}):\n{self.seen()[-3000:]!r}"
            assert time.monotonic() < deadline, f"{needle!r} never shown"
            time.sleep(0.05)

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        os.close(self.master)


def test_backend_escape_sequences_never_reach_the_terminal(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMUX", "K3TUI"))}
    env.update(K3TUI_HOME=str(tmp_path / "home"), TERM="xterm-256color", COLUMNS="110",
               LINES="30", PYTHONPATH=os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    with HostileServer() as server:
        app = PtyApp([sys.executable, "-m", "k3tui", "chat", "--url", server.url], env)
        try:
            app.wait_for(b"Stop")                     # the footer: the chat is up
            app.type("hello")
            app.wait_for(b"hello")
            app.type("\r")
            app.wait_for(VISIBLE["content"])
            app.type("\x14")                          # ctrl+t: show the reasoning
            app.wait_for(VISIBLE["reasoning"])
            app.type("again\r")                       # the server now answers an error
            app.wait_for(VISIBLE["error"])            # shown as text, not read as markup
            app.type("still here")
            app.wait_for(b"still here")               # the chat survived it
            app.wait_for(VISIBLE["model"])           # the header, its OSC cut out
            out = app.seen()
            leaked = [f for f in FORBIDDEN if f in out]
            assert not leaked, f"backend sequences reached the terminal: {leaked}"
            assert b"Traceback" not in out
        finally:
            app.close()
