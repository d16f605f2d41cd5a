"""Choosing the next token from logits: greedy, or temperature / top-k / top-p with a seed.

Greedy takes the first index on ties (np.argmax). Sampling is reproducible: the draw for
the token at position i of the sequence depends only on (seed, i) and its logits, never
on how many draws came before, so an answer continued from its first k tokens (a partial
turn, a resumed state) draws what the uninterrupted run drew. Filtering works in float64
on a copy.
"""

from __future__ import annotations

import numpy as np


class Sampler:
    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0):
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if top_k < 0:
            raise ValueError("top_k must be >= 0")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.seed = int(seed)

    def __call__(self, logits: np.ndarray, position: int) -> int:
        if self.temperature == 0.0 or self.top_k == 1:
            return int(np.argmax(logits))
        z = np.asarray(logits, np.float64) / self.temperature
        if self.top_k and self.top_k < z.size:
            kth = np.partition(z, -self.top_k)[-self.top_k]
            z = np.where(z >= kth, z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, self.top_p) + 1)]  # smallest set reaching top_p
            mask = np.zeros_like(p)
            mask[keep] = p[keep]
            p = mask / mask.sum()
        rng = np.random.default_rng((self.seed, int(position)))
        return int(rng.choice(p.size, p=p))
