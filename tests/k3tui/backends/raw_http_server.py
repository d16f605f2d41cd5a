"""A hostile or broken HTTP server for client tests: a real socket on 127.0.0.1 that
answers every request with the bytes a test's `respond` writes, however wrong they are
(no framing rules enforced, nothing buffered). It records how much of the answer went out
and whether the client hung up first, so a test can prove the client stopped reading."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable


class RawHTTPServer:
    """`respond(request_head) -> iterable of bytes`, written piece by piece to the client.
    `sent` counts the bytes that went out; `cut` is set when the client closed the
    connection before the last piece; `done` when an answer ended either way."""

    def __init__(self, respond: Callable[[bytes], Iterable[bytes]]) -> None:
        self.respond = respond
        self.heads: list[bytes] = []
        self.sent = 0
        self.cut = threading.Event()
        self.done = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(body) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    body += chunk
                self.heads.append(head)
                for piece in self.respond(head):
                    conn.sendall(piece)
                    self.sent += len(piece)
            except OSError:  # the client hung up (reset, broken pipe) or stalled
                self.cut.set()
            finally:
                self.done.set()

    def stop(self) -> None:
        self._sock.close()


def sse_head(status: str = "200 OK", content_type: str = "text/event-stream",
             extra: str = "") -> bytes:
    """A response head without a length: the body runs until the server closes."""
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n{extra}"
            "Connection: close\r\n\r\n").encode()
