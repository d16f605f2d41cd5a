"""Trunk packing: every layer's non-expert tensors copied into one aligned `trunk.bin`.

`trunk.json` uses the peer engine's schema, so a trunk packed by either tool works with
both: `{"n_layers", "align": 4096, "layers": [{"layer", "shard", "run_start", "nbytes",
"file_off", "tensors": {full_name: {"off", "nbytes", "dtype", "shape"}}}]}`, plus keys the
peer ignores: a `"fingerprint"` of the checkpoint it came from, `"sources"` (the shards'
identity) and per layer `"sha256"` and `"source_sha256"` (binding.py: what they bind and
where they are checked). A layer whose trunk tensors are not one contiguous run in one
shard is refused: the gap would drag expert bytes into every token's reads.

The copy reads with O_DIRECT and writes with O_DIRECT from aligned buffers, a few chunks
in flight, so neither side goes through (or grows) the page cache; each chunk is hashed
in order as it lands. Finished layers are recorded with their digests in
`trunk.progress.json` after an fdatasync, so an interrupted pack resumes where it
stopped, re-reading what it finished first; `trunk.json` appears only when every layer is
in place. `pack` on a finished trunk checks every layer again and re-packs what no longer
matches its digest or its shard. What this pack shares with the compact one
(compact_pack.py) — the runs, the session, trunk.json — is in packing.py.
"""

from __future__ import annotations

import os
import queue
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoint.binding import (
    changed_shards,
    is_digest,
    new_digest,
    shard_stats,
)
from engine.checkpoint.safetensors import DTYPES, SafetensorsIndex, TensorInfo, overlap
from engine.checkpoint.schema import TensorNames
from engine.checkpoint.compact import C12, CompactSpec, c12_nbytes, eligible
from engine.checkpoint.compact_pack import pack_compact
from engine.checkpoint.packing import (
    COMPACT_FORMAT,
    PROGRESS,
    TRUNK_BIN,
    TRUNK_JSON,
    LayerRun,
    Progress,
    Session,
    fail_write,
    fingerprint,
    layer_runs,
    load_trunk_json,
    open_checkpoint,
    spans,
    same_layout,
    trunk_json,
    write_json,
)
from engine.errors import CheckpointError, EngineError, ReadError
from engine.core.directio import ALIGN, FileTable, TensorSpec, align_down, align_up, aligned_buffer

CHUNK = 16 << 20
WORKERS = 4  # chunks copied concurrently: the disk's queue depth for reads and writes


def _open_out(path: Path) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644), True
    except OSError:
        return os.open(path, flags, 0o644), False


