"""Forecast s/token, its bound, peak RSS and first-token time from measured parts.

A function of three things: the machine's measured parts (`bench parts` JSON: disk GB/s
for the ring's background trunk runs, for the head's urgent chunks and for expert reads at
the engine's queue depth; seconds of one real-width KDA-MoE, MLA-MoE, dense layer 0 and
head through the engine's decoder layer and kernels, the MoE layers split at the moment
they ask for their experts; the top-k routed experts' compute; how many of the routed
experts the attention-time guess names), a model's layer kinds, and a memory `Plan`.

A token is replayed the way the engine runs it, on two resources — the cores and the disk:
* trunk: pinned layers cost nothing; streamed layers go through the plan's ring: when a
  layer releases its slot, the slot starts reading the next streamed layer that is not
  held (with one slot the read starts only then: it adds; with two it overlaps the layer
  computing now, and with pinned layers in between it overlaps those);
* experts: misses per MoE layer = top-k x (1 - hit), hit = the engine's own ExpertCache
  (its eviction policy, the plan's slots) replayed on uniformly random routing (no
  locality assumed). With the plan's expert read-ahead the guessed share of the misses
  is read from the layer's start, the rest from when the router asks; the reads are
  urgent (they go ahead of trunk read-ahead on the disk) and the layer ends when its
  compute ends or one expert's compute after its last read lands, whichever is later;
* head: resident, its matvec; streamed (plan.stream_tables), chunk by chunk through two
  buffers, the next chunk read while the current one computes; embedding rows on demand;
* the disk serves urgent reads first, background trunk reads in the gaps.
The token is replayed until the ring is in its steady state (a few tokens) and the last
one is reported, with its terms named as `run --json` reports them: compute, waiting for
the trunk, waiting for experts (the head's waits count as compute there, as in the run).
First token of a T-token prompt: the streamed trunk and head read once, the union of each
layer's experts, E x (1 - (1 - k/E)^T) per layer, not resident, and T x the per-token
compute (an upper bound: the kernels read each weight once for all T rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.core.directio import ALIGN
from engine.weights.experts import ExpertCache
from engine.weights.planner import HEAD_CHUNK_BYTES, Plan
from k3vocab import GB

KINDS = ("dense", "kda", "mla")


@dataclass(frozen=True)
class Parts:
    """What `python -m engine bench parts` measured (seconds and bytes per second)."""

    seq_read_bps: float  # trunk-sized runs at read-ahead priority, as the ring reads them
    chunk_read_bps: float  # the streamed head's chunks, urgent, one at a time
    expert_read_bps: float  # top-k expert reads at once, urgent, in the engine's chunks
    kda_moe_s: float
    mla_moe_s: float
    dense_s: float
    head_s: float
    kda_pre_s: float  # a KDA-MoE layer's start until it asks for its experts (router done)
    mla_pre_s: float
    routed_s: float  # the top-k routed experts of one token, weights in memory
    guess_hit: float  # share of the routed experts the attention-time guess named

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Parts:
        """From the bench parts JSON; refuses missing or out-of-range figures."""
        keys = {"seq_read_bps": ("disk", "sequential_gb_per_s", GB),
                "chunk_read_bps": ("disk", "chunk_gb_per_s", GB),
                "expert_read_bps": ("disk", "expert_gb_per_s", GB),
                "kda_moe_s": ("compute", "kda_moe_layer_s", 1),
                "mla_moe_s": ("compute", "mla_moe_layer_s", 1),
                "dense_s": ("compute", "dense_layer0_s", 1), "head_s": ("compute", "head_s", 1),
                "kda_pre_s": ("compute", "kda_moe_pre_experts_s", 1),
                "mla_pre_s": ("compute", "mla_moe_pre_experts_s", 1),
                "routed_s": ("compute", "routed_experts_s", 1),
                "guess_hit": ("compute", "guess_hit_rate", 1)}
        vals = {}
        for name, (group, key, scale) in keys.items():
            v = (d.get(group) or {}).get(key) if isinstance(d.get(group), dict) else None
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or not (0 <= v <= 1 if name == "guess_hit" else v > 0):
                raise ValueError(f"the parts measurement lacks a valid {group}.{key}; "
                                 "run `python -m engine bench parts` again.")
            vals[name] = float(v) * scale
        return cls(**vals)


@dataclass(frozen=True)
class LayerKinds:
    kinds: tuple[str, ...]  # per layer: dense, kda (KDA-MoE) or mla (MLA-MoE)
    row_bytes: int = 0  # one embedding row, read on demand when the tables stream

    @classmethod
    def of(cls, cfg) -> LayerKinds:
        kinds = tuple("dense" if not cfg.is_moe(i) else "mla" if cfg.is_mla(i) else "kda"
                      for i in range(cfg.num_hidden_layers))
        return cls(kinds, 2 * cfg.hidden_size)

    def count(self, kind: str) -> int:
        return self.kinds.count(kind)


def expert_hit_rate(plan: Plan, tokens: int = 16, seed: int = 0) -> float:
    """The hit rate of the engine's ExpertCache (its policy, the plan's slots, tiny slots
    of one page) replayed on uniformly random top-k routing, after it has filled."""
    g = plan.geometry
    if not g.moe_layers or plan.expert_slots >= g.n_experts * g.moe_layers:
        return 1.0  # every expert is read once, up front
    n_moe, k = g.moe_layers, g.top_k
    cache = ExpertCache(plan.expert_slots, ALIGN, "cyclic", n_layers=n_moe,
                        working_set=k * n_moe)
    rng = np.random.default_rng(seed)
    warm = math.ceil(plan.expert_slots / (k * n_moe)) + 2
    hits = asked = 0
    for t in range(warm + tokens):
        for layer in range(n_moe):
            held, missing = [], []
            for e in rng.choice(g.n_experts, k, replace=False):
                slot = cache.lookup((layer, int(e)))
                if slot is None:
                    missing.append(int(e))
                else:
                    cache.pin(slot)
                    held.append(slot)
            slots = cache.reserve(len(missing), layer)
            for e, slot in zip(missing, slots):
                cache.publish(slot, (layer, e))
            for slot in held + slots:
                cache.unpin(slot)
            if t >= warm:
                hits, asked = hits + len(held), asked + k
    return hits / asked


class _Disk:
    """One device: urgent reads in the order asked, background trunk reads in the gaps."""

    def __init__(self) -> None:
        self.busy: list[tuple[float, float]] = []  # urgent intervals, in start order
        self.urgent_free = 0.0
        self.queue: list[tuple[float, float]] = []  # background reads: (issued at, seconds)
        self.done: list[float] = []

    def urgent(self, t: float, secs: float) -> float:
        if secs <= 0:
            return t
        start = max(t, self.urgent_free)
        self.urgent_free = start + secs
        self.busy.append((start, self.urgent_free))
        return self.urgent_free

    def background(self, t: float, secs: float) -> int:
        self.queue.append((t, secs))
        return len(self.queue) - 1

    def finished(self, j: int) -> float:
        """When background read j ends. Asked when the compute needs it, so every urgent
        read that can go before it is already known."""
        while len(self.done) <= j:
            issued, left = self.queue[len(self.done)]
            s = max(issued, self.done[-1] if self.done else 0.0)
            for a, b in self.busy:
                if b <= s:
                    continue
                if a >= s + left:
                    break
                left -= max(0.0, a - s)
                s = b
            self.done.append(s + left)
        return self.done[j]


def _moe_layer(parts: Parts, plan: Plan, disk: _Disk, kind: str, t: float,
               miss_s: float) -> tuple[float, float]:
    """(end, seconds waited for experts) of one MoE layer starting at t."""
    full, pre = ((parts.kda_moe_s, parts.kda_pre_s) if kind == "kda"
                 else (parts.mla_moe_s, parts.mla_pre_s))
    pre = min(pre, full)
    guessed = miss_s * parts.guess_hit if plan.guess_experts else 0.0
    landed = disk.urgent(t, guessed)  # reads of the guess start with the layer
    landed = max(landed, disk.urgent(t + pre, miss_s - guessed))  # the rest at the router
    end = t + full
    if miss_s > 0:
        end = max(end, landed + parts.routed_s / plan.geometry.top_k)
    return end, end - (t + full)


def _head(parts: Parts, plan: Plan, disk: _Disk, t: float) -> float:
    """End of the head's matvec, streamed in chunks through two buffers when the plan
    streams the tables."""
    if not plan.stream_tables:
        return t + parts.head_s
    n = max(1, math.ceil(plan.geometry.table_bytes / 2 / HEAD_CHUNK_BYTES))
    read = plan.geometry.table_bytes / 2 / n / parts.chunk_read_bps
    landed = disk.urgent(t, read)
    for k in range(n):
        t = max(t, landed)
        if k + 1 < n:
            landed = disk.urgent(t, read)
        t += parts.head_s / n
    return t


def replay(parts: Parts, kinds: LayerKinds, plan: Plan, hit: float,
           tokens: int = 4) -> dict[str, float]:
    """The last of `tokens` decode tokens replayed: wall seconds and its terms."""
    g = plan.geometry
    pinned = set(plan.pinned)
    streamed = [i for i in range(g.n_layers) if i not in pinned]
    ring = plan.ring_slots
    # A ring holding every streamed layer reads each once (the first pass): none per token.
    order = [L for _ in range(tokens) for L in streamed] if ring < len(streamed) else []
    disk = _Disk()
    reads = [disk.background(0.0, g.layer_bytes[L] / parts.seq_read_bps)
             for L in order[:ring]]
    miss_s = g.top_k * (1 - hit) * g.expert_bytes / parts.expert_read_bps
    row_s = kinds.row_bytes / parts.expert_read_bps if plan.stream_tables else 0.0
    t, nxt, out = 0.0, 0, {}
    for _ in range(tokens):
        t0, waits = t, {"trunk": 0.0, "experts": 0.0}
        t = disk.urgent(t, row_s)  # the token's embedding row
        for L, kind in enumerate(kinds.kinds):
            j = nxt if order and L not in pinned else None
            if j is not None:
                ready = disk.finished(reads[j])
                waits["trunk"] += max(0.0, ready - t)
                t = max(t, ready)
            if kind == "dense":
                t += parts.dense_s
            else:
                t, w = _moe_layer(parts, plan, disk, kind, t, miss_s)
                waits["experts"] += w
            if j is not None:  # the slot is released: it reads the next streamed layer
                nxt += 1
                if j + ring < len(order):
                    reads.append(disk.background(t, g.layer_bytes[order[j + ring]]
                                                 / parts.seq_read_bps))
        t = _head(parts, plan, disk, t)
        out = {"s_per_token": t - t0, "wait_trunk_s": waits["trunk"],
               "wait_experts_s": waits["experts"]}
    out["compute_s"] = out["s_per_token"] - out["wait_trunk_s"] - out["wait_experts_s"]
    return out


def forecast(parts: Parts, kinds: LayerKinds, plan: Plan,
             prompts: tuple[int, ...] = (50, 500)) -> dict[str, Any]:
    g = plan.geometry
    trunk_compute = (kinds.count("kda") * parts.kda_moe_s + kinds.count("mla") * parts.mla_moe_s
                     + kinds.count("dense") * parts.dense_s)
    head_bytes = g.table_bytes / 2 if plan.stream_tables else 0.0
    hit = expert_hit_rate(plan)
    miss_bytes = g.top_k * g.moe_layers * (1 - hit) * g.expert_bytes
    trunk_disk = plan.streamed_trunk_bytes / parts.seq_read_bps
    disk = trunk_disk + head_bytes / parts.chunk_read_bps + miss_bytes / parts.expert_read_bps
    compute = trunk_compute + parts.head_s
    token = replay(parts, kinds, plan, hit)
    first: dict[str, float] = {}
    union_gb: dict[str, float] = {}
    for t in prompts:
        union = g.n_experts * (1 - (1 - g.top_k / max(g.n_experts, 1)) ** t)
        u_bytes = union * g.moe_layers * (1 - hit) * g.expert_bytes
        union_gb[str(t)] = u_bytes / GB
        first[str(t)] = (trunk_disk + head_bytes / parts.chunk_read_bps
                         + u_bytes / parts.expert_read_bps + t * trunk_compute + parts.head_s)
    return {
        "s_per_token": token["s_per_token"],
        "bound": "disk" if disk >= compute else "compute",
        "disk_s": disk,
        "compute_s": compute,
        "terms": token,  # the replayed token, named as `run --json` names its totals
        "gb_read_per_token": (plan.read_bytes_per_token + miss_bytes) / GB,
        "gb_read_experts_per_token": miss_bytes / GB,
        "expert_hit_rate": hit,
        "peak_rss_gb": plan.forecast_rss_bytes / GB,
        "first_token_s": first[str(prompts[0])],
        "first_token_s_by_prompt": first,
        "prefill_expert_gb_by_prompt": union_gb,
    }
