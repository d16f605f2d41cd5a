"""Feed-forward blocks: the dense FFN of layer 0 and the Stable LatentMoE (spec 1.4)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from engine.kernels import linear, mxfp4_linear
from engine.kernels.reference import to_f32
from engine.core.config import ModelConfig
from engine.model.ops import rmsnorm, sigmoid, situ_glu
from engine.weights.schedule import each_expert
from engine.weights.source import ExpertSet, ExpertWeights


@dataclass(frozen=True)
class DenseExpert:
    """An expert held as plain float matrices (the op fixtures; not the checkpoint format)."""

    w1: np.ndarray
    w2: np.ndarray
    w3: np.ndarray


Expert = ExpertWeights | DenseExpert


def situ_mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
             cfg: ModelConfig) -> np.ndarray:
    """down · SiTU(gate x, up x) — the dense FFN and the shared experts."""
    return linear(
        situ_glu(linear(x, gate), linear(x, up), cfg.situ_beta, cfg.situ_linear_beta), down
    )


def expert_mlp(z: np.ndarray, ex: Expert, cfg: ModelConfig) -> np.ndarray:
    """w2 · SiTU(w1 z, w3 z) on the latent z [T, latent] → [T, latent]. Each expert runs
    on one thread (`run_experts` may run several side by side)."""
    if isinstance(ex, DenseExpert):
        return situ_mlp(z, ex.w1, ex.w3, ex.w2, cfg)
    g = mxfp4_linear(z, ex.w1_packed, ex.w1_scale, parallel=False)
    u = mxfp4_linear(z, ex.w3_packed, ex.w3_scale, parallel=False)
    return mxfp4_linear(
        situ_glu(g, u, cfg.situ_beta, cfg.situ_linear_beta),
        ex.w2_packed,
        ex.w2_scale,
        parallel=False,
    )


def run_experts(
    z: np.ndarray, tokens: list[np.ndarray], ids: list[int], experts: ExpertSet, cfg: ModelConfig
) -> list[np.ndarray]:
    """expert_mlp of expert ids[i] over rows z[tokens[i]], for each i; in which order and on
    how many threads is the weights' business (`engine.weights.schedule.each_expert`)."""
    return each_expert(experts, ids, lambda i, ex: expert_mlp(z[tokens[i]], ex, cfg))


def route(
    x: np.ndarray, gate: np.ndarray, bias: np.ndarray, top_k: int, scaling: float
) -> tuple[np.ndarray, np.ndarray]:
    """Sigmoid scores; top-k of score + bias (ties → lowest index); weights are the
    *unbiased* scores of the chosen experts, renormalised. Returns (ids, weights) [T, k]."""
    s = sigmoid(linear(x, gate))
    selection = s + to_f32(bias).reshape(-1)
    ids = np.argsort(-selection, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(s, ids, axis=-1)
    weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    return ids, (weights * np.float32(scaling)).astype(np.float32)


def distinct(ids: np.ndarray) -> list[int]:
    """Each expert of a routing once, in id order."""
    return [int(e) for e in np.unique(ids)]


def latent_moe(
    x: np.ndarray,
    w: Mapping[str, np.ndarray],
    experts: ExpertSet,
    ids: np.ndarray,
    weights: np.ndarray,
    cfg: ModelConfig,
    prefix: str = "block_sparse_moe.",
) -> np.ndarray:
    """x [T, hidden] (normalised), routing (ids, weights) [T, k], the chosen experts.

    The routed experts are touched last: a streaming source has their reads in flight
    when this is called, so the shared experts and the latent down-projection compute
    while the disk delivers them (each expert waits only for its own read)."""
    T, k = ids.shape
    shared = None
    if cfg.num_shared_experts:
        shared = situ_mlp(
            x,
            w[f"{prefix}shared_experts.gate_proj.weight"],
            w[f"{prefix}shared_experts.up_proj.weight"],
            w[f"{prefix}shared_experts.down_proj.weight"],
            cfg,
        )  # original x, unweighted
    z = linear(x, w[f"{prefix}routed_expert_down_proj.weight"])  # to the latent width
    y = np.zeros((T, k, z.shape[1]), np.float32)
    unique = distinct(ids)  # each expert once, over the tokens that chose it
    chosen = [np.nonzero(ids == e) for e in unique]
    outs = run_experts(z, [tok for tok, _ in chosen], unique, experts, cfg)
    for (tok, slot), out in zip(chosen, outs):
        y[tok, slot] = out
    acc = np.zeros_like(z)
    for j in range(k):  # accumulate in rank order, the same for a step and a prefill
        acc += weights[:, j, None] * y[:, j]
    acc = rmsnorm(acc, w[f"{prefix}routed_expert_norm.weight"], cfg.rms_norm_eps)  # on the sum
    routed = linear(acc, w[f"{prefix}routed_expert_up_proj.weight"])
    return routed if shared is None else routed + shared


def dense_ffn(
    x: np.ndarray, w: Mapping[str, np.ndarray], cfg: ModelConfig, prefix: str = "mlp."
) -> np.ndarray:
    return situ_mlp(
        x,
        w[f"{prefix}gate_proj.weight"],
        w[f"{prefix}up_proj.weight"],
        w[f"{prefix}down_proj.weight"],
        cfg,
    )
