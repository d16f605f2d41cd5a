"""The memory planner: trunk first, ring sizing, refusals with numbers, presets, auto."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from engine.errors import PlanError
from engine.weights.planner import (
    Geometry,
    MemoryFacts,
    MemorySettings,
    add_memory_arguments,
    make_plan,
    read_memory_facts,
)
from engine.weights.sysmem import Roots, read_cgroup
from k3vocab import GB

MB = 1_000_000
BIG = MemoryFacts(mem_total=64 * 2**30, mem_available=60 * 2**30, cgroup_limit=None,
                  cgroup_usage=None)


def geom(**kw) -> Geometry:
    base = dict(
        n_layers=13,
        layer_bytes=(111 * MB,) + (76 * MB,) * 12,
        expert_slot_bytes=int(1.68 * MB),
        expert_bytes=int(1.67 * MB),
        n_experts=256,
        top_k=16,
        moe_layers=12,
        model_bytes=268 * MB,
        checkpoint_bytes=int(6.38 * GB),
        kv_bytes_per_token=4 * 320 * 4,
        state_bytes=10 * MB,
        scratch_bytes=50 * MB,
    )
    base.update(kw)
    return Geometry(**base)


def test_stream_plan_floor_streams_everything_through_two_slots():
    g = geom()
    floor = max(g.layer_bytes) + 17 * g.expert_slot_bytes
    p = make_plan(g, budget_gb=(2 * 111 * MB + 17 * g.expert_slot_bytes) / GB, facts=BIG)
    assert p.pinned == () and p.ring_slots == 2 and p.ring_slot_bytes == 111 * MB
    assert p.expert_slots >= 17
    assert p.budget_bytes <= 2 * 111 * MB + 17 * g.expert_slot_bytes
    # Between one and two slots' worth: one slot, no read-ahead.
    p1 = make_plan(g, budget_gb=(floor + 10 * MB) / GB, facts=BIG)
    assert p1.ring_slots == 1 and p1.pinned == ()
    assert "no read-ahead" in p1.describe()


def test_stream_plan_trunk_first_and_leftover_to_experts():
    g = geom()
    p = make_plan(g, budget_gb=0.53, facts=BIG)
    # Pinning layer 0 (the largest) shrinks the ring slot to 76 MB.
    assert p.pinned[:1] == (0,) and p.ring_slot_bytes == 76 * MB and p.ring_slots == 2
    assert p.pinned_bytes + p.ring_bytes + 17 * g.expert_slot_bytes <= 0.53 * GB
    # Not one more layer fits, and what is left over went to expert slots.
    assert p.pinned_bytes + 76 * MB + p.ring_bytes + 17 * g.expert_slot_bytes > 0.53 * GB
    assert p.budget_bytes <= 0.53 * GB and p.budget_bytes > 0.53 * GB - g.expert_slot_bytes
    assert p.streamed_trunk_bytes == sum(g.layer_bytes) - p.pinned_bytes
    more = make_plan(g, budget_gb=1.06, facts=BIG)
    assert len(more.pinned) > len(p.pinned)


def test_stream_plan_budget_above_the_trunk_pins_all_then_caches():
    g = geom()
    p = make_plan(g, budget_gb=2.1, facts=BIG)
    assert p.pinned == tuple(range(13)) and p.ring_slots == 0
    assert p.expert_slots == int((2.1 * GB - g.trunk_bytes) // g.expert_slot_bytes)
    huge = make_plan(g, budget_gb=100, facts=BIG, check_memory=False)
    assert huge.expert_slots == 256 * 12  # never more slots than experts


def test_stream_plan_refuses_below_minimum_with_numbers():
    g = geom()
    with pytest.raises(PlanError) as e:
        make_plan(g, budget_gb=0.1, facts=BIG)
    msg = str(e.value)
    assert "0.1 GB" in msg and "minimum" in msg and "17 expert slots" in msg
    assert "--budget-gb 0.1396" in msg  # 111 MB + 17 x 1.68 MB, rounded up
    with pytest.raises(PlanError, match="top-16 needs 17"):
        make_plan(g, trunk_gb=0.5, cache_gb=0.02, facts=BIG)
    with pytest.raises(PlanError, match="largest layer"):
        make_plan(g, trunk_gb=0.05, cache_gb=0.1, facts=BIG)


def test_stream_plan_refuses_above_available_memory():
    g = geom()
    small = MemoryFacts(mem_total=2 * 2**30, mem_available=int(1.0 * GB), cgroup_limit=None,
                        cgroup_usage=None)
    with pytest.raises(PlanError) as e:
        make_plan(g, budget_gb=0.9, facts=small)
    assert "available" in str(e.value) and "95%" in str(e.value)
    # A cgroup limit tighter than MemAvailable is what counts.
    capped = MemoryFacts(mem_total=64 * 2**30, mem_available=60 * 2**30,
                         cgroup_limit=int(1.2 * GB), cgroup_usage=int(0.2 * GB))
    assert capped.available == int(1.0 * GB)
    with pytest.raises(PlanError):
        make_plan(g, budget_gb=0.9, facts=capped)
    # KV for a long context above 90% of what is available.
    with pytest.raises(PlanError, match="KV cache for 1000000 tokens"):
        make_plan(geom(kv_bytes_per_token=100_000), budget_gb=0.5, facts=BIG, context=1_000_000)


def test_stream_plan_presets_and_overrides():
    g = geom()
    p = make_plan(g, preset="laptop", facts=BIG)  # 3 GB trunk: the whole 0.98 GB trunk
    assert p.pinned == tuple(range(13))
    p2 = make_plan(g, preset="laptop", cache_gb=0.05, trunk_gb=0.5, facts=BIG)
    assert p2.expert_slots == int(0.05 * GB // g.expert_slot_bytes)
    with pytest.raises(PlanError, match="unknown preset"):
        make_plan(g, preset="huge", facts=BIG)


def test_stream_plan_auto_uses_available_memory():
    g = geom()
    p = make_plan(g, preset="auto", facts=BIG)
    assert p.pinned == tuple(range(13)) and p.expert_slots == 256 * 12
    tight = MemoryFacts(mem_total=4 * 2**30, mem_available=int(3.0 * GB), cgroup_limit=None,
                        cgroup_usage=None)
    p2 = make_plan(g, preset="auto", facts=tight)
    assert 0 < len(p2.pinned) < 13  # leaves the reserve free
    with pytest.raises(PlanError, match="must stay free"):
        make_plan(g, preset="auto", facts=MemoryFacts(2**30, int(1.5 * GB), None, None))


def _captured(kind: str) -> Roots:
    root = Path(__file__).resolve().parents[2] / "k3tui" / "probe" / "data" / kind
    return Roots(proc=root / "proc", sys=root / "sys")


def test_stream_memory_facts_honour_a_parent_cgroups_limit():
    # v2: the 16 GiB limit is set on user@1000.service, two levels above the process's scope
    # (whose own memory.max says "max"); the planner must see it, as the probe does.
    env = _captured("v2")
    facts = read_memory_facts(env)
    assert facts.cgroup_limit == 16 * 2**30 == read_cgroup(env).memory_limit_bytes
    assert facts.available == 16 * 2**30 - facts.cgroup_usage
    plan = make_plan(geom(), preset="auto", facts=facts)
    assert plan.budget_bytes + plan.overhead_bytes <= facts.available
    # v1 inside a container namespace: 8 GiB; hybrid with PAGE_COUNTER_MAX: no limit
    assert read_memory_facts(_captured("v1")).cgroup_limit == 8 * 2**30
    assert read_memory_facts(_captured("hybrid")).cgroup_limit is None


def test_stream_memory_arguments():
    p = argparse.ArgumentParser()
    add_memory_arguments(p)
    def settings(*argv):
        return MemorySettings.from_args(p.parse_args(argv))

    assert not settings().streams
    assert not settings("--threads", "4").streams
    a = settings("--budget-gb", "0.5", "--trunk", "/t", "--threads", "6")
    assert a.streams and a == MemorySettings(budget_gb=0.5, trunk="/t", threads=6)
    assert settings("--preset", "auto").streams
    with pytest.raises(SystemExit):
        p.parse_args(["--preset", "nope"])


def test_stream_plan_spreads_pinned_layers():
    g = geom()
    p = make_plan(g, budget_gb=0.75, facts=BIG)
    k = len(p.pinned)
    assert k >= 3 and p.pinned[0] == 0  # the oversized layer first
    assert p.pinned != tuple(range(k))  # spread out: the reader runs ahead during each
    gaps = [b - a for a, b in zip(p.pinned[1:], p.pinned[2:])]
    assert max(gaps) - min(gaps) <= 1
    assert "layers 0," in p.describe()


def test_stream_plan_auto_on_the_real_shape_stays_under_95_percent():
    mla = {3 + 4 * i for i in range(23)} | {92}
    sizes = tuple(2_341_216_112 if L == 0 else 845_200_000 if L in mla else 1_268_600_000
                  for L in range(93))
    g = Geometry(n_layers=93, layer_bytes=sizes, expert_slot_bytes=17_555_456,
                 expert_bytes=17_547_264, n_experts=896, top_k=16, moe_layers=92,
                 model_bytes=4_700_000_000, checkpoint_bytes=1_560_936_091_448,
                 kv_bytes_per_token=24 * 576 * 4, state_bytes=69 * 96 * 128 * 128 * 4,
                 scratch_bytes=50 * MB)
    for gib in (228, 121, 30):
        facts = MemoryFacts(256 * 2**30, gib * 2**30, None, None)
        p = make_plan(g, preset="auto", facts=facts)  # would raise above 95 %
        assert p.budget_bytes + p.overhead_bytes <= 0.95 * facts.available
    big = make_plan(g, preset="auto", facts=MemoryFacts(256 * 2**30, 228 * 2**30, None, None))
    assert len(big.pinned) == 93 and big.expert_slots > 1000  # trunk first, then experts
    mid = make_plan(g, preset="auto", facts=MemoryFacts(64 * 2**30, 30 * 2**30, None, None))
    assert 0 < len(mid.pinned) < 93 and mid.ring_slots == 2
    with pytest.raises(PlanError, match="must stay free"):
        make_plan(g, preset="auto", facts=MemoryFacts(8 * 2**30, 8 * 2**30, None, None))