class _Copier:
    """Copies layer runs into trunk.bin: `WORKERS` threads each read a chunk (O_DIRECT) and
    write it (O_DIRECT) at its aligned place, so reads and writes overlap at queue depth.
    The caller's thread hashes each chunk's bytes in order while the others copy."""

    def __init__(self, out_fd: int, direct: bool):
        self.fd, self.direct = out_fd, direct
        self.files = FileTable()
        self.buffers: queue.Queue = queue.Queue()
        for _ in range(WORKERS):
            self.buffers.put((aligned_buffer(CHUNK + 2 * ALIGN), aligned_buffer(CHUNK)))

    def copy(self, runs: list[LayerRun], on_bytes: Callable[[int, int], None],
             on_layer: Callable[[LayerRun, str], None]) -> None:
        """Copy `runs`; `on_layer(run, sha256 of its bytes)` once they are durable (in layer
        order)."""
        chunks = [(r, k, min(CHUNK, r.nbytes - k)) for r in runs for k in range(0, r.nbytes, CHUNK)]
        todo = iter(chunks)
        window: deque = deque()
        digest = new_digest()
        with ThreadPoolExecutor(WORKERS, thread_name_prefix="k3-pack") as ex:
            def submit() -> None:
                # A chunk takes its buffers here and gives them back once hashed below: a
                # chunk in the window always has them, so the oldest never waits.
                c = next(todo, None)
                if c is not None:
                    bufs = self.buffers.get()
                    window.append((c, bufs, ex.submit(self._chunk, *c, bufs)))

            for _ in range(WORKERS):
                submit()
            try:
                while window:
                    (run, k, n), bufs, fut = window.popleft()
                    try:
                        digest.update(fut.result())
                    finally:
                        self.buffers.put(bufs)
                    on_bytes(run.layer, n)
                    if k + n >= run.nbytes:
                        try:
                            os.fdatasync(self.fd)
                        except OSError as exc:
                            raise fail_write(run.file_off, exc) from None
                        if not self.direct:
                            os.posix_fadvise(self.fd, run.file_off, run.nbytes,
                                             os.POSIX_FADV_DONTNEED)
                        on_layer(run, digest.hexdigest())
                        digest = new_digest()
                    submit()
            finally:
                for _, _, fut in window:
                    fut.cancel()

    def _chunk(self, run: LayerRun, k: int, n: int, bufs: tuple) -> np.ndarray:
        """Copy chunk k of `run`; returns its payload (the run's bytes, not the padding)."""
        rbuf, wbuf = bufs
        lo = run.start + k
        hi = run.start + min(k + n, run.own)  # payload; the tail of the last is padding
        win = align_down(lo)
        buf = rbuf[: align_up(hi) - win]
        self.files.get(run.shard).read_into(buf, win, hi - win)
        delta, payload = lo - win, hi - lo
        if delta == 0 and payload == n:
            out = buf[:n]
        else:  # shift to an aligned address and zero the padding
            out = wbuf[:n]
            out[:payload] = buf[delta:delta + payload]
            out[payload:] = 0
        self._write(out, run.file_off + k)
        return out[:payload]

    def _write(self, buf: np.ndarray, offset: int) -> None:
        done = 0
        while done < buf.nbytes:
            try:
                n = os.pwrite(self.fd, buf[done:], offset + done)
            except OSError as exc:
                raise fail_write(offset + done, exc) from None
            done += n

    def close(self) -> None:
        self.files.close()


def pack(checkpoint_dir: str | Path, out_dir: str | Path,
         progress: Progress | None = None, compact: bool = False) -> dict[str, Any]:
    """Pack the trunk into `out_dir`; resumable, and a finished trunk is checked again
    (binding.py) with what no longer matches re-packed. Returns a summary (bytes, seconds,
    MB/s). `compact`: the lossless c12 trunk (compact_pack.py) instead of the peer's BF16
    one."""
    try:
        if compact:
            return pack_compact(checkpoint_dir, out_dir, progress)
        return _pack_bf16(checkpoint_dir, out_dir, progress)
    except OSError as exc:  # what the steps above did not word themselves: one sentence
        raise EngineError(
            f"packing into {out_dir} failed on {exc.filename or TRUNK_BIN} ({exc.strerror}); "
            "free disk space or fix the folder's permissions, then rerun to resume."
        ) from None


