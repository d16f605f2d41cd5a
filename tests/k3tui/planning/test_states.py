"""The bundled engine's state folder, through the real CLI: `k3tui plan` prints its budget
and the real model's state size, `k3tui doctor` what it holds (files a real engine wrote),
`k3tui config clear-states` removes the state files and nothing else, never through a
symlink."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine.serve import durable
from k3tui.planning import states
from tests.engine.serve.test_serve_process import CHAT, ServeProcess, small_ckpt  # noqa: F401

OWNER = "a" * 64


def k3(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, K3TUI_HOME=str(home), NO_COLOR="1")
    return subprocess.run([sys.executable, "-m", "k3tui", *args], capture_output=True,
                          text=True, env=env, stdin=subprocess.DEVNULL, timeout=120)


def states_line(home: Path) -> str:
    p = k3(home, "doctor")
    return next(line for line in p.stdout.splitlines() if " states " in line)


def test_names_are_the_engines():
    assert states.OWNER_NAME.pattern == durable._OWNER.pattern
    assert states.STATE_NAME.pattern == durable._NAME.pattern


def test_plan_prints_the_budget_and_a_real_state_size(tmp_path):
    p = k3(tmp_path, "plan", "--machine", "dgx-spark", "--kind", "safetensors")
    assert p.returncode == 0, p.stderr
    assert f"States:  up to 16 GB in {tmp_path / 'states'}" in p.stdout, p.stdout
    assert "465 MB + 55.3 KB a token of context, 0.92 GB at 8,192 tokens" in p.stdout
    facts = json.loads(k3(tmp_path, "plan", "--machine", "dgx-spark", "--kind",
                          "safetensors", "--json").stdout)["states"]
    assert facts["budget_gb"] == 16 and facts["ctx"] == 8192
    assert facts["state_bytes_at_ctx"] == 465_300_000 + 8192 * 55_300


def test_real_engine_states_are_shown_and_cleared_never_through_a_symlink(
        tmp_path, small_ckpt):  # noqa: F811
    home = tmp_path / "home"
    root = home / "states"
    assert "no kept conversation states yet" in states_line(home)
    srv = ServeProcess(str(small_ckpt), "--port", "0", "--state-dir", str(root))
    try:
        resp = httpx.post(srv.url + CHAT, json={"messages": [{"role": "user", "content": "Hi"}],
                                                "max_tokens": 4}, timeout=120)
        assert resp.status_code == 200, resp.text
    finally:
        srv.stop()
    made = sorted(root.glob("*/*.k3s"))
    assert made, "the engine kept no state"
    size = sum(f.stat().st_size for f in made)
    old = time.time() - 3 * 86400
    os.utime(made[0], (old, old))
    line = states_line(home)
    assert f"{len(made)} kept conversation state(s)" in line and "of 16 GB" in line, line
    assert "the oldest used 3 days ago" in line, line

    # what is not a state file of an owner folder stays, and no symlink is followed
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / ("1" * 32 + ".k3s")
    secret.write_bytes(b"not yours")
    (root / OWNER).symlink_to(outside)                     # an owner folder that is a link
    (made[0].parent / ("2" * 32 + ".k3s")).symlink_to(secret)  # a state name that is a link
    keep = [made[0].parent / ("3" * 32 + ".txt"), made[0].parent / ".x.123.tmp",
            root / "notes" / ("4" * 32 + ".k3s")]
    for path in keep:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"kept")

    p = k3(home, "config", "clear-states")
    assert p.returncode == 0, p.stderr
    assert f"Removed {len(made)} kept conversation state(s)" in p.stdout, p.stdout
    assert f"{size / 1e6:.1f} MB freed" in p.stdout or f"{size / 1e3:.1f} KB freed" in p.stdout
    assert not any(f.exists() for f in made)
    assert secret.read_bytes() == b"not yours" and all(f.read_bytes() == b"kept" for f in keep)
    assert (made[0].parent / ("2" * 32 + ".k3s")).is_symlink()
    assert "no kept conversation states yet" in states_line(home)
    assert "No kept conversation states" in k3(home, "config", "clear-states").stdout


def test_over_budget_is_a_warning(tmp_path):
    folder = tmp_path / "states" / "local"
    folder.mkdir(parents=True)
    with open(folder / ("5" * 32 + ".k3s"), "wb") as f:
        f.truncate(17 * 10**9)  # sparse: 17 GB by stat, nothing on disk
    line = states_line(tmp_path)
    assert line.split()[0] == "warn" and "over its budget" in line, line


def test_a_state_folder_that_is_a_symlink_is_neither_read_nor_cleared(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "local").mkdir(parents=True)
    victim = elsewhere / "local" / ("6" * 32 + ".k3s")
    victim.write_bytes(b"x")
    home = tmp_path / "home"
    home.mkdir()
    (home / "states").symlink_to(elsewhere)
    line = states_line(home)
    assert line.split()[0] == "warn" and "is not a folder (a symlink?)" in line, line
    p = k3(home, "config", "clear-states")
    assert p.returncode != 0 and "nothing was removed" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and victim.read_bytes() == b"x"
