"""Kimi-K3 text-model configuration, read strictly.

The released `config.json` is nested (`text_config`, `text_config.linear_attn_config`);
a flat form (the same keys at the top level, KDA keys either in `linear_attn_config` or
prefixed `kda_`) is accepted too. A missing field is refused, never defaulted: a reader
that defaults the layer map silently builds an all-KDA model that still talks fluently
(spec 1.8, trap 10). Options the engine does not implement (grouped top-k with several
groups, RoPE, a low-rank KDA gate, ...) are refused as contradictions, by name.
"""

from __future__ import annotations

import builtins  # _Reader's int and float methods shadow the types in its annotations
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ConfigError
from engine.jsonfile import load_json

MAX_CONFIG_BYTES = 16 << 20  # the released config.json is a few KB


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    situ_beta: float  # gate cap β1
    situ_linear_beta: float  # up cap β2
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int
    gate_lower_bound: float
    full_attn_layers: tuple[int, ...]  # ONE-based MLA layers, as in the file
    # MLA
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # MoE
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    routed_expert_hidden_size: int  # latent width
    moe_intermediate_size: int
    routed_scaling_factor: float
    first_k_dense_replace: int
    intermediate_size: int  # dense FFN width
    attn_res_block_size: int
    # tokens (optional: a tokenizer may not ship with tiny checkpoints)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    # ---- derived -------------------------------------------------------------------
    def is_mla(self, layer: int) -> bool:
        """Zero-based `layer` is MLA iff layer+1 is in the one-based `full_attn_layers`."""
        return layer + 1 in self.full_attn_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(sorted(n - 1 for n in self.full_attn_layers))

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_mla(i))

    @property
    def kda_width(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_width(self) -> int:
        """Floats cached per position per MLA layer: normalised c_kv + raw k_rope."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_width(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    def layer_kind(self, layer: int) -> str:
        return ("MLA" if self.is_mla(layer) else "KDA") + (
            "-MoE" if self.is_moe(layer) else "-dense"
        )

    def describe(self) -> str:
        kinds = "".join("M" if self.is_mla(i) else "K" for i in range(self.num_hidden_layers))
        return (
            f"hidden {self.hidden_size}, {self.num_hidden_layers} layers {kinds}, "
            f"{self.num_experts} experts top-{self.num_experts_per_token}, vocab {self.vocab_size}"
        )

    # ---- reading -------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(
                f"{file} does not exist; point at a checkpoint folder that holds config.json."
            )
        data = load_json(file, MAX_CONFIG_BYTES, "re-download config.json.", ConfigError)
        return cls.from_dict(data, source=str(file))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> ModelConfig:
        r = _Reader(data, source)
        n_layers = r.int("num_hidden_layers", minimum=1)
        full = r.layer_list("full_attn_layers", n_layers)
        kda = r.optional_layer_list("kda_layers", n_layers)
        if kda is not None:
            overlap = sorted(set(full) & set(kda))
            missing = sorted(set(range(1, n_layers + 1)) - set(full) - set(kda))
            if overlap or missing:
                raise ConfigError(
                    f"{source}: linear_attn_config.full_attn_layers and kda_layers contradict "
                    f"each other (in both: {overlap}, in neither: {missing}); they are one-based "
                    "and must split 1..num_hidden_layers; fix config.json."
                )
        cfg = cls(
            hidden_size=r.int("hidden_size", minimum=1),
            num_hidden_layers=n_layers,
            vocab_size=r.int("vocab_size", minimum=1),
            rms_norm_eps=r.float("rms_norm_eps"),
            situ_beta=r.float("activation_situ_beta", alias="situ_beta"),
            situ_linear_beta=r.float("activation_situ_linear_beta", alias="situ_linear_beta"),
            kda_num_heads=r.int("num_heads", linear=True, minimum=1),
            kda_head_dim=r.int("head_dim", linear=True, minimum=1),
            short_conv_kernel_size=r.int("short_conv_kernel_size", linear=True, minimum=1),
            gate_lower_bound=r.float("gate_lower_bound", linear=True),
            full_attn_layers=tuple(full),
            num_attention_heads=r.int("num_attention_heads", minimum=1),
            q_lora_rank=r.int("q_lora_rank", minimum=1),
            kv_lora_rank=r.int("kv_lora_rank", minimum=1),
            qk_nope_head_dim=r.int("qk_nope_head_dim", minimum=1),
            qk_rope_head_dim=r.int("qk_rope_head_dim", minimum=0),
            v_head_dim=r.int("v_head_dim", minimum=1),
            num_experts=r.int("num_experts", alias="n_routed_experts", minimum=1),
            num_experts_per_token=r.int(
                "num_experts_per_token", alias="num_experts_per_tok", minimum=1
            ),
            num_shared_experts=r.int("num_shared_experts", alias="n_shared_experts", minimum=0),
            routed_expert_hidden_size=r.int("routed_expert_hidden_size", minimum=1),
            moe_intermediate_size=r.int("moe_intermediate_size", minimum=1),
            routed_scaling_factor=r.float("routed_scaling_factor"),
            first_k_dense_replace=r.int("first_k_dense_replace", minimum=0),
            intermediate_size=r.int("intermediate_size", minimum=1),
            attn_res_block_size=r.int("attn_res_block_size", minimum=1),
            bos_token_id=r.optional_int("bos_token_id"),
            eos_token_id=r.optional_int("eos_token_id"),
            pad_token_id=r.optional_int("pad_token_id"),
        )
        r.check_supported(cfg)
        return cfg


# Upper bounds, generous above the release (hidden 7168, 93 layers, vocab 163840, 896
# experts, ...): a value past one is a broken or hostile file, refused before anything
# sized by it (expert tables, KDA state, KV cache, the memory plan) is allocated.
_MAX: dict[str, int] = {
    "hidden_size": 1 << 16,
    "num_hidden_layers": 1024,
    "vocab_size": 1 << 21,
    "num_heads": 1024,
    "head_dim": 1024,
    "short_conv_kernel_size": 64,
    "num_attention_heads": 1024,
    "q_lora_rank": 1 << 16,
    "kv_lora_rank": 1 << 16,
    "qk_nope_head_dim": 1024,
    "qk_rope_head_dim": 1024,
    "v_head_dim": 1024,
    "num_experts": 4096,
    "num_experts_per_token": 4096,
    "num_shared_experts": 64,
    "routed_expert_hidden_size": 1 << 16,
    "moe_intermediate_size": 1 << 16,
    "first_k_dense_replace": 1024,
    "intermediate_size": 1 << 20,
    "attn_res_block_size": 1024,
}
MAX_TOKEN_ID = 1 << 21

# Options whose other values select math this engine does not implement.
_MUST_EQUAL: dict[str, Any] = {
    "hidden_act": "situ",
    "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc",
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "latent_moe_use_norm": True,
    "moe_layer_freq": 1,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
}
_LINEAR_MUST_EQUAL: dict[str, Any] = {"use_full_rank_gate": True}


class _Reader:
    """Looks fields up in text_config / linear_attn_config (nested) or at the top (flat)."""

    def __init__(self, data: dict[str, Any], source: str):
        self.source = source
        text = data.get("text_config")
        self.nested = isinstance(text, dict)
        self.text: dict[str, Any] = text if isinstance(text, dict) else data
        self.text_path = "text_config." if self.nested else ""
        lin = self.text.get("linear_attn_config")
        self.linear: dict[str, Any] = lin if isinstance(lin, dict) else {}
        self.linear_path = self.text_path + "linear_attn_config."
        self.top = data

    def _lookup(self, key: str, linear: bool, alias: str | None) -> tuple[bool, Any, str]:
        if linear:
            if key in self.linear:
                return True, self.linear[key], self.linear_path + key
            flat = "kda_" + key if key in ("num_heads", "head_dim") else key
            if not self.linear and flat in self.text:  # flat form: kda_num_heads, ...
                return True, self.text[flat], self.text_path + flat
            return False, None, self.linear_path + key
        for k in (key, alias):
            if k and k in self.text:
                return True, self.text[k], self.text_path + k
        if self.nested:  # token ids live at the top level of the nested form
            for k in (key, alias):
                if k and k in self.top and k.endswith("_token_id"):
                    return True, self.top[k], k
        return False, None, self.text_path + key

    def _missing(self, path: str) -> ConfigError:
        return ConfigError(
            f"{self.source}: required field {path} is missing; the engine refuses to guess it "
            "(a defaulted field builds a different model), so restore it from the released "
            "config.json."
        )

    def _bad(self, path: str, value: Any, want: str) -> ConfigError:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return ConfigError(f"{self.source}: {path} is {shown}, expected {want}; fix config.json.")

    def int(
        self, key: str, *, linear: bool = False, alias: str | None = None, minimum: int = 0
    ) -> int:
        found, value, path = self._lookup(key, linear, alias)
        if not found or value is None:
            raise self._missing(path)
        top = _MAX[key]
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= top:
            raise self._bad(path, value, f"an integer in {minimum}..{top}")
        return value

    def optional_int(self, key: str) -> builtins.int | None:
        found, value, path = self._lookup(key, False, None)
        if not found or value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_TOKEN_ID:
            raise self._bad(path, value, f"a token id in 0..{MAX_TOKEN_ID - 1}")
        return value

    def float(self, key: str, *, linear: bool = False, alias: str | None = None) -> float:
        found, value, path = self._lookup(key, linear, alias)
        if not found or value is None:
            raise self._missing(path)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise self._bad(path, value, "a finite number")
        return float(value)

    def layer_list(self, key: str, n_layers: builtins.int) -> list[builtins.int]:
        found = self.optional_layer_list(key, n_layers)
        if found is None:
            raise self._missing(self._lookup(key, True, None)[2])
        return found

    def optional_layer_list(self, key: str, n_layers: builtins.int
                            ) -> list[builtins.int] | None:
        found, value, path = self._lookup(key, True, None)
        if not found or value is None:
            return None
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise self._bad(path, value, "a list of one-based layer numbers")
        if len(set(value)) != len(value) or any(v < 1 or v > n_layers for v in value):
            raise self._bad(path, value, f"distinct one-based layer numbers in 1..{n_layers}")
        return list(value)

    def check_supported(self, cfg: ModelConfig) -> None:
        for table, prefix, rules in (
            (self.text, self.text_path, _MUST_EQUAL),
            (self.linear, self.linear_path, _LINEAR_MUST_EQUAL),
        ):
            for key, want in rules.items():
                if key in table and table[key] != want:
                    raise ConfigError(
                        f"{self.source}: {prefix}{key} is {table[key]!r} but this engine "
                        f"implements only {want!r}; this is not a Kimi-K3 config it can run."
                    )
        kv_heads = self.text.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != cfg.num_attention_heads:
            raise ConfigError(
                f"{self.source}: {self.text_path}num_key_value_heads ({kv_heads}) differs from "
                f"num_attention_heads ({cfg.num_attention_heads}); MLA needs them equal."
            )
        if cfg.num_experts_per_token > cfg.num_experts:
            raise ConfigError(
                f"{self.source}: {self.text_path}num_experts_per_token "
                f"({cfg.num_experts_per_token}) exceeds num_experts ({cfg.num_experts})."
            )
        if cfg.first_k_dense_replace > cfg.num_hidden_layers:
            raise ConfigError(
                f"{self.source}: {self.text_path}first_k_dense_replace "
                f"({cfg.first_k_dense_replace}) exceeds num_hidden_layers."
            )
        quant = self.text.get("quantization_config", self.top.get("quantization_config"))
        if isinstance(quant, dict):
            fmt = quant.get("format")
            if fmt not in (None, "mxfp4-pack-quantized"):
                raise ConfigError(
                    f"{self.source}: quantization_config.format is {fmt!r}; this engine reads "
                    "MXFP4 routed experts ('mxfp4-pack-quantized') only."
                )
            groups = quant.get("config_groups")
            for group in groups.values() if isinstance(groups, dict) else ():
                w = group.get("weights") if isinstance(group, dict) else None
                w = w if isinstance(w, dict) else {}
                if w.get("num_bits", 4) != 4 or w.get("group_size", 32) != 32:
                    raise ConfigError(
                        f"{self.source}: quantization_config has num_bits "
                        f"{w.get('num_bits')} / group_size {w.get('group_size')}; "
                        "MXFP4 needs 4 / 32."
                    )
