"""`check_endpoint` against a hostile or broken server (real sockets on loopback): what
the server writes never reaches the terminal with escape sequences, a malformed answer is
a failed check (never an exception), and no answer is read without bound."""

from __future__ import annotations

import json

import pytest
from raw_http_server import RawHTTPServer

from k3tui.backends.endpoint import MAX_MODEL_ID, check_endpoint

OSC = "\x1b]52;c;SElKQUNLRUQ=\x07\x1b]0;TITLE\x07\x9b2J\x1b[6n"
CONTROL = ("\x1b", "\x07", "\x9b", "SElKQUNLRUQ", "TITLE")
OK_CHAT = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "OK"}}]}


def answer(status: str, body, extra: str = "") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{extra}Connection: close\r\n\r\n"
            ).encode("latin-1") + data


def endpoint(models=None, chat=None):
    """A server whose /health is fine and whose /v1/models and chat answer as given."""

    def respond(head: bytes):
        path = head.split(b" ")[1]
        if path.endswith(b"/health"):
            return [answer("200 OK", {"status": "ok"})]
        if path.endswith(b"/models"):
            return models() if callable(models) else [models or answer(
                "200 OK", {"data": [{"id": "m"}]})]
        return [chat or answer("200 OK", OK_CHAT)]

    return respond


@pytest.fixture
def serve():
    servers: list[RawHTTPServer] = []

    def make(respond) -> RawHTTPServer:
        servers.append(RawHTTPServer(respond))
        return servers[-1]

    yield make
    for srv in servers:
        srv.stop()


@pytest.mark.parametrize("respond, words", [
    (endpoint(models=answer("200 OK", {"data": [{"id": f"k3{OSC}-big"}, {"id": OSC}]})),
     "works"),
    (endpoint(models=answer("401 Unauthorized", {"error": {"message": f"no{OSC} key"}})),
     "refused the API key"),
    (endpoint(models=answer("500 Oops", {"error": {"message": f"boom{OSC}"}})), "answered 500"),
    (endpoint(models=answer("302 Found", b"", extra="Location: http://x/\x9b2J\x9b6n\r\n")),
     "redirects"),
    (endpoint(chat=answer("500 Oops", f"fail{OSC}".encode("latin-1", "replace"))),
     "test request"),
], ids=["model-ids", "401-message", "500-message", "location-c1-csi", "chat-error-text"])
def test_endh_server_text_reaches_the_terminal_without_escape_sequences(serve, respond, words):
    check = check_endpoint(serve(respond).url, "k3-secret-key-1234", timeout=10)
    shown = check.describe() + " ".join(check.models)
    assert words in shown, shown
    assert not any(c in shown for c in CONTROL), repr(shown)
    if check.ok:
        assert check.models == ["k3-big"]  # the id that is nothing but escapes is dropped


@pytest.mark.parametrize("respond, words", [
    (endpoint(models=answer("200 OK", b"[" * 100_000)), "did not return OpenAI-style JSON"),
    (endpoint(models=answer("500 Oops", b"[" * 100_000)), "answered 500"),
    (endpoint(chat=answer("200 OK", b"[" * 100_000)), "without choices"),
    (endpoint(models=answer("200 OK", {"data": "abc"}), chat=answer("200 OK", {"choices": 5})),
     "without choices"),
], ids=["models-deep", "error-deep", "chat-deep", "wrong-types"])
def test_endh_malformed_answers_are_a_failed_check_not_an_exception(serve, respond, words):
    check = check_endpoint(serve(respond).url, None, timeout=10)
    assert not check.ok and words in check.message, check.describe()


def test_endh_an_endless_model_list_is_not_read_to_its_end(serve):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
    srv = serve(endpoint(models=lambda: [head, b'{"data": [', *[b" " * 2**16] * 1024]))
    check = check_endpoint(srv.url, None, timeout=10)
    assert not check.ok and "more than 16 MiB" in check.message, check.describe()
    assert srv.cut.wait(30), f"the client read all {srv.sent} bytes"


def test_endh_a_huge_model_id_is_cut(serve):
    srv = serve(endpoint(models=answer("200 OK", {"data": [{"id": "m" * 10**6}]})))
    check = check_endpoint(srv.url, None, timeout=10)
    assert check.ok and check.models == ["m" * MAX_MODEL_ID] and len(check.message) < 2000