def _pack_bf16(checkpoint_dir: str | Path, out_dir: str | Path,
               progress: Progress | None) -> dict[str, Any]:
    s = Session.open(checkpoint_dir, out_dir, None)
    runs, out, n = s.runs, s.out, len(s.runs)
    total = sum(r.nbytes for r in runs)
    t0 = time.perf_counter()
    kept, _ = s.verify(spans(s), prefix=False, progress=progress, total=total)
    digests = {e["layer"]: e["sha256"] for e in kept}
    verified = time.perf_counter() - t0
    if s.complete and len(digests) == n:
        if s.stale_meta or changed_shards(s.recorded, s.sources):  # same bytes: bind anew
            write_json(out / TRUNK_JSON, trunk_json(runs, s.fp, digests, s.sources))
        if progress:
            progress(total, total, n - 1)
        return {"bytes": 0, "total_bytes": total, "seconds": verified, "mb_per_s": 0.0,
                "layers_copied": 0, "layers_verified": n, "already_packed": True,
                "out": str(out)}
    fd, direct = _open_out(out / TRUNK_BIN)
    copier = _Copier(fd, direct)
    copied = sum(r.nbytes for r in runs if r.layer in digests)
    moved = n_copied = 0
    t0 = time.perf_counter()

    def on_bytes(layer: int, k: int) -> None:
        nonlocal copied, moved
        copied += k
        moved += k
        if progress:
            progress(copied, total, layer)

    def records() -> list[dict]:
        return [{"layer": L, "sha256": d, "source_sha256": d} for L, d in sorted(digests.items())]

    def on_layer(run: LayerRun, digest: str) -> None:
        nonlocal n_copied
        n_copied += 1
        digests[run.layer] = digest
        s.record(fd, records())

    try:
        s.begin(fd, records())
        try:
            os.ftruncate(fd, total)
        except OSError as exc:
            raise fail_write(total, exc) from None
        copier.copy([r for r in runs if r.layer not in digests], on_bytes, on_layer)
    except ReadError as exc:
        raise EngineError(f"{exc} Rerun pack to resume.") from None
    finally:
        copier.close()
        os.close(fd)
    s.finish(trunk_json(runs, s.fp, digests, s.sources))
    secs = time.perf_counter() - t0
    return {"bytes": moved, "total_bytes": total, "seconds": secs,
            "mb_per_s": moved / 1e6 / secs if secs > 0 else 0.0,
            "layers_copied": n_copied, "layers_verified": len(kept), "already_packed": False,
            "out": str(out)}


def verify(checkpoint_dir: str | Path, out_dir: str | Path,
           progress: Progress | None = None) -> dict[str, Any]:
    """Check a finished trunk and change nothing: every layer's bytes in trunk.bin against
    its digest, and the runs of any shard changed since the pack against theirs. Returns
    {"layers", "bytes", "seconds", "bad": [(layer, why)]}."""
    out = Path(out_dir)
    if not (out / TRUNK_JSON).is_file():
        raise EngineError(f"{out} holds no finished trunk ({TRUNK_JSON} is missing); pack one "
                          f"with `python -m engine pack {checkpoint_dir} {out}`.")
    fmt = load_trunk_json(out / TRUNK_JSON).get("format")
    s = Session.open(checkpoint_dir, out, COMPACT_FORMAT if fmt == COMPACT_FORMAT else None)
    if not s.complete:
        raise EngineError(
            f"the trunk in {out} has no per-layer digests (packed by the C peer or an older "
            f"k3tui), so it cannot be verified; {repack_in_place(Path(checkpoint_dir), out)}.")
    t0 = time.perf_counter()
    checked = spans(s)
    total = sum(r.nbytes if s.fmt is None else r.own for r in s.runs)
    _, bad = s.verify(checked, prefix=False, progress=progress, total=total)
    listed = {run.layer for run, *_ in checked}
    bad += [(r.layer, "its trunk.json entry is malformed") for r in s.runs if r.layer not in listed]
    return {"layers": len(s.runs), "bytes": sum(used for *_, used in checked),
            "seconds": time.perf_counter() - t0, "bad": sorted(bad)}



class _Checker:
    """Refusals for one trunk.json, each naming the file, the field and the way out."""

    def __init__(self, meta_path: Path, repack: str):
        self.meta_path, self.repack = meta_path, repack

    def need(self, obj: Any, key: str, kind: type, where: str) -> Any:
        """obj[key] if it is a `kind` (an int: non-negative, not a bool), else refuse."""
        value = obj.get(key) if isinstance(obj, dict) else None
        if isinstance(value, kind) and not (kind is int and (isinstance(value, bool) or value < 0)):
            return value
        got = f"{value!r}"[:40] if isinstance(obj, dict) and key in obj else "missing"
        want = "a non-negative integer" if kind is int else f"a JSON {_KINDS[kind]}"
        raise CheckpointError(
            f"{self.meta_path}: {where}{key} is {got}, expected {want}; {self.repack}.")

    def bad(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.meta_path}: {what}; {self.repack}.")


