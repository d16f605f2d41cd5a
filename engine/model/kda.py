"""Kimi Delta Attention (spec 1.4, "KDA mixer"): the 69 linear-attention layers.

State per sequence and layer: the recurrent matrices S [H, d_k, d_v] and, for each of
q, k, v, the last K−1 *pre-conv* inputs (the short-convolution history).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from engine.kernels import linear
from engine.kernels.reference import to_f32
from engine.core.config import ModelConfig
from engine.model.ops import rmsnorm, sigmoid, silu

L2_EPS = 1e-6


@dataclass
class KDAState:
    S: np.ndarray  # [H, d_k, d_v] float32
    conv: dict[str, np.ndarray]  # "q"/"k"/"v" → [K−1, P] pre-conv inputs, oldest first

    @classmethod
    def zeros(cls, cfg: ModelConfig) -> KDAState:
        H, D, P = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_width
        hist = cfg.short_conv_kernel_size - 1
        return cls(
            S=np.zeros((H, D, D), np.float32),
            conv={p: np.zeros((hist, P), np.float32) for p in "qkv"},
        )


def short_conv(
    x: np.ndarray, weight: np.ndarray, history: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv + SiLU. x [T, P], weight [P, 1, K] (oldest→newest tap),
    history [K−1, P]. Returns (y [T, P], new history [K−1, P])."""
    w = to_f32(weight).reshape(weight.shape[0], -1)  # [P, K]
    K = w.shape[1]
    seq = np.concatenate([history, x], axis=0)  # [K−1+T, P]
    T = x.shape[0]
    y = np.zeros_like(x)
    for j in range(K):  # tap j multiplies x_{t−(K−1)+j}
        y += w[:, j] * seq[j : j + T]
    return silu(y), seq[T:].copy()


def l2norm_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """x / sqrt(Σx² + 1e-6) per head (a sum, not a mean)."""
    xh = x.reshape(x.shape[0], heads, -1)
    ss = np.sum(np.square(xh, dtype=np.float64), axis=-1, keepdims=True)
    return (xh / np.sqrt(ss + L2_EPS)).astype(np.float32)


def decay(
    z: np.ndarray, A_log: np.ndarray, dt_bias: np.ndarray, heads: int, lower_bound: float
) -> np.ndarray:
    """g = lower_bound·σ(exp(A_log[h])·(z + dt_bias)); returns α = exp(g) as [T, H, d_k].
    A_log is per head: only its first H values are meaningful."""
    a = np.exp(to_f32(A_log).reshape(-1)[:heads]).astype(np.float32)
    zz = (z + to_f32(dt_bias).reshape(-1)).reshape(z.shape[0], heads, -1)
    g = np.float32(lower_bound) * sigmoid(a[None, :, None] * zz)
    return np.exp(g).astype(np.float32)


def recurrence(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    alpha: np.ndarray,
    beta: np.ndarray,
    S: np.ndarray,
    q_scale: float,
) -> np.ndarray:
    """The delta rule per token, strict order: decay rows, read, write, read the updated S.
    q, k, alpha [T, H, d_k]; v [T, H, d_v]; beta [T, H]; S [H, d_k, d_v] updated in place."""
    T = q.shape[0]
    out = np.empty_like(v)
    qs = (q * np.float32(q_scale)).astype(np.float32)
    for t in range(T):
        S *= alpha[t][:, :, None]  # decay rows (key channels)
        u = np.einsum("hkv,hk->hv", S, k[t])  # read Sᵀk
        S += k[t][:, :, None] * (beta[t][:, None] * (v[t] - u))[:, None, :]  # delta write
        out[t] = np.einsum("hkv,hk->hv", S, qs[t])  # read the updated state
    return out


def kda_mixer(
    x: np.ndarray,
    w: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    state: KDAState,
    prefix: str = "self_attn.",
) -> np.ndarray:
    """x [T, hidden] (already normalised) → [T, hidden]; advances `state`."""
    H, D = cfg.kda_num_heads, cfg.kda_head_dim
    T = x.shape[0]
    proj = {p: linear(x, w[f"{prefix}{p}_proj.weight"]) for p in "qkv"}
    conv = {}
    for p in "qkv":
        conv[p], state.conv[p] = short_conv(proj[p], w[f"{prefix}{p}_conv1d.weight"], state.conv[p])
    q = l2norm_heads(conv["q"], H)
    k = l2norm_heads(conv["k"], H)
    v = conv["v"].reshape(T, H, D)
    beta = sigmoid(linear(x, w[f"{prefix}b_proj.weight"]))
    z = linear(linear(x, w[f"{prefix}f_a_proj.weight"]), w[f"{prefix}f_b_proj.weight"])
    alpha = decay(z, w[f"{prefix}A_log"], w[f"{prefix}dt_bias"], H, cfg.gate_lower_bound)
    # per token at any T, so a prompt prefilled whole and fed token by token agree bit for
    # bit (a chunked, batched-matmul form of the delta rule rounded differently from 64
    # tokens on and could change the ids; at the real widths this is ~4 ms a token a layer)
    o = recurrence(q, k, v, alpha, beta, state.S, D**-0.5)
    o = rmsnorm(o, w[f"{prefix}o_norm.weight"], cfg.rms_norm_eps)  # per head, shared gain
    o = o.reshape(T, H * D) * sigmoid(linear(x, w[f"{prefix}g_proj.weight"]))  # norm, then gate
    return linear(o, w[f"{prefix}o_proj.weight"])
