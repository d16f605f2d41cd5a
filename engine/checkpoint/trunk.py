"""Trunk packing: every layer's non-expert tensors copied into one aligned `trunk.bin`.

`trunk.json` uses the peer engine's schema, so a trunk packed by either tool works with
both: `{"n_layers", "align": 4096, "layers": [{"layer", "shard", "run_start", "nbytes",
"file_off", "tensors": {full_name: {"off", "nbytes", "dtype", "shape"}}}]}`, plus a
`"fingerprint"` of the checkpoint it came from (the peer ignores unknown keys). A layer
whose trunk tensors are not one contiguous run in one shard is refused: the gap would drag
expert bytes into every token's reads.

The copy reads with O_DIRECT and writes with O_DIRECT from aligned buffers, a few chunks
in flight, so neither side goes through (or grows) the page cache. Finished layers are
recorded in `trunk.progress.json` after an fdatasync, so an interrupted pack resumes
where it stopped; `trunk.json` appears only when every layer is in place.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoint.safetensors import DTYPES, SafetensorsIndex, TensorInfo, overlap
from engine.checkpoint.schema import TensorNames
from engine.checkpoint.compact import C12, CompactSpec, c12_nbytes, eligible
from engine.errors import CheckpointError, EngineError, ReadError
from engine.jsonfile import load_json
from engine.model.config import ModelConfig
from engine.weights.io import ALIGN, FileTable, TensorSpec, align_down, align_up, aligned_buffer

TRUNK_BIN = "trunk.bin"
TRUNK_JSON = "trunk.json"
PROGRESS = "trunk.progress.json"
COMPACT_FORMAT = "k3-c12"  # compact_pack.FORMAT
CHUNK = 16 << 20
WORKERS = 4  # chunks copied concurrently: the disk's queue depth for reads and writes
Progress = Callable[[int, int, int], None]  # (done_bytes, total_bytes, layer)


@dataclass(frozen=True)
class LayerRun:
    layer: int
    shard: Path
    start: int  # absolute offset of the run in the shard
    own: int  # bytes of the run (= sum of its tensors)
    file_off: int  # offset in trunk.bin (aligned)
    tensors: tuple[TensorInfo, ...]

    @property
    def nbytes(self) -> int:
        return align_up(self.own)


def layer_runs(index: SafetensorsIndex, names: TensorNames, n_layers: int) -> list[LayerRun]:
    """Each layer's trunk as one contiguous run; refuse a layer where that is not so."""
    per: dict[int, list[TensorInfo]] = {i: [] for i in range(n_layers)}
    lp = names.prefix + "layers."
    for name, t in index.tensors.items():
        if name.startswith(lp) and not names.is_expert(name):
            num = name[len(lp):].split(".", 1)[0]
            if num.isdigit() and int(num) < n_layers:
                per[int(num)].append(t)
    runs = []
    off = 0
    for i in range(n_layers):
        ts = sorted(per[i], key=lambda t: t.offset)
        if not ts:
            raise CheckpointError(f"layer {i} has no trunk tensors in {index.root}.")
        shards = sorted({t.file.name for t in ts})
        if len(shards) > 1:
            raise CheckpointError(
                f"layer {i}'s trunk tensors span several shards ({', '.join(shards)}); it cannot "
                "be packed as one run."
            )
        lo, hi = ts[0].offset, max(t.end for t in ts)
        own = sum(t.nbytes for t in ts)
        if hi - lo != own:
            raise CheckpointError(
                f"layer {i}'s trunk tensors in {shards[0]} are not one contiguous run (bytes "
                f"[{lo}, {hi}) hold {own} bytes of trunk and {hi - lo - own} of other data); "
                "packing it would drag expert bytes into every token's reads."
            )
        runs.append(LayerRun(i, ts[0].file, lo, own, off, tuple(ts)))
        off += align_up(own)
    return runs


def fingerprint(checkpoint_dir: Path, index: SafetensorsIndex, runs: list[LayerRun]) -> str:
    """Identity of a checkpoint: config, shard sizes, trunk layout and sampled trunk bytes."""
    h = hashlib.sha256()
    cfg = Path(checkpoint_dir) / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in index.files():
        h.update(f"{f.name}:{f.stat().st_size}\n".encode())
    for r in runs:
        for t in r.tensors:
            h.update(f"{t.name}:{t.dtype}:{list(t.shape)}:{t.offset}\n".encode())
        with open(r.shard, "rb") as f:  # first and last 4 KiB of the run: same layout,
            for pos in (r.start, max(r.start, r.start + r.own - ALIGN)):  # other weights
                h.update(os.pread(f.fileno(), min(ALIGN, r.own), pos))
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return "sha256:" + h.hexdigest()


