"""`ResidentSource`: the whole checkpoint in RAM, the default `WeightSource`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoint.safetensors import SafetensorsIndex
from engine.checkpoint.schema import TensorNames
from engine.errors import CheckpointError
from engine.weights.source import ExpertTable, ExpertWeights, expert_from_arrays


class ResidentSource:
    """Every tensor read into RAM once (one read per file); views handed out for free."""

    wants_guesses = False  # everything is resident already

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
    def experts(self, layer: int, ids: Sequence[int]) -> Iterator[ExpertTable]:
        yield ExpertTable({int(e): self.expert(layer, int(e)) for e in ids})

    def guess(self, layer: int, ids: Sequence[int]) -> None:
        pass  # wants_guesses is false: never called

    def resident_layer(self, index: int) -> Mapping[str, np.ndarray] | None:
        return self._layers.get(index)

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
