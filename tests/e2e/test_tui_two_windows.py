"""Two real `k3tui chat` windows (two tmux sessions) on one K3TUI_HOME, against a real HTTP
server on loopback that records each request: the second window opens its own
conversation instead of the first one's, and neither sends the other's turns."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from tui_helpers import REPO_ROOT, Tmux

from k3tui.history import History

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


class Recorder(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        data = json.dumps({"object": "list", "data": [{"id": "rec"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        answer = f"answer {len(type(self).bodies)}"
        for chunk in ({"delta": {"content": answer}, "finish_reason": None},
                      {"delta": {}, "finish_reason": "stop"}):
            data = json.dumps({"choices": [{"index": 0, **chunk}]})
            self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def server():
    Recorder.bodies = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def _sent(body: dict) -> list[str]:
    return [m["content"] for m in body["messages"]]


def test_a_second_chat_window_has_its_own_conversation(server, tmp_path):
    home = tmp_path / "home"
    history = History(home / "history.sqlite3")
    old = history.new_conversation("old chat")
    history.add_message(old, "user", "an old question")
    history.add_message(old, "assistant", "an old answer")
    history.close()
    env = {"K3TUI_HOME": str(home), "TERM": "xterm-256color",
           "PYTHONPATH": str(REPO_ROOT)}
    one = Tmux(f"k3tui-window-one-{os.getpid()}", env)
    two = Tmux(f"k3tui-window-two-{os.getpid()}", env)
    command = f"{sys.executable} -m k3tui chat --url {server}"
    try:
        one.start(command)
        one.wait_for(lambda s: "an old answer" in s)
        two.start(command)
        seen = two.wait_for(lambda s: "Stop" in s and "open in another k3tui" in s)
        assert "an old answer" not in seen
        two.keys("hello from two", literal=True)
        two.keys("Enter")
        two.wait_for(lambda s: "answer 1" in s)
        one.keys("hello from one", literal=True)
        one.keys("Enter")
        one.wait_for(lambda s: "answer 2" in s)
        one.keys("C-q")
        two.keys("C-q")
    finally:
        one.close()
        two.close()
    assert _sent(Recorder.bodies[0]) == ["hello from two"]
    assert _sent(Recorder.bodies[1]) == ["an old question", "an old answer", "hello from one"]
    stored = History(home / "history.sqlite3")
    assert [m.content for m in stored.messages(old)] == [
        "an old question", "an old answer", "hello from one", "answer 2"]
    assert len(stored.list_conversations()) == 2
