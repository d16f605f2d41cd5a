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
