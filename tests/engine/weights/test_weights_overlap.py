"""The MoE computes the shared experts and the latent down-projection while the routed
experts' reads are in flight: the reads are issued before that compute, and no routed
expert is touched until it is done."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from engine.checkpoint.synth import synthesize
from engine.decode.generate import GenParams, generate
from engine.model import moe
from engine.model.transformer import load_model
from engine.weights.planner import make_plan
from k3vocab import GB
from engine.weights.streaming import CheckpointMap, StreamingSource


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("overlap") / "ck", "small", seed=5)


def test_stream_shared_experts_compute_while_expert_reads_are_in_flight(small, monkeypatch):
    cmap = CheckpointMap(small)
    g, cfg = cmap.geometry(), cmap.config
    budget = (g.trunk_bytes + 2 * g.min_expert_slots * g.expert_slot_bytes) / GB
    events: list[str] = []
    real_situ, real_linear = moe.situ_mlp, moe.linear
    in_situ = [False]

    def situ(*a):
        events.append("shared")
        in_situ[0] = True
        try:
            return real_situ(*a)
        finally:
            in_situ[0] = False

    def linear(x, w):
        if not in_situ[0] and w.shape == (cfg.routed_expert_hidden_size, cfg.hidden_size):
            events.append("down")
        return real_linear(x, w)

    class Spy:
        def __init__(self, inner):
            self.inner = inner
            # as concurrent as the source's own set, so experts still run in parallel
            self.concurrent = inner.concurrent
            self.arrival = inner.arrival

        def __getitem__(self, e):
            events.append("expert")
            return self.inner[e]

    with StreamingSource(cmap, make_plan(g, budget_gb=budget, threads=2)) as src:
        real_submit, real_experts = src.pool.submit, src.experts

        def submit(reads, priority=(1,), chunk=None):
            if priority[0] == 0:
                events.append("read")
            return real_submit(reads, priority, chunk)

        @contextmanager
        def experts(layer, ids):
            events.append("enter")
            with real_experts(layer, ids) as ex:
                yield Spy(ex)

        monkeypatch.setattr(moe, "situ_mlp", situ)
        monkeypatch.setattr(moe, "linear", linear)
        monkeypatch.setattr(src.pool, "submit", submit)
        monkeypatch.setattr(src, "experts", experts)
        model = load_model(small, src)
        want = [t.id for t in generate(load_model(small), [3, 7, 11], GenParams(max_tokens=3))]
        events.clear()
        got = [t.id for t in generate(model, [3, 7, 11], GenParams(max_tokens=3))]
    assert got == want  # the order changed nothing in the numbers
    # Each MoE layer: enter (the reads are issued), shared experts, down-projection, then
    # the routed experts; no read is issued after the compute started.
    segments = " ".join(events).split("enter")[1:]
    assert len(segments) == 3 * sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    with_reads = 0
    for seg in segments:
        kinds = seg.split()
        moe_part = kinds[: kinds.index("expert") + 1]
        assert [k for k in moe_part if k != "read"] == ["shared", "down", "expert"], seg
        reads = [i for i, k in enumerate(moe_part) if k == "read"]
        assert all(i < moe_part.index("shared") for i in reads), seg
        with_reads += bool(reads)
    assert with_reads >= len(segments) // 2  # most layers had to read some experts
