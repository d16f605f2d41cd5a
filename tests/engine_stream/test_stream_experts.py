"""The expert slot arena: LRU order, pinned and filling slots are never victims."""

from __future__ import annotations

import pytest

from engine.errors import PlanError
from engine.experts import ExpertCache


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
