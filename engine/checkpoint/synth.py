"""Random-weight Kimi-K3-architecture checkpoints in the released on-disk format.

`python -m engine synth OUT [--size tiny|small|medium|demo|bench|slice] [--seed N]` writes a
nested config.json, one safetensors shard per decoder layer (its trunk tensors sorted by
name, then its routed experts 0..N−1, six tensors each, MXFP4), a final shard with the
embedding, head and model-level vectors, and model.safetensors.index.json. Every size but
tiny also gets a test tokenizer (engine/text/bpe_train.py) so the checkpoint can be served;
`--tokenizer-only` adds just that tokenizer to a checkpoint already written.

Initialisation follows the peer's tiny oracle recipe, so the tricky paths are exercised:
matrices N(0, 0.02); shared and dense gate/up weights with std 1.2 and routed-expert
gate/up codes scaled to RMS ~1.5, so both SiTU caps saturate; routing bias
linspace(−0.15, 0.15) so the bias changes which experts are picked; A_log =
linspace(−0.4, 1.2) per head, padded with zeros to head_dim values like the release;
dt_bias N(0, 0.5); conv kernels N(0, 0.4); gains 1 + N(0, 0.1).
Each tensor draws from its own generator seeded by (seed, name), so a tensor's values do
not depend on the write order. Shards are written tensor by tensor: the 6 GB "bench"
size never holds more than one expert in memory.
"""

from __future__ import annotations

import json
import math
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoint.schema import EXPERT_PARTS, TensorNames, expected_tensors
from engine.core.config import ModelConfig

_BASE: dict[str, Any] = dict(
    rms_norm_eps=1e-5,
    situ_beta=4.0,
    situ_linear_beta=25.0,
    short_conv_kernel_size=4,
    gate_lower_bound=-5.0,
    routed_scaling_factor=1.0,
    first_k_dense_replace=1,
)
SIZES: dict[str, dict[str, Any]] = {
    # 7 layers KKKMKKM, one shared expert, AttnRes block 2: unlike tiny-a on purpose
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=7,
        vocab_size=256,
        kda_num_heads=4,
        kda_head_dim=16,
        full_attn_layers=[4, 7],
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        routed_expert_hidden_size=32,
        moe_intermediate_size=32,
        intermediate_size=96,
        attn_res_block_size=2,
    ),
    "small": dict(
        hidden_size=128,
        num_hidden_layers=6,
        vocab_size=1024 + 256,
        kda_num_heads=2,
        kda_head_dim=32,
        full_attn_layers=[3, 6],
        num_attention_heads=2,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=16,
        num_experts_per_token=4,
        num_shared_experts=2,
        routed_expert_hidden_size=64,
        moe_intermediate_size=64,
        intermediate_size=256,
        attn_res_block_size=4,
    ),
    "medium": dict(
        hidden_size=512,
        num_hidden_layers=12,
        vocab_size=4096 + 256,
        kda_num_heads=8,
        kda_head_dim=64,
        full_attn_layers=[4, 8, 11, 12],
        num_attention_heads=8,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        num_experts=64,
        num_experts_per_token=8,
        num_shared_experts=2,
        routed_expert_hidden_size=256,
        moe_intermediate_size=512,
        intermediate_size=2048,
        attn_res_block_size=4,
    ),
    # the chat demo: fast fully resident, and mostly experts so it streams under ~1/3 budget
    "demo": dict(
        hidden_size=256,
        num_hidden_layers=8,
        vocab_size=2304 + 256,
        kda_num_heads=4,
        kda_head_dim=64,
        full_attn_layers=[4, 7, 8],
        num_attention_heads=4,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        num_experts=64,
        num_experts_per_token=6,
        num_shared_experts=1,
        routed_expert_hidden_size=128,
        moe_intermediate_size=512,
        intermediate_size=1024,
        attn_res_block_size=3,
    ),
    # the peer's benchmark shape (issue 3): 13 layers KKKMKKKMKKKMM, ~6.2 GB
    "bench": dict(hidden_size=2048, num_hidden_layers=13, vocab_size=32768, kda_num_heads=16,
                  kda_head_dim=128, full_attn_layers=[4, 8, 12, 13], num_attention_heads=16,
                  q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64,
                  v_head_dim=128, num_experts=256, num_experts_per_token=16,
                  num_shared_experts=2, routed_expert_hidden_size=1024,
                  moe_intermediate_size=1024, intermediate_size=5632, attn_res_block_size=4),
    # Kimi-K3's real widths, vocab and expert size (spec 1.1), fewer layers and experts:
    # 4 layers = dense KDA layer 0, two KDA-MoE, one MLA-MoE (~13.8 GB); see slice_overrides
    "slice": dict(hidden_size=7168, num_hidden_layers=4, vocab_size=163840, kda_num_heads=96,
                  kda_head_dim=128, full_attn_layers=[4], num_attention_heads=96,
                  q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                  v_head_dim=128, num_experts=64, num_experts_per_token=16,
                  num_shared_experts=2, routed_expert_hidden_size=3584,
                  moe_intermediate_size=3072, intermediate_size=33792, attn_res_block_size=12),
}
N_SPECIAL = 256  # added tokens after the BPE ranks


