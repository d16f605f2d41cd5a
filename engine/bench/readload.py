"""The compute-only decode under the streamed decode's read traffic, for `bench stream`.

`ReadLoad` wraps the resident twin's source: at each MoE layer it issues the reads the
streamed rung issued per layer on average (whole experts at random, with the engine's
layouts, pool, reader threads, chunking and priority) into a reused, pre-faulted scratch
ring, and never waits for them. What that costs the twin is what the reads cost on this
machine: the compute slowed while they land, and where they outlast the compute (its turn
then drains them) the disk itself at this pattern beside the compute. The streamed
decode's time above it is its schedule.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from engine.core.directio import ALIGN, FileTable, ReadPool, aligned_buffer
from engine.weights.source import ExpertSet
from engine.weights.streaming import EXPERT_CHUNK, EXPERT_PRIORITY, CheckpointMap


class ReadLoad:
    """`source` plus `reads_per_layer` expert reads (on average) at each `experts()` call."""

    def __init__(self, source, cmap: CheckpointMap, threads: int, reads_per_layer: float,
                 seed: int = 11):
        self._src = source
        self.map = cmap
        self.per_layer = reads_per_layer
        self.pool = ReadPool(threads)
        self.files = FileTable()
        self.slot_bytes = cmap.geometry().expert_slot_bytes
        self.ring = 4 * self.pool.threads  # reads never waited for may queue past the readers
        self.arena = aligned_buffer(self.ring * self.slot_bytes)
        self.arena[::ALIGN] = 0  # faulted in now, as a warm source's slots are
        self.rng = np.random.default_rng(seed)
        self._owed = 0.0
        self._issued = 0

    def __getattr__(self, name: str):
        return getattr(self._src, name)

    @contextmanager
    def experts(self, layer: int, ids: Sequence[int]) -> Iterator[ExpertSet]:
        self._owed += self.per_layer
        n_experts = self.map.config.num_experts
        while self._owed >= 1.0:
            self._owed -= 1.0
            at = (self._issued % self.ring) * self.slot_bytes
            self._issued += 1
            lay = self.map.expert_layout(layer, int(self.rng.integers(n_experts)))
            self.pool.submit(lay.reads(self.files, self.arena[at:at + self.slot_bytes]),
                             (EXPERT_PRIORITY, self._issued), chunk=EXPERT_CHUNK)
        with self._src.experts(layer, ids) as ex:
            yield ex

    def close(self) -> None:
        self.pool.close()
        self.files.close()
