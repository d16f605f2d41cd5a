"""StreamingSource end to end: same bytes and same tokens at every budget, minimal reads,
read-ahead that never touches a slot in use, and clear errors instead of missing weights."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from stream_helpers import Recorder

from engine.checkpoint.synth import synthesize
from engine.checkpoint.trunk import pack
from engine.decode.generate import GenParams, generate
from engine.errors import ReadError
from engine.model.transformer import load_model
from engine.core.directio import Layout
from engine.weights.planner import MemorySettings, add_memory_arguments, make_plan
from k3vocab import GB
from engine.weights.resident import ResidentSource
from engine.weights import streaming
from engine.weights.streaming import MODEL_TENSORS, CheckpointMap, StreamingSource, open_source

REPO = str(Path(__file__).resolve().parents[3])
PROMPT = [3, 7, 11, 5, 9, 200, 17]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A multi-shard real-format checkpoint: 6 layers, 16 experts top-4."""
    return synthesize(tmp_path_factory.mktemp("small") / "ck", "small", seed=3)


def source(ck, trunk=None, threads=4, **plan_kw) -> StreamingSource:
    cmap = CheckpointMap(ck, trunk)
    plan = make_plan(cmap.geometry(), threads=threads, **plan_kw)
    return StreamingSource(cmap, plan)


def floor_gb(ck) -> float:
    g = CheckpointMap(ck).geometry()
    return (max(g.layer_bytes) + g.min_expert_slots * g.expert_slot_bytes) / GB


def budgets(ck) -> list[dict]:
    """From the smallest budget that runs (one slot) to everything pinned."""
    g = CheckpointMap(ck).geometry()
    lo = floor_gb(ck)
    two = (2 * max(g.layer_bytes) + g.min_expert_slots * g.expert_slot_bytes) / GB
    return [
        dict(budget_gb=lo),
        dict(budget_gb=two),
        dict(budget_gb=two + max(g.layer_bytes) / GB),  # a pinned prefix + two slots
        dict(budget_gb=(g.trunk_bytes + 2 * g.min_expert_slots * g.expert_slot_bytes) / GB),
    ]


def greedy(ck, src, n=8, prompt=PROMPT) -> list[int]:
    model = load_model(ck, src)
    return [t.id for t in generate(model, prompt, GenParams(max_tokens=n))]


def test_stream_source_serves_the_same_bytes_as_resident(tiny_a):
    res = ResidentSource(tiny_a)
    rng = np.random.default_rng(0)
    for kw in budgets(tiny_a):
        with source(tiny_a, **kw) as src:
            order = list(range(13)) * 3 + [5, 2, 9, 12, 0, 7]  # cyclic, then out of order
            for L in order:
                with src.layer(L) as w, res.layer(L) as ref:
                    assert set(w) == set(ref)
                    for k in ref:
                        assert w[k].dtype == ref[k].dtype and np.array_equal(w[k], ref[k]), (L, k)
                    if L >= 1:
                        ids = sorted(rng.choice(8, size=int(rng.integers(1, 8)), replace=False))
                        with src.experts(L, ids) as ex, res.experts(L, ids) as exr:
                            for e in ids:  # more than the slots at the floor: served in groups
                                for f in ("w1_packed", "w1_scale", "w2_packed", "w3_scale"):
                                    assert np.array_equal(getattr(ex[e], f),
                                                          getattr(exr[e], f))
            for n in ("embed_tokens.weight", "lm_head.weight", "norm.weight"):
                assert np.array_equal(src.model_tensor(n), res.model_tensor(n))


def test_stream_tiny_a_greedy_ids_at_every_budget(tiny_a, tmp_path):
    import json

    want = json.loads((tiny_a / "expected.json").read_text())["greedy_ids"]
    prompt = [3, 7, 11, 5, 9]
    pack(tiny_a, tmp_path / "trunk")
    for kw in budgets(tiny_a):
        with source(tiny_a, **kw) as src:
            assert greedy(tiny_a, src, 16, prompt) == want, kw
    with source(tiny_a, trunk=tmp_path / "trunk", threads=1, budget_gb=floor_gb(tiny_a)) as src:
        assert greedy(tiny_a, src, 16, prompt) == want