def _tensor_specs(chk: _Checker, where: str, got: dict, want: dict, binary: Path, base: int,
                  span: int, layer: int, fmt: str | None) -> list[TensorSpec]:
    """One layer's tensors in trunk.bin, each checked against the checkpoint's and inside
    the layer's own span."""
    specs = []
    for name, t in got.items():
        tw = f"{where}tensors[{name!r}]."
        off, nb = chk.need(t, "off", int, tw), chk.need(t, "nbytes", int, tw)
        dtype, shape = chk.need(t, "dtype", str, tw), chk.need(t, "shape", list, tw)
        ref = want[name]
        expect, kind = _encoding(fmt, t, ref, chk.need, tw)
        if nb != expect or dtype != ref.dtype or tuple(shape) != ref.shape:
            raise chk.bad(f"tensor {name} is {dtype} {shape} in {nb} bytes but the checkpoint's "
                          f"is {ref.dtype} {list(ref.shape)} in {ref.nbytes}")
        if off + nb > span:
            raise chk.bad(f"tensor {name} spans bytes [{off}, {off + nb}) of layer {layer}, "
                          f"which holds only {span}: it points outside its own layer")
        specs.append(kind(name, binary, base + off, nb, DTYPES[ref.dtype], ref.shape))
    return specs


@dataclass(frozen=True)
class PackedTrunk:
    """A checked trunk: per layer its tensors in trunk.bin and the sha256 its bytes must
    have (checked on the layer's first read); no digests for a trunk packed by the peer,
    whose schema has none."""

    layers: dict[int, list[TensorSpec]]
    digests: dict[int, str]


def repack_in_place(checkpoint_dir: Path, trunk_dir: Path) -> str:
    """The next step for a trunk that no longer matches: pack re-checks it and re-packs
    the layers that changed."""
    return (f"run `k3tui pack` (or `python -m engine pack {checkpoint_dir} {trunk_dir}`) to "
            "re-pack what changed")


def layer_mismatch(checkpoint_dir: Path, trunk_dir: Path, layer: int) -> str:
    return (f"layer {layer} of the trunk in {trunk_dir} does not match the digest it was packed "
            f"with ({TRUNK_BIN} changed after packing); "
            f"{repack_in_place(checkpoint_dir, trunk_dir)}.")


