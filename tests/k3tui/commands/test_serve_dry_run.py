"""`k3tui serve --dry-run --machine NAME` as a user runs it before any model is here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_ls_dry_run_for_a_profile_without_a_model_shows_the_plan():
    res = subprocess.run([sys.executable, "-m", "k3tui", "serve", "--dry-run", "--machine",
                          "dgx-spark"], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ), stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "placeholder" in out and "--cpu-moe --no-host --load-mode mmap" in out
    assert "96.7 GiB" in out and "--reasoning-budget 2048" in out


def test_ls_dry_run_after_setup_says_the_configured_checkpoint_is_not_here_yet(tmp_path):
    """After `k3tui setup`, before the download, it said "No model is configured here"."""
    k3 = [sys.executable, "-m", "k3tui"]
    folder = tmp_path / "not-downloaded"
    setup = subprocess.run([*k3, "setup", "--yes", "--model-dir", str(folder), "--force"],
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert setup.returncode == 0, setup.stderr
    res = subprocess.run([*k3, "serve", "--dry-run", "--machine", "dgx-spark"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"The configured checkpoint {folder} is not here; this is "
                                 "what k3tui would run on dgx-spark"), res.stdout
    assert "No model is configured" not in res.stdout


def test_ls_bundled_dry_run_names_the_port_and_load_phase_reads_as_a_phase(tmp_path):
    from k3tui.backends.llama.server import _load_phase

    res = subprocess.run([sys.executable, "-m", "k3tui", "serve", "--backend", "bundled",
                          "--model", str(tmp_path), "--port", "18123", "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env=dict(os.environ),
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0 and "--port 18123" in res.stdout, res.stdout + res.stderr
    phase = _load_phase({"progress": {"phase": "model", "n_layers": 6, "layers_bound": 2}})
    assert phase == "now: model (layers 2/6)"
