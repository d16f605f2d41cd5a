"""The raw-disk reference reads into memory the way a warm decode does."""

from __future__ import annotations

import numpy as np

from engine.bench import disk
from engine.core.directio import ReadPool


def test_raw_sweep_reuses_one_faulted_buffer(tmp_path, monkeypatch):
    # Fresh memory per configuration would time the kernel faulting pages in (up to 2.5 CPU
    # s/GB on the VM this was found on), which the engine's reused slots never pay.
    data = tmp_path / "shard.bin"
    data.write_bytes(np.random.default_rng(0).integers(0, 255, 8 << 20, np.uint8).tobytes())
    seen: list[list[int]] = []
    submit = ReadPool.submit

    def spy(self, reads, *a, **k):
        reads = list(reads)
        seen.append([r.dest.ctypes.data for r in reads])
        return submit(self, reads, *a, **k)

    monkeypatch.setattr(ReadPool, "submit", spy)
    sizes, depths = [1 << 16, 1 << 17], [2, 4]
    out = disk.raw_sweep([data], sizes, depths, np.random.default_rng(1), nbytes=4 << 20)
    assert len(out["sweep"]) == 4 and out["raw_gb_per_s"] > 0
    assert len(seen) == 4
    ring = 2 * max(depths)
    for addrs, (depth, size) in zip(seen, [(d, s) for d in depths for s in sizes]):
        assert len(addrs) == (4 << 20) // size  # the bytes asked for are all read
        assert len(set(addrs)) <= ring  # ... into a few reused buffers, not fresh memory
        for k in range(len(addrs) - depth):  # never two reads into one buffer at once
            assert len(set(addrs[k:k + depth + 1])) == depth + 1
