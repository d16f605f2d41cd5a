"""run_experts takes a concurrent set's experts in the order their bytes arrive (any in
memory first, then by read queue position), so no compute thread blocks on a late read
while an earlier one is waiting; each result still lands in its own place."""

from __future__ import annotations

import numpy as np
import pytest

from engine.model import moe
from engine.weights.source import ExpertTable


class Arriving(ExpertTable):
    """Experts whose reads land in a given order (0 = already in memory)."""

    def __init__(self, ids, arrival):
        super().__init__({e: e for e in ids})
        self._arrival = dict(zip(ids, arrival))

    def arrival(self, e):
        return self._arrival[e]


@pytest.mark.parametrize("threads", [1, 2])
def test_run_experts_computes_in_arrival_order(monkeypatch, threads):
    ids = [2, 5, 7, 9, 11]
    experts = Arriving(ids, [40, 0, 12, 0, 30])  # 5 and 9 in memory; 7, then 11, then 2
    done = []

    def fake_mlp(z, ex, cfg):
        done.append(ex)
        return z * ex

    monkeypatch.setattr(moe, "expert_mlp", fake_mlp)
    monkeypatch.setattr(moe, "compute_threads", lambda: threads)
    z = np.arange(12, dtype=np.float32).reshape(6, 2)
    tokens = [np.array([k]) for k in range(len(ids))]
    outs = moe.run_experts(z, tokens, ids, experts, cfg=None)
    for k, e in enumerate(ids):  # results in the order of ids, whatever the compute order
        assert np.array_equal(outs[k], z[[k]] * e)
    if threads == 1:
        assert done == [5, 9, 7, 11, 2]
    else:
        assert sorted(done) == sorted(ids)


def test_run_experts_keeps_order_for_a_set_that_is_not_concurrent(monkeypatch):
    class Groups(Arriving):
        concurrent = False

    ids = [2, 5, 7]
    done = []
    monkeypatch.setattr(moe, "expert_mlp", lambda z, ex, cfg: done.append(ex) or z)
    moe.run_experts(np.zeros((3, 2), np.float32), [np.array([0])] * 3, ids,
                    Groups(ids, [9, 0, 3]), cfg=None)
    assert done == ids  # groups stay valid only in order
