"""each_expert takes a concurrent set's experts in the order their bytes arrive (any in
memory first, then by read queue position), so no compute thread blocks on a late read
while an earlier one is waiting; each result still lands in its own place."""

from __future__ import annotations

import numpy as np
import pytest

from engine.weights import schedule
from engine.weights.schedule import each_expert
from engine.weights.source import ExpertTable


class Arriving(ExpertTable):
    """Experts whose reads land in a given order (0 = already in memory)."""

    def __init__(self, ids, arrival):
        super().__init__({e: e for e in ids})
        self._arrival = dict(zip(ids, arrival))

    def arrival(self, e):
        return self._arrival[e]


@pytest.mark.parametrize("threads", [1, 2])
def test_each_expert_computes_in_arrival_order(monkeypatch, threads):
    ids = [2, 5, 7, 9, 11]
    experts = Arriving(ids, [40, 0, 12, 0, 30])  # 5 and 9 in memory; 7, then 11, then 2
    done = []

    def fake_mlp(i, ex):
        done.append(ex)
        return z[[i]] * ex

    monkeypatch.setattr(schedule, "compute_threads", lambda: threads)
    z = np.arange(12, dtype=np.float32).reshape(6, 2)
    outs = each_expert(experts, ids, fake_mlp)
    for k, e in enumerate(ids):  # results in the order of ids, whatever the compute order
        assert np.array_equal(outs[k], z[[k]] * e)
    if threads == 1:
        assert done == [5, 9, 7, 11, 2]
    else:
        assert sorted(done) == sorted(ids)


def test_each_expert_keeps_order_for_a_set_that_is_not_concurrent(monkeypatch):
    class Groups(Arriving):
        concurrent = False

    ids = [2, 5, 7]
    done = []
    each_expert(Groups(ids, [9, 0, 3]), ids, lambda i, ex: done.append(ex))
    assert done == ids  # groups stay valid only in order
