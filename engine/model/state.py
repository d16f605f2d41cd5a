"""Per-sequence state: each layer's KDA recurrent state + conv history or MLA latent cache,
and the ids consumed so far. The model's weights are elsewhere (a WeightSource)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.model.kda import KDAState
from engine.model.mla import MLAState


@dataclass
class ModelState:
    layers: list[KDAState | MLAState]
    position: int = 0  # tokens consumed so far
    ids: list[int] = field(default_factory=list)
