"""Block Attention Residuals (spec 1.4): a softmax over earlier block snapshots.

Token-local: for each token, every source is RMS-normalised (no gain) to make its key,
scored against the folded vector `w = norm.weight ⊙ proj.weight`, and the *raw* sources
are mixed with the softmax of those scores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from engine.kernels.reference import to_f32
from engine.model.ops import softmax


def fold(w: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    """`name` = "self_attention_res" | "mlp_res" | "output_attn_res" → norm ⊙ proj."""
    return (
        to_f32(w[f"{name}_norm.weight"]).reshape(-1) * to_f32(w[f"{name}_proj.weight"]).reshape(-1)
    ).astype(np.float32)


def attn_res(sources: Sequence[np.ndarray], w: np.ndarray, eps: float) -> np.ndarray:
    """sources: n arrays [T, E] → [T, E]."""
    s = np.stack(sources, axis=1)  # [T, n, E]
    ms = np.mean(np.square(s, dtype=np.float64), axis=-1)  # [T, n]
    scores = (s @ w).astype(np.float64) / np.sqrt(ms + eps)  # key·w = (s·w)/rms(s)
    p = softmax(scores.astype(np.float32), axis=-1)  # over the n sources
    return np.einsum("tn,tne->te", p, s).astype(np.float32)
