"""GGUF files: the header fields k3tui reads, and the shard set of a split model."""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3tui.errors import K3Error
from k3tui.units import MiB


SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


# ggml type id -> (elements per block, bytes per block); from the GGUF spec (gguf-py constants).
GGML_BLOCK: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
    15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18),
    21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4),
    27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66),
    39: (32, 17), 40: (64, 36), 41: (128, 18),
}
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}


@dataclass
class GGUFHeader:
    path: Path
    split_no: int | None
    split_count: int | None
    expected_size: int | None  # None when a tensor type is unknown to us
    n_tensors: int
    block_count: int | None = None  # the model's layers, as its architecture's metadata says


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse the header and tensor table; the expected file size ends at the last tensor."""
    with open(path, "rb", buffering=MiB) as fh:
        def take(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            raw = fh.read(size)
            if len(raw) != size:
                raise EOFError
            return struct.unpack(fmt, raw)[0]

        def string() -> str:
            return fh.read(take("<Q")).decode("utf-8", "replace")

        def value(kind: int) -> Any:
            if kind == 8:
                return string()
            if kind == 9:
                sub, count = take("<I"), take("<Q")
                if sub in _SCALAR and sub != 8:
                    fh.seek(struct.calcsize(_SCALAR[sub]) * count, 1)
                    return None
                for _ in range(count):
                    value(sub)
                return None
            return take(_SCALAR[kind])

        if fh.read(4) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        version = take("<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        n_tensors, n_kv = take("<Q"), take("<Q")
        kv: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            kv[key] = value(take("<I"))
        end = 0
        known = True
        for _ in range(n_tensors):
            string()
            dims = [take("<Q") for _ in range(take("<I"))]
            ggml_type, offset = take("<I"), take("<Q")
            block = GGML_BLOCK.get(ggml_type)
            if block is None:
                known = False
                continue
            n = 1
            for d in dims:
                n *= d
            end = max(end, offset + n // block[0] * block[1])
        align = int(kv.get("general.alignment") or 32)
        data_start = -(-fh.tell() // align) * align
    no, count = kv.get("split.no"), kv.get("split.count")
    blocks = kv.get(f"{kv.get('general.architecture')}.block_count")
    return GGUFHeader(path, None if no is None else int(no),
                      None if count is None else int(count),
                      data_start + end if known else None, n_tensors,
                      blocks if isinstance(blocks, int) and blocks > 0 else None)


def model_shards(model: Path) -> list[Path]:
    """Every file of a (possibly split) GGUF given any shard or the folder; first shard first."""
    model = Path(model).expanduser()
    if model.is_dir():
        ggufs = sorted(model.glob("*.gguf"))
        firsts = [p for p in ggufs if (m := SPLIT_RE.match(p.name)) and int(m["no"]) == 1]
        singles = [p for p in ggufs if not SPLIT_RE.match(p.name)]
        choices = firsts + singles
        later = [m for p in ggufs if (m := SPLIT_RE.match(p.name)) and int(m["no"]) != 1]
        if not choices and later:  # a split model whose first shard is missing
            first = f"{later[0]['prefix']}-00001-of-{int(later[0]['count']):05d}.gguf"
            raise K3Error(f"{model} holds {len(later)} shards of a split GGUF but not its "
                          f"first shard, {first}.",
                          "run `k3tui download` to fetch (or resume) it, then start again")
        if len(choices) != 1:
            raise K3Error(f"{model} holds {len(choices) or 'no'} GGUF models"
                          + (f" ({', '.join(p.name for p in choices)})" if choices else "") + ".",
                          "point the config at the .gguf file to serve "
                          "(`k3tui config set model.dir FILE.gguf`)")
        model = choices[0]
    m = SPLIT_RE.match(model.name)
    if not m:
        return [model]
    count = int(m["count"])
    return [model.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]


def check_shards(model: Path) -> list[Path]:
    """Refuse a split GGUF with a missing or short shard *before* launching anything."""
    shards = model_shards(model)
    missing = [p for p in shards if not p.is_file()]
    if missing and len(shards) == 1:
        raise K3Error(f"The GGUF model {shards[0]} does not exist.",
                      "point the config at the .gguf file "
                      "(`k3tui config set model.dir FILE.gguf`), or run `k3tui download`")
    if missing:
        names = ", ".join(p.name for p in missing[:5]) + (" …" if len(missing) > 5 else "")
        raise K3Error(f"{len(missing)} of {len(shards)} GGUF shards are missing in "
                      f"{shards[0].parent}: {names}.",
                      "run `k3tui download` to fetch (or resume) them, then start again")
    problems: list[str] = []
    for p in shards:
        try:
            head = read_gguf_header(p)
        except (OSError, ValueError, EOFError, KeyError, UnicodeError) as exc:
            why = str(exc) or "the file ends inside it"  # a bare EOFError has no words
            problems.append(f"{p.name} has an unreadable header ({why})")
            continue
        size = p.stat().st_size
        if head.expected_size is not None and size < head.expected_size:
            problems.append(f"{p.name} is {size:,} bytes but its tensors need "
                            f"{head.expected_size:,}")
        if len(shards) > 1 and head.split_count not in (None, len(shards)):
            problems.append(f"{p.name} says it is one of {head.split_count} shards, "
                            f"not {len(shards)}")
    if problems:
        raise K3Error("The GGUF model is incomplete: " + "; ".join(problems[:3]) + ".",
                      "run `k3tui download` to resume the download, then start again")
    return shards


