"""Model tables (embedding, head) read from disk instead of held in RAM.

At the real size the embedding and the head are 2.35 GB each: a laptop budget of 4 GB
cannot also keep 4.7 GB of tables resident. When the plan says `stream_tables`:
* the embedding is a `RowTable`: `table[ids]` reads just those rows (14 KB each);
* the head is a `StreamedMatrix`: `linear(x)` reads it in chunks of rows through two
  buffers, the next chunk on the disk while the current one computes. That costs the
  head's bytes once per forward pass, like one more streamed trunk layer.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from engine.core.directio import (Batch, FileTable, Layout, ReadPool, TensorSpec,
                                  aligned_buffer)
from engine.kernels import linear
from engine.weights.planner import HEAD_CHUNK_BYTES



def _rows(spec: TensorSpec, r0: int, r1: int) -> Layout:
    row = spec.nbytes // spec.shape[0]
    return Layout([replace(spec, offset=spec.offset + r0 * row, nbytes=(r1 - r0) * row,
                           shape=(r1 - r0, *spec.shape[1:]))])


class RowTable:
    """`table[ids]` → the rows `ids` of a 2-D tensor on disk, in its raw dtype."""

    def __init__(self, spec: TensorSpec, pool: ReadPool, files: FileTable, priority: tuple):
        self.spec, self.pool, self.files, self.priority = spec, pool, files, priority
        self.shape, self.dtype = spec.shape, spec.dtype
        self.bytes_read = 0

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.empty((len(ids), *self.shape[1:]), self.dtype)
        for j, r in enumerate(ids):
            lay = _rows(self.spec, int(r), int(r) + 1)
            buf = aligned_buffer(lay.nbytes)
            self.pool.submit(lay.reads(self.files, buf), self.priority).wait()
            out[j] = next(iter(lay.views(buf).values()))[0]
            self.bytes_read += lay.payload
        return out


class StreamedMatrix:
    """A [out, in] weight applied as `linear(x)` chunk by chunk, never resident whole."""

    def __init__(self, spec: TensorSpec, pool: ReadPool, files: FileTable, priority: tuple,
                 chunk_bytes: int = HEAD_CHUNK_BYTES):
        self.spec, self.pool, self.files, self.priority = spec, pool, files, priority
        self.shape, self.dtype = spec.shape, spec.dtype
        row = spec.nbytes // spec.shape[0]
        self.step = max(1, min(spec.shape[0], chunk_bytes // row))
        self._bufs = [aligned_buffer(_rows(spec, 0, self.step).nbytes + 8192) for _ in range(2)]
        self.bytes_read = 0

    def _start(self, r0: int, k: int) -> tuple[Layout, Batch]:
        lay = _rows(self.spec, r0, min(r0 + self.step, self.shape[0]))
        return lay, self.pool.submit(lay.reads(self.files, self._bufs[k]), self.priority)

    def linear(self, x: np.ndarray) -> np.ndarray:
        n = self.shape[0]
        out = np.empty((*x.shape[:-1], n), np.float32)
        pending = self._start(0, 0)
        for k, r0 in enumerate(range(0, n, self.step)):
            lay, batch = pending
            batch.wait()
            if r0 + self.step < n:
                pending = self._start(r0 + self.step, (k + 1) % 2)
            w = next(iter(lay.views(self._bufs[k % 2]).values()))
            out[..., r0 : r0 + w.shape[0]] = linear(x, w)
            self.bytes_read += lay.payload
        return out
