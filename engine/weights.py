"""The seam between the model's math and where its bytes come from.

`model.py` asks a `WeightSource` for one layer's trunk tensors and for the routed experts
a layer needs; it never knows whether they are resident (`ResidentSource`, below) or
streamed from disk under a memory budget (`engine/streaming.py`). Arrays are the raw
on-disk dtypes: BF16 as uint16 views, F32 as float32, MXFP4 packed/scale as uint8, so a
streamed source can hand out views of its read buffers without copying.

Contract:
* `with source.layer(L) as w:` — `w` maps names relative to `layers.L.` (e.g.
  `"self_attn.q_proj.weight"`) to arrays, valid only inside the `with` block. Layers are
  requested in order 0..n-1 each forward pass, which is what read-ahead relies on.
* `with source.experts(L, ids) as ex:` — `ex[e]` is the `ExpertWeights` of expert `e` of
  layer `L` for each `e` in `ids` (the whole set a layer needs for a step or a prefill
  chunk, asked for at once so the reads can be issued together), valid inside the block.
* `source.model_tensor(name)` — model-level tensors (embed_tokens, lm_head, norm,
  output_attn_res_*), kept resident.
* `source.stats()` — counters for the per-token statistics (bytes read, waits, hits).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import numpy as np


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert, still MXFP4: w1 gate and w3 up (latent→inter), w2 down."""

    w1_packed: np.ndarray
    w1_scale: np.ndarray
    w2_packed: np.ndarray
    w2_scale: np.ndarray
    w3_packed: np.ndarray
    w3_scale: np.ndarray


class WeightSource(Protocol):
    def layer(self, index: int) -> AbstractContextManager[Mapping[str, np.ndarray]]: ...

    def experts(
        self, layer: int, ids: Sequence[int]
    ) -> AbstractContextManager[Mapping[int, ExpertWeights]]: ...

    def model_tensor(self, name: str) -> np.ndarray: ...

    def stats(self) -> dict[str, Any]: ...
