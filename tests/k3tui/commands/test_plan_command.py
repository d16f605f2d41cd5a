"""`k3tui plan` shows the llama-server command as `k3tui serve` will really run it: inside
the systemd-run scope that applies the memory limit, with the flags k3tui always adds; and
`k3tui serve --dry-run --model X.gguf` picks llama-server for a GGUF by itself."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys

import pytest

from k3tui.probe import load_report

WRAPPER = ["systemd-run", "--user", "--scope", "--quiet"]


def k3(*args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "k3tui", *args], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ), stdin=subprocess.DEVNULL, check=False)
    assert p.returncode == 0, p.stderr
    return p


def line_after(text: str, label: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(label))[len(label):]


def plan_command(machine: str) -> tuple[list[str], str]:
    out = k3("plan", "--machine", machine, "--model", "gguf").stdout
    return line_after(out, "Command: ").split(), out


def flags(argv: list[str]) -> list[str]:
    return sorted(a for a in argv if a.startswith("-") and not a.startswith("-p"))


def test_polish_plan_shows_the_systemd_wrapper_with_the_limit():
    cmd, out = plan_command("dgx-spark")
    limit = int(line_after(out, "Memory limit: ").split("(")[1].split()[0])
    assert cmd[:4] == WRAPPER
    assert cmd[4:cmd.index("--")] == ["-p", f"MemoryMax={limit}", "-p", "MemorySwapMax=0"]
    server = cmd[cmd.index("--") + 1:]
    assert server[0] == "llama-server"
    assert "--no-warmup" in server and "--metrics" in server       # added at every launch
    assert "--cpu-moe" in server and "--no-host" in server
    assert "applied by the systemd-run wrapper" in out


def test_polish_plan_without_isolation_says_the_limit_is_not_applied(tmp_path):
    report = load_report("dgx-spark")
    report.isolation = dataclasses.replace(report.isolation, method="none",
                                           systemd_run_scope=False,
                                           detail="systemd-run is not available")
    box = tmp_path / "box.json"
    box.write_text(report.to_json())
    cmd, out = plan_command(str(box))
    assert cmd[0] == "llama-server" and "systemd-run" not in cmd
    assert "NOT applied" in out and "systemd-run is not available" in out


@pytest.fixture
def tiny_gguf(tmp_path):
    gguf = pytest.importorskip("gguf")
    from k3tui.backends.llama.binary import find_binary
    from k3tui.errors import K3Error

    try:
        find_binary("")
    except K3Error:
        pytest.skip("no llama-server binary here (the test extra installs one on x86-64)")
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_name("tiny")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_polish_plan_command_matches_what_serve_would_run(tiny_gguf):
    planned, _ = plan_command("dgx-spark")
    # no --backend: a .gguf runs only in llama-server, whatever the default config says
    out = k3("serve", "--dry-run", "--machine", "dgx-spark", "--model", str(tiny_gguf)).stdout
    real = shlex.split(line_after(out, "command: "))
    assert real[:4] == WRAPPER and planned[:planned.index("--") + 1] == \
        real[:real.index("--") + 1]                    # the same wrapper, the same limit
    assert flags(planned) == flags(real)               # the same flags, nothing left out


@pytest.mark.slow
def test_plan_shows_the_pool_with_an_unreachable_worker():
    from llama_helpers import refused_port

    from k3tui.config import Config, save_config

    with refused_port() as port:
        cfg = Config()
        cfg.model.kind, cfg.backend.kind = "gguf", "llama-server"
        cfg.llama_server.rpc = [f"127.0.0.1:{port}"]
        save_config(cfg)
        out = k3("plan").stdout
    assert f"--rpc 127.0.0.1:{port}" in line_after(out, "Command: ")
    pool = out[out.index("Pool:"):]
    assert f"127.0.0.1:{port}: 0 of 93 layers (no answer: refused the connection" in pool
    assert "the pool cannot hold the model: it needs 540.3 GiB" in pool
    assert "no GPU: llama-server runs the GGUF on the CPU" not in out  # the workers compute
