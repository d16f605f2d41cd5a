"""What both trunk formats' packs share (trunk.py packs the peer's BF16 trunk,
compact_pack.py the lossless c12 one): each layer's run in its shard, the checkpoint's
fingerprint, trunk.json and the progress file written atomically, and the `Session` that
holds the checkpoint's identity and the checked prior state a resumed pack starts from.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.checkpoint.binding import (
    changed_shards,
    digest_of_range,
    file_identity,
    is_digest,
    shard_stats,
)
from engine.checkpoint.safetensors import SafetensorsIndex, TensorInfo
from engine.checkpoint.schema import TensorNames
from engine.core.config import ModelConfig
from engine.core.directio import ALIGN, align_up
from engine.errors import CheckpointError, EngineError
from engine.jsonfile import load_json

TRUNK_BIN = "trunk.bin"
TRUNK_JSON = "trunk.json"
PROGRESS = "trunk.progress.json"
COMPACT_FORMAT = "k3-c12"  # trunk.json's "format" for the compact trunk; absent: BF16
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


def open_checkpoint(checkpoint_dir: Path) -> tuple[SafetensorsIndex, TensorNames, int]:
    index = SafetensorsIndex.open(checkpoint_dir)
    names = TensorNames.detect(index)
    n = ModelConfig.from_dir(checkpoint_dir).num_hidden_layers
    return index, names, n


def trunk_json(runs: list[LayerRun], fp: str, digests: dict[int, str],
               sources: dict[str, dict[str, int]]) -> dict[str, Any]:
    """The BF16 trunk's trunk.json; `digests[layer]` is both digests (the bytes are the run's)."""
    return {
        "n_layers": len(runs),
        "align": ALIGN,
        "fingerprint": fp,
        "sources": sources,
        "layers": [
            {
                "layer": r.layer,
                "shard": r.shard.name,
                "run_start": r.start,
                "nbytes": r.nbytes,
                "file_off": r.file_off,
                "sha256": digests[r.layer],
                "source_sha256": digests[r.layer],
                "tensors": {
                    t.name: {"off": t.offset - r.start, "nbytes": t.nbytes, "dtype": t.dtype,
                             "shape": list(t.shape)}
                    for t in r.tensors
                },
            }
            for r in runs
        ],
    }


def write_json(path: Path, data: dict) -> None:
    """Atomically: the old file or the new one, never a part; nothing left on failure."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(data, indent=1))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise EngineError(
            f"writing {path} failed ({exc.strerror}); free disk space or choose another "
            "folder, then rerun to resume."
        ) from None


def fail_write(offset: int, exc: OSError) -> EngineError:
    return EngineError(
        f"writing {TRUNK_BIN} failed at byte {offset} ({exc.strerror}); free disk space or "
        "choose another folder, then rerun to resume."
    )


Span = tuple[LayerRun, dict[str, Any], int, int]  # run, entry, file_off, bytes sha256 covers


