"""The real `k3tui chat` / `k3tui bench tui` entry points, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tui_helpers import REPO_ROOT


def k3(*args: str, timeout: float = 120, stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3tui", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=stdin, cwd=REPO_ROOT)


@pytest.fixture
def loopback_server():
    """The bench's OpenAI-compatible SSE server: 60 tokens, fast."""
    proc = subprocess.Popen([sys.executable, "-m", "k3tui.tui.bench", "--serve", "--tokens", "60",
                             "--rate", "600"], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    line = proc.stdout.readline()
    assert line.startswith("listening on "), line
    yield line.split()[-1]
    proc.kill()
    proc.wait()


def test_tui_cli_chat_refuses_without_terminal():
    out = k3("chat", "--url", "http://127.0.0.1:9", timeout=30)
    assert out.returncode == 2
    assert "needs a terminal" in out.stderr and "--smoke" in out.stderr
    assert "Traceback" not in out.stderr


def test_tui_cli_chat_url_smoke_streams(loopback_server):
    out = k3("chat", "--url", loopback_server + "/v1", "--smoke")
    assert out.returncode == 0, out.stderr
    assert "smoke: 60 tokens streamed, status done" in out.stdout
    assert "ZZENDMARKERZZ" in out.stdout or "answer:" in out.stdout


def test_tui_cli_chat_unreachable_backend_is_one_sentence():
    """It printed `first token 0.0 s after sending` for a turn with no token, and the reason
    without the next step the chat would have shown."""
    out = k3("chat", "--url", "http://127.0.0.1:9", "--smoke", timeout=60)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr + out.stdout
    assert "first token" not in out.stdout
    lines = out.stderr.splitlines()
    assert lines[0].startswith("smoke: no answer (error after ") and \
        lines[0].endswith("Could not connect to the backend at http://127.0.0.1:9.")
    assert lines[1].startswith("next: start it with `k3tui serve`")


@pytest.mark.parametrize("url", ["ftp://host/v1", "127.0.0.1:8080"])
def test_tui_cli_chat_url_must_be_http(url):
    out = k3("chat", "--url", url, "--smoke", timeout=30)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines() == [
        f"k3tui: --url {url} is not an http:// or https:// address.",
        "  next: e.g. `k3tui chat --url http://127.0.0.1:8080/v1`"]


def test_tui_cli_missing_api_key_env(monkeypatch):
    monkeypatch.delenv("K3_TEST_NO_SUCH_KEY", raising=False)
    out = k3("chat", "--url", "http://127.0.0.1:9", "--api-key-env", "K3_TEST_NO_SUCH_KEY",
             "--smoke", timeout=30)
    assert out.returncode == 2 and "K3_TEST_NO_SUCH_KEY" in out.stderr


def test_tui_cli_no_config_without_terminal_points_to_demo():
    out = k3("chat", "--smoke", timeout=30)
    assert out.returncode == 2
    assert "k3tui chat --demo" in out.stderr and "Traceback" not in out.stderr


def test_tui_cli_bench_json_small():
    out = k3("bench", "tui", "--json", "--tokens", "300", "--rate", "300", "--idle-s", "1",
             timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) >= {"lag_fraction", "cpu_s_per_1000_tokens", "idle_cpu_fraction"}
    assert result["tokens"] == 300
    assert result["lag_fraction"] >= 0 and result["cpu_s_per_1000_tokens"] > 0
    assert 0 <= result["idle_cpu_fraction"] <= result["idle_app_cpu_fraction"] < 0.5
