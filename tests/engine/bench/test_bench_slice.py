"""`bench slice` on a small checkpoint laid out like the slice (synth tiny: dense layer 0,
KDA-MoE layer 1, MLA-MoE layer 3; under 1 MB), with the parts measured at its widths at
toy cost (K3_BENCH_PARTS_QUICK): the ladder's keys, peak RSS inside the plan's forecast,
the forecast's GB/token against what each run read, and the `max` rung fully resident."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.checkpoint.synth import synthesize
from engine.core.directio import ALIGN
from engine.weights.planner import make_plan
from k3vocab import GB
from engine.weights.streaming import CheckpointMap

REPO = str(Path(__file__).resolve().parents[3])
KEYS = ("budget_gb", "s_per_token", "forecast_s_per_token", "error", "peak_rss_gb",
        "forecast_rss_gb", "gb_read_per_token", "forecast_gb_read_per_token", "terms")


def bench_slice(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "bench", "slice", "--dir",
                           str(folder), *args], capture_output=True, text=True, cwd=REPO,
                          timeout=600, env={**os.environ, "K3_BENCH_PARTS_QUICK": "1"})


def test_bench_slice_ladder_on_a_slice_shaped_checkpoint(tmp_path):
    ck = synthesize(tmp_path / "ck", "tiny", seed=3)
    g = CheckpointMap(ck).geometry()
    small = (max(g.layer_bytes) + (g.min_expert_slots + 1) * g.expert_slot_bytes) / GB
    out = bench_slice(ck, "--budgets", f"{small:.7f},max", "--gen", "3", "--json")
    assert out.returncode == 0, out.stderr
    ladder = json.loads(out.stdout)["ladder"]
    assert len(ladder) == 2
    for r in ladder:
        assert all(r[k] is not None for k in KEYS), r
        assert r["s_per_token"] > 0 and r["forecast_s_per_token"] > 0
        assert r["error"] == pytest.approx(r["forecast_s_per_token"] / r["s_per_token"] - 1)
        assert r["peak_rss_gb"] <= 1.05 * r["forecast_rss_gb"]
        for name in ("compute_s_per_token", "wait_trunk_s_per_token", "wait_experts_s_per_token",
                     "expert_hit_rate", "gb_read_experts_per_token"):
            assert len(r["terms"][name]) == 2, name  # measured beside forecast
        plan = make_plan(g, budget_gb=r["budget_gb"], check_memory=False)
        # The trunk the plan streams is read every token: the run's bytes are its payload,
        # the plan's its aligned buffers (at most two pages more per layer).
        streamed = [i for i in range(g.n_layers) if i not in plan.pinned]
        assert 0 <= plan.streamed_trunk_bytes / GB - r["gb_read_trunk_per_token"] \
            <= 2 * ALIGN * len(streamed) / GB
        # Experts: at most one token's routing apart from the forecast's misses.
        token = g.top_k * g.moe_layers * g.expert_bytes / GB
        assert abs(r["gb_read_per_token"] - r["forecast_gb_read_per_token"]) \
            <= token + 2 * ALIGN * len(streamed) / GB
    low, top = ladder
    assert low["gb_read_trunk_per_token"] > 0 and low["pinned_layers"] < g.n_layers
    # `max` holds every weight: nothing is read per token, and the forecast says so
    assert top["pinned_layers"] == g.n_layers and top["expert_slots"] == g.n_experts * g.moe_layers
    assert top["gb_read_per_token"] == 0 and top["forecast_gb_read_per_token"] == 0
    assert top["terms"]["expert_hit_rate"] == [1.0, 1.0]

    text = bench_slice(ck, "--budgets", "max", "--gen", "2")
    assert text.returncode == 0, text.stderr
    assert "forecast" in text.stdout and "load average" in text.stdout


def test_bench_slice_refuses_another_layout_and_bad_budgets(tmp_path):
    ck = synthesize(tmp_path / "ck", "small", seed=1)  # layer 3 is KDA: not the slice's layout
    out = bench_slice(ck, "--json")
    assert out.returncode != 0 and "not dense, KDA-MoE and MLA-MoE" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    tiny = synthesize(tmp_path / "tiny", "tiny")
    out = bench_slice(tiny, "--budgets", "lots")
    assert out.returncode == 2 and "--budgets takes GB values or max" in out.stderr
