"""Decoding loop: prefill, then one token per step (or full recomputation), sampling,
stop ids, max tokens, cancellation, per-token timing and engine statistics."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.model.transformer import Cancelled, Model
from engine.weights.planner import GB
from engine.sampler import Sampler
from engine.weights.sysmem import current_rss, peak_rss

LogitsHook = Callable[[list[int], np.ndarray], np.ndarray]


@dataclass(frozen=True)
class GenParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    full_recompute: bool = False


@dataclass(frozen=True)
class GenToken:
    id: int
    seconds: float  # wall time since the previous token (since the start for index 0)
    index: int
    prefill_seconds: float | None  # index 0 only: the prompt's forward pass
    stats: dict[str, Any] = field(default_factory=dict)
    stop: bool = False  # this id is one of params.stop_ids; it is the last token yielded


def generate(model: Model, prompt_ids: Sequence[int], params: GenParams, *,
             cancel: threading.Event | None = None,
             logits_hook: LogitsHook | None = None) -> Iterator[GenToken]:
    """Yield generated tokens one by one. A stop id is yielded (flagged `stop`) and ends the
    run; `cancel` is checked between tokens and between layers."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt id")
    sample = Sampler(params.temperature, params.top_k, params.top_p, params.seed)
    stops = set(int(s) for s in params.stop_ids)
    ids = [int(i) for i in prompt_ids]
    generated: list[int] = []
    state = None if params.full_recompute else model.new_state()
    meter = _StatsMeter(model)
    start = last = time.perf_counter()
    try:
        for index in range(params.max_tokens):
            if cancel is not None and cancel.is_set():
                return
            t0 = time.perf_counter()
            if params.full_recompute:
                logits = model.forward(ids, model.new_state(), all_positions=False, cancel=cancel)[-1]
            elif index == 0:
                logits = model.prefill(ids, state, cancel=cancel)
            else:
                logits = model.step(ids[-1], state, cancel=cancel)
            compute = time.perf_counter() - t0
            if logits_hook is not None:
                logits = logits_hook(list(generated), logits)
            token = sample(logits)
            now = time.perf_counter()
            generated.append(token)
            ids.append(token)
            yield GenToken(
                id=token,
                seconds=now - (start if index == 0 else last),
                index=index,
                prefill_seconds=compute if index == 0 else None,
                stats=meter.delta(compute),
                stop=token in stops,
            )
            last = time.perf_counter()
            if token in stops:
                return
    except Cancelled:
        return


class _StatsMeter:
    """Per-token statistics (the interface's keys) from the source's running totals, plus
    each token's expert hits/misses (so a run's hit rate can be totalled) and the RSS now
    and at its peak, measured here when the source does not report them."""

    def __init__(self, model: Model):
        self.source = model.source
        self.prev = self._read()

    def _read(self) -> dict[str, Any]:
        return dict(self.source.stats())

    def delta(self, seconds: float) -> dict[str, Any]:
        prev, cur = self.prev, self._read()
        self.prev = cur

        def d(key: str) -> float:
            return float(cur.get(key, 0) or 0) - float(prev.get(key, 0) or 0)

        gb = d("gb_read_trunk") + d("gb_read_experts")
        hits, misses = int(d("expert_hits")), int(d("expert_misses"))
        out = {
            "compute_s": max(0.0, seconds - d("wait_trunk_s") - d("wait_experts_s")),
            "wait_trunk_s": d("wait_trunk_s"),
            "wait_experts_s": d("wait_experts_s"),
            "gb_read_trunk": d("gb_read_trunk"),
            "gb_read_experts": d("gb_read_experts"),
            "mb_per_s": gb * 1000.0 / seconds if seconds > 0 else 0.0,
            "true_hit_rate": hits / (hits + misses) if hits + misses else None,
            "expert_hits": hits,
            "expert_misses": misses,
            "evictions": int(d("evictions")),
            "rss_gb": cur.get("rss_gb", current_rss() / GB),
            "peak_rss_gb": cur.get("peak_rss_gb", peak_rss() / GB),
        }
        if "budget_gb" in cur:
            out["budget_gb"] = cur["budget_gb"]
        if "experts_guessed" in cur:  # expert read-ahead: guesses made, adopted, bytes wasted
            out["experts_guessed"] = int(d("experts_guessed"))
            out["experts_guessed_used"] = int(d("experts_guessed_used"))
            out["gb_read_unused"] = d("gb_read_unused")
        return out
