"""`bench stream` on a small real-format checkpoint: it runs, reports the agreed keys, and
the bytes it reports per token are the ones the plan must read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.checkpoint.synth import synthesize
from engine.weights.planner import make_plan
from k3vocab import GB
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
                "raw_gb_per_s", "peak_rss_gb", "pack_ratio_vs_cp", "ladder", "raw_best"):
        assert res[key] is not None, key
    # An efficiency is only ever printed against a reference the decode did not beat.
    assert (res["efficiency"] is None) == (res["reference_error"] is not None)
    assert res["efficiency"] is None or res["efficiency"] <= 1.0
    # raw is the best of a sweep that includes the engine's own demand reads (1 MiB chunks
    # at the plan's reader count) and the best it found
    head = res["ladder"][0]
    sweep = {(r["request_bytes"], r["queue_depth"]): r["gb_per_s"] for r in head["raw_sweep"][0]}
    assert (1 << 20, head["threads"]) in sweep
    assert head["raw_gb_per_s"] == max(g for s in head["raw_sweep"] for g in
                                       (r["gb_per_s"] for r in s))
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
    # every rung, the resident one included, has turns timed against its twin
    for rung in res["ladder"]:
        lo, hi = rung["overlap_range"]
        assert 0 < lo <= hi and rung["rounds"]
    # the reads' own CPU is measured per configuration of the sweep (never free)
    assert all(r["cpu_s_per_gb"] > 0 for r in head["raw_sweep"][0])
    # these rungs stream trunk layers: no read-load twin (it loads expert reads only)
    assert all(r["loaded_s_per_token"] is None for r in res["ladder"])
    assert res["ladder"][0]["gb_read_per_token"] > 0
    assert not (tmp_path / "work" / "scratch" / "trunk").exists()  # pack output cleaned up


def _one_rung(r: dict) -> dict:
    """A bench result around one assessed rung, for `render`."""
    return {"checkpoint_gb": 6.0, "budget_gb": r["budget_gb"], "s_per_token": r["s_per_token"],
            "gb_read_per_token": r["gb_read_per_token"],
            "mb_per_s": r["gb_read_per_token"] * 1000 / r["s_per_token"],
            "raw_gb_per_s": r["raw_gb_per_s"],
            "raw_best": {"request_bytes": 1 << 20, "queue_depth": 8},
            "efficiency": r["efficiency"],
            "compute_only_s_per_token": r["compute_only_s_per_token"], "peak_rss_gb": 1.0,
            "rss_limit_gb": 1.7, "ids_identical": True, "ladder": [r]}


def test_stream_bench_reports_a_raw_figure_below_the_decode_as_a_bug():
    """A decode that read its useful bytes faster than 'raw' proves raw wrong: no
    efficiency is printed, the rung says reference bug."""
    from engine.bench.stream import assess, render

    rung = {"budget": "1", "budget_gb": 1.0, "s_per_token": 0.2, "gb_read_per_token": 0.5,
            "gb_unused_per_token": 0.1, "compute_only_s_per_token": 0.07,
            "raw_gb_per_s": 2.0, "engine_device_gb_per_s": 2.4, "pinned_layers": 0,
            "disk_busy_fraction": 1.0, "peak_rss_gb": 1.0}
    r = assess(dict(rung))
    assert r["efficiency"] is None and "reference bug" in r["reference_error"]
    assert r["bound_s_per_token"] == pytest.approx(0.25)  # useful bytes only: 0.5 / 2.0
    text = render(_one_rung(r))
    assert "reference bug" in text and "efficiency 1.25" not in text
    ok = assess(dict(rung, raw_gb_per_s=4.0, engine_device_gb_per_s=3.0))
    assert ok["reference_error"] is None and ok["efficiency"] == pytest.approx(0.625)


def test_stream_bench_overlap_by_turn_is_each_turn_against_its_own_twin_turn():
    """The spread printed beside the overlap: each alternating turn's streamed s/token over
    that turn's twin (or the I/O time where the disk bounds), lowest and highest."""
    from engine.bench.stream import assess, render

    rung = {"budget": "1", "budget_gb": 1.0, "s_per_token": 0.14, "gb_read_per_token": 0.2,
            "gb_unused_per_token": 0.0, "compute_only_s_per_token": 0.11,
            "raw_gb_per_s": 2.0, "pinned_layers": 13, "disk_busy_fraction": 0.5,
            "peak_rss_gb": 1.0, "rounds": [(0.10, 0.15), (0.12, 0.13), (0.08, 0.12)]}
    r = assess(dict(rung))
    # io = 0.2 / 2.0 = 0.1 s: the third turn's twin (0.08) is below it, so 0.12 / 0.1
    assert r["overlap_range"] == pytest.approx([0.13 / 0.12, 0.15 / 0.10])
    assert assess(dict(rung, rounds=[]))["overlap_range"] is None
    assert " 1.08-1.50 " in render(_one_rung(r))


def test_stream_bench_vs_load_is_the_streamed_decode_against_the_loaded_twin():
    """Beside the headline: s/token over max(the twin under the same reads, the I/O time)."""
    from engine.bench.stream import assess, render

    rung = {"budget": "1", "budget_gb": 1.0, "s_per_token": 0.14, "gb_read_per_token": 0.2,
            "gb_unused_per_token": 0.0, "compute_only_s_per_token": 0.11,
            "raw_gb_per_s": 2.0, "pinned_layers": 13, "disk_busy_fraction": 0.5,
            "peak_rss_gb": 1.0, "loaded_s_per_token": 0.125, "loaded_drain_s_per_token": 0.03,
            "loaded_read_gb_per_s": 2.4}
    r = assess(dict(rung))
    assert r["overlap_ratio"] == pytest.approx(0.14 / 0.11)  # the headline is unchanged
    assert r["overlap_vs_loaded"] == pytest.approx(0.14 / 0.125)
    assert assess(dict(rung, loaded_s_per_token=0.05))["overlap_vs_loaded"] == pytest.approx(
        0.14 / 0.1)  # the disk still bounds
    assert assess(dict(rung, loaded_s_per_token=None))["overlap_vs_loaded"] is None
    # loaded, then how much of it was waiting for its reads and their rate, then vs load
    assert "  0.125   0.030    2400    1.12" in render(_one_rung(r))