def test_stream_synth_ids_identical_from_floor_to_resident(small, tmp_path):
    want = greedy(small, ResidentSource(small))
    pack(small, tmp_path / "trunk")
    runs = [dict(kw, threads=t) for kw in budgets(small) for t in (1, 6)]
    runs.append(dict(trunk=tmp_path / "trunk", budget_gb=floor_gb(small)))
    runs.append(dict(trunk=tmp_path / "trunk", trunk_gb=0.001, cache_gb=0.0002))
    for kw in runs:
        with source(small, **kw) as src:
            rec = Recorder(src)
            assert greedy(small, rec) == want, kw
            if kw.get("budget_gb") == floor_gb(small):
                # The prefill's union did not fit the slots: it was served in groups.
                assert max(len(ids) for _, ids, _ in rec.calls) > src.cache.nslots


def test_stream_bytes_per_token_are_the_minimum(small):
    g = CheckpointMap(small).geometry()
    kw = dict(budget_gb=budgets(small)[2]["budget_gb"])
    with source(small, **kw) as src:
        rec = Recorder(src)
        model = load_model(small, rec)
        plan = src.plan
        assert plan.ring_slots == 2 and 0 < len(plan.pinned) < g.n_layers
        lay = src.map.layers
        streamed_payload = sum(lay[i].payload for i in range(g.n_layers) if i not in plan.pinned)
        pinned_payload = sum(lay[i].payload for i in plan.pinned)
        expert_payload = g.expert_bytes
        prev = src.stats()
        n_calls = 0
        for tok in generate(model, PROMPT, GenParams(max_tokens=6)):
            cur = src.stats()
            calls = rec.calls[n_calls:]
            n_calls = len(rec.calls)
            not_resident = sum(1 for L, ids, res in calls for e in ids if (L, e) not in res)
            trunk = (cur["gb_read_trunk"] - prev["gb_read_trunk"]) * GB
            experts = (cur["gb_read_experts"] - prev["gb_read_experts"]) * GB
            want_trunk = streamed_payload + (pinned_payload if tok.index == 0 else 0)
            assert round(trunk) == want_trunk, tok.index
            assert round(experts) == not_resident * expert_payload, tok.index
            assert cur["expert_misses"] - prev["expert_misses"] == not_resident
            assert tok.stats.gb_read_trunk == pytest.approx(want_trunk / GB)
            prev = cur
        # The device delivered nothing beyond those bytes' aligned windows, plus the
        # read-ahead of the next (never requested) token's first streamed layers.
        deadline = time.monotonic() + 30
        while src.pool.busy() and time.monotonic() < deadline:  # read-ahead lands
            time.sleep(0.01)
        windows = (6 - 1) * sum(lay[i].nbytes for i in range(g.n_layers) if i not in plan.pinned)
        windows += sum(lay[i].nbytes for i in range(g.n_layers))  # first token, pinned too
        windows += prev["expert_misses"] * g.expert_slot_bytes
        windows += sum(Layout([src.map.model_spec(n)]).nbytes for n in MODEL_TENSORS)
        extra = src.pool.bytes_read - windows
        assert 0 <= extra <= plan.ring_slots * plan.ring_slot_bytes


def test_stream_read_ahead_never_overwrites_a_slot_in_use(small):
    g = CheckpointMap(small).geometry()
    with source(small, budget_gb=budgets(small)[1]["budget_gb"]) as src:
        assert src.plan.ring_slots == 2 and src.plan.pinned == ()
        for L in range(g.n_layers):
            with src.layer(L) as w:
                before = {k: v.copy() for k, v in w.items()}
                nxt = (L + 1) % g.n_layers
                ahead = [s for s in src._ring if s.layer == nxt]
                assert ahead, "the next layer is being read while this one computes"
                ahead[0].batch.finished()
                time.sleep(0.02)
                assert all(np.array_equal(w[k], before[k]) for k in before)
    with source(small, budget_gb=floor_gb(small)) as src:
        assert src.plan.ring_slots == 1
        for L in range(g.n_layers):
            with src.layer(L):
                read0 = src.pool.bytes_read
                time.sleep(0.05)
                assert src.pool.bytes_read == read0  # one slot: no read-ahead
                assert [s.layer for s in src._ring] == [L]


def test_stream_short_read_stops_generation(small, tmp_path, copy_checkpoint):
    ck = copy_checkpoint(small, tmp_path / "ck")
    src = source(ck, budget_gb=floor_gb(ck))
    model = load_model(ck, src)
    assert len(list(generate(model, PROMPT, GenParams(max_tokens=2)))) == 2
    # The shard of layer 4 loses its experts (and half its trunk) after it was indexed.
    shard = sorted(ck.glob("model-00005-*.safetensors"))[0]
    os.truncate(shard, src.map.layers[4].runs[0].start + 1000)
    got = []
    with pytest.raises(ReadError, match="short read"):
        for t in generate(model, PROMPT, GenParams(max_tokens=3)):
            got.append(t.id)
    assert got == []  # not one token computed from missing weights
    src.close()


