"""The resident source: every tensor's bytes as the file holds them, read past the page
cache (a second copy of a whole checkpoint in the cache is what made loading slow)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from engine.checkpoint.safetensors import SafetensorsIndex
from engine.checkpoint.synth import synthesize
from engine.errors import CheckpointError
from engine.weights.resident import ResidentSource


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def _cached_bytes(path: Path) -> int:
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip() or 0)


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("ck") / "small", "small", seed=3)


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return 8 + n, json.loads(raw[8:8 + n])


def test_resident_tensors_are_the_files_bytes(ck):
    src = ResidentSource(ck)
    checked = 0
    for shard in sorted(ck.glob("*.safetensors")):
        base, header = _header(shard)
        raw = shard.read_bytes()
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            lo, hi = meta["data_offsets"]
            assert src._arrays[name].tobytes() == raw[base + lo:base + hi], name
            checked += 1
    assert checked == len(src._arrays)


def test_resident_load_leaves_the_page_cache_empty(ck):
    shards = sorted(ck.glob("*.safetensors"))
    for s in shards:
        _evict(s)
    index = SafetensorsIndex.open(ck)  # headers are read buffered (and read ahead)
    headers = sum(_cached_bytes(s) for s in shards)
    total = sum(s.stat().st_size for s in shards)
    assert headers < total / 2, "the page cache could not be emptied before the load"
    ResidentSource(ck, index=index)
    assert sum(_cached_bytes(s) for s in shards) == headers  # the tensors left no copy


def test_resident_truncated_shard_is_one_sentence(tmp_path, ck):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ck.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    last = max(bad.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = last.read_bytes()
    last.write_bytes(data[: len(data) - 5000])
    with pytest.raises(CheckpointError) as exc:
        ResidentSource(bad)
    assert "\n" not in str(exc.value) and str(last.name) in str(exc.value)
