"""`python -m engine run` reports: per-token statistics and run totals (--json), and the
human per-step table with a summary and peak RSS, checked against byte counts worked out
from the checkpoint's own layout under the same plan."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.checkpoint.synth import synthesize
from engine.decode.generate import GenParams, generate
from engine.model.transformer import load_model
from engine.weights.planner import MemorySettings, add_memory_arguments
from k3vocab import GB
from engine.weights.streaming import CheckpointMap

REPO = str(Path(__file__).resolve().parents[3])
PROMPT = "3,7,11,5,9,200,17"
TOKEN_KEYS = ("index", "id", "seconds", "compute_s", "wait_trunk_s", "wait_experts_s",
              "gb_read_trunk", "gb_read_experts", "mb_per_s", "true_hit_rate", "expert_hits",
              "expert_misses", "evictions", "rss_gb", "peak_rss_gb", "budget_gb")
TOTAL_KEYS = ("tokens", "decode_tokens", "s_per_token", "compute_s_per_token",
              "wait_trunk_s_per_token", "wait_experts_s_per_token", "gb_read_per_token",
              "gb_read_trunk_per_token", "gb_read_experts_per_token", "mb_per_s",
              "true_hit_rate", "expert_hits", "expert_misses", "evictions", "prefill_seconds",
              "prefill_gb_read", "gb_read", "budget_gb", "peak_rss_gb")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A multi-shard real-format checkpoint: 6 layers, 16 experts top-4."""
    return synthesize(tmp_path_factory.mktemp("run") / "ck", "small", seed=3)


def budget_gb(ck) -> float:
    """Three times the floor: a pinned prefix, two ring slots, a few expert slots."""
    g = CheckpointMap(ck).geometry()
    return 3 * (max(g.layer_bytes) + g.min_expert_slots * g.expert_slot_bytes) / GB


def run_cli(ck, *extra: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "engine", "run", str(ck), "--ids", PROMPT,
                          *extra], check=False, capture_output=True, text=True, cwd=REPO,
                         timeout=180)
    assert out.returncode == 0, out.stderr
    return out


def test_run_json_per_token_stats_and_totals(small):
    budget = f"{budget_gb(small):.9f}"
    res = json.loads(run_cli(small, "--gen", "6", "--budget-gb", budget, "--json").stdout)
    # The plan the CLI made from the same flags.
    p = argparse.ArgumentParser()
    add_memory_arguments(p)
    cmap = CheckpointMap(small)
    g = cmap.geometry()
    plan = MemorySettings.from_args(p.parse_args(["--budget-gb", budget])).plan(g)
    assert 0 < len(plan.pinned) < g.n_layers and plan.expert_slots < g.top_k * g.moe_layers
    payload = [lay.payload for lay in cmap.layers]
    streamed = sum(b for i, b in enumerate(payload) if i not in plan.pinned)
    expert = cmap.expert_layout(1, 0).payload

    toks, tot = res["per_token"], res["totals"]
    assert [t["id"] for t in toks] == res["generated_ids"] and len(toks) == 6
    for t in toks:
        assert set(TOKEN_KEYS) <= set(t), set(TOKEN_KEYS) - set(t)
        asked = t["expert_hits"] + t["expert_misses"]
        # Bytes read are the unavoidable minimum: the unpinned trunk (all of it for the
        # prompt) and exactly the experts that were not resident.
        want_trunk = sum(payload) if t["index"] == 0 else streamed
        assert round(t["gb_read_trunk"] * GB) == want_trunk, t
        assert round(t["gb_read_experts"] * GB) == t["expert_misses"] * expert, t
        if t["index"] > 0:  # one token: its top-k distinct experts in every MoE layer
            assert asked == g.top_k * g.moe_layers
            assert t["true_hit_rate"] == pytest.approx(t["expert_hits"] / asked)
        assert 0 < t["rss_gb"] <= t["peak_rss_gb"]
        assert t["budget_gb"] == pytest.approx(plan.budget_bytes / GB)
        assert t["compute_s"] + t["wait_trunk_s"] + t["wait_experts_s"] <= t["seconds"] + 1e-6
    assert set(TOTAL_KEYS) <= set(tot), set(TOTAL_KEYS) - set(tot)
    decode = toks[1:]
    n = len(decode)
    secs = sum(t["seconds"] for t in decode)
    gb = sum(t["gb_read_trunk"] + t["gb_read_experts"] for t in decode)
    hits = sum(t["expert_hits"] for t in decode)
    misses = sum(t["expert_misses"] for t in decode)
    assert tot["tokens"] == 6 and tot["decode_tokens"] == n == 5
    assert tot["s_per_token"] == pytest.approx(secs / n)
    assert tot["gb_read_per_token"] == pytest.approx(gb / n)
    assert round(tot["gb_read_trunk_per_token"] * GB) == streamed
    assert tot["mb_per_s"] == pytest.approx(gb * 1000 / secs)
    assert (tot["expert_hits"], tot["expert_misses"]) == (hits, misses)
    assert tot["true_hit_rate"] == pytest.approx(hits / (hits + misses))
    assert round(tot["gb_read"] * GB) == sum(payload) + (n * streamed) + sum(
        t["expert_misses"] for t in toks) * expert
    assert tot["prefill_seconds"] == res["prefill_seconds"] > 0
    # Slots fill empty first, then every further miss evicts one.
    all_misses = sum(t["expert_misses"] for t in toks)
    assert all_misses > plan.expert_slots
    assert sum(t["evictions"] for t in toks) == all_misses - plan.expert_slots
    assert tot["evictions"] == sum(t["evictions"] for t in decode)
    assert tot["peak_rss_gb"] >= max(t["peak_rss_gb"] for t in toks) > 0
    assert res["stats"] == {k: v for k, v in toks[-1].items()
                            if k not in ("index", "id", "seconds")}


def test_run_human_report_has_steps_and_peak_rss(small):
    out = run_cli(small, "--gen", "4", "--budget-gb", f"{budget_gb(small):.9f}").stdout
    lines = out.splitlines()
    assert lines[0].split() == ["step", "token", "seconds", "hit", "%", "GB", "read", "tok/s"]
    steps = [ln.split() for ln in lines[1:5]]
    assert [int(s[0]) for s in steps] == [0, 1, 2, 3] and lines[1].endswith("(prompt)")
    ids = [int(s[1]) for s in steps]
    assert f"generated 4 tokens: {','.join(map(str, ids))}" in out
    assert "s/token" in out and "true resident hit rate" in out and "evictions" in out
    peak = [ln for ln in lines if ln.startswith("PEAK RSS for the whole run:")]
    assert len(peak) == 1 and float(peak[0].split()[6]) > 0


def test_generate_stats_carry_rss_for_a_resident_model(small):
    """No memory flags: the source reports no RSS, generate measures it itself."""
    toks = list(generate(load_model(small), [3, 7, 11], GenParams(max_tokens=2)))
    for t in toks:
        assert 0 < t.stats.rss_gb <= t.stats.peak_rss_gb
        assert t.stats.gb_read_experts == 0 and t.stats.true_hit_rate is None
