"""llama-server when something is wrong around it (issue 13): a port another server already
answers on, a unified-memory GPU too busy to leave a memory limit, a binary without
--no-host, a chat --smoke whose backend cannot start, and the API key kept out of argv.
Real binary from the pinned wheel; the GPU is the project's recorded nvidia-smi."""

from __future__ import annotations

import contextlib
import http.server
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from llama_helpers import gguf_config, real_binary, systemd_that_applies, write_tiny_gguf

from k3tui.backends.llama import server
from k3tui.backends.launch import prepare_launch
from k3tui.errors import K3Error

GIB = 2**30
REPO = Path(__file__).resolve().parents[2]
FOUNDATION = REPO / "tests" / "k3tui" / "probe"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    real_binary()
    return write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf")[0]


@contextlib.contextmanager
def health_server():
    """Another program's server on a loopback port: answers /health 200 to anyone."""
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's name
            body = b'{"status":"ok"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def slow_binary(tmp_path: Path) -> Path:
    """The real server, exec'd (same pid) a second after it was started: the other
    server's /health is polled while ours is still alive and has not tried to bind."""
    script = tmp_path / "llama-server"
    script.write_text(f"""#!/bin/sh
case "$1" in --help|--version) exec "{real_binary()}" "$@";; esac
sleep 1
exec "{real_binary()}" "$@"
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_a_port_another_server_answers_on_is_not_taken_for_ours(model, started, tmp_path):
    with health_server() as port:
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        prepared = server.prepare(model, binary=str(slow_binary(tmp_path)), port=port,
                              ctx_size=2048, threads=1)
        with pytest.raises(K3Error) as exc:
            started.append(server.start(prepared))  # was: "ready" (the other server's 200)
    first = exc.value.message.splitlines()[0]
    assert "exited with code 1 while loading" in first and "couldn't bind" in first, first
    assert str(port) in first and "port is taken" in exc.value.next_step


def busy_small_unified_machine():
    """A GB10 (unified memory) whose GPU ollama holds 36 GiB of, with 60 GiB in all:
    60 - 25 (driver and system) - 36 leaves nothing for llama-server."""
    from k3tui.probe import load_report
    from k3tui.probe.env import ProbeEnv
    from k3tui.probe.gpu import probe_gpu

    report = load_report("dgx-spark")
    smi = [sys.executable, str(FOUNDATION / "fake_nvidia_smi.py"),
           str(FOUNDATION / "data" / "nvidia-smi" / "busy")]
    report.gpu = probe_gpu(ProbeEnv(nvidia_smi=smi, use_nvml=False))
    report.memory.total_bytes = 60 * GIB
    return report


def test_a_limit_that_computes_to_nothing_is_refused_and_force_warns(model):
    report = busy_small_unified_machine()
    assert report.gpu.unified_memory and report.gpu.apps[0].used_bytes == 36 * GIB
    cfg = gguf_config(model)
    with pytest.raises(K3Error) as exc:
        prepare_launch(cfg, report=report, runner=systemd_that_applies)
    msg = exc.value.message
    assert "will not start llama-server" in msg and "only 0.0 GiB would be left" in msg, msg
    assert "60.0 GiB unified memory" in msg and "36.0 GiB held by other GPU processes" in msg
    assert "--force" in exc.value.next_step and exc.value.exit_code == 2
    ready = prepare_launch(cfg, report=report, runner=systemd_that_applies, force=True)
    risk = next(w for w in ready.warnings if "only 0.0 GiB would be left" in w)
    assert risk.startswith("--force") and "freezes" in risk
    assert risk in ready.describe()


def test_a_binary_without_no_host_is_refused_for_cpu_moe_on_unified_memory(model, tmp_path):
    real = real_binary()
    old = tmp_path / "llama-server"
    old.write_text(f"""#!/bin/sh
case "$1" in
  --help) "{real}" --help 2>&1 | grep -v -- '--no-host'; exit 0;;
  --version) echo "version: 4000 (build 4000, commit 01dbeef)"; exit 0;;
esac
exec "{real}" "$@"
""")
    old.chmod(old.stat().st_mode | stat.S_IEXEC)
    from k3tui.probe import load_report

    cfg = gguf_config(model)
    cfg.llama_server.binary = str(old)
    with pytest.raises(K3Error) as exc:
        prepare_launch(cfg, report=load_report("dgx-spark"), runner=systemd_that_applies)
    assert "no --no-host" in exc.value.message and "545 GB" in exc.value.message
    assert "b10434" in exc.value.next_step  # a version that has it


def test_chat_smoke_whose_backend_cannot_start_fails_with_the_reason(tmp_path):
    from k3tui.config import save_config

    missing = tmp_path / "gone.gguf"
    save_config(gguf_config(missing))
    try:
        done = subprocess.run([sys.executable, "-m", "k3tui", "chat", "--smoke"], cwd=REPO,
                              capture_output=True, text=True, timeout=120,  # a hang guard
                              stdin=subprocess.DEVNULL, env=dict(os.environ), check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("chat --smoke hung when the backend could not start")
    assert done.returncode != 0
    assert f"The GGUF model {missing} does not exist." in done.stderr, done.stderr
    assert "next:" in done.stderr and "Traceback" not in done.stderr


def test_the_api_key_reaches_the_real_server_in_a_0600_file_not_argv(model, started):
    key = "k3-test-secret-" + "x" * 20
    # 127.0.0.2 is loopback on Linux but not in k3tui's loopback set: it needs a key
    prepared = server.prepare(model, host="127.0.0.2", api_key=key, ctx_size=2048, threads=1)
    assert key not in prepared.describe()
    backend = server.start(prepared)
    started.append(backend)
    cmdline = Path(f"/proc/{backend.pid}/cmdline").read_bytes().split(b"\0")
    assert key.encode() not in b" ".join(cmdline) and b"--api-key" not in cmdline
    key_file = Path(cmdline[cmdline.index(b"--api-key-file") + 1].decode())
    assert key_file.read_text().strip() == key
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    assert httpx.get(backend.base_url + "/props").status_code == 401  # /v1/models is public
    ok = httpx.get(backend.base_url + "/props", headers={"Authorization": f"Bearer {key}"})
    assert ok.status_code == 200
    assert stat.S_IMODE(Path(backend.log_path).stat().st_mode) == 0o600  # its log is private
    backend.stop()
    assert not key_file.exists()  # gone with the server
