"""`python -m engine plan --model real|DIR --preset NAME`: the memory plan, without weights.

`--model real` builds the geometry of the released 93-layer Kimi-K3 from its config
(spec 1.1-1.3: the slice synthesiser's widths with 93 layers and 896 experts), so a user
can see what a preset will hold, read and cost before a 1.56 TB download. `--model DIR`
plans a checkpoint on disk from its headers. The plan is printed as a forecast for any
machine: it is not refused for lack of memory here (`fits_here` says whether it would be).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from engine.errors import EngineError
from engine.core.config import ModelConfig
from engine.core.directio import ALIGN, align_up
from engine.weights.planner import DEFAULT_CONTEXT, PRESETS, Geometry, Plan, make_plan

REAL_CHECKPOINT_BYTES = 1_560_936_091_448  # spec 1.2, all 96 shards
_F32 = ("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias")


def real_config() -> ModelConfig:
    from engine.checkpoint.synth import flat_config, nested_config, slice_overrides

    return ModelConfig.from_dict(nested_config(flat_config("slice", slice_overrides(93, 896))))


def _nbytes(short: str, shape: tuple[int, ...]) -> int:
    n = math.prod(shape)
    return n if ".experts." in short else 4 * n if short.endswith(_F32) else 2 * n


def geometry_from_config(cfg: ModelConfig, checkpoint_bytes: int = 0) -> Geometry:
    """The planner's geometry from a config alone, laid out as the release (and synth) do:
    each layer's trunk one run (aligned window), each expert one run, A_log 128 values."""
    from engine.checkpoint.synth import synth_shapes
    from engine.weights.streaming import MODEL_TENSORS, _scratch_bytes

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
        scratch_bytes=_scratch_bytes(biggest, cfg),
        table_bytes=model[0] + model[1],
    )


def plan_for(model: str, preset: str | None = None, budget_gb: float | None = None,
             context: int = DEFAULT_CONTEXT) -> Plan:
    if model == "real":
        g = geometry_from_config(real_config(), REAL_CHECKPOINT_BYTES)
    else:
        from engine.weights.streaming import CheckpointMap

        g = CheckpointMap(model).geometry()
    return make_plan(g, preset=preset, budget_gb=budget_gb, context=context,
                     check_memory=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="real", metavar="real|DIR",
                        help="'real' (the released 93-layer model, from its geometry) or a "
                        "checkpoint folder")
    parser.add_argument("--preset", choices=[*PRESETS, "auto"], default=None)
    parser.add_argument("--budget-gb", type=float, default=None, metavar="X")
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT, metavar="N")
    parser.add_argument("--json", action="store_true", help="one JSON object")


def main(args: argparse.Namespace) -> int:
    if args.preset is None and args.budget_gb is None:
        args.preset = "laptop"
    if args.context < 1:
        print("error: --context must be at least 1 token.", file=sys.stderr)
        return 2
    try:
        plan = plan_for(args.model, args.preset, args.budget_gb, args.context)
    except (EngineError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    avail = plan.facts.available if plan.facts else 0
    fits = bool(avail) and plan.forecast_rss_bytes <= 0.95 * avail
    if args.json:
        print(json.dumps({"model": args.model, "source": plan.source, **plan.as_dict(),
                          "context": plan.context, "fits_here": fits}))
        return 0
    print(plan.describe())
    print(f"  reads per token: {plan.read_bytes_per_token / 1e9:.2f} GB of trunk/head + "
          f"expert misses; fits in this machine's memory: {'yes' if fits else 'no'}")
    return 0