def flat_config(size: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    cfg = {**_BASE, **SIZES[size], **(overrides or {})}
    ModelConfig.from_dict(cfg)  # refuse nonsense early
    if cfg["routed_expert_hidden_size"] % 32 or cfg["moe_intermediate_size"] % 32:
        raise ValueError("MXFP4 experts need latent and expert widths divisible by 32")
    return cfg


def slice_overrides(layers: int | None = None, experts: int | None = None) -> dict[str, Any]:
    """Config keys for a slice of `layers` layers and `experts` experts per MoE layer.

    The layer map keeps the release's rule (one-based multiples of 4 are MLA) and, like the
    release, makes the last layer MLA, so 3+ layers hold a dense layer 0, KDA-MoE and
    MLA-MoE layers. Fewer than 16 experts lower top-k to the expert count."""
    out: dict[str, Any] = {}
    if layers is not None:
        if not 2 <= layers <= 93:
            raise ValueError("a slice has 2 to 93 layers (layer 0 dense, the last one MLA)")
        out["num_hidden_layers"] = layers
        out["full_attn_layers"] = sorted({i for i in range(4, layers + 1, 4)} | {layers})
    if experts is not None:
        if not 1 <= experts <= 896:
            raise ValueError("a slice has 1 to 896 experts per layer")
        out["num_experts"] = experts
        out["num_experts_per_token"] = min(16, experts)
    return out


def nested_config(flat: dict[str, Any]) -> dict[str, Any]:
    """The released layout: text model under text_config, KDA map under linear_attn_config."""
    n = flat["num_hidden_layers"]
    full = sorted(flat["full_attn_layers"])
    vocab = flat["vocab_size"]
    specials = vocab - N_SPECIAL if vocab > N_SPECIAL else None
    text = {
        "model_type": "kimi_linear",
        "dtype": "bfloat16",
        "hidden_size": flat["hidden_size"],
        "num_hidden_layers": n,
        "vocab_size": vocab,
        "max_position_embeddings": 1048576,
        "rms_norm_eps": flat["rms_norm_eps"],
        "hidden_act": "situ",
        "activation_situ_beta": flat["situ_beta"],
        "activation_situ_linear_beta": flat["situ_linear_beta"],
        "num_attention_heads": flat["num_attention_heads"],
        "num_key_value_heads": flat["num_attention_heads"],
        **{
            k: flat[k]
            for k in (
                "q_lora_rank",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
                "num_experts",
                "num_experts_per_token",
                "num_shared_experts",
                "routed_expert_hidden_size",
                "moe_intermediate_size",
                "routed_scaling_factor",
                "first_k_dense_replace",
                "intermediate_size",
                "attn_res_block_size",
            )
        },
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "latent_moe_use_norm": True,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "linear_attn_config": {
            "num_heads": flat["kda_num_heads"],
            "head_dim": flat["kda_head_dim"],
            "short_conv_kernel_size": flat["short_conv_kernel_size"],
            "gate_lower_bound": flat["gate_lower_bound"],
            "use_full_rank_gate": True,
            "full_attn_layers": full,
            "kda_layers": [i for i in range(1, n + 1) if i not in full],
        },
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "format": "mxfp4-pack-quantized",
                    "targets": ["re:.*block_sparse_moe\\.experts\\.\\d+\\.w[123]$"],
                    "weights": {
                        "num_bits": 4,
                        "type": "float",
                        "symmetric": True,
                        "group_size": 32,
                        "strategy": "group",
                        "dynamic": False,
                        "scale_dtype": "torch.uint8",
                        "observer": "minmax",
                    },
                    "input_activations": None,
                    "output_activations": None,
                }
            },
            "ignore": ["lm_head", "re:.*shared_experts.*"],
            "kv_cache_scheme": None,
        },
    }
    top: dict[str, Any] = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
    }
    if specials is not None:  # Kimi's order: [BOS], [EOS], <|end_of_msg|>, ..., pad last
        top.update(bos_token_id=specials, eos_token_id=specials + 2, pad_token_id=vocab - 1)
    top.update(tie_word_embeddings=False, text_config=text)
    return top


