"""Expert read-ahead from a guess: reads start before the router, the router still decides.
Same tokens with and without it, demand bytes still the minimum, wrong guesses counted
apart and kept as valid cached experts, and a failed guessed read never yields a token."""

from __future__ import annotations

import argparse
import os
import threading

import numpy as np
import pytest
from stream_helpers import Recorder

from engine.checkpoint.synth import synthesize
from engine.decode.generate import GenParams, generate
from engine.errors import PlanError, ReadError
from engine.model.transformer import load_model
from engine.weights.planner import MemorySettings, add_memory_arguments, make_plan
from k3vocab import GB
from engine.weights.resident import ResidentSource
from engine.core.directio import Read, aligned_buffer
from engine.weights.streaming import CheckpointMap, StreamingSource

PROMPT = [3, 7, 11, 5, 9, 200, 17]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """6 layers, 16 experts top-4, several shards."""
    return synthesize(tmp_path_factory.mktemp("guess") / "ck", "small", seed=3)


def trunk_and_slots(ck, slots: int) -> float:
    """A budget that pins the whole trunk and leaves `slots` expert slots."""
    g = CheckpointMap(ck).geometry()
    return (g.trunk_bytes + slots * g.expert_slot_bytes + 1) / GB


def source(ck, guess="on", **kw) -> StreamingSource:
    cmap = CheckpointMap(ck)
    return StreamingSource(cmap, make_plan(cmap.geometry(), threads=4, guess_experts=guess, **kw))


def greedy(ck, src, n=8) -> list[int]:
    return [t.id for t in generate(load_model(ck, src), PROMPT, GenParams(max_tokens=n))]


def test_stream_guess_plan_auto_only_where_the_disk_is_idle(small):
    g = CheckpointMap(small).geometry()
    resident_trunk = make_plan(g, budget_gb=trunk_and_slots(small, 12))
    assert resident_trunk.streamed_trunk_bytes == 0 and resident_trunk.guess_experts
    assert "expert read-ahead: on" in resident_trunk.describe()
    streaming = make_plan(g, budget_gb=(max(g.layer_bytes) * 2 + 12 * g.expert_slot_bytes) / GB)
    assert streaming.streamed_trunk_bytes > 0 and not streaming.guess_experts
    assert make_plan(g, budget_gb=(max(g.layer_bytes) * 2 + 12 * g.expert_slot_bytes) / GB,
                     guess_experts="on").guess_experts
    # No room for a second layer's guesses beside the demand reads: off even when asked.
    cramped = make_plan(g, budget_gb=trunk_and_slots(small, g.top_k + 1), guess_experts="on")
    assert not cramped.guess_experts and f"needs {2 * g.top_k} expert slots" in cramped.describe()
    everything = make_plan(g, budget_gb=trunk_and_slots(small, g.n_experts * g.moe_layers))
    assert not everything.guess_experts  # every expert stays resident: nothing to guess
    assert not make_plan(g, budget_gb=trunk_and_slots(small, 12), guess_experts="off").guess_experts
    with pytest.raises(PlanError, match="auto, on or off"):
        make_plan(g, budget_gb=trunk_and_slots(small, 12), guess_experts="maybe")
    p = argparse.ArgumentParser()
    add_memory_arguments(p)
    args = p.parse_args(
        ["--budget-gb", f"{trunk_and_slots(small, 12):.6f}", "--guess-experts", "off"]
    )
    assert not MemorySettings.from_args(args).plan(g).guess_experts


def test_stream_guess_same_ids_and_most_reads_start_early(small):
    want = greedy(small, ResidentSource(small))
    for slots, threads in ((2 * 4, 1), (12, 4), (40, 6)):
        cmap = CheckpointMap(small)
        plan = make_plan(
            cmap.geometry(),
            budget_gb=trunk_and_slots(small, slots),
            threads=threads,
            guess_experts="on",
        )
        with StreamingSource(cmap, plan) as src:
            assert src.wants_guesses
            assert greedy(small, src) == want, (slots, threads)
            st = src.stats()
            assert st["experts_guessed"] > 0
            # Most experts a step read had their read started by a guess.
            assert st["experts_guessed_used"] >= 0.5 * st["experts_guessed"], st
    with source(small, guess="off", budget_gb=trunk_and_slots(small, 12)) as src:
        assert greedy(small, src) == want
        assert src.stats()["experts_guessed"] == 0