def _open_checkpoint(checkpoint_dir: Path) -> tuple[SafetensorsIndex, TensorNames, int]:
    index = SafetensorsIndex.open(checkpoint_dir)
    names = TensorNames.detect(index)
    n = ModelConfig.from_dir(checkpoint_dir).num_hidden_layers
    return index, names, n


def trunk_json(runs: list[LayerRun], fp: str) -> dict[str, Any]:
    return {
        "n_layers": len(runs),
        "align": ALIGN,
        "fingerprint": fp,
        "layers": [
            {
                "layer": r.layer,
                "shard": r.shard.name,
                "run_start": r.start,
                "nbytes": r.nbytes,
                "file_off": r.file_off,
                "tensors": {
                    t.name: {"off": t.offset - r.start, "nbytes": t.nbytes, "dtype": t.dtype,
                             "shape": list(t.shape)}
                    for t in r.tensors
                },
            }
            for r in runs
        ],
    }


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _open_out(path: Path) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644), True
    except OSError:
        return os.open(path, flags, 0o644), False


class _Copier:
    """Copies layer runs into trunk.bin: `WORKERS` threads each read a chunk (O_DIRECT) and
    write it (O_DIRECT) at its aligned place, so reads and writes overlap at queue depth."""

    def __init__(self, out_fd: int, direct: bool):
        self.fd, self.direct = out_fd, direct
        self.files = FileTable()
        self.buffers: queue.Queue = queue.Queue()
        for _ in range(WORKERS):
            self.buffers.put((aligned_buffer(CHUNK + 2 * ALIGN), aligned_buffer(CHUNK)))

    def copy(self, runs: list[LayerRun], on_bytes: Callable[[int, int], None],
             on_layer: Callable[[LayerRun], None]) -> None:
        """Copy `runs`; `on_layer(run)` once its bytes are durable (in layer order)."""
        chunks = [(r, k, min(CHUNK, r.nbytes - k)) for r in runs for k in range(0, r.nbytes, CHUNK)]
        todo = iter(chunks)
        window: deque = deque()
        with ThreadPoolExecutor(WORKERS, thread_name_prefix="k3-pack") as ex:
            def submit() -> None:
                c = next(todo, None)
                if c is not None:
                    window.append((c, ex.submit(self._chunk, *c)))

            for _ in range(2 * WORKERS):
                submit()
            try:
                while window:
                    (run, k, n), fut = window.popleft()
                    fut.result()
                    on_bytes(run.layer, n)
                    if k + n >= run.nbytes:
                        os.fdatasync(self.fd)
                        if not self.direct:
                            os.posix_fadvise(self.fd, run.file_off, run.nbytes,
                                             os.POSIX_FADV_DONTNEED)
                        on_layer(run)
                    submit()
            finally:
                for _, fut in window:
                    fut.cancel()

    def _chunk(self, run: LayerRun, k: int, n: int) -> None:
        rbuf, wbuf = self.buffers.get()
        try:
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
        finally:
            self.buffers.put((rbuf, wbuf))

    def _write(self, buf: np.ndarray, offset: int) -> None:
        done = 0
        while done < buf.nbytes:
            try:
                n = os.pwrite(self.fd, buf[done:], offset + done)
            except OSError as exc:
                raise EngineError(
                    f"writing {TRUNK_BIN} failed at byte {offset + done} ({exc.strerror}); "
                    "free disk space or choose another folder, then rerun to resume."
                ) from None
            done += n

    def close(self) -> None:
        self.files.close()


