"""`bench stream` on a small real-format checkpoint: it runs, reports the agreed keys, and
the bytes it reports per token are the ones the plan must read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.checkpoint.synth import synthesize
from engine.weights.planner import GB, make_plan
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
    cmap = CheckpointMap(ck)
    payload = g.expert_bytes
    demand = g.top_k * g.moe_layers  # distinct experts a one-token step asks for
    for budget, rung in zip(budgets, res["ladder"]):
        # Computed apart from the bench: a decode step reads every layer its plan does not
        # pin, plus each expert it asked for that was not resident (misses = demand x
        # (1 - hit rate)); read-ahead guesses the router rejected are counted apart.
        plan = make_plan(g, budget_gb=float(budget), check_memory=False)
        assert (rung["pinned_layers"], rung["ring_slots"]) == (len(plan.pinned), plan.ring_slots)
        trunk = sum(cmap.layers[i].payload for i in range(g.n_layers) if i not in plan.pinned)
        experts = demand * (1 - rung["true_hit_rate"]) * payload
        assert rung["gb_read_per_token"] == pytest.approx((trunk + experts) / GB, rel=1e-9)
        assert trunk > 0
    assert res["ladder"][-1]["gb_read_per_token"] == 0  # resident: nothing read
    assert res["ladder"][0]["gb_read_per_token"] > 0
    assert not (tmp_path / "work" / "scratch" / "trunk").exists()  # pack output cleaned up
