"""Resuming a conversation from a kept state (engine/model/state.py snapshots, the
server's SnapshotStore): every turn gives exactly the ids, and the logits within float32
rounding, of a cold prefill of the same prompt, resident and streaming."""

from __future__ import annotations

import argparse
import threading

import numpy as np
import pytest

from engine.checkpoint.synth import synthesize
from engine.decode.generate import GenParams, generate
from engine.model.transformer import load_model
from engine.serve.snapshots import SnapshotStore
from engine.weights.planner import MemorySettings, add_memory_arguments
from k3vocab import GB
from engine.weights.streaming import CheckpointMap, open_source

SYS_A, SYS_B = [5, 17, 3, 99], [8, 1, 2]
PARAMS = GenParams(max_tokens=5)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("resume"), "small", seed=5)


@pytest.fixture(scope="module", params=["resident", "streaming"])
def model(request, ckpt):
    if request.param == "resident":
        return load_model(ckpt)
    g = CheckpointMap(ckpt).geometry()
    floor = (max(g.layer_bytes) + g.min_expert_slots * g.expert_slot_bytes) / GB
    p = argparse.ArgumentParser()
    add_memory_arguments(p)
    memory = MemorySettings.from_args(p.parse_args(["--budget-gb", f"{floor * 1.2:.6f}"]))
    source = open_source(ckpt, memory, quiet=True)
    return load_model(ckpt, source)


def run(model, prompt, store=None, cancel_after=None):
    """(ids, logits per step, prompt ids reused)."""
    logits: list[np.ndarray] = []
    cancel = threading.Event()

    def hook(generated, lg):
        logits.append(lg.copy())
        return lg

    kw = {} if store is None else dict(resume=store.take(prompt), keep=store.put)
    ids, reused = [], None
    for t in generate(model, prompt, PARAMS, logits_hook=hook, cancel=cancel, **kw):
        ids.append(t.id)
        reused = t.reused if reused is None else reused
        if cancel_after is not None and len(ids) >= cancel_after:
            cancel.set()
    return ids, logits, reused


def turn(model, store, prompt, expect_reused, cancel_after=None):
    ids, logits, reused = run(model, prompt, store, cancel_after)
    cold_ids, cold_logits, _ = run(model, prompt, cancel_after=cancel_after)
    assert ids == cold_ids
    for a, b in zip(logits, cold_logits):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert reused == expect_reused
    return ids


def test_resumed_turns_equal_cold_prefills(model):
    store = SnapshotStore(1 << 30)
    a1 = SYS_A + [40, 41]
    r1 = turn(model, store, a1, 0)
    a2 = a1 + r1 + [42, 43, 44]
    r2 = turn(model, store, a2, len(a1) + len(r1) - 1)  # the reply's state: all but its last id
    turn(model, store, a2, len(a2))  # regenerate: the prompt's state and logits, no prefill
    a2e = a1 + r1 + [45]  # edit of the last prompt: back to the first reply's state
    r2e = turn(model, store, a2e, len(a1) + len(r1) - 1)
    b1 = SYS_B + [50]  # another conversation, and back
    rb = turn(model, store, b1, 0)
    turn(model, store, b1 + rb + [51], len(b1) + len(rb) - 1)
    a3 = a2e + r2e + [46]
    turn(model, store, a3, len(a2e) + len(r2e) - 1)
    assert r2  # (the unedited branch stays kept too)
    turn(model, store, a2 + r2 + [47], len(a2) + len(r2) - 1)


def test_cancelled_answer_keeps_no_state_past_its_prompt(model):
    store = SnapshotStore(1 << 30)
    a1 = SYS_A + [60]
    turn(model, store, a1, 0, cancel_after=2)
    assert [len(ids) for _, ids in store._kept] == [len(a1)]  # the prompt's, none of the reply's
    partial = run(model, a1)[0][:2]
    turn(model, store, a1 + partial + [61], len(a1))


def test_a_taken_state_is_a_copy(model):
    store = SnapshotStore(1 << 30)
    prompt = SYS_A + [70, 71]
    run(model, prompt, store)
    kept = {k: s.snapshot() for k, s in store._kept.items()}
    run(model, prompt + [72], store)  # advances the copy it took
    for key, before in kept.items():
        after = store._kept[key]
        for x, y in zip(before.layers, after.layers):
            if hasattr(x, "S"):
                assert np.array_equal(x.S, y.S)
            else:
                assert x.length == y.length
                assert np.array_equal(x.latent[: x.length], y.latent[: y.length])


def test_lru_and_a_budget_too_small_for_one(model):
    one = model.new_state().nbytes()
    tiny = SnapshotStore(one // 2)
    run(model, SYS_A + [80], tiny)
    assert len(tiny) == 0 and tiny.take(SYS_A + [80, 81]) is None
    store = SnapshotStore(int(one * 2.5))  # room for two states of a short conversation
    a, b = SYS_A + [81], SYS_B + [82]
    run(model, a, store, cancel_after=1)  # keeps a's prompt only
    run(model, b, store, cancel_after=1)
    assert store.take(a + [1]) is not None  # a is now the most recently used
    run(model, SYS_B + [83], store, cancel_after=1)  # a third: b goes, not a
    assert store.take(a + [1]) is not None and store.take(b + [1]) is None