def test_stream_expert_read_error_never_publishes_the_slot(small, tmp_path, copy_checkpoint):
    ck = copy_checkpoint(small, tmp_path / "ck")
    with source(ck, budget_gb=floor_gb(ck) * 2) as src:
        lay = src.map.expert_layout(3, 15)
        os.truncate(lay.runs[0].file, lay.runs[0].start + 10)
        for attempt in range(2):  # the failed slot was not published as holding expert 15
            with pytest.raises(ReadError), src.experts(3, [0, 15]) as ex:
                ex[0]
                ex[15]
        assert (3, 15) not in src.cache.resident()
        assert (3, 0) in src.cache.resident()


def test_stream_trunk_layer_not_matching_its_digest_never_reaches_the_model(tiny_a, tmp_path):
    """A byte of layer 5 changed in trunk.bin after the pack: at every budget (pinned,
    ring) asking for layer 5 fails with one sentence, every time; the other layers are the
    shards' bytes, each checked once."""
    import json

    trunk = tmp_path / "t"
    pack(tiny_a, trunk)
    entry = json.loads((trunk / "trunk.json").read_text())["layers"][5]
    with open(trunk / "trunk.bin", "r+b") as f:
        f.seek(entry["file_off"] + 777)
        f.write(b"\xff\x00\xff")
    res = ResidentSource(tiny_a)
    for kw in budgets(tiny_a):
        with source(tiny_a, trunk, **kw) as src:
            for L in list(range(13)) * 2:
                if L == 5:
                    with pytest.raises(ReadError, match="layer 5 of the trunk in .* does not "
                                       "match the digest it was packed with .* `k3tui pack`"):
                        with src.layer(5):
                            pass
                    continue
                with src.layer(L) as w, res.layer(L) as ref:
                    assert all(np.array_equal(w[k], ref[k]) for k in ref), (kw, L)
            assert src._verified == set(range(13)) - {5}


