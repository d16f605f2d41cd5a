"""Per-sequence state: each layer's KDA recurrent state + conv history or MLA latent cache,
and the ids consumed so far. The model's weights are elsewhere (a WeightSource).

A KDA layer's state cannot be cut back to an earlier position, so a conversation can only
be resumed from a `snapshot()` taken at exactly the position it covers."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.model.kda import KDAState
from engine.model.mla import MLAState


def _copy_layer(layer: KDAState | MLAState) -> KDAState | MLAState:
    if isinstance(layer, MLAState):  # only the rows in use; append() regrows the array
        return MLAState(layer.latent[: layer.length].copy(), layer.length)
    return KDAState(layer.S.copy(), {p: h.copy() for p, h in layer.conv.items()})


@dataclass
class ModelState:
    layers: list[KDAState | MLAState]
    position: int = 0  # tokens consumed so far
    ids: list[int] = field(default_factory=list)
    # logits [vocab] at the last consumed position: a resumed prompt that adds nothing new
    # (a regenerate) samples from these instead of prefilling
    logits: np.ndarray | None = None

    def snapshot(self) -> ModelState:
        """A deep copy: advancing either one leaves the other as it was."""
        return ModelState(
            [_copy_layer(layer) for layer in self.layers],
            self.position,
            list(self.ids),
            None if self.logits is None else self.logits.copy(),
        )

    def nbytes(self) -> int:
        """Memory a snapshot of this state holds (arrays only)."""
        total = 0 if self.logits is None else self.logits.nbytes
        for layer in self.layers:
            if isinstance(layer, MLAState):
                total += layer.latent[: layer.length].nbytes
            else:
                total += layer.S.nbytes + sum(h.nbytes for h in layer.conv.values())
        return total + 8 * len(self.ids)
