"""`k3tui chat --url … --smoke` against a real HTTP server on loopback that records each
request body: the [chat] settings reach a server given by --url, a smoke run starts its
own conversation, and an answer that is all reasoning is a failure with its reason."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from k3tui.config import Config, save_config
from k3tui.history import History


class Recorder(BaseHTTPRequestHandler):
    bodies: list[dict] = []
    deltas: list[dict] = [{"content": "Hello there."}]

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, doc: dict) -> None:
        data = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.endswith("/models"):
            self._json({"object": "list", "data": [{"id": "rec", "object": "model"}]})
        else:
            self._json({"status": "ok"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for delta in self.deltas:
            chunk = {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        self.wfile.write(f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def server():
    Recorder.bodies = []
    Recorder.deltas = [{"content": "Hello there."}]
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def smoke(url: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3tui", "chat", "--url", url, "--smoke",
                           "--prompt", "hi", *extra],
                          capture_output=True, text=True, timeout=120)


def test_url_chat_sends_the_config_chat_settings_in_a_new_conversation(server):
    cfg = Config()
    cfg.chat.max_tokens, cfg.chat.temperature = 77, 0.25
    cfg.chat.thinking_effort, cfg.chat.system_prompt = "low", "Be brief."
    save_config(cfg)
    old = History()
    conv = old.new_conversation("old chat")
    old.add_message(conv, "user", "an old question")
    old.add_message(conv, "assistant", "an old answer")
    old.close()

    res = smoke(server)
    assert res.returncode == 0, res.stderr
    body, = Recorder.bodies
    assert body["max_tokens"] == 77 and body["temperature"] == 0.25
    assert body["chat_template_kwargs"] == {"thinking": True, "thinking_effort": "low"}
    assert body["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hi"}]  # no old turns


def test_smoke_fails_on_an_answer_that_is_all_reasoning(server):
    Recorder.deltas = [{"reasoning_content": "Let me think about it."}]
    res = smoke(server)
    assert res.returncode == 1, res.stdout
    assert "without writing an answer" in res.stderr
    assert "finish_reason stop" in res.stdout + res.stderr


def test_missing_configured_model_advice_names_no_chat_flag(tmp_path):
    """In `chat`, --model is a model name: the advice for a missing folder is the config key."""
    cfg = Config()
    cfg.backend.kind, cfg.model.dir = "bundled", str(tmp_path / "gone")
    save_config(cfg)
    res = subprocess.run([sys.executable, "-m", "k3tui", "chat", "--smoke"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert "does not exist" in res.stderr
    assert "k3tui config set model.dir FOLDER" in res.stderr and "--model" not in res.stderr
