"""Gated Multi-head Latent Attention without positional encoding (spec 1.4, "MLA").

The cache holds the *latent* per position — the normalised c_kv (kv_lora) and the raw,
never-rotated k_rope (rope) — 576 floats per position in the real model instead of the
24,640 of expanded keys and values. W_kvb is absorbed at attention time:
q_nope·(W_uk c) = (W_ukᵀ q_nope)·c and Σ p·(W_uv c) = W_uv (Σ p·c), which is the same math.
Each query position is computed by the same code whether it arrives in a prefill or as
a single step, so incremental decoding matches full recomputation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from engine.kernels import linear
from engine.kernels.reference import to_f32
from engine.core.config import ModelConfig
from engine.model.ops import rmsnorm, sigmoid, softmax


@dataclass
class MLAState:
    latent: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    length: int = 0

    @classmethod
    def empty(cls, cfg: ModelConfig, capacity: int = 64) -> MLAState:
        return cls(np.zeros((capacity, cfg.mla_latent_width), np.float32), 0)

    def append(self, rows: np.ndarray) -> None:
        need = self.length + rows.shape[0]
        if need > self.latent.shape[0]:
            grown = np.zeros(
                (max(need, 2 * self.latent.shape[0]), self.latent.shape[1]), np.float32
            )
            grown[: self.length] = self.latent[: self.length]
            self.latent = grown
        self.latent[self.length : need] = rows
        self.length = need


def latent_kv(
    x: np.ndarray, w: Mapping[str, np.ndarray], cfg: ModelConfig, prefix: str = "self_attn."
) -> np.ndarray:
    """x [T, hidden] → cache rows [T, kv_lora + rope]: RMSNorm'd c_kv, then raw k_rope."""
    c = linear(x, w[f"{prefix}kv_a_proj_with_mqa.weight"])
    r = cfg.kv_lora_rank
    c_kv = rmsnorm(c[:, :r], w[f"{prefix}kv_a_layernorm.weight"], cfg.rms_norm_eps)
    return np.concatenate([c_kv, c[:, r:]], axis=1)


def queries(
    x: np.ndarray, w: Mapping[str, np.ndarray], cfg: ModelConfig, prefix: str = "self_attn."
) -> np.ndarray:
    """x [T, hidden] → q [T, H, nope + rope]."""
    c_q = rmsnorm(
        linear(x, w[f"{prefix}q_a_proj.weight"]),
        w[f"{prefix}q_a_layernorm.weight"],
        cfg.rms_norm_eps,
    )
    return linear(c_q, w[f"{prefix}q_b_proj.weight"]).reshape(
        x.shape[0], cfg.num_attention_heads, cfg.qk_head_dim
    )


def attend(
    q: np.ndarray, cache: np.ndarray, w_uk: np.ndarray, w_uv: np.ndarray, cfg: ModelConfig
) -> np.ndarray:
    """One query position q [H, nope+rope] over cache rows [S, kv_lora+rope] → o [H, v]."""
    r, nope = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    q_abs = (q[:, None, :nope] @ w_uk)[:, 0]  # absorb W_uk into the query: [H, kv_lora]
    scores = q_abs @ cache[:, :r].T + q[:, nope:] @ cache[:, r:].T  # rope key shared by heads
    p = softmax(scores * np.float32(cfg.qk_head_dim**-0.5))  # scale by the full q/k width
    ctx = p @ cache[:, :r]  # [H, kv_lora]
    return (w_uv @ ctx[:, :, None])[:, :, 0]  # then W_uv: [H, v]


def mla_mixer(
    x: np.ndarray,
    w: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    state: MLAState,
    prefix: str = "self_attn.",
) -> np.ndarray:
    """x [T, hidden] (already normalised) → [T, hidden]; appends T latents to `state`."""
    T, H = x.shape[0], cfg.num_attention_heads
    q = queries(x, w, cfg, prefix)
    start = state.length
    state.append(latent_kv(x, w, cfg, prefix))
    kv_b = to_f32(w[f"{prefix}kv_b_proj.weight"]).reshape(
        H, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank
    )
    w_uk = np.ascontiguousarray(kv_b[:, : cfg.qk_nope_head_dim])  # [H, nope, kv_lora]
    w_uv = np.ascontiguousarray(kv_b[:, cfg.qk_nope_head_dim :])  # [H, v, kv_lora]
    o = np.empty((T, H * cfg.v_head_dim), np.float32)
    for t in range(T):  # causal: position start+t sees cache rows 0..start+t
        o[t] = attend(q[t], state.latent[: start + t + 1], w_uk, w_uv, cfg).reshape(-1)
    o *= sigmoid(linear(x, w[f"{prefix}g_proj.weight"]))  # gate, no norm
    return linear(o, w[f"{prefix}o_proj.weight"])