# ---- values ----------------------------------------------------------------------------------
def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 → BF16 bits, round to nearest even."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


_STD_CAPPED = ("gate_proj.weight", "up_proj.weight")  # dense + shared gate/up: caps saturate


def trunk_value(
    short: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int
) -> tuple[str, np.ndarray]:
    """(dtype, array) for one non-expert tensor."""
    rng = _rng(seed, short)
    n = int(np.prod(shape))
    if short.endswith("A_log"):  # per head, padded with exact zeros to head_dim values
        vals = np.zeros(max(cfg.kda_head_dim, cfg.kda_num_heads), np.float32)
        vals[: cfg.kda_num_heads] = np.linspace(-0.4, 1.2, cfg.kda_num_heads)
        return "F32", vals
    if short.endswith("dt_bias"):
        return "F32", rng.normal(0, 0.5, shape).astype(np.float32)
    if short.endswith("conv1d.weight"):
        return "F32", rng.normal(0, 0.4, shape).astype(np.float32)
    if short.endswith("e_score_correction_bias"):
        return "F32", np.linspace(-0.15, 0.15, n).astype(np.float32)
    if short.endswith(("norm.weight", "res_proj.weight")) or len(shape) == 1:
        return "BF16", to_bf16(1.0 + rng.normal(0, 0.1, shape).astype(np.float32))
    std = 1.2 if short.endswith(_STD_CAPPED) else 0.02
    if short.startswith(("embed_tokens", "lm_head")):
        std = 1.0 if short.startswith("embed") else 0.02
    if n > _CHUNK_ELEMS:  # real widths: never hold a whole 2.35 GB head (and temporaries)
        return "BF16", _NormalRows(rng, shape, std)
    return "BF16", to_bf16(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))


_CHUNK_ELEMS = 1 << 24


