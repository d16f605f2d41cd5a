"""`ResidentSource`: the whole checkpoint in RAM, the default `WeightSource`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoint.safetensors import SafetensorsIndex
from engine.checkpoint.schema import TensorNames
from engine.errors import CheckpointError, ReadError
from engine.core.directio import FileTable, Read, ReadPool, align_down, aligned_buffer
from engine.weights.source import ExpertTable, ExpertWeights, expert_from_arrays

LOAD_THREADS = 8  # requests in flight: a virtual disk is bound by requests per second


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
        # One aligned O_DIRECT window per file, all files in flight at once: the page cache
        # would hold a second copy of every byte, and filling it cost ~10x the disk's time.
        files, pool, spans = FileTable(), ReadPool(LOAD_THREADS, reserve=0), []
        try:
            reads = []
            for file, infos in by_file.items():
                start = align_down(min(t.offset for t in infos))
                end = max(t.end for t in infos)
                buf = aligned_buffer(end - start)
                reads.append(Read(files.get(file), start, buf, end - start))
                spans.append((start, buf, infos))
            pool.submit(reads, (0,)).wait()
        except ReadError as exc:
            raise CheckpointError(str(exc)) from None
        finally:
            pool.close()
            files.close()
        for start, buf, infos in spans:
            for t in infos:
                raw = buf[t.offset - start : t.end - start]
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

    def warm(self) -> None:
        pass  # read in full when made

    def stats(self) -> dict[str, Any]:
        return {"resident_gb": self.nbytes / 1e9}
