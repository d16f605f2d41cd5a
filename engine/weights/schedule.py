"""When the model's expert work happens relative to the reads — the I/O schedule, kept out
of the math (engine/model/ says what to compute, this says in what order and how early).

* `each_expert`: the arrival order and the compute threads of one layer's experts.
* `guess_at_attention` / `guess_ahead`: the reads a streaming source starts before the
  router has chosen, from the model's router applied to an earlier hidden state. A guess
  is a hint only: `WeightSource.experts` still receives the router's choice, so the ids
  never depend on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from engine.core.config import ModelConfig
from engine.kernels import compute_threads
from engine.weights.source import ExpertSet, ExpertWeights, WeightSource

R = TypeVar("R")
# The model's router for a layer's tensors and a hidden state: the distinct experts of its
# top-k (a pure function of its arguments).
Router = Callable[[Mapping[str, np.ndarray], np.ndarray, int], list[int]]

_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (workers, pool)


class _Arrivals:
    """Hands out the experts of one layer in the order their bytes arrive: any already in
    memory first, else the one whose read was queued first (reads land roughly in queue
    order), so a compute thread never blocks on a late read while an earlier one waits."""

    def __init__(self, ids: Sequence[int], experts: ExpertSet):
        self.left = list(range(len(ids)))
        self.ids = ids
        self.experts = experts
        self.lock = threading.Lock()

    def take(self) -> int:
        with self.lock:
            i = min(self.left, key=lambda k: self.experts.arrival(self.ids[k]))
            self.left.remove(i)
            return i


def each_expert(experts: ExpertSet, ids: Sequence[int],
                fn: Callable[[int, ExpertWeights], R]) -> list[R]:
    """[fn(i, experts[ids[i]]) for each i], in the order of `ids`.

    A source may hand experts out in groups that stay valid only until a later one is
    asked for, so by default each expert is fetched and used at once, in order. When the
    set is `concurrent` (ResidentSource's, or the streaming source's when the whole set
    fits its cache) experts are taken in the order they arrive and, with several compute
    threads, run side by side (the fused kernels release the GIL): one fork-join per
    layer rather than one per matrix. Each result goes to its own place and `fn` is the
    same either way, so results do not depend on the order."""
    global _POOL
    if not experts.concurrent or len(ids) <= 1:
        return [fn(i, experts[e]) for i, e in enumerate(ids)]
    outs: list[R | None] = [None] * len(ids)
    arrivals = _Arrivals(ids, experts)

    def one(_: int) -> None:
        i = arrivals.take()
        outs[i] = fn(i, experts[ids[i]])

    threads = compute_threads()
    if threads <= 1:
        for k in range(len(ids)):
            one(k)
    else:
        if _POOL is None or _POOL[0] != threads:
            _POOL = (threads, ThreadPoolExecutor(max_workers=threads,
                                                 thread_name_prefix="k3-expert"))
        list(_POOL[1].map(one, range(len(ids))))
    return outs  # type: ignore[return-value]


def guess_at_attention(source: WeightSource, cfg: ModelConfig, layer: int,
                       w: Mapping[str, np.ndarray], x: np.ndarray, router: Router) -> None:
    """Before layer `layer`'s attention in a one-token step: its router applied to the
    attention's input instead of its output. One mixer moves the residual stream little,
    so this names most of the experts the layer will choose (~90 % on the synthesised
    checkpoints), early enough for their reads to overlap the attention."""
    if len(x) == 1 and cfg.is_moe(layer) and source.wants_guesses:
        source.guess(layer, router(w, x, cfg.num_experts_per_token))


def guess_ahead(source: WeightSource, cfg: ModelConfig, layer: int, x: np.ndarray,
                router: Router) -> None:
    """While layer `layer`'s experts are read (call it after their reads are issued, so
    these queue behind them): start reading the experts `layer + 1` is surest to route to,
    judged by its router on this layer's FFN input `x`; otherwise the disk idles from
    this layer's last read to the next layer's guess at its attention. Only the surest
    half (~70 % right on the bench checkpoint, ~60 % for all top-k); the guess at the
    attention adds the rest. Only where the next layer's trunk is resident: it is not
    waited for."""
    nxt = layer + 1
    if len(x) != 1 or not source.wants_guesses or nxt >= cfg.num_hidden_layers \
            or not cfg.is_moe(nxt):
        return
    w = source.resident_layer(nxt)
    if w is not None:
        source.guess(nxt, router(w, x, cfg.num_experts_per_token // 2))