@dataclass
class Session:
    """One pack of `runs` into `out`: the checkpoint's identity taken before any of its
    bytes are read, and what the folder already holds, checked."""

    out: Path
    runs: list[LayerRun]
    fp: str
    fmt: str | None  # None: the peer's BF16 trunk; COMPACT_FORMAT
    sources: dict[str, dict[str, int]]
    prior: list[dict[str, Any]]  # layer entries from trunk.json or the progress file
    recorded: Any  # the shard stats they were recorded with
    complete: bool  # prior came from a finished trunk.json
    stale_meta: bool = False  # ... whose fingerprint is not this checkpoint's (config.json)

    @classmethod
    def open(cls, checkpoint_dir: str | Path, out_dir: str | Path, fmt: str | None) -> Session:
        root, out = Path(checkpoint_dir), Path(out_dir)
        index, names, n = open_checkpoint(root)
        runs = layer_runs(index, names, n)
        fp = fingerprint(root, index, runs)
        sources = shard_stats(r.shard for r in runs)
        out.mkdir(parents=True, exist_ok=True)
        s = cls(out, runs, fp, fmt, sources, [], None, False)
        s._read_prior()
        return s

    @property
    def progress_file(self) -> Path:
        return self.out / PROGRESS

    def _read_prior(self) -> None:
        done_json = self.out / TRUNK_JSON
        if done_json.is_file():
            have = load_trunk_json(done_json)
            layers = have.get("layers")
            # This checkpoint's layout: its trunk, even if a shard or config.json changed
            # since (the digests below find which layers); anything else is not ours to
            # overwrite.
            if have.get("format") != self.fmt or not same_layout(layers, self.runs):
                raise EngineError(
                    f"{self.out} already holds another trunk (packed from a different "
                    "checkpoint, or in the other format); choose another folder or delete "
                    "that one."
                )
            if all(is_digest(e.get("sha256")) for e in layers):
                self.prior, self.recorded, self.complete = layers, have.get("sources"), True
                self.stale_meta = have.get("fingerprint") != self.fp
            return  # packed without digests (the peer, an older k3tui): re-packed whole
        if self.progress_file.is_file():
            state = load_trunk_json(self.progress_file)
            # Only the trunk.bin it was written for: deleted and made again is another file.
            if state.get("fingerprint") == self.fp and state.get("format") == self._fmt_name \
                    and state.get("bin") == file_identity(self.out / TRUNK_BIN) \
                    and isinstance(state.get("layers"), list):
                self.prior, self.recorded = state["layers"], state.get("sources")

    @property
    def _fmt_name(self) -> str:
        return self.fmt or "bf16"

    def verify(self, spans: list[Span], prefix: bool, progress: Progress | None,
               total: int) -> tuple[list[dict], list[tuple[int, str]]]:
        """The prior layers whose bytes still match: each one's bytes in trunk.bin against
        its `sha256`, and its shard's run against `source_sha256` where the shard changed
        since it was recorded. `spans`: (run, entry, file_off, used bytes) per layer.
        Returns (entries kept, [(layer, why)] for the others); `prefix`: nothing after the
        first that fails is kept (the compact trunk: each layer's offset follows the last)."""
        changed = changed_shards(self.recorded, self.sources)
        kept: list[dict] = []
        bad: list[tuple[int, str]] = []
        done = 0
        for run, entry, file_off, used in spans:
            why = None
            if digest_of_range(self.out / TRUNK_BIN, file_off, used) != entry["sha256"]:
                why = f"its bytes in {TRUNK_BIN} do not match its digest"
            elif run.shard.name in changed and digest_of_range(
                    run.shard, run.start, run.own) != entry["source_sha256"]:
                why = f"{run.shard.name} changed since it was packed"
            if why:
                bad.append((run.layer, why))
                if prefix:
                    break
                continue
            kept.append(entry)
            done += run.nbytes if self.fmt is None else run.own
            if progress:
                progress(done, total, run.layer)
        return kept, bad

    def begin(self, fd: int, layers: list[dict]) -> None:
        """Bind the progress file to the trunk.bin open as `fd` before any byte of it
        changes; a finished trunk.json is retired only once that is recorded."""
        self.record(fd, layers)
        (self.out / TRUNK_JSON).unlink(missing_ok=True)

    def record(self, fd: int, layers: list[dict]) -> None:
        st = os.fstat(fd)
        write_json(self.progress_file, {
            "fingerprint": self.fp, "format": self._fmt_name,
            "bin": {"dev": st.st_dev, "ino": st.st_ino}, "sources": self.sources,
            "layers": layers})

    def finish(self, meta: dict[str, Any]) -> None:
        write_json(self.out / TRUNK_JSON, meta)
        self.progress_file.unlink(missing_ok=True)


def same_layout(layers: Any, runs: list[LayerRun]) -> bool:
    """trunk.json's layers are these runs: same shards, starts and tensor names."""
    return isinstance(layers, list) and len(layers) == len(runs) and all(
        isinstance(e, dict) and e.get("layer") == r.layer and e.get("shard") == r.shard.name
        and e.get("run_start") == r.start and isinstance(e.get("tensors"), dict)
        and set(e["tensors"]) == {t.name for t in r.tensors}
        for e, r in zip(layers, runs))


def spans(s: Session) -> list[Span]:
    """The well-formed prior entries. BF16: any layers (offsets are fixed), both digests
    equal (the bytes are the run's). Compact: layers 0, 1, ... each at the end of the one
    before, since every later offset follows from them."""
    by_layer = {r.layer: r for r in s.runs}
    out: list[Span] = []
    seen: set[int] = set()
    off = 0
    for e in s.prior:
        layer = e.get("layer") if isinstance(e, dict) else None
        run = by_layer.get(layer) if type(layer) is int else None
        ok = run is not None and run.layer not in seen and is_digest(e.get("sha256")) \
            and is_digest(e.get("source_sha256"))
        if s.fmt is None and ok and e["source_sha256"] == e["sha256"]:
            out.append((run, e, run.file_off, run.own))
        elif s.fmt is not None and ok and run.layer == len(out) \
                and type(e.get("file_off")) is int and e["file_off"] == off:
            used = _extent(e.get("tensors"))
            if used is None or type(e.get("nbytes")) is not int or e["nbytes"] != align_up(used):
                break
            out.append((run, e, off, used))
            off += e["nbytes"]
        elif s.fmt is not None:
            break
        else:
            continue
        seen.add(run.layer)
    return out


def _extent(tensors: Any) -> int | None:
    """Where a layer's last tensor ends (what its digest covers), None if malformed."""
    if not isinstance(tensors, dict) or not tensors:
        return None
    ends = []
    for t in tensors.values():
        off, nb = (t.get("off"), t.get("nbytes")) if isinstance(t, dict) else (None, None)
        if type(off) is not int or type(nb) is not int or off < 0 or nb < 0:
            return None
        ends.append(off + nb)
    return max(ends)


MAX_TRUNK_JSON = 64 << 20  # the release's trunk.json is ~1 MB


def load_trunk_json(path: Path) -> dict[str, Any]:
    return load_json(path, MAX_TRUNK_JSON, "delete it and re-pack.")
