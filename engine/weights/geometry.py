"""The memory plan without weights (`python -m engine plan`, engine/commands/plan.py, and
the forecast of `bench parts`).

`real_config` is the released 93-layer Kimi-K3's config (spec 1.1-1.3: the slice
synthesiser's widths with 93 layers and 896 experts) and `geometry_from_config` the
planner's geometry from a config alone, so a user can see what a preset will hold, read
and cost before a 1.56 TB download; `plan_for` plans that or a checkpoint on disk (from
its headers), as a forecast for any machine: never refused for lack of memory here.
"""

from __future__ import annotations

import math

from engine.checkpoint.synth import flat_config, nested_config, slice_overrides, synth_shapes
from engine.core.config import ModelConfig
from engine.core.directio import ALIGN, align_up
from engine.weights.planner import Geometry, Plan, make_plan
from k3vocab import DEFAULT_CONTEXT

REAL_CHECKPOINT_BYTES = 1_560_936_091_448  # spec 1.2, all 96 shards
_F32 = ("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias")


def real_config() -> ModelConfig:
    return ModelConfig.from_dict(nested_config(flat_config("slice", slice_overrides(93, 896))))


def _nbytes(short: str, shape: tuple[int, ...]) -> int:
    n = math.prod(shape)
    return n if ".experts." in short else 4 * n if short.endswith(_F32) else 2 * n


def geometry_from_config(cfg: ModelConfig, checkpoint_bytes: int = 0) -> Geometry:
    """The planner's geometry from a config alone, laid out as the release (and synth) do:
    each layer's trunk one run (aligned window), each expert one run, A_log 128 values."""
    # deferred: streaming imports the kernels and numba, ~0.3 s of `plan --help` (measured)
    from engine.weights.streaming import MODEL_TENSORS, scratch_bytes

    shapes = synth_shapes(cfg)
    n = cfg.num_hidden_layers
    layer = [0] * n
    for short, shape in shapes.items():
        if short.startswith("layers.") and ".experts." not in short:
            layer[int(short.split(".")[1])] += _nbytes(short, shape)
    lat, m = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    expert = 3 * lat * m // 2 + 3 * lat * m // 32  # w1/w2/w3 packed + scales
    model = [_nbytes(s, shapes[s]) for s in MODEL_TENSORS]
    n_mla = len(cfg.mla_layers)
    n_kda = n - n_mla
    state = n_kda * (cfg.kda_num_heads * cfg.kda_head_dim ** 2
                     + 3 * cfg.kda_width * max(cfg.short_conv_kernel_size - 1, 0)) * 4
    biggest = max(math.prod(s) for s in shapes.values() if len(s) == 2)
    moe = [i for i in range(n) if cfg.is_moe(i)]
    return Geometry(
        n_layers=n,
        layer_bytes=tuple(align_up(b) + ALIGN for b in layer),  # a window straddles a page
        expert_slot_bytes=align_up(expert) + ALIGN,
        expert_bytes=expert,
        n_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_token,
        moe_layers=len(moe),
        model_bytes=sum(model),
        checkpoint_bytes=checkpoint_bytes or sum(_nbytes(s, v) for s, v in shapes.items()),
        kv_bytes_per_token=n_mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4,
        state_bytes=state,
        scratch_bytes=scratch_bytes(biggest, cfg),
        table_bytes=model[0] + model[1],
    )


def plan_for(model: str, preset: str | None = None, budget_gb: float | None = None,
             context: int = DEFAULT_CONTEXT) -> Plan:
    if model == "real":
        g = geometry_from_config(real_config(), REAL_CHECKPOINT_BYTES)
    else:
        from engine.weights.streaming import CheckpointMap  # deferred: as above

        g = CheckpointMap(model).geometry()
    return make_plan(g, preset=preset, budget_gb=budget_gb, context=context,
                     check_memory=False)