def trunk_specs(trunk_dir: Path, index: SafetensorsIndex, names: TensorNames, n_layers: int,
                checkpoint_dir: Path) -> PackedTrunk:
    """Per layer, where its tensors live in a packed trunk: trunk.json checked against its
    schema, against trunk.bin's size (every tensor inside its own layer's span, the spans
    disjoint) and against the checkpoint (its layout, and each shard a layer came from
    still the file it was packed from), so a corrupt, hostile or stale file never hands
    the model another layer's bytes."""
    meta_path = trunk_dir / TRUNK_JSON
    repack = (f"re-pack it with `python -m engine pack {checkpoint_dir} {trunk_dir}-new` "
              "(or `k3tui pack`)")
    if not meta_path.is_file() and (trunk_dir / PROGRESS).is_file():
        raise CheckpointError(
            f"packing into {trunk_dir} is not finished; rerun `python -m engine pack "
            f"{checkpoint_dir} {trunk_dir}` to resume it."
        )
    if not meta_path.is_file():
        raise CheckpointError(
            f"{trunk_dir} has no {TRUNK_JSON}; pack one with `python -m engine pack "
            f"{checkpoint_dir} {trunk_dir}`."
        )
    meta = load_trunk_json(meta_path)

    chk = _Checker(meta_path, repack)
    need, bad = chk.need, chk.bad

    runs = layer_runs(index, names, n_layers)
    _check_current(meta, runs, checkpoint_dir, trunk_dir, index, need, repack)
    fmt = _format(meta, bad)
    if need(meta, "align", int, "") != ALIGN or need(meta, "n_layers", int, "") != n_layers:
        raise bad(f"it describes {meta['n_layers']} layers aligned to {meta['align']} but the "
                  f"checkpoint has {n_layers} (align {ALIGN})")
    layers = need(meta, "layers", list, "")
    if len(layers) != n_layers:
        raise bad(f"it lists {len(layers)} of {n_layers} layers")
    binary = trunk_dir / TRUNK_BIN
    size = binary.stat().st_size if binary.is_file() else -1
    out: dict[int, list[TensorSpec]] = {}
    spans = []
    for i, (entry, run) in enumerate(zip(layers, runs)):
        where = f"layers[{i}]."
        L = need(entry, "layer", int, where)
        got = need(entry, "tensors", dict, where)
        want = {t.name: t for t in run.tensors}
        if L != run.layer or set(got) != set(want) \
                or need(entry, "shard", str, where) != run.shard.name \
                or need(entry, "run_start", int, where) != run.start:
            raise bad(f"layer {run.layer} does not match the checkpoint's tensors (the trunk "
                      "was packed from another checkpoint)")
        base, span = need(entry, "file_off", int, where), need(entry, "nbytes", int, where)
        if base % ALIGN or base + span > size:
            raise CheckpointError(
                f"{binary} is {size} bytes but layer {L} needs bytes up to {base + span}; the "
                f"pack is incomplete or corrupt; {repack}."
            )
        spans.append((base, base + span, L))
        specs = _tensor_specs(chk, where, got, want, binary, base, span, L, fmt)
        clash = overlap([(s.offset, s.offset + s.nbytes, s.name) for s in specs])
        if clash:
            raise bad(f"tensors {clash[0]} and {clash[1]} of layer {L} overlap")
        out[L] = specs
    clash = overlap(spans)
    if clash:
        raise bad(f"layers {clash[0]} and {clash[1]} overlap in {TRUNK_BIN}")
    return PackedTrunk(out, _digests(meta, layers, out, chk, checkpoint_dir, trunk_dir))


def _check_current(meta: dict, runs: list[LayerRun], checkpoint_dir: Path, trunk_dir: Path,
                   index: SafetensorsIndex, need: Callable, repack: str) -> None:
    """The trunk was packed from this checkpoint as it is now: each shard a layer came from
    still the same file, and the fingerprint (config.json, layout) the same. A stale trunk
    of this checkpoint's layout is re-checked in place by pack; any other is another's."""
    changed = set()
    if "sources" in meta:
        changed = changed_shards(need(meta, "sources", dict, ""),
                                 shard_stats(r.shard for r in runs))
    first = next((r for r in runs if r.shard.name in changed), None)
    fp = meta.get("fingerprint")
    if first is None and (fp is None or fp == fingerprint(checkpoint_dir, index, runs)):
        return
    if not same_layout(meta.get("layers"), runs):
        raise CheckpointError(
            f"the trunk in {trunk_dir} was packed from a different checkpoint than "
            f"{checkpoint_dir}; {repack}."
        )
    what = (f"{first.shard.name} is not the file layer {first.layer} of the trunk in "
            f"{trunk_dir} was packed from (it was replaced or rewritten since)" if first else
            f"{checkpoint_dir} changed since the trunk in {trunk_dir} was packed from it (its "
            "config.json, or a shard's bytes)")
    raise CheckpointError(f"{what}; {repack_in_place(checkpoint_dir, trunk_dir)}.")


def check(checkpoint_dir: str | Path, trunk_dir: str | Path) -> PackedTrunk:
    """trunk_specs for a checkpoint folder: what `k3tui doctor` runs (it reads two pages
    per layer of the shards, no trunk bytes)."""
    index, names, n = open_checkpoint(Path(checkpoint_dir))
    return trunk_specs(Path(trunk_dir), index, names, n, Path(checkpoint_dir))