def pack(checkpoint_dir: str | Path, out_dir: str | Path,
         progress: Progress | None = None, compact: bool = False) -> dict[str, Any]:
    """Pack the trunk into `out_dir`; resumable. Returns a summary (bytes, seconds, MB/s).
    `compact`: the lossless c12 trunk (compact_pack.py) instead of the peer's BF16 one."""
    if compact:
        from engine.checkpoint.compact_pack import pack_compact

        return pack_compact(checkpoint_dir, out_dir, progress)
    root, out = Path(checkpoint_dir), Path(out_dir)
    index, names, n = _open_checkpoint(root)
    runs = layer_runs(index, names, n)
    fp = fingerprint(root, index, runs)
    out.mkdir(parents=True, exist_ok=True)
    total = sum(r.nbytes for r in runs)
    done_json = out / TRUNK_JSON
    if done_json.is_file():
        have = _load_json(done_json)
        if have.get("fingerprint") == fp and "format" not in have and (out / TRUNK_BIN).is_file() \
                and (out / TRUNK_BIN).stat().st_size >= total:
            if progress:
                progress(total, total, n - 1)
            return {"bytes": 0, "total_bytes": total, "seconds": 0.0, "mb_per_s": 0.0,
                    "layers_copied": 0, "already_packed": True, "out": str(out)}
        raise EngineError(
            f"{out} already holds a trunk packed from a different checkpoint; choose another "
            "folder or delete that one."
        )
    state_file = out / PROGRESS
    done: set[int] = set()
    if state_file.is_file():
        state = _load_json(state_file)
        listed = state.get("done")
        if state.get("fingerprint") == fp and isinstance(listed, list):
            done = {i for i in listed if type(i) is int}
    fd, direct = _open_out(out / TRUNK_BIN)
    copier = _Copier(fd, direct)
    copied = sum(r.nbytes for r in runs if r.layer in done)
    moved = n_copied = 0
    t0 = time.perf_counter()

    def on_bytes(layer: int, k: int) -> None:
        nonlocal copied, moved
        copied += k
        moved += k
        if progress:
            progress(copied, total, layer)

    def on_layer(run: LayerRun) -> None:
        nonlocal n_copied
        n_copied += 1
        done.add(run.layer)
        _write_json(state_file, {"fingerprint": fp, "done": sorted(done)})

    try:
        os.ftruncate(fd, total)
        copier.copy([r for r in runs if r.layer not in done], on_bytes, on_layer)
    except ReadError as exc:
        raise EngineError(f"{exc} Rerun pack to resume.") from None
    finally:
        copier.close()
        os.close(fd)
    _write_json(done_json, trunk_json(runs, fp))
    state_file.unlink(missing_ok=True)
    secs = time.perf_counter() - t0
    return {"bytes": moved, "total_bytes": total, "seconds": secs,
            "mb_per_s": moved / 1e6 / secs if secs > 0 else 0.0,
            "layers_copied": n_copied, "already_packed": False, "out": str(out)}


MAX_TRUNK_JSON = 64 << 20  # the release's trunk.json is ~1 MB


def _load_json(path: Path) -> dict[str, Any]:
    return load_json(path, MAX_TRUNK_JSON, "delete it and re-pack.")


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


def trunk_specs(trunk_dir: Path, index: SafetensorsIndex, names: TensorNames, n_layers: int,
                checkpoint_dir: Path) -> dict[int, list[TensorSpec]]:
    """Per layer, where its tensors live in a packed trunk: trunk.json checked against its
    schema, against trunk.bin's size (every tensor inside its own layer's span, the spans
    disjoint) and against the checkpoint, so a corrupt or hostile file never hands the
    model another layer's bytes."""
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
    meta = _load_json(meta_path)

    chk = _Checker(meta_path, repack)
    need, bad = chk.need, chk.bad

    runs = layer_runs(index, names, n_layers)
    fp = meta.get("fingerprint")
    if fp is not None and fp != fingerprint(checkpoint_dir, index, runs):
        raise CheckpointError(
            f"the trunk in {trunk_dir} was packed from a different checkpoint than "
            f"{checkpoint_dir}; {repack}."
        )
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
    index, names, n = _open_checkpoint(Path(checkpoint_dir))
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint folder (safetensors shards + config)")
    parser.add_argument("out", help="folder for trunk.bin + trunk.json (resumes if present)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    parser.add_argument("--compact", action="store_true",
                        help="write the lossless compact trunk (~12 bits/weight, this engine "
                        "only) instead of the peer-compatible BF16 one")


def main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    last = [0.0]

    def show(done: int, total: int, layer: int) -> None:
        now = time.perf_counter()
        if now - last[0] < 0.5 and done < total:
            return
        last[0] = now
        rate = done / 1e6 / max(now - t0, 1e-9)
        print(f"\rpacking layer {layer}: {done / 1e9:.2f} / {total / 1e9:.2f} GB "
              f"({100 * done / max(total, 1):.0f}%), {rate:.0f} MB/s", end="",
              file=sys.stderr, flush=True)

    try:
        summary = pack(args.checkpoint, args.out, progress=show,
                       compact=getattr(args, "compact", False))
    except EngineError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    print(file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
    elif summary["already_packed"]:
        print(f"{args.out} already holds this checkpoint's trunk; nothing to do.")
    else:
        kind = (f"compact trunk ({100 * summary['ratio']:.1f}% of its BF16 size)"
                if "ratio" in summary else "trunk")
        print(f"packed {summary['total_bytes'] / 1e9:.3f} GB of {kind} into {args.out} "
              f"({summary['mb_per_s']:.0f} MB/s).")
    return 0
