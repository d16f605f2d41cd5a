"""The expert slot arena: LRU order, pinned and filling slots are never victims."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import PlanError
from engine.weights.experts import ExpertCache


def test_stream_cache_lru_order_and_evictions():
    c = ExpertCache(3, 4096)
    for k in range(3):
        (s,) = c.reserve(1)
        c.publish(s, (1, k))
        c.unpin(s)
    assert c.evictions == 0
    c.pin(c.lookup((1, 0)))  # use expert 0 again: expert 1 is now least recent
    c.unpin(c.lookup((1, 0)))
    (s,) = c.reserve(1)
    assert c.lookup((1, 1)) is None and c.lookup((1, 0)) is not None
    assert c.evictions == 1
    c.publish(s, (2, 5))
    c.unpin(s)
    assert set(c.resident()) == {(1, 0), (1, 2), (2, 5)}


def test_stream_cache_never_evicts_pinned_or_filling():
    c = ExpertCache(3, 4096)
    a, b = c.reserve(2)  # filling + pinned
    c.publish(a, (1, 0))  # a published but still pinned (in use)
    (s,) = c.reserve(1)
    assert s not in (a, b)
    with pytest.raises(PlanError, match="larger --cache-gb"):
        c.reserve(1)
    c.discard(b)
    c.unpin(b)
    (again,) = c.reserve(1)
    assert again == b
    buf = c.buffer(2)
    assert buf.nbytes == 4096 and buf.ctypes.data % 4096 == 0


def _replay(cache: ExpertCache, trace) -> float:
    """Serve a routing trace [(layer, ids)] like the source does; → true resident hit rate."""
    hits = asked = 0
    for layer, ids in trace:
        got = []
        for e in ids:
            s = cache.lookup((layer, e))
            asked += 1
            if s is not None:
                hits += 1
                cache.pin(s)
                got.append(s)
        missing = [e for e in ids if cache.lookup((layer, e)) is None]
        slots = cache.reserve(len(missing), layer)
        for e, s in zip(missing, slots):
            cache.publish(s, (layer, e))
        for s in got + slots:
            cache.unpin(s)
    return hits / asked


def _trace(tokens=30, layers=12, experts=256, k=16, reuse=0.33, seed=0):
    rng = np.random.default_rng(seed)
    prev: dict[int, list[int]] = {}
    out = []
    for _ in range(tokens):
        for L in range(1, layers + 1):
            keep = [e for e in prev.get(L, []) if rng.random() < reuse]
            rest = rng.choice(np.setdiff1d(np.arange(experts), keep), k - len(keep),
                              replace=False)
            prev[L] = keep + [int(e) for e in rest]
            out.append((L, sorted(prev[L])))
    return out


def test_stream_cyclic_policy_retains_below_the_working_set():
    trace = _trace()
    working_set = 12 * 16
    for nslots in (48, 150):  # below one token's working set
        lru = _replay(ExpertCache(nslots, 4096, "lru"), trace)
        cyc = _replay(ExpertCache(nslots, 4096, "cyclic", n_layers=13,
                                  working_set=working_set), trace)
        assert lru == 0.0  # LRU evicts every expert just before its layer comes round
        assert cyc > 0.04 * nslots / 48
    # At or above the working set it is LRU.
    a = _replay(ExpertCache(400, 4096, "lru"), trace)
    b = _replay(ExpertCache(400, 4096, "cyclic", n_layers=13, working_set=working_set), trace)
    assert a == b > 0.3
