"""The forecast from measured parts (engine.decode.forecast) and `bench parts` refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.decode.forecast import LayerKinds, Parts, forecast
from engine.weights.plan_cli import plan_for, real_config
from engine.weights.planner import GB

PARTS = {"disk": {"sequential_gb_per_s": 2.0, "expert_gb_per_s": 1.0},
         "compute": {"kda_moe_layer_s": 0.1, "mla_moe_layer_s": 0.05, "dense_layer0_s": 0.2,
                     "head_s": 0.3}}


def test_forecast_adds_what_the_engine_cannot_overlap():
    parts, kinds = Parts.from_dict(PARTS), LayerKinds.of(real_config())
    assert (kinds.n_kda_moe, kinds.n_mla_moe, kinds.n_dense) == (68, 24, 1)
    compute = 68 * 0.1 + 24 * 0.05 + 0.2
    laptop = plan_for("real", "laptop")  # ring of one: trunk reads and compute add
    f = forecast(parts, kinds, laptop)
    g = laptop.geometry
    misses = 16 * 92 * (1 - laptop.expert_slots / (896 * 92)) * g.expert_bytes
    want = (laptop.streamed_trunk_bytes / 2e9 + compute + max(g.table_bytes / 2 / 2e9, 0.3)
            + misses / 1e9)
    assert f["s_per_token"] == pytest.approx(want)
    assert f["bound"] == "disk"
    assert f["peak_rss_gb"] == pytest.approx(laptop.forecast_rss_bytes / GB)
    desk = forecast(parts, kinds, plan_for("real", "desktop"))  # ring of two: they overlap
    d_plan = plan_for("real", "desktop")
    assert desk["s_per_token"] == pytest.approx(
        max(d_plan.streamed_trunk_bytes / 2e9, compute) + 0.3
        + 16 * 92 * (1 - d_plan.expert_slots / (896 * 92)) * g.expert_bytes / 1e9)
    # a 500-token prompt reads more distinct experts than a 50-token one, never more than all
    gb = f["prefill_expert_gb_by_prompt"]
    assert 0 < gb["50"] < gb["500"] <= 896 * 92 * g.expert_bytes / GB
    assert f["first_token_s_by_prompt"]["500"] > f["first_token_s"]


@pytest.mark.parametrize("bad", [{}, {"disk": "x"}, {**PARTS, "compute": {**PARTS["compute"],
                                                                          "head_s": -1}}])
def test_parts_refuse_missing_or_nonpositive_figures(bad):
    with pytest.raises(ValueError, match="bench parts"):
        Parts.from_dict(bad)


def test_bench_parts_refuses_a_missing_folder(tmp_path):
    out = subprocess.run([sys.executable, "-m", "engine", "bench", "parts", "--dir",
                          str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "not a folder" in out.stderr and "Traceback" not in out.stderr
