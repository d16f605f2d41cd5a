"""The pool's arithmetic: the rpc recipe's numbers applied to the workers' own answers."""

from __future__ import annotations

import pytest

from k3tui.planning import pool, recipes
from k3tui.units import GiB


def test_pool_split_deals_the_layers_like_llama_cpp():
    # llama.cpp deals the n + 1 layers (output last) by cumulative share: two equal workers
    # of the real head's log got 75.02 and 45.74 MiB of a 15 MiB-a-layer model, 5 and 3
    assert recipes.split_layers(8, [1, 1]) == [5, 3]
    assert recipes.split_layers(93, [121, 121, 121, 121, 121]) == [19, 19, 19, 19, 17]
    assert recipes.split_layers(93, [3, 1]) == [71, 22]
    assert recipes.split_layers(93, [0, 0]) == [0, 0]
    for shares in ([5, 1, 1], [1, 0, 2], [7]):
        assert sum(recipes.split_layers(61, shares)) == 61


def test_pool_shortfall_says_the_numbers():
    members = [pool.Member("10.0.0.2:50052", 121 * GiB), pool.Member("10.0.0.3:50052",
                                                                      121 * GiB)]
    short = pool.shortfall(members, int(539 * GiB), 8192)
    need = 539 + recipes.cache_gib(8192)
    assert f"it needs {need:.1f} GiB (539.0 GiB of weights" in short
    assert "it offers 226.0 GiB" in short and "10.0.0.2:50052 113.0 GiB" in short
    assert f"{need - 226:.1f} GiB short" in short
    assert "3 more machine(s)" in short
    assert pool.shortfall(members * 3, int(539 * GiB), 8192) is None


def test_pool_workers_needed_is_the_recipes_count_less_the_head():
    assert pool.workers_needed(int(539 * GiB), 121 * GiB, 8192) == \
        recipes.rpc_sizing(539, 121).nodes - 1 == 4
    assert pool.workers_needed(int(539 * GiB), 8 * GiB, 8192) is None


@pytest.mark.parametrize("head,count", [(pool.Member("this machine's GPU", 100 * GiB), 4),
                                        (None, 5)])
def test_pool_plan_without_workers_says_how_many_it_takes(head, count):
    line, = pool.plan_lines([], model_bytes=int(539 * GiB), ctx=8192, node_bytes=121 * GiB,
                            head=head)
    assert f": {count} worker(s) with this machine's 121.0 GiB would hold it" in line


def test_pool_plan_counts_a_silent_worker_as_nothing():
    lines = pool.plan_lines([pool.Member("10.0.0.2:50052", 64 * GiB),
                             pool.Member("10.0.0.3:50052", None, "refused the connection")],
                            model_bytes=GiB, ctx=4096, node_bytes=64 * GiB, head=None)
    text = "\n".join(lines)
    assert "10.0.0.2:50052: 93 of 93 layers (64.0 GiB free)" in text
    assert "10.0.0.3:50052: 0 of 93 layers (no answer: refused the connection)" in text
    assert "refuses to start until every worker answers" in text
    assert "together they hold it" in text
