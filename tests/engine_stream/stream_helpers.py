"""Small real-format files for the streaming tests (safetensors written by hand)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np

DT = {np.dtype("<u2"): "BF16", np.dtype("<f4"): "F32", np.dtype("u1"): "U8"}


def write_safetensors(path: Path, tensors: list[tuple[str, np.ndarray]],
                      gaps: dict[str, int] | None = None) -> None:
    """Tensors in the given order; `gaps[name]` zero bytes are inserted before `name`."""
    gaps = gaps or {}
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs = []
    off = 0
    for name, arr in tensors:
        pad = gaps.get(name, 0)
        blobs.append(b"\0" * pad)
        off += pad
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": DT[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A writable copy of a checkpoint folder."""
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


class Recorder:
    """Forwards to a StreamingSource (expert guesses too) and records each experts() call
    with the experts that were resident before it."""

    def __init__(self, src):
        self.src = src
        self.index = src.index
        self.wants_guesses = src.wants_guesses
        self.calls: list[tuple[int, list[int], set]] = []

    def layer(self, i):
        return self.src.layer(i)

    def guess(self, layer, ids):
        self.src.guess(layer, ids)

    def experts(self, layer, ids):
        self.calls.append((layer, list(ids), set(self.src.cache.resident())))
        return self.src.experts(layer, ids)

    def model_tensor(self, name):
        return self.src.model_tensor(name)

    def stats(self):
        return self.src.stats()
