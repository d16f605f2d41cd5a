"""`bench stream` on a small real-format checkpoint: it runs and reports the agreed keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.checkpoint.synth import synthesize
from engine.weights.planner import GB
from engine.weights.streaming import CheckpointMap

REPO = str(Path(__file__).resolve().parents[3])


def test_stream_bench_json_keys(tmp_path):
    ck = synthesize(tmp_path / "ck", "small", seed=5)
    g = CheckpointMap(ck).geometry()
    floor = (2 * max(g.layer_bytes) + g.min_expert_slots * g.expert_slot_bytes) / GB
    budgets = [f"{floor:.6f}", f"{floor * 1.5:.6f}"]
    out = subprocess.run(
        [sys.executable, "-m", "engine.bench.stream", "--checkpoint", str(ck), "--budget-gb",
         budgets[0], "--ladder", ",".join(budgets), "--tokens", "3", "--json",
         "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    for key in ("checkpoint_gb", "budget_gb", "s_per_token", "gb_read_per_token",
                "raw_gb_per_s", "efficiency", "peak_rss_gb", "pack_ratio_vs_cp", "ladder"):
        assert res[key] is not None, key
    assert res["ids_identical"] is True
    assert len(res["ladder"]) == 3  # two budgets + everything resident
    for rung in res["ladder"]:
        for key in ("budget_gb", "s_per_token", "gb_read_per_token", "compute_s_per_token",
                    "bound_s_per_token", "overlap_ratio"):
            assert rung[key] is not None, key
        assert rung["overlap_ratio"] == rung["s_per_token"] / rung["bound_s_per_token"]
    assert res["ladder"][-1]["gb_read_per_token"] == 0  # resident: nothing read
    assert res["ladder"][0]["gb_read_per_token"] > 0
    assert not (tmp_path / "work" / "scratch" / "trunk").exists()  # pack output cleaned up