def test_stream_guess_demand_bytes_stay_the_minimum(small):
    g = CheckpointMap(small).geometry()
    with source(small, budget_gb=trunk_and_slots(small, 12)) as src:
        rec = Recorder(src)
        model = load_model(small, rec)
        payload = g.expert_bytes
        prev = src.stats()
        n = 0
        for tok in generate(model, PROMPT, GenParams(max_tokens=6)):
            cur = src.stats()
            calls, n = rec.calls[n:], len(rec.calls)
            not_resident = sum(1 for L, ids, res in calls for e in ids if (L, e) not in res)
            experts = (cur["gb_read_experts"] - prev["gb_read_experts"]) * GB
            assert round(experts) == not_resident * payload, tok.index
            assert cur["expert_misses"] - prev["expert_misses"] == not_resident
            if tok.index > 0:
                assert tok.stats.experts_guessed > 0
                unused = tok.stats.experts_guessed - tok.stats.experts_guessed_used
                # Wrong guesses are counted apart, once their read has landed.
                assert tok.stats.gb_read_unused * GB <= unused * payload + 1
            prev = cur
        src._reap_guesses(block=True)
        st = src.stats()
        wrong = st["experts_guessed"] - st["experts_guessed_used"]
        assert round(st["gb_read_unused"] * GB) == wrong * payload


def test_stream_wrong_guess_becomes_a_cached_expert(small):
    """A wrong guess whose read had begun when its layer asked is kept as a cached expert."""
    with source(small, budget_gb=trunk_and_slots(small, 12)) as src:
        res = ResidentSource(small)
        src.guess(2, [5, 6])
        assert src.stats()["experts_guessed"] == 2
        src._guesses[(2, 5)][1].finished()  # begun (and ended) before the router decides
        with src.experts(2, [6, 7]) as ex, res.experts(2, [6, 7]) as ref:
            for e in (6, 7):
                assert np.array_equal(ex[e].w1_packed, ref[e].w1_packed)
        src._reap_guesses(block=True)
        st = src.stats()
        assert st["experts_guessed_used"] == 1 and st["expert_misses"] == 2
        assert (2, 5) in src.cache.resident()  # the wrong guess is a valid cached expert
        assert st["gb_read_unused"] * GB == pytest.approx(src.map.expert_layout(2, 5).payload)
        with src.experts(2, [5]) as ex, res.experts(2, [5]) as ref:
            assert np.array_equal(ex[5].w2_scale, ref[5].w2_scale)
        assert src.stats()["expert_hits"] == 1  # ... and counts as resident later
        src.guess(2, [5, 6, 7])  # resident ones are not read again
        assert src.stats()["experts_guessed"] == 2
        # A guess never takes the slots a layer's own top-k needs.
        src.guess(3, range(16))
        assert src.cache.free_for_reuse >= src.plan.geometry.top_k


class _Gate:
    """A file whose reads wait until the test opens the gate: it holds the pool's workers
    so the reads queued behind them have not begun."""

    path = "gate"

    def __init__(self):
        self.open = threading.Event()

    def read_into(self, dest, offset, need):
        assert self.open.wait(30)
        return need


def test_stream_wrong_guess_not_yet_begun_is_cancelled(small):
    """A wrong guess still queued when its layer asks is cancelled: never read, its slot
    free again, no wasted bytes; the right guess is adopted and its bytes are the file's."""
    with source(small, budget_gb=trunk_and_slots(small, 12)) as src:
        src.warm()
        gate = _Gate()
        held = src.pool.submit([Read(gate, 0, aligned_buffer(4096)[:4096], 4096)
                                for _ in range(src.pool.threads)], (0,))
        read0 = src.pool.bytes_read
        src.guess(2, [5, 6])
        with src.experts(2, [6]) as ex:
            assert [b.cancelled for _, b in src._cancelled] == [True]  # still queued
            gate.open.set()
            with ResidentSource(small).experts(2, [6]) as ref:
                assert np.array_equal(ex[6].w1_packed, ref[6].w1_packed)
        held.wait()
        src._reap_guesses(block=True)
        st = src.stats()
        assert (2, 5) not in src.cache.resident() and (2, 6) in src.cache.resident()
        assert st["gb_read_unused"] == 0 and st["experts_guessed_used"] == 1
        six = src.map.expert_layout(2, 6).nbytes
        assert src.pool.bytes_read - read0 == src.pool.threads * 4096 + six  # 5 never read
        assert not src._guesses and src.cache.free_for_reuse == src.cache.nslots


