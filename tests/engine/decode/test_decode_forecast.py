"""The forecast from measured parts (engine.decode.forecast) and `bench parts` refusals."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from engine.checkpoint.synth import flat_config
from engine.decode.forecast import LayerKinds, Parts, expert_hit_rate, forecast
from engine.core.config import ModelConfig
from engine.weights.geometry import geometry_from_config, plan_for, real_config
from engine.weights.planner import make_plan
from k3vocab import GB

PARTS = {"disk": {"sequential_gb_per_s": 2.0, "chunk_gb_per_s": 2.0, "expert_gb_per_s": 1.0},
         "compute": {"kda_moe_layer_s": 0.1, "mla_moe_layer_s": 0.05, "dense_layer0_s": 0.2,
                     "head_s": 0.3, "kda_moe_pre_experts_s": 0.04,
                     "mla_moe_pre_experts_s": 0.02, "routed_experts_s": 0.032,
                     "guess_hit_rate": 0.9}}
SLICE = geometry_from_config(ModelConfig.from_dict(flat_config("slice")))
SLICE_KINDS = LayerKinds.of(ModelConfig.from_dict(flat_config("slice")))


def slice_plan(budget: float, **changes):
    return replace(make_plan(SLICE, budget_gb=budget, check_memory=False), **changes)


def test_a_resident_plan_costs_its_compute_alone():
    parts = Parts.from_dict(PARTS)
    assert SLICE_KINDS.kinds == ("dense", "kda", "kda", "mla")
    every = slice_plan((SLICE.trunk_bytes + SLICE.all_experts_bytes) / GB)
    f = forecast(parts, SLICE_KINDS, every)
    assert f["expert_hit_rate"] == 1.0 and f["gb_read_per_token"] == 0
    assert f["s_per_token"] == pytest.approx(0.2 + 2 * 0.1 + 0.05 + 0.3)
    assert f["terms"]["wait_trunk_s"] == f["terms"]["wait_experts_s"] == 0
    assert f["bound"] == "compute"


def test_the_replay_overlaps_what_the_engine_overlaps():
    parts = Parts.from_dict(PARTS)
    compute = 0.2 + 2 * 0.1 + 0.05 + 0.3
    # trunk pinned, experts streamed: the guess starts the misses' reads with the layer
    guessing = slice_plan(7)
    assert guessing.pinned == (0, 1, 2, 3) and guessing.guess_experts
    guessed = forecast(parts, SLICE_KINDS, guessing)
    unguessed = forecast(parts, SLICE_KINDS, replace(guessing, guess_experts=False))
    misses = guessed["gb_read_experts_per_token"] * GB / 1e9  # seconds at 1 GB/s
    assert compute <= guessed["s_per_token"] < unguessed["s_per_token"] < compute + misses
    assert guessed["terms"]["compute_s"] == pytest.approx(compute)
    # a ring of one reads the next layer only when the last one is done: reads and compute
    # add; a second slot reads it while the current one computes
    one = slice_plan(2.7, stream_tables=False)
    assert one.ring_slots == 1 and not one.pinned
    f1 = forecast(parts, SLICE_KINDS, one)
    f2 = forecast(parts, SLICE_KINDS, replace(one, ring_slots=2))
    trunk = one.streamed_trunk_bytes / 2e9
    assert f1["s_per_token"] >= trunk + compute - 0.3  # the head overlaps layer 0's read
    assert f2["s_per_token"] < f1["s_per_token"] - 0.2
    assert f1["terms"]["wait_trunk_s"] > f2["terms"]["wait_trunk_s"] > 0
    # a streamed head costs its chunks' reads beside its matvec
    streamed = forecast(parts, SLICE_KINDS, replace(one, stream_tables=True))
    assert streamed["s_per_token"] > f1["s_per_token"] + SLICE.table_bytes / 2 / 2e9 - 0.3


def test_the_hit_rate_is_the_engine_cache_on_a_cycle():
    # 74 slots for 3 x 64 experts, top-16: more than a token's 48, so plain LRU, which on
    # a cycle of layers keeps less than its share of slots
    plan = slice_plan(7)
    assert plan.expert_slots == 74
    hit = expert_hit_rate(plan)
    assert 0.2 < hit < 74 / 192
    assert expert_hit_rate(slice_plan(9.1)) == 1.0


def test_the_real_model_forecast():
    parts, kinds = Parts.from_dict(PARTS), LayerKinds.of(real_config())
    assert (kinds.count("kda"), kinds.count("mla"), kinds.count("dense")) == (68, 24, 1)
    laptop = plan_for("real", "laptop")
    f = forecast(parts, kinds, laptop)
    g = laptop.geometry
    assert f["bound"] == "disk" and f["s_per_token"] >= laptop.streamed_trunk_bytes / 2e9
    assert f["peak_rss_gb"] == pytest.approx(laptop.forecast_rss_bytes / GB)
    assert forecast(parts, kinds, plan_for("real", "desktop"))["s_per_token"] < f["s_per_token"]
    # a 500-token prompt reads more distinct experts than a 50-token one, never more than all
    gb = f["prefill_expert_gb_by_prompt"]
    assert 0 < gb["50"] < gb["500"] <= 896 * 92 * g.expert_bytes / GB
    assert f["first_token_s_by_prompt"]["500"] > f["first_token_s"]


@pytest.mark.parametrize("bad", [{}, {"disk": "x"}, {**PARTS, "compute": {**PARTS["compute"],
                                                                          "head_s": -1}},
                                 {**PARTS, "compute": {**PARTS["compute"], "guess_hit_rate": 2}}])
def test_parts_refuse_missing_or_nonpositive_figures(bad):
    with pytest.raises(ValueError, match="bench parts"):
        Parts.from_dict(bad)


def test_bench_parts_refuses_a_missing_folder(tmp_path):
    out = subprocess.run([sys.executable, "-m", "engine", "bench", "parts", "--dir",
                          str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "not a folder" in out.stderr and "Traceback" not in out.stderr


def test_bench_parts_refuses_widths_that_are_not_a_release_layout(tmp_path):
    from engine.checkpoint.synth import synthesize

    small = synthesize(tmp_path / "small", "small")  # its layer 3 is a KDA layer
    for widths, says in ((tmp_path, "config.json does not exist"),
                         (small, "not dense, KDA-MoE and MLA-MoE")):
        out = subprocess.run([sys.executable, "-m", "engine", "bench", "parts", "--dir",
                              str(tmp_path), "--widths", str(widths), "--quick"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and says in out.stderr, out.stderr
        assert out.stderr.startswith("error: --widths:") and "Traceback" not in out.stderr
