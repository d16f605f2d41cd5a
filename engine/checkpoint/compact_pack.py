"""`pack --compact`: the trunk written with each BF16 matrix in c12 form where it pays
(engine/checkpoint/compact.py), every other tensor as its raw bytes.

Same folder contract as the BF16 pack (trunk.py): layers in order at 4096-aligned
offsets of `trunk.bin` (each layer's c12 tensors first, 64-byte aligned, then its raw
ones, no gaps), `trunk.json` only once every layer is durable, and
`trunk.progress.json` (the finished layers' entries, bound as binding.py says) to resume
from. trunk.json adds `"format": "k3-c12"`, the packer's identity and, per c12 tensor,
`"encoding": "c12"` and its exception count; `nbytes` is the compact size. Every matrix
is decoded again and compared with the checkpoint's bits before it is written; a layer's
`sha256` covers its compact bytes, `source_sha256` the run they encode.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoint import packing
from engine.checkpoint.binding import changed_shards, new_digest
from engine.checkpoint.compact import C12, MIN_SAVING, c12_nbytes, eligible, encode, to_bytes
from engine.errors import EngineError
from engine.core.directio import align_up

FORMAT = packing.COMPACT_FORMAT
PACKER = "k3tui engine.checkpoint.compact_pack c12 v1"


def _encode_tensor(t, raw: np.ndarray) -> tuple[bytes, dict[str, Any]]:
    """(bytes to store, trunk.json entry minus "off") for one tensor."""
    entry: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape)}
    if eligible(t.dtype, tuple(t.shape)):
        bits = raw.view(np.uint16).reshape(t.shape)
        m = encode(bits)
        size = c12_nbytes(m.shape, m.exc_col.size)
        if size <= (1 - MIN_SAVING) * t.nbytes:
            if not np.array_equal(m.bf16(), bits):  # lossless is the whole promise
                raise EngineError(f"the c12 encoding of {t.name} does not decode to its bits; "
                                  "pack without --compact and report this.")
            return to_bytes(m), dict(entry, nbytes=size, encoding=C12,
                                     exceptions=int(m.exc_col.size))
    return raw.tobytes(), dict(entry, nbytes=t.nbytes)


def _pack_layer(run: packing.LayerRun, file_off: int) -> tuple[bytes, dict[str, Any]]:
    with open(run.shard, "rb") as f:  # each layer's source once: its digest, then its c12
        data = os.pread(f.fileno(), run.own, run.start)
        os.posix_fadvise(f.fileno(), run.start, run.own, os.POSIX_FADV_DONTNEED)
    if len(data) != run.own:
        raise EngineError(f"short read of {run.shard}; the file is truncated; re-download it.")
    source = new_digest()
    source.update(data)
    src = np.frombuffer(data, np.uint8)
    done = []
    for t in sorted(run.tensors, key=lambda t: t.offset):
        lo = t.offset - run.start
        done.append((t.name, *_encode_tensor(t, src[lo:lo + t.nbytes])))
    # c12 tensors first (sizes are multiples of 64, so each starts aligned), then the raw
    # ones: no gaps, so the layer stays one run, read as one window.
    done.sort(key=lambda d: "encoding" not in d[2])
    out, tensors = bytearray(), {}
    for name, blob, entry in done:
        tensors[name] = dict(entry, off=len(out))
        out += blob
    digest = new_digest()
    digest.update(out)
    out += bytes(align_up(len(out)) - len(out))
    return bytes(out), {"layer": run.layer, "shard": run.shard.name, "run_start": run.start,
                        "nbytes": len(out), "file_off": file_off,
                        "sha256": digest.hexdigest(), "source_sha256": source.hexdigest(),
                        "tensors": tensors}


def pack_compact(checkpoint_dir: str | Path, out_dir: str | Path,
                 progress: packing.Progress | None = None) -> dict[str, Any]:
    s = packing.Session.open(checkpoint_dir, out_dir, FORMAT)
    runs, out, n = s.runs, s.out, len(s.runs)
    total = sum(r.own for r in runs)
    t0 = time.perf_counter()
    layers, _ = s.verify(packing.spans(s), prefix=True, progress=progress, total=total)
    if s.complete and len(layers) == n:
        if s.stale_meta or changed_shards(s.recorded, s.sources):  # same bytes: bind anew
            packing.write_json(out / packing.TRUNK_JSON, _meta(s, layers))
        if progress:
            progress(total, total, n - 1)
        return _summary(layers, total, 0, time.perf_counter() - t0, 0, True, out)
    fd = os.open(out / packing.TRUNK_BIN, os.O_WRONLY | os.O_CREAT, 0o644)
    t0, moved, copied = time.perf_counter(), 0, 0
    try:
        s.begin(fd, layers)
        off = layers[-1]["file_off"] + layers[-1]["nbytes"] if layers else 0
        os.ftruncate(fd, off)
        done = sum(r.own for r in runs[:len(layers)])
        for run in runs[len(layers):]:
            blob, entry = _pack_layer(run, off)
            _write(fd, blob, off)
            try:
                os.fdatasync(fd)
            except OSError as exc:
                raise packing.fail_write(off, exc) from None
            os.posix_fadvise(fd, off, len(blob), os.POSIX_FADV_DONTNEED)
            layers.append(entry)
            s.record(fd, layers)
            off += len(blob)
            done += run.own
            moved += len(blob)
            copied += 1
            if progress:
                progress(done, total, run.layer)
    finally:
        os.close(fd)
    s.finish(_meta(s, layers))
    secs = time.perf_counter() - t0
    return _summary(layers, total, moved, secs, copied, False, out)


def _meta(s: packing.Session, layers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"n_layers": len(s.runs), "align": packing.ALIGN, "format": FORMAT, "packer": PACKER,
            "fingerprint": s.fp, "sources": s.sources, "layers": layers}


def _write(fd: int, blob: bytes, offset: int) -> None:
    view, done = memoryview(blob), 0
    while done < len(blob):
        try:
            done += os.pwrite(fd, view[done:], offset + done)
        except OSError as exc:
            raise packing.fail_write(offset + done, exc) from None


def _summary(layers: list, total: int, moved: int, secs: float, copied: int, already: bool,
             out: Path) -> dict[str, Any]:
    compact = sum(e["nbytes"] for e in layers)
    return {"bytes": moved, "total_bytes": compact, "bf16_bytes": total,
            "ratio": compact / max(total, 1), "seconds": secs,
            "mb_per_s": moved / 1e6 / secs if secs > 0 else 0.0, "layers_copied": copied,
            "already_packed": already, "format": FORMAT, "out": str(out)}
