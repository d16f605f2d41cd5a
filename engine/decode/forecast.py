"""Forecast s/token, its bound, peak RSS and first-token time from measured parts.

A pure function of three things: the machine's measured parts (`bench parts` JSON: disk
GB/s for trunk-sized sequential runs and for expert reads at the engine's queue depth,
seconds of one real-width KDA-MoE, MLA-MoE, dense layer 0 and head on this machine's
cores), a model's `Geometry`/layer kinds, and a memory `Plan`. The model of a token:

* disk: the unpinned trunk (and the head, when the plan streams it) at the sequential
  rate, plus expert misses at the expert rate. Misses per token = top-k × MoE layers ×
  (1 − hit), hit = expert slots ÷ all experts (routing spread evenly: no locality assumed);
* compute: the sum of the layers' measured seconds;
* overlap, as the engine does it: with a ring of two slots the next layer's trunk is read
  while the current one computes, so trunk reads and compute overlap (max); with one slot
  they add. Expert misses are demand reads: the layer waits for them (they add).
* first token of a T-token prompt: one pass reading the streamed trunk once and the union
  of each layer's experts, E × (1 − (1 − k/E)^T) per layer, compute T × per-token compute
  (an upper bound: the kernels read each weight once for all T rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.weights.planner import GB, Plan


@dataclass(frozen=True)
class Parts:
    """What `python -m engine bench parts` measured (seconds and bytes per second)."""

    seq_read_bps: float
    expert_read_bps: float
    kda_moe_s: float
    mla_moe_s: float
    dense_s: float
    head_s: float

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Parts:
        """From the bench parts JSON; refuses missing or non-positive figures."""
        keys = {"seq_read_bps": ("disk", "sequential_gb_per_s", GB),
                "expert_read_bps": ("disk", "expert_gb_per_s", GB),
                "kda_moe_s": ("compute", "kda_moe_layer_s", 1), "mla_moe_s": ("compute",
                "mla_moe_layer_s", 1), "dense_s": ("compute", "dense_layer0_s", 1),
                "head_s": ("compute", "head_s", 1)}
        vals = {}
        for name, (group, key, scale) in keys.items():
            v = (d.get(group) or {}).get(key) if isinstance(d.get(group), dict) else None
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"the parts measurement lacks a positive {group}.{key}; "
                                 "run `python -m engine bench parts` again.")
            vals[name] = float(v) * scale
        return cls(**vals)


@dataclass(frozen=True)
class LayerKinds:
    n_kda_moe: int
    n_mla_moe: int
    n_dense: int

    @classmethod
    def of(cls, cfg) -> LayerKinds:
        n = cfg.num_hidden_layers
        dense = sum(not cfg.is_moe(i) for i in range(n))
        mla = sum(cfg.is_mla(i) and cfg.is_moe(i) for i in range(n))
        return cls(n - dense - mla, mla, dense)


def expert_hit_rate(plan: Plan) -> float:
    g = plan.geometry
    return min(1.0, plan.expert_slots / max(1, g.n_experts * g.moe_layers))


def forecast(parts: Parts, kinds: LayerKinds, plan: Plan,
             prompts: tuple[int, ...] = (50, 500)) -> dict[str, Any]:
    g = plan.geometry
    trunk_compute = (kinds.n_kda_moe * parts.kda_moe_s + kinds.n_mla_moe * parts.mla_moe_s
                     + kinds.n_dense * parts.dense_s)
    trunk_disk = plan.streamed_trunk_bytes / parts.seq_read_bps
    head_disk = (g.table_bytes // 2) / parts.seq_read_bps if plan.stream_tables else 0.0
    head = max(head_disk, parts.head_s)  # the head streams in chunks under its matvec
    hit = expert_hit_rate(plan)
    miss_bytes = g.top_k * g.moe_layers * (1 - hit) * g.expert_bytes
    expert_disk = miss_bytes / parts.expert_read_bps
    trunk = (max(trunk_disk, trunk_compute) if plan.ring_slots >= 2
             else trunk_disk + trunk_compute)
    s = trunk + head + expert_disk
    disk = trunk_disk + head_disk + expert_disk
    compute = trunk_compute + parts.head_s
    first: dict[str, float] = {}
    union_gb: dict[str, float] = {}
    for t in prompts:
        union = g.n_experts * (1 - (1 - g.top_k / max(g.n_experts, 1)) ** t)
        u_bytes = union * g.moe_layers * (1 - hit) * g.expert_bytes
        union_gb[str(t)] = u_bytes / GB
        first[str(t)] = (trunk_disk + head_disk + u_bytes / parts.expert_read_bps
                         + t * trunk_compute + parts.head_s)
    return {
        "s_per_token": s,
        "bound": "disk" if disk >= compute else "compute",
        "disk_s": disk,
        "compute_s": compute,
        "gb_read_per_token": (plan.read_bytes_per_token + miss_bytes) / GB,
        "expert_hit_rate": hit,
        "peak_rss_gb": plan.forecast_rss_bytes / GB,
        "first_token_s": first[str(prompts[0])],
        "first_token_s_by_prompt": first,
        "prefill_expert_gb_by_prompt": union_gb,
    }
