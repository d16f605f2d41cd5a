"""What a new user meets first: `k3tui doctor` before any config points at `k3tui setup`
before `k3tui download` (which cannot know the repo yet), and `k3tui download --help` says
the download is a detached job that Ctrl-C only detaches from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from k3tui.config import Config, save_config


def k3(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3tui", *args], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ),
                          stdin=subprocess.DEVNULL, check=False)


def model_check(tmp_path) -> dict:
    data = json.loads(k3("doctor", "--json").stdout)
    return next(c for c in data["checks"] if c["name"] == "model")


def test_polish_doctor_without_config_says_setup_before_download(tmp_path):
    check = model_check(tmp_path)
    assert check["status"] == "warn"
    assert check["next"].startswith("`k3tui setup`") and "k3tui download" in check["next"]
    p = k3("download")                      # what the old advice led to
    assert p.returncode == 2 and "No model is configured" in p.stderr
    cfg = Config()
    cfg.model.dir = str(tmp_path / "m")
    save_config(cfg)
    assert model_check(tmp_path)["next"] == "k3tui download"   # configured: straight on


def test_polish_download_help_says_it_is_a_detached_job():
    out = " ".join(k3("download", "--help").stdout.split())
    assert "Ctrl-C only detaches" in out and "Rerun the same command" in out
    assert "k3tui jobs" in out


def test_polish_serve_dry_run_refuses_a_missing_checkpoint(tmp_path):
    missing = tmp_path / "not-downloaded"
    p = k3("serve", "--dry-run", "--backend", "bundled", "--model", str(missing))
    assert p.returncode == 1 and f"{missing} does not exist" in p.stderr
    assert "k3tui download" in p.stderr and "Traceback" not in p.stderr
