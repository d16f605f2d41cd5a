"""Elementwise math in the spec's notation (section 1.4): activations are float32 [T, features];
weights arrive raw (BF16 as uint16) and are widened by `to_f32`."""

from __future__ import annotations

import numpy as np

from engine.kernels.reference import to_f32


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(−x) → inf for very negative x gives the right 0
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return (x * sigmoid(x)).astype(np.float32)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """w ⊙ x / sqrt(mean(x²) + eps) over the last axis; mean of squares in double."""
    ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    return ((x / np.sqrt(ms + eps)).astype(np.float32) * to_f32(w)).astype(np.float32)


def situ_glu(g: np.ndarray, u: np.ndarray, beta: float, linear_beta: float) -> np.ndarray:
    """[β1·tanh(g/β1)·σ(g)] · [β2·tanh(u/β2)] — the sigmoid sees the uncapped g."""
    gate = np.float32(beta) * np.tanh(g / np.float32(beta)) * sigmoid(g)
    up = np.float32(linear_beta) * np.tanh(u / np.float32(linear_beta))
    return (gate * up).astype(np.float32)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)
