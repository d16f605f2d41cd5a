"""The read-load twin: the resident decode, unchanged, with the streamed rung's reads."""

from __future__ import annotations

import pytest

from engine.bench.readload import ReadLoad
from engine.bench.stream import run_rung
from engine.checkpoint.synth import synthesize
from engine.decode.generate import GenParams, generate
from engine.model.transformer import Model, load_model
from engine.weights.planner import make_plan
from k3vocab import GB
from engine.weights.resident import ResidentSource
from engine.weights.streaming import CheckpointMap

PROMPT = [5, 17, 99, 3]


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("ck") / "small", "small", seed=3)


def test_read_load_issues_its_reads_and_leaves_the_decode_alone(ck):
    cmap = CheckpointMap(ck)
    g = cmap.geometry()
    twin = load_model(ck, ResidentSource(ck))
    want = [t.id for t in generate(twin, PROMPT, GenParams(max_tokens=4))]
    load = ReadLoad(twin.source, cmap, threads=2, reads_per_layer=1.5)
    try:
        toks = list(generate(Model(twin.config, load), PROMPT, GenParams(max_tokens=4)))
        while load.pool.busy():
            pass
        calls = g.moe_layers * len(toks)  # one experts() per MoE layer per forward pass
        assert [t.id for t in toks] == want  # the load never touches the decode's bytes
        assert load._issued == int(calls * 1.5)  # 1.5 per layer on average, none lost
        assert load.pool.bytes_read >= load._issued * g.expert_bytes  # and all were read
    finally:
        load.close()


def test_rung_with_only_experts_streaming_times_the_loaded_twin(ck):
    g = CheckpointMap(ck).geometry()
    budget = (g.trunk_bytes + (g.top_k + 4) * g.expert_slot_bytes) / GB
    plan = make_plan(g, budget_gb=budget, check_memory=False)
    assert len(plan.pinned) == g.n_layers and plan.expert_slots < g.n_experts * g.moe_layers
    r = run_rung(ck, f"{budget:.6f}", 5, 2, None)
    assert r["loaded_s_per_token"] > 0
    # its wait for the reads after its turns is part of its s/token, and they were timed
    assert 0 <= r["loaded_drain_s_per_token"] <= r["loaded_s_per_token"]
    assert r["loaded_read_gb_per_s"] > 0
    # expert reads per layer, as the streamed decode issued them: some (its cache is smaller
    # than one token's experts), at most a layer's top-k misses plus as many guesses
    assert 0 < r["loaded_reads_per_layer"] <= 2 * g.top_k
