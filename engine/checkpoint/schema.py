"""What a Kimi-K3 checkpoint must hold: the tensors a config implies (names and shapes), the
checkpoint's naming (`TensorNames`), and `open_checked`, which every source runs before it
allocates anything sized by the config."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint.safetensors import SafetensorsIndex
from engine.errors import CheckpointError
from engine.core.config import ModelConfig

EXPERT_PARTS = ("w1", "w2", "w3")  # on-disk order of one expert's run: packed then scale


@dataclass(frozen=True)
class TensorNames:
    """Full checkpoint names: `language_model.model.` prefix, head outside the model."""

    prefix: str = "language_model.model."
    head: str = "language_model.lm_head.weight"

    @classmethod
    def detect(cls, index: SafetensorsIndex) -> TensorNames:
        for prefix, head in (
            ("language_model.model.", "language_model.lm_head.weight"),
            ("model.", "lm_head.weight"),
        ):
            if prefix + "embed_tokens.weight" in index:
                return cls(prefix, head)
        raise CheckpointError(
            f"tensor language_model.model.embed_tokens.weight is missing from the checkpoint in "
            f"{index.root}; this is not a Kimi-K3 checkpoint or the download is incomplete."
        )

    def model(self, short: str) -> str:
        return self.head if short == "lm_head.weight" else self.prefix + short

    def layer_prefix(self, layer: int) -> str:
        return f"{self.prefix}layers.{layer}."

    def expert_prefix(self, layer: int, expert: int) -> str:
        return f"{self.prefix}layers.{layer}.block_sparse_moe.experts.{expert}."

    def expert(self, layer: int, expert: int) -> list[str]:
        """The six tensor names of one expert, in on-disk order."""
        p = self.expert_prefix(layer, expert)
        return [f"{p}{w}.weight_{k}" for w in EXPERT_PARTS for k in ("packed", "scale")]

    def is_expert(self, name: str) -> bool:
        return ".block_sparse_moe.experts." in name



def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Short name (relative to the model prefix; `lm_head.weight` for the head) → shape.
    Routed experts are listed per layer and expert. A_log is listed with H values; the
    checkpoint may hold more (the real one stores 128, of which the first H are used)."""
    return dict(iter_expected(cfg))


