"""`pack --compact`: the trunk written with each BF16 matrix in c12 form where it pays
(engine/checkpoint/compact.py), every other tensor as its raw bytes.

Same folder contract as the BF16 pack (trunk.py): layers in order at 4096-aligned
offsets of `trunk.bin` (each layer's c12 tensors first, 64-byte aligned, then its raw
ones, no gaps), `trunk.json` only once every layer is durable, and
`trunk.progress.json` (the finished layers' entries) to resume from. trunk.json adds
`"format": "k3-c12"`, the packer's identity and, per c12 tensor, `"encoding": "c12"`
and its exception count; `nbytes` is the compact size. Every matrix is decoded again
and compared with the checkpoint's bits before it is written.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoint import trunk as T
from engine.checkpoint.compact import C12, MIN_SAVING, c12_nbytes, eligible, encode, to_bytes
from engine.errors import EngineError
from engine.weights.io import align_up

FORMAT = T.COMPACT_FORMAT
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


def _pack_layer(run: T.LayerRun, file_off: int) -> tuple[bytes, dict[str, Any]]:
    with open(run.shard, "rb") as f:
        data = os.pread(f.fileno(), run.own, run.start)
        os.posix_fadvise(f.fileno(), run.start, run.own, os.POSIX_FADV_DONTNEED)
    if len(data) != run.own:
        raise EngineError(f"short read of {run.shard}; the file is truncated; re-download it.")
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
    out += bytes(align_up(len(out)) - len(out))
    return bytes(out), {"layer": run.layer, "shard": run.shard.name, "run_start": run.start,
                        "nbytes": len(out), "file_off": file_off, "tensors": tensors}


def pack_compact(checkpoint_dir: str | Path, out_dir: str | Path,
                 progress: T.Progress | None = None) -> dict[str, Any]:
    root, out = Path(checkpoint_dir), Path(out_dir)
    index, names, n = T._open_checkpoint(root)
    runs = T.layer_runs(index, names, n)
    fp = T.fingerprint(root, index, runs)
    out.mkdir(parents=True, exist_ok=True)
    total = sum(r.own for r in runs)
    done_json, state_file = out / T.TRUNK_JSON, out / T.PROGRESS
    if done_json.is_file():
        have = T._load_json(done_json)
        if have.get("fingerprint") == fp and have.get("format") == FORMAT:
            if progress:
                progress(total, total, n - 1)
            return _summary(have["layers"], total, 0, 0.0, 0, True, out)
        raise EngineError(f"{out} already holds another trunk (another checkpoint, or the "
                          "BF16 format); choose another folder or delete that one.")
    layers: list[dict[str, Any]] = []
    if state_file.is_file():
        state = T._load_json(state_file)
        if state.get("fingerprint") == fp and state.get("format") == FORMAT \
                and isinstance(state.get("layers"), list):
            layers = _checked_resume(state["layers"], runs)
    fd = os.open(out / T.TRUNK_BIN, os.O_WRONLY | os.O_CREAT, 0o644)
    t0, moved, copied = time.perf_counter(), 0, 0
    try:
        off = layers[-1]["file_off"] + layers[-1]["nbytes"] if layers else 0
        os.ftruncate(fd, off)
        done = sum(r.own for r in runs[:len(layers)])
        for run in runs[len(layers):]:
            blob, entry = _pack_layer(run, off)
            _write(fd, blob, off)
            os.fdatasync(fd)
            os.posix_fadvise(fd, off, len(blob), os.POSIX_FADV_DONTNEED)
            layers.append(entry)
            T._write_json(state_file, {"fingerprint": fp, "format": FORMAT, "layers": layers})
            off += len(blob)
            done += run.own
            moved += len(blob)
            copied += 1
            if progress:
                progress(done, total, run.layer)
    finally:
        os.close(fd)
    meta = T.trunk_json(runs, fp)
    meta.update(format=FORMAT, packer=PACKER, layers=layers)
    T._write_json(done_json, meta)
    state_file.unlink(missing_ok=True)
    secs = time.perf_counter() - t0
    return _summary(layers, total, moved, secs, copied, False, out)


def _write(fd: int, blob: bytes, offset: int) -> None:
    view, done = memoryview(blob), 0
    while done < len(blob):
        try:
            done += os.pwrite(fd, view[done:], offset + done)
        except OSError as exc:
            raise EngineError(
                f"writing {T.TRUNK_BIN} failed at byte {offset + done} ({exc.strerror}); "
                "free disk space or choose another folder, then rerun to resume."
            ) from None


def _checked_resume(entries: list, runs: list[T.LayerRun]) -> list[dict[str, Any]]:
    """The finished layers of an interrupted pack, if they are the first ones, in order."""
    off = 0
    for entry, run in zip(entries, runs):
        if not isinstance(entry, dict) or entry.get("layer") != run.layer \
                or entry.get("file_off") != off or not isinstance(entry.get("nbytes"), int):
            return []
        off += entry["nbytes"]
    return entries[:len(runs)]


def _summary(layers: list, total: int, moved: int, secs: float, copied: int, already: bool,
             out: Path) -> dict[str, Any]:
    compact = sum(e["nbytes"] for e in layers)
    return {"bytes": moved, "total_bytes": compact, "bf16_bytes": total,
            "ratio": compact / max(total, 1), "seconds": secs,
            "mb_per_s": moved / 1e6 / secs if secs > 0 else 0.0, "layers_copied": copied,
            "already_packed": already, "format": FORMAT, "out": str(out)}
