"""The seam between the model's math and where its bytes come from.

`engine/model/transformer.py` asks a `WeightSource` for one layer's trunk tensors and for
the routed experts a layer needs; it never knows whether they are resident
(`resident.ResidentSource`) or streamed from disk under a memory budget
(`streaming.StreamingSource`). Arrays are the raw on-disk dtypes: BF16 as uint16 views, F32
as float32, MXFP4 packed/scale as uint8, so a streamed source can hand out views of its read
buffers without copying.

Contract (everything the model asks of a source is declared in `WeightSource`):
* `with source.layer(L) as w:` — `w` maps names relative to `layers.L.` (e.g.
  `"self_attn.q_proj.weight"`) to arrays, valid only inside the `with` block. Layers are
  requested in order 0..n-1 each forward pass, which is what read-ahead relies on.
* `with source.experts(L, ids) as ex:` — an `ExpertSet`: `ex[e]` is the `ExpertWeights` of
  expert `e` of layer `L` for each `e` in `ids` (the whole set a layer needs for a step or a
  prefill chunk, asked for at once so the reads can be issued together), valid inside the
  block. `ex.concurrent` says whether every expert stays valid for the whole block and may
  be fetched from several threads in any order (schedule.each_expert then runs them side
  by side); when false, fetch them in the order of `ids` and use each at once.
  `ex.arrival(e)` says which experts are in memory and in what order the others' reads
  will land.
* `source.model_tensor(name)` — model-level tensors by short name (`"embed_tokens.weight"`,
  `"lm_head.weight"`, `"norm.weight"`, `"output_attn_res_norm.weight"`,
  `"output_attn_res_proj.weight"`), kept resident. `TensorNames` maps short names to the
  checkpoint's full names.
* `source.wants_guesses` / `source.guess(L, ids)` — when `wants_guesses` is true,
  schedule.py calls `guess` (from the points where the model hands it its router) with the
  experts L will probably route to, so their reads can start early: before layer L's
  attention in a one-token step, and a layer ahead, from the previous layer's FFN input,
  with `source.resident_layer(L)`: layer L's tensors if they are in memory for good and
  already read (pinned), else None; never waits. A hint only; `experts()` still receives
  the router's choice.
* `source.stats()` — a flat dict of numbers. Keys in `CUMULATIVE_STATS` are running totals
  since the source opened; generate turns them into each token's `compute_s`, waits, GB
  read, `mb_per_s`, `true_hit_rate` (hits / (hits + misses)) and `evictions`, and passes
  `rss_gb`, `peak_rss_gb` and `budget_gb` through as they are (generate measures RSS
  itself when a source does not report it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

# Running totals a source may report; generate turns them into per-token deltas.
CUMULATIVE_STATS = (
    "wait_trunk_s",
    "wait_experts_s",
    "gb_read_trunk",
    "gb_read_experts",
    "expert_hits",
    "expert_misses",
    "evictions",
)


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert, still MXFP4: w1 gate and w3 up (latent→inter), w2 down."""

    w1_packed: np.ndarray
    w1_scale: np.ndarray
    w2_packed: np.ndarray
    w2_scale: np.ndarray
    w3_packed: np.ndarray
    w3_scale: np.ndarray


class ExpertSet(Protocol):
    """What `WeightSource.experts` yields (see the module's contract)."""

    concurrent: bool

    def __getitem__(self, e: int) -> ExpertWeights: ...

    def arrival(self, e: int) -> int:
        """0 when e's bytes are in memory, else the queue position of its read (a lower
        one arrives sooner): a concurrent set's experts are computed in that order."""
        ...


class ExpertTable(dict):
    """Experts already in memory, as a plain table: all valid at once, from any thread."""

    concurrent = True

    def arrival(self, e: int) -> int:
        return 0


class WeightSource(Protocol):
    wants_guesses: bool

    def layer(self, index: int) -> AbstractContextManager[Mapping[str, np.ndarray]]: ...

    def experts(self, layer: int, ids: Sequence[int]) -> AbstractContextManager[ExpertSet]: ...

    def guess(self, layer: int, ids: Sequence[int]) -> None: ...

    def resident_layer(self, index: int) -> Mapping[str, np.ndarray] | None: ...

    def model_tensor(self, name: str) -> np.ndarray: ...

    def warm(self) -> None: ...  # what it keeps in RAM read now (a server, before it says ready)

    def stats(self) -> dict[str, Any]: ...


def expert_from_arrays(arrays: Sequence[np.ndarray]) -> ExpertWeights:
    """Six arrays in `TensorNames.expert` order → ExpertWeights."""
    w1p, w1s, w2p, w2s, w3p, w3s = arrays
    return ExpertWeights(w1p, w1s, w2p, w2s, w3p, w3s)