def iter_expected(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """`expected_tensors` one at a time, each layer's router gate before its experts: a
    checker stops at the first tensor the header lacks, so a config claiming more
    experts than the file holds costs one lookup, not a table of them."""
    E, V = cfg.hidden_size, cfg.vocab_size
    H, D, P, K = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_width, cfg.short_conv_kernel_size
    Hm, nope, rope, vd = (
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    )
    lat, M, N = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    yield from {
        "embed_tokens.weight": (V, E),
        "norm.weight": (E,),
        "output_attn_res_norm.weight": (E,),
        "output_attn_res_proj.weight": (1, E),
        "lm_head.weight": (V, E),
    }.items()
    for L in range(cfg.num_hidden_layers):
        p = f"layers.{L}."
        out: dict[str, tuple[int, ...]] = {}  # this layer's trunk
        for n in (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attention_res_norm",
            "mlp_res_norm",
        ):
            out[f"{p}{n}.weight"] = (E,)
        out[f"{p}self_attention_res_proj.weight"] = (1, E)
        out[f"{p}mlp_res_proj.weight"] = (1, E)
        a = p + "self_attn."
        if cfg.is_mla(L):
            out.update(
                {
                    f"{a}q_a_proj.weight": (cfg.q_lora_rank, E),
                    f"{a}q_a_layernorm.weight": (cfg.q_lora_rank,),
                    f"{a}q_b_proj.weight": (Hm * (nope + rope), cfg.q_lora_rank),
                    f"{a}kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + rope, E),
                    f"{a}kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                    f"{a}kv_b_proj.weight": (Hm * (nope + vd), cfg.kv_lora_rank),
                    f"{a}g_proj.weight": (Hm * vd, E),
                    f"{a}o_proj.weight": (E, Hm * vd),
                }
            )
        else:
            for n in "qkv":
                out[f"{a}{n}_proj.weight"] = (P, E)
                out[f"{a}{n}_conv1d.weight"] = (P, 1, K)
            out.update(
                {
                    f"{a}f_a_proj.weight": (D, E),
                    f"{a}f_b_proj.weight": (P, D),
                    f"{a}b_proj.weight": (H, E),
                    f"{a}A_log": (H,),
                    f"{a}dt_bias": (P,),
                    f"{a}g_proj.weight": (P, E),
                    f"{a}o_norm.weight": (D,),
                    f"{a}o_proj.weight": (E, P),
                }
            )
        if not cfg.is_moe(L):
            inter = cfg.intermediate_size
            out.update(
                {
                    f"{p}mlp.gate_proj.weight": (inter, E),
                    f"{p}mlp.up_proj.weight": (inter, E),
                    f"{p}mlp.down_proj.weight": (E, inter),
                }
            )
            yield from out.items()
            continue
        m = p + "block_sparse_moe."
        out.update(
            {
                f"{m}gate.weight": (N, E),
                f"{m}gate.e_score_correction_bias": (N,),
                f"{m}routed_expert_down_proj.weight": (lat, E),
                f"{m}routed_expert_up_proj.weight": (E, lat),
                f"{m}routed_expert_norm.weight": (lat,),
            }
        )
        if cfg.num_shared_experts:
            S = cfg.shared_width
            out.update(
                {
                    f"{m}shared_experts.gate_proj.weight": (S, E),
                    f"{m}shared_experts.up_proj.weight": (S, E),
                    f"{m}shared_experts.down_proj.weight": (E, S),
                }
            )
        yield from out.items()
        for e in range(N):
            x = f"{m}experts.{e}."
            yield from {
                f"{x}w1.weight_packed": (M, lat // 2),
                f"{x}w1.weight_scale": (M, lat // 32),
                f"{x}w2.weight_packed": (lat, M // 2),
                f"{x}w2.weight_scale": (lat, M // 32),
                f"{x}w3.weight_packed": (M, lat // 2),
                f"{x}w3.weight_scale": (M, lat // 32),
            }.items()


def check_tensors(cfg: ModelConfig, index: SafetensorsIndex, names: TensorNames) -> None:
    """Every tensor the config implies is present with the implied shape (once per index:
    the source's constructor and load_model both ask)."""
    if index.checked_against == cfg:
        return
    for short, shape in iter_expected(cfg):
        full = names.model(short)
        info = index.info(full)  # raises naming the tensor when missing
        got = info.shape
        if short.endswith("A_log"):
            ok = math.prod(got) >= shape[0]
        elif len(shape) == 1 or shape[0] == 1 or short.endswith("conv1d.weight"):
            ok = math.prod(got) == math.prod(shape)
        else:
            ok = got == shape
        if not ok:
            raise CheckpointError(
                f"{info.file.name}: tensor {full} has shape {list(got)} but config.json implies "
                f"{list(shape)}; the config and the weights belong to different models."
            )
        if ".experts." in short and info.dtype != "U8":
            raise CheckpointError(
                f"{info.file.name}: tensor {full} is {info.dtype}; routed experts must be MXFP4 "
                "(U8 packed + U8 scales)."
            )
    index.checked_against = cfg


def open_checked(
    checkpoint_dir: str | Path, index: SafetensorsIndex | None = None
) -> tuple[ModelConfig, SafetensorsIndex, TensorNames]:
    """config.json (bounded), the safetensors headers, and every tensor the config implies
    checked against them: what each source does first, before anything sized by the
    config (expert tables, KDA state, KV cache, the memory plan) is allocated."""
    cfg = ModelConfig.from_dir(checkpoint_dir)
    index = index or SafetensorsIndex.open(checkpoint_dir)
    names = TensorNames.detect(index)
    check_tensors(cfg, index, names)
    return cfg, index, names