def test_stream_open_source_and_cli(small, capsys, tmp_path, copy_checkpoint):
    p = argparse.ArgumentParser()
    add_memory_arguments(p)
    assert isinstance(open_source(small, MemorySettings.from_args(p.parse_args([]))),
                      ResidentSource)
    src = open_source(small, MemorySettings(budget_gb=floor_gb(small) * 1.5))
    assert isinstance(src, StreamingSource)
    assert "memory plan" in capsys.readouterr().err
    src.close()
    ck = copy_checkpoint(small, tmp_path / "ck")
    base = [sys.executable, "-m", "engine", "run", str(ck), "--ids", "3,7,11", "--gen", "2"]
    ok = subprocess.run(base + ["--budget-gb", "0.01"], capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    low = subprocess.run(base + ["--budget-gb", "0.0001"], capture_output=True, text=True,
                         cwd=REPO)
    assert low.returncode != 0 and "Traceback" not in low.stderr
    assert "below this checkpoint's minimum" in low.stderr
    os.truncate(sorted(ck.glob("model-00003-*.safetensors"))[0], 5000)
    bad = subprocess.run(base + ["--budget-gb", "0.01"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr


def test_stream_experts_fetched_from_several_threads(small):
    """When the set fits, the view is concurrent: the MoE may read it from its compute threads."""
    from concurrent.futures import ThreadPoolExecutor

    res = ResidentSource(small)
    with source(small, budget_gb=floor_gb(small) * 3, threads=3) as src:
        for L in (1, 2, 3, 1):
            ids = list(range(16)) if src.cache.nslots >= 16 else list(range(src.cache.nslots))
            with src.experts(L, ids) as ex, res.experts(L, ids) as ref:
                assert ex.concurrent and set(ex) == set(ids)
                with ThreadPoolExecutor(4) as pool:
                    got = list(pool.map(lambda e: ex[e], ids * 2))
                for e, w in zip(ids * 2, got):
                    assert np.array_equal(w.w2_packed, ref[e].w2_packed)
                    assert np.array_equal(w.w3_scale, ref[e].w3_scale)
        st = src.stats()
        payload = src.map.expert_layout(1, 0).payload
        assert round(st["gb_read_experts"] * GB) == st["expert_misses"] * payload


def test_stream_plan_holding_everything_loads_it_up_front(small):
    """At the top rung no expert is read on the critical path: every expert is read once,
    before the first token, and the ids are the resident engine's."""
    g = CheckpointMap(small).geometry()
    full = (g.trunk_bytes + g.all_experts_bytes) / GB
    with source(small, budget_gb=full) as src:
        assert src.plan.expert_slots >= g.n_experts * g.moe_layers
        toks = list(generate(load_model(small, src), PROMPT, GenParams(max_tokens=6)))
        later = toks[1:]
        assert sum(t.stats.expert_misses for t in later) == 0
        assert sum(t.stats.gb_read_experts for t in later) == 0
        assert src.stats()["gb_read_experts"] * GB == pytest.approx(
            g.n_experts * g.moe_layers * g.expert_bytes)
    assert [t.id for t in toks] == greedy(small, ResidentSource(small), n=6)


@pytest.mark.parametrize("forms_per_slot", [1000, 2])
def test_stream_cached_expert_views_are_reused_and_never_stale(small, monkeypatch,
                                                               forms_per_slot):
    """A slot's ExpertWeights are built once per expert form (the same object while the
    slot holds an expert, and again when it is refilled with another of that form), and
    never hand out stale bytes: every expert equals the resident bytes across evictions.
    The small checkpoint's experts have 32 forms (their size is no whole number of pages):
    with a cap below that a slot keeps at most the cap's views, bytes still right."""
    monkeypatch.setattr(streaming, "FORMS_PER_SLOT", forms_per_slot)
    res = ResidentSource(small)
    g = CheckpointMap(small).geometry()
    budget = (g.trunk_bytes + (g.top_k + 2) * g.expert_slot_bytes) / GB
    rng = np.random.default_rng(4)
    with source(small, budget_gb=budget) as src:
        nslots = src.cache.nslots
        assert nslots < 2 * g.top_k  # two layers' experts do not fit: slots are reused
        first: dict = {}
        by_form: dict = {}  # (slot, form) -> the ExpertWeights last served from it
        refilled = 0
        for step in range(40):
            L = 1 + step % 3
            ids = sorted(rng.choice(g.n_experts, size=g.top_k, replace=False).tolist())
            resident_before = set(src.cache.resident())
            with src.experts(L, ids) as ex, res.experts(L, ids) as ref:
                for e in ids:
                    w = ex[e]
                    for f in ("w1_packed", "w1_scale", "w2_packed", "w2_scale", "w3_packed",
                              "w3_scale"):
                        assert np.array_equal(getattr(w, f), getattr(ref[e], f)), (L, e, f)
                    slot = src.cache.lookup((L, e))
                    if (L, e) in resident_before and first.get((L, e))[0] == slot:
                        assert w is first[(L, e)][1]  # a hit: no new views
                    known = by_form.get((slot, src.map.expert_form(L, e)))
                    if known is not None and forms_per_slot > 32:
                        assert w is known  # a refilled slot: its views of that form again
                        refilled += (L, e) not in resident_before
                    by_form[(slot, src.map.expert_form(L, e))] = w
                    first[(L, e)] = (slot, w)
                    assert len(src._weights[slot]) <= forms_per_slot
        assert src.cache.evictions > 0 and (refilled > 0 or forms_per_slot < 32)


def test_stream_warm_reads_what_the_plan_keeps_before_the_first_token(small):
    """A server warms its source before it says ready: afterwards the first token reads
    nothing the plan keeps in RAM (pinned layers, the up-front experts, the tables)."""
    cmap = CheckpointMap(small)
    g = cmap.geometry()
    full = (g.trunk_bytes + g.all_experts_bytes) / GB
    with source(small, budget_gb=full) as src:
        assert len(src.plan.pinned) == g.n_layers
        src.warm()
        assert not src.pool.busy()
        warmed = src.stats()
        assert warmed["gb_read_trunk"] * GB == sum(lay.payload for lay in cmap.layers)
        assert warmed["gb_read_experts"] * GB == pytest.approx(
            g.n_experts * g.moe_layers * g.expert_bytes)
        device = src.pool.bytes_read
        toks = list(generate(load_model(small, src), PROMPT, GenParams(max_tokens=3)))
        assert src.pool.bytes_read == device  # nothing more came from the disk
        assert toks[0].stats.gb_read_trunk == 0 and toks[0].stats.gb_read_experts == 0
    assert [t.id for t in toks] == greedy(small, ResidentSource(small), n=3)
