"""An OpenAI-compatible server on loopback that writes terminal escape sequences.

Real HTTP (stdlib `http.server` in a thread): `/health`, `/v1/models` (a model id with an
OSC title in it), and chat completions streamed as SSE the way llama-server sends them.
The first chat request streams every hostile sequence in reasoning and content; every
later one answers 500 with an error message that is both Rich markup and escape codes.
Each sequence carries a marker that must never reach the terminal (`FORBIDDEN`), while
the visible text around it must (`VISIBLE`).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ESC = "\x1b"
HOSTILE = (
    f"{ESC}]52;c;SElKQUNLRUQ={ESC}\\"        # OSC 52: set the clipboard (ST-terminated)
    f"{ESC}]0;PWNED-TITLE\x07"                # OSC 0: window title
    f"Zq{ESC}[2JQz"                           # CSI 2J: clear the screen
    f"Mm{ESC}[6nNn"                           # CSI 6n: the terminal answers into stdin
    f"{ESC}]8;;http://evil.example/{ESC}\\link{ESC}]8;;{ESC}\\"   # OSC 8 hyperlink
    f"\x9d0;C1-TITLE\x07"                     # 8-bit OSC
    f"\x9b31mRr"                              # 8-bit CSI
    f"{ESC}PDCS-PAYLOAD{ESC}\\"               # DCS string
    f"{ESC}_APC-PAYLOAD{ESC}\\"               # APC string
)
MODEL = f"fake{ESC}]0;MODEL-TITLE\x07-k3"
ERROR = f"bad [bold]thing[/] {ESC}]0;ERR-TITLE\x07 [/x]"

FORBIDDEN = [b"SElKQUNLRUQ", b"PWNED-TITLE", b"\x1b[2JQz", b"\x1b[6nNn", b"evil.example",
             b"]8;;", b"C1-TITLE", b"\xc2\x9d", b"\xc2\x9b", b"DCS-PAYLOAD", b"APC-PAYLOAD",
             b"MODEL-TITLE", b"ERR-TITLE"]
# What the cleaned text still shows: "Zq<CSI 2J>Qz" becomes "ZqQz".
VISIBLE = {"content": b"ZqQz", "reasoning": b"pondering", "model": b"fake-k3",
           "error": b"[bold]thing[/]"}


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    body = {"object": "chat.completion.chunk", "model": "fake-k3",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"   # the body ends when the connection closes

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:
            self._json(404, {"error": {"code": 404, "message": "not found"}})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        server = self.server
        with server.lock:
            server.chats += 1
            first = server.chats == 1
        if not first:
            self._json(500, {"error": {"code": 500, "message": ERROR, "type": "server_error"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(_chunk({"role": "assistant", "content": None}))
        self.wfile.write(_chunk({"reasoning_content": f"pondering {HOSTILE}"}))
        self.wfile.write(_chunk({"content": f"answer {HOSTILE}"}))
        self.wfile.write(_chunk({}, "stop"))
        self.wfile.write(b"data: [DONE]\n\n")


class HostileServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.chats = 0
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> HostileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()
