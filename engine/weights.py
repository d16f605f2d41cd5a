"""The seam between the model's math and where its bytes come from.

`model/transformer.py` asks a `WeightSource` for one layer's trunk tensors and for the routed experts
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
* `source.model_tensor(name)` — model-level tensors by short name (`"embed_tokens.weight"`,
  `"lm_head.weight"`, `"norm.weight"`, `"output_attn_res_norm.weight"`,
  `"output_attn_res_proj.weight"`), kept resident. `TensorNames` maps short names to the
  checkpoint's full names.
* Optional: a source with `wants_guesses` true gets `source.guess(L, ids)` before layer
  L's attention in a one-token step: the experts L will probably route to, so their
  reads can start early. A hint only; `experts()` still receives the router's choice.
* `source.stats()` — a flat dict of numbers. Keys in `CUMULATIVE_STATS` are running totals
  since the source opened; generate turns them into each token's `compute_s`, waits, GB
  read, `mb_per_s`, `true_hit_rate` (hits / (hits + misses)) and `evictions`, and passes
  `rss_gb`, `peak_rss_gb` and `budget_gb` through as they are (generate measures RSS
  itself when a source does not report it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from engine.errors import CheckpointError
from engine.checkpoint.safetensors import SafetensorsIndex
from engine.checkpoint.schema import TensorNames

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


class WeightSource(Protocol):
    def layer(self, index: int) -> AbstractContextManager[Mapping[str, np.ndarray]]: ...

    def experts(
        self, layer: int, ids: Sequence[int]
    ) -> AbstractContextManager[Mapping[int, ExpertWeights]]: ...

    def model_tensor(self, name: str) -> np.ndarray: ...

    def stats(self) -> dict[str, Any]: ...


def expert_from_arrays(arrays: Sequence[np.ndarray]) -> ExpertWeights:
    """Six arrays in `TensorNames.expert` order → ExpertWeights."""
    w1p, w1s, w2p, w2s, w3p, w3s = arrays
    return ExpertWeights(w1p, w1s, w2p, w2s, w3p, w3s)


class ResidentSource:
    """Every tensor read into RAM once (one read per file); views handed out for free."""

    def __init__(self, checkpoint_dir: str | Path, index: SafetensorsIndex | None = None):
        self.index = index or SafetensorsIndex.open(checkpoint_dir)
        self.names = TensorNames.detect(self.index)
        self._arrays: dict[str, np.ndarray] = {}
        by_file: dict[Path, list] = {}
        for info in self.index.tensors.values():
            by_file.setdefault(info.file, []).append(info)
        for file, infos in by_file.items():
            lo = min(t.offset for t in infos)
            hi = max(t.end for t in infos)
            buf = np.empty(hi - lo, np.uint8)
            with open(file, "rb") as f:
                f.seek(lo)
                if f.readinto(memoryview(buf)) != hi - lo:
                    raise CheckpointError(f"{file}: short read; the file is truncated.")
            for t in infos:
                raw = buf[t.offset - lo : t.end - lo]
                self._arrays[t.name] = raw.view(t.np_dtype).reshape(t.shape)
        self._layers: dict[int, dict[str, np.ndarray]] = {}
        for name, arr in self._arrays.items():
            if not name.startswith(self.names.prefix + "layers.") or self.names.is_expert(name):
                continue
            rest = name[len(self.names.prefix) + len("layers.") :]
            num, _, short = rest.partition(".")
            if num.isdigit():  # any other name is not a layer tensor the model asks for
                self._layers.setdefault(int(num), {})[short] = arr
        self.nbytes = sum(a.nbytes for a in self._arrays.values())

    @contextmanager
    def layer(self, index: int) -> Iterator[Mapping[str, np.ndarray]]:
        if index not in self._layers:
            raise CheckpointError(
                f"layer {index} has no tensors in the checkpoint in {self.index.root}; "
                "the download is incomplete."
            )
        yield self._layers[index]

    @contextmanager
    def experts(self, layer: int, ids: Sequence[int]) -> Iterator[Mapping[int, ExpertWeights]]:
        yield {int(e): self.expert(layer, int(e)) for e in ids}

    def expert(self, layer: int, e: int) -> ExpertWeights:
        names = self.names.expert(layer, e)
        missing = [n for n in names if n not in self._arrays]
        if missing:
            self.index.info(missing[0])  # raises, naming the tensor
        return expert_from_arrays([self._arrays[n] for n in names])

    def model_tensor(self, name: str) -> np.ndarray:
        full = self.names.model(name)
        if full not in self._arrays:
            self.index.info(full)  # raises, naming the tensor
        return self._arrays[full]

    def stats(self) -> dict[str, Any]:
        return {"resident_gb": self.nbytes / 1e9}
