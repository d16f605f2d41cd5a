"""Trunk packing on real-format checkpoints: schema, bytes, resume, fingerprint, refusals."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint.safetensors import SafetensorsIndex
from engine.checkpoint.schema import TensorNames
from engine.checkpoint.trunk import check, pack, trunk_specs
from engine.errors import CheckpointError, EngineError
from engine.core.directio import ALIGN

REPO = str(Path(__file__).resolve().parents[3])


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


def test_stream_pack_schema_and_bytes(tiny_a, tmp_path):
    seen = []
    summary = pack(tiny_a, tmp_path / "t", progress=lambda d, t, L: seen.append((d, t, L)))
    meta = json.loads((tmp_path / "t" / "trunk.json").read_text())
    assert meta["n_layers"] == 13 and meta["align"] == 4096
    assert meta["fingerprint"].startswith("sha256:")
    index = SafetensorsIndex.open(tiny_a)
    blob = (tmp_path / "t" / "trunk.bin").read_bytes()
    prev_end = 0
    for i, layer in enumerate(meta["layers"]):
        assert set(layer) >= {"layer", "shard", "run_start", "nbytes", "file_off", "tensors"}
        assert layer["layer"] == i and layer["shard"] == f"model-{i + 1:05d}-of-000014.safetensors"
        assert layer["file_off"] % ALIGN == 0 and layer["nbytes"] % ALIGN == 0
        assert layer["file_off"] == prev_end
        prev_end = layer["file_off"] + layer["nbytes"]
        for name, t in layer["tensors"].items():
            assert ".experts." not in name
            ref = index.tensors[name]
            assert t["nbytes"] == ref.nbytes and t["dtype"] == ref.dtype
            assert tuple(t["shape"]) == ref.shape
            assert ref.offset - layer["run_start"] == t["off"]
            start = layer["file_off"] + t["off"]
            assert blob[start:start + t["nbytes"]] == index.read(name).tobytes()
    assert len(blob) == prev_end == summary["total_bytes"]
    assert seen[-1][0] == seen[-1][1] == summary["total_bytes"]
    assert all(b[0] <= b[1] for b in seen) and [s[0] for s in seen] == sorted(s[0] for s in seen)
    # A second run finds it done.
    assert pack(tiny_a, tmp_path / "t")["already_packed"]


def test_stream_pack_resumes_after_interruption(tiny_a, tmp_path):
    class Stop(Exception):
        pass

    def stop_at_layer_5(done, total, layer):
        if layer == 5:
            raise Stop

    with pytest.raises(Stop):
        pack(tiny_a, tmp_path / "t", progress=stop_at_layer_5)
    assert not (tmp_path / "t" / "trunk.json").exists()
    index = SafetensorsIndex.open(tiny_a)
    with pytest.raises(CheckpointError, match="not finished; rerun .* to resume"):
        trunk_specs(tmp_path / "t", index, TensorNames.detect(index), 13, tiny_a)
    state = json.loads((tmp_path / "t" / "trunk.progress.json").read_text())
    assert [e["layer"] for e in state["layers"]] == [0, 1, 2, 3, 4]
    layers = []
    summary = pack(tiny_a, tmp_path / "t", progress=lambda d, t, L: layers.append(L))
    assert summary["layers_copied"] == 8 and summary["layers_verified"] == 5
    assert sorted(set(layers)) == list(range(13))  # 0-4 checked, then 5-12 copied
    assert not (tmp_path / "t" / "trunk.progress.json").exists()
    pack(tiny_a, tmp_path / "whole")
    assert (tmp_path / "t" / "trunk.bin").read_bytes() == \
        (tmp_path / "whole" / "trunk.bin").read_bytes()


def test_stream_trunk_of_a_copy_with_other_bytes_is_refused_then_repacked(
        tiny_a, tmp_path, copy_checkpoint):
    """A copy of the checkpoint whose layer 3 differs at the start of its run: the trunk is
    refused for it (its shards are other files), and pack re-packs layer 3 alone."""
    pack(tiny_a, tmp_path / "t")
    other = copy_checkpoint(tiny_a, tmp_path / "other")
    index = SafetensorsIndex.open(other)
    meta = json.loads((tmp_path / "t" / "trunk.json").read_text())
    entry = meta["layers"][3]
    with open(other / entry["shard"], "r+b") as f:
        f.seek(entry["run_start"])
        f.write(b"\x55" * 8)
    names = TensorNames.detect(index)
    with pytest.raises(CheckpointError, match="is not the file layer 0 of the trunk .* was "
                       "packed from .* `k3tui pack`"):
        trunk_specs(tmp_path / "t", index, names, 13, other)
    summary = pack(other, tmp_path / "t")
    assert summary["layers_copied"] == 1 and summary["layers_verified"] == 12
    pack(other, tmp_path / "fresh")
    assert (tmp_path / "t" / "trunk.bin").read_bytes() == \
        (tmp_path / "fresh" / "trunk.bin").read_bytes()
    assert len(trunk_specs(tmp_path / "t", index, names, 13, other).layers) == 13
    # Now the original's shards are not the files it was packed from.
    with pytest.raises(CheckpointError, match="is not the file layer 0"):
        trunk_specs(tmp_path / "t", SafetensorsIndex.open(tiny_a), names, 13, tiny_a)


def test_stream_pack_refuses_a_folder_holding_another_checkpoints_trunk(tmp_path):
    from engine.checkpoint.synth import synthesize

    a = synthesize(tmp_path / "a", "tiny", seed=1)
    b = synthesize(tmp_path / "b", "small", seed=1)
    pack(a, tmp_path / "t")
    with pytest.raises(EngineError, match="already holds another trunk .* different checkpoint"):
        pack(b, tmp_path / "t")
    with pytest.raises(CheckpointError, match="packed from a different checkpoint"):
        check(b, tmp_path / "t")


def test_stream_pack_refuses_a_layer_with_a_gap(tiny_a, tmp_path, copy_checkpoint):
    ck = copy_checkpoint(tiny_a, tmp_path / "gap")
    index = SafetensorsIndex.open(ck)
    shard = ck / "model-00003-of-000014.safetensors"
    infos = sorted((t for t in index.tensors.values() if t.file.name == shard.name),
                   key=lambda t: t.offset)
    tensors = [(t.name, index.read(t.name)) for t in infos]
    write_safetensors(shard, tensors, gaps={infos[3].name: 64})
    with pytest.raises(CheckpointError, match="layer 2's trunk tensors .* not one contiguous run"):
        pack(ck, tmp_path / "t")


def test_stream_pack_cli(tiny_a, tmp_path):
    out = subprocess.run([sys.executable, "-m", "engine", "pack", str(tiny_a),
                          str(tmp_path / "t")], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "packed" in out.stdout and "MB/s" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "engine", "pack", str(tmp_path / "missing"),
                          str(tmp_path / "t2")], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 1
    assert "Traceback" not in bad.stderr and "error:" in bad.stderr
