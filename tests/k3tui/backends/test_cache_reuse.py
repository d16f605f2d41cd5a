"""llama-server's prompt cache: `--cache-reuse` goes on the command only when the binary's
--help lists it (the real bundled binary does), and chat requests ask for `cache_prompt`."""

from __future__ import annotations

from pathlib import Path

from llama_helpers import real_binary

from k3tui.backends.llama import binary as lb
from k3tui.backends.llama import command as lc


def _command(info: lb.BinaryInfo, tmp_path: Path) -> lc.LlamaCommand:
    shard = tmp_path / "m.gguf"
    shard.write_bytes(b"GGUF")
    return lc.build_command(info, [shard], plan_args=lc.BASE_ARGS, port=8080)


def test_ls_cache_reuse_only_when_the_binary_lists_it(tmp_path):
    real = lb.inspect_binary(real_binary())
    argv = _command(real, tmp_path).argv
    assert argv[argv.index("--cache-reuse") + 1] == "256"
    older = lb.BinaryInfo(real.path, real.version, real.flags - {"--cache-reuse"},
                          real.canonical, real.removed, real.envs)
    cmd = _command(older, tmp_path)
    assert "--cache-reuse" not in cmd.argv
    assert any("--cache-reuse" in w for w in cmd.warnings)


def _capture_server(bodies: list):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_ls_chat_asks_llama_server_for_its_prompt_cache():
    import asyncio

    from k3tui.backends.running import RunningBackend

    bodies: list = []
    srv = _capture_server(bodies)
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"

        async def ask(kind):
            backend = RunningBackend(kind, url, None, "k3")
            return [e async for e in backend.chat([{"role": "user", "content": "x"}])]

        for kind in ("llama-server", "remote"):
            asyncio.run(ask(kind))
    finally:
        srv.shutdown()
    assert bodies[0]["cache_prompt"] is True
    assert "cache_prompt" not in bodies[1]  # other servers may refuse unknown fields