def test_stream_cancelled_guess_wanted_later_is_read_anew(small):
    """The next token's router may want an expert whose cancelled guess is still queued: it
    is read again, never handed out as a cancelled read (which would fail the token)."""
    with source(small, budget_gb=trunk_and_slots(small, 12)) as src:
        src.warm()
        with src.experts(2, [7]) as ex:
            ex[7]  # cached: asking for it again reads nothing
        gate = _Gate()
        held = src.pool.submit([Read(gate, 0, aligned_buffer(4096)[:4096], 4096)
                                for _ in range(src.pool.threads)], (0,))
        src.guess(2, [5])
        with src.experts(2, [7]):
            pass  # 5 was a wrong guess, still queued: cancelled
        assert [b.cancelled for _, b in src._cancelled] == [True]
        with src.experts(2, [5]) as ex:
            gate.open.set()
            with ResidentSource(small).experts(2, [5]) as ref:
                assert np.array_equal(ex[5].w3_packed, ref[5].w3_packed)
        held.wait()
        src._reap_guesses(block=True)
        assert not src._guesses and (2, 5) in src.cache.resident()
        assert src.cache.free_for_reuse == src.cache.nslots


def test_stream_guess_keeps_the_layers_own_cached_experts(small):
    with source(small, budget_gb=trunk_and_slots(small, 12)) as src:
        assert src.cache.nslots == 12
        for L in (1, 2, 3):
            with src.experts(L, [0, 1, 2, 3]) as ex:
                for e in range(4):
                    ex[e]
        src.guess(2, [8, 9, 10, 11])  # the arena is full: four experts must go
        src._retire_guesses(2, [])
        src._reap_guesses(block=True)
        resident = set(src.cache.resident())
        assert {(2, e) for e in range(4)} <= resident  # layer 2 is about to ask for its own
        assert not {(1, e) for e in range(4)} & resident  # layer 1 comes round last


def test_stream_guess_read_error(small, tmp_path, copy_checkpoint):
    ck = copy_checkpoint(small, tmp_path / "ck")
    with source(ck, budget_gb=trunk_and_slots(ck, 12)) as src:
        lay = src.map.expert_layout(3, 15)
        os.truncate(lay.runs[0].file, lay.runs[0].start + 10)
        # A failed guess the router did not choose is dropped quietly.
        src.guess(3, [15])
        with src.experts(3, [0]) as ex:
            ex[0]
        src._reap_guesses(block=True)
        assert (3, 15) not in src.cache.resident() and not src._guesses
        # One it did choose stops the step with the read's error.
        src.guess(3, [15])
        with pytest.raises(ReadError), src.experts(3, [15]) as ex:
            ex[15]
        assert (3, 15) not in src.cache.resident()
    ck2 = copy_checkpoint(small, tmp_path / "ck2")
    src = source(ck2, budget_gb=trunk_and_slots(ck2, 12))
    model = load_model(ck2, src)
    assert len(list(generate(model, PROMPT, GenParams(max_tokens=2)))) == 2
    # Layer 4's experts are cut off after they were indexed (the trunk is pinned by now).
    runs = [src.map.expert_layout(4, e).runs[0] for e in range(16)]
    first = min(runs, key=lambda r: r.start)
    os.truncate(first.file, first.start + 10)
    got = []
    with pytest.raises(ReadError):
        for t in generate(model, [9, 8], GenParams(max_tokens=4)):
            got.append(t.id)
    assert got == []  # not one token computed from missing weights
    src.close()


def test_stream_guess_a_layer_ahead_while_the_previous_layer_computes(small):
    """With the trunk resident, reads for layer L+1's surest experts are queued while layer
    L's routed experts are read and computed (inside L's experts() block, behind L's own
    reads), so the disk has work across the layer boundary; the ids do not change."""
    want = greedy(small, ResidentSource(small))
    g = CheckpointMap(small).geometry()
    with source(small, budget_gb=trunk_and_slots(small, 12)) as src:
        events: list[tuple] = []
        real_layer, real_experts, real_guess = src.layer, src.experts, src.guess

        def layer(i):
            events.append(("layer", i))
            return real_layer(i)

        def guess(L, ids):
            events.append(("guess", L, len(ids)))
            real_guess(L, ids)

        class Experts:
            def __init__(self, L, ids):
                self.inner = real_experts(L, ids)
                self.L = L

            def __enter__(self):
                events.append(("enter", self.L))
                return self.inner.__enter__()

            def __exit__(self, *exc):
                events.append(("exit", self.L))
                return self.inner.__exit__(*exc)

        src.layer, src.experts, src.guess = layer, Experts, guess
        assert greedy(small, src) == want
    ahead = []
    inside: int | None = None
    for ev in events:
        if ev[0] == "enter":
            inside = ev[1]
        elif ev[0] == "exit":
            inside = None
        elif ev[0] == "guess" and inside is not None:
            ahead.append((inside, ev[1], ev[2]))
    assert ahead, "no guess was made a layer ahead"
    assert all(L + 1 == nxt and n <= g.top_k // 2 for L, nxt, n in ahead)
    assert {L for L, _, _ in ahead} == set(range(1, g.n_layers - 1))  # every MoE layer but the last