class _NormalRows:
    """A BF16 N(0, std) matrix produced a block of rows at a time, with the same values as
    one draw (the generator's stream does not depend on how the draws are split)."""

    def __init__(self, rng: np.random.Generator, shape: tuple[int, ...], std: float):
        self.rng, self.shape, self.std = rng, tuple(shape), np.float32(std)
        self.nbytes = 2 * math.prod(shape)

    def __iter__(self):
        cols = math.prod(self.shape[1:])
        step = max(1, _CHUNK_ELEMS // cols)
        for r0 in range(0, self.shape[0], step):
            rows = min(step, self.shape[0] - r0)
            yield to_bf16(self.rng.standard_normal((rows, cols), dtype=np.float32) * self.std)


# E2M1 codes drawn uniformly have RMS 2.93 (magnitudes 0…6), so a scale of 2^(s−127) gives
# RMS ≈ 2.93·2^(s−127): byte 126 → ~1.5 (gate/up: SiTU caps saturate), 120 → ~0.023 (down).
_EXPERT_SCALE_BYTE = {"w1": 126, "w3": 126, "w2": 120}


def expert_values(prefix: str, cfg: ModelConfig, seed: int) -> list[np.ndarray]:
    """Six uint8 arrays (w1/w2/w3 packed+scale), on-disk order: random codes, scales
    jittered ±1 around the byte that gives the recipe's standard deviation. Drawing codes
    directly (rather than quantising normal draws) keeps the 6 GB bench size quick."""
    lat, m = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    out = []
    for part in EXPERT_PARTS:
        rng = _rng(seed, prefix + part)
        rows, cols = (lat, m) if part == "w2" else (m, lat)
        packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        scale = (_EXPERT_SCALE_BYTE[part] + rng.integers(-1, 2, (rows, cols // 32))).astype(
            np.uint8
        )
        out.extend((packed, scale))
    return out


# ---- writing ---------------------------------------------------------------------------------
class _Entry:
    def __init__(
        self, name: str, dtype: str, shape: tuple[int, ...], make: Callable[[], np.ndarray]
    ):
        self.name, self.dtype, self.shape, self.make = name, dtype, shape, make

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * (
            1 if self.dtype == "U8" else 2 if self.dtype == "BF16" else 4
        )


def _write_shard(path: Path, entries: list[_Entry]) -> int:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for e in entries:
        header[e.name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [pos, pos + e.nbytes],
        }
        pos += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for e in entries:
            value = e.make()
            chunks = value if isinstance(value, _NormalRows) else [np.ascontiguousarray(value)]
            if value.nbytes != e.nbytes:
                raise AssertionError(
                    f"{e.name}: generated {value.nbytes} bytes, header says {e.nbytes}")
            for arr in chunks:
                f.write(arr.data)
    return pos


def _layer_entries(
    cfg: ModelConfig, layer: int, shapes: dict[str, tuple[int, ...]], names: TensorNames, seed: int
) -> list[_Entry]:
    p = f"layers.{layer}."
    entries = []
    trunk = sorted(s for s in shapes if s.startswith(p) and ".experts." not in s)
    for short in trunk:
        dtype, value = trunk_value(short, shapes[short], cfg, seed)
        entries.append(_Entry(names.model(short), dtype, value.shape, lambda v=value: v))
    if cfg.is_moe(layer):
        for e in range(cfg.num_experts):
            cache: dict[str, list[np.ndarray]] = {}
            prefix = names.expert_prefix(layer, e)

            def part(i: int, prefix=prefix, cache=cache) -> np.ndarray:
                if "v" not in cache:  # all six arrays come from the same three matrices
                    cache["v"] = expert_values(prefix, cfg, seed)
                arr = cache["v"][i]
                if i == 5:
                    cache.clear()
                return arr

            for i, full in enumerate(names.expert(layer, e)):
                short = full[len(names.prefix) :]
                entries.append(_Entry(full, "U8", shapes[short], lambda i=i, part=part: part(i)))
    return entries


def synthesize(
    out_dir: str | Path,
    size: str = "tiny",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write a checkpoint of `size` (config keys in `overrides` replace the size's) to
    out_dir; returns out_dir."""
    flat = flat_config(size, overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    nested = nested_config(flat)
    cfg = ModelConfig.from_dict(nested)
    shapes = synth_shapes(cfg)
    names = TensorNames()
    n_files = cfg.num_hidden_layers + 1
    fname = [f"model-{i:05d}-of-{n_files:06d}.safetensors" for i in range(1, n_files + 1)]
    weight_map: dict[str, str] = {}
    total = 0
    for layer in range(cfg.num_hidden_layers):
        entries = _layer_entries(cfg, layer, shapes, names, seed)
        total += _write_shard(out / fname[layer], entries)
        weight_map.update({e.name: fname[layer] for e in entries})
        if progress:
            progress(f"layer {layer + 1}/{cfg.num_hidden_layers} written ({total / 1e9:.2f} GB)")
    model_level = []
    for short in (
        "embed_tokens.weight",
        "lm_head.weight",
        "norm.weight",
        "output_attn_res_norm.weight",
        "output_attn_res_proj.weight",
    ):
        dtype, value = trunk_value(short, shapes[short], cfg, seed)
        model_level.append(_Entry(names.model(short), dtype, value.shape, lambda v=value: v))
    total += _write_shard(out / fname[-1], model_level)
    weight_map.update({e.name: fname[-1] for e in model_level})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (out / "config.json").write_text(json.dumps(nested, indent=2))
    if size != "tiny" and cfg.vocab_size > N_SPECIAL:
        write_tokenizer(out, cfg.vocab_size - N_SPECIAL)
    return out


def write_tokenizer(out: Path, n_ranks: int) -> None:
    from engine.text.bpe_train import write_test_tokenizer  # HF tokenizers: only when needed

    try:
        write_test_tokenizer(out, n_ranks=n_ranks)
    except ValueError as exc:  # more ranks than a test vocabulary has
        print(
            f"note: no tokenizer written ({exc}); the checkpoint runs from token ids",
            file=sys.stderr,
        )


def synth_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """expected_tensors, with A_log stored as head_dim values like the release."""
    a_log = (max(cfg.kda_head_dim, cfg.kda_num_heads),)
    return {k: a_log if k.endswith("A_log") else v for k, v in expected_tensors(cfg).items()}


def checkpoint_bytes(size: str, overrides: dict[str, Any] | None = None) -> int:
    cfg = ModelConfig.from_dict(nested_config(flat_config(size, overrides)))
    total = 0
    for short, shape in synth_shapes(cfg).items():
        n = math.prod(shape)
        total += (
            n
            if ".experts." in short
            else 4 * n
            if short.endswith(("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias"))
            else 2 * n
        )
    return total


# ---- CLI -------------------------------------------------------------------------------------