def _digests(meta: dict, layers: list, specs: dict[int, list[TensorSpec]], chk: _Checker,
             checkpoint_dir: Path, trunk_dir: Path) -> dict[int, str]:
    """Each layer's sha256, its tensors checked to fill its bytes from `file_off` without a
    gap (what the digest covers is then exactly what the engine reads). A trunk of ours
    (it has a fingerprint) without them was packed by a k3tui whose resume could leave
    zeroed layers: refused. The peer's trunks have none: {} (not verified)."""
    if not any(isinstance(e, dict) and "sha256" in e for e in layers):
        if "fingerprint" in meta:
            raise CheckpointError(
                f"the trunk in {trunk_dir} was packed by an older k3tui, without the per-layer "
                "digests that show its bytes are whole (an interrupted pack of that version "
                f"could leave zeroed layers); {repack_in_place(checkpoint_dir, trunk_dir)}."
            )
        return {}
    if "fingerprint" in meta:
        chk.need(meta, "sources", dict, "")
    out = {}
    for i, entry in enumerate(layers):
        where = f"layers[{i}]."
        digest = chk.need(entry, "sha256", str, where)
        if not is_digest(digest) or not is_digest(chk.need(entry, "source_sha256", str, where)):
            raise chk.bad(f"{where}sha256 or source_sha256 is not a sha256 in hex")
        L = entry["layer"]
        ts = sorted(specs[L], key=lambda t: t.offset)
        pos = entry["file_off"]
        for t in ts:
            if t.offset != pos:
                raise chk.bad(f"layer {L}'s tensors leave a gap before {t.name}, which its "
                              "digest does not cover")
            pos += t.nbytes
        out[L] = digest
    return out


_KINDS = {dict: "object", list: "list", str: "string"}


def _format(meta: dict, bad: Callable[[str], CheckpointError]) -> str | None:
    """None for the peer's BF16 trunk, COMPACT_FORMAT for ours; anything else is refused."""
    fmt = meta.get("format")
    if fmt not in (None, COMPACT_FORMAT):
        raise bad(f"its format {str(fmt)[:40]!r} is not one this engine reads")
    return fmt


def _encoding(fmt: str | None, t: dict, ref: TensorInfo, need: Callable,
              where: str) -> tuple[int, Callable[..., TensorSpec]]:
    """The bytes a trunk.json tensor entry must span and the spec type that reads them:
    a c12 matrix of a compact trunk, else the raw bytes."""
    if fmt is None or t.get("encoding") != C12 or not eligible(ref.dtype, ref.shape):
        return ref.nbytes, TensorSpec
    n_exc = need(t, "exceptions", int, where)
    return c12_nbytes(ref.shape, n_exc), partial(CompactSpec, exceptions=n_exc)


def plain_copy(checkpoint_dir: str | Path, dest: str | Path) -> dict[str, Any]:
    """The baseline: `cp` + `sync` of the same bytes. Like cp, each trunk run is copied in
    the kernel (`copy_file_range`), then the copy is made durable (fsync), from a cold
    page cache."""
    index, names, n = open_checkpoint(Path(checkpoint_dir))
    runs = layer_runs(index, names, n)
    drop_cache(index.files())
    t0 = time.perf_counter()
    moved = 0
    with open(dest, "wb") as out:
        for r in runs:
            with open(r.shard, "rb") as f:
                pos, left = r.start, r.own
                while left:
                    k = os.copy_file_range(f.fileno(), out.fileno(), left, pos)
                    if k == 0:
                        raise ReadError(f"short read of {r.shard}; the file is truncated.")
                    pos, left, moved = pos + k, left - k, moved + k
        os.fsync(out.fileno())
    secs = time.perf_counter() - t0
    drop_cache([Path(dest), *index.files()])
    return {"bytes": moved, "seconds": secs, "mb_per_s": moved / 1e6 / secs}


def drop_cache(files: list[Path]) -> None:
    """Ask the kernel to forget these files' clean cached pages (fair timing, no growth)."""
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- python -m engine pack ----------------------------------------------------------
