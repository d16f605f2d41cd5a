"""Broken and hostile checkpoints, trunks and JSON files (issue 13): each is refused with
one line naming the file and field and saying what to do, before anything sized by it is
allocated, and never with a traceback. The files are the synthesiser's own, then corrupted."""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from engine.checkpoint.safetensors import SafetensorsIndex, read_header
from engine.checkpoint.schema import TensorNames
from engine.checkpoint.synth import synthesize
from engine.checkpoint.trunk import pack, trunk_specs
from engine.errors import CheckpointError, ConfigError
from engine.core.config import ModelConfig
from engine.text.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[3]
DEEP = "[" * 100_000  # far past the JSON parser's recursion limit
CAP = 2 << 30  # address space for a refused run; the tiny model runs in 1.5 GB


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("hostile") / "ck", "tiny", seed=5)


@pytest.fixture(scope="module")
def trunk(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "trunk"
    pack(tiny, out)
    return out


@pytest.fixture
def ck(tiny, tmp_path) -> Path:
    """A private copy of the tiny checkpoint to corrupt."""
    return Path(shutil.copytree(tiny, tmp_path / "ck"))


def edit_config(ck: Path, **text: object) -> None:
    cfg = json.loads((ck / "config.json").read_text())
    cfg["text_config"].update(text)
    (ck / "config.json").write_text(json.dumps(cfg))


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))


def run_engine(*args: object) -> subprocess.CompletedProcess:
    """`python -m engine run …` under a 2 GB address-space cap, with a generous hang guard."""
    return subprocess.run([sys.executable, "-m", "engine", "run", *map(str, args)],
                          check=False, capture_output=True, text=True, cwd=REPO, timeout=120,
                          preexec_fn=_cap_memory,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def refused(out: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, one `error:` line holding every needle, no traceback."""
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    if not any("sampling" in n for n in needles):
        assert "sampling flags" not in lines[0], lines[0]
    return lines[0]


# ---- config.json ------------------------------------------------------------------------


def test_absurd_num_experts_is_refused_at_once_in_little_memory(ck):
    edit_config(ck, num_experts=10**15)  # on main: 12 GB in a minute, then MemoryError
    refused(run_engine(ck, "--ids", "1,2", "--gen", "1"),
            "config.json", "text_config.num_experts", "1000000000000000", "1..4096")


@pytest.mark.parametrize("field, value, needle", [  # ("8", 8.0, true: refused before)
    ("num_hidden_layers", 5000, "text_config.num_hidden_layers is 5000"),
    ("vocab_size", 1 << 22, "text_config.vocab_size"),
    ("rms_norm_eps", float("nan"), "text_config.rms_norm_eps is nan, expected a finite number"),
    ("eos_token_id", -3, "eos_token_id is -3"),
])
def test_config_values_out_of_range_or_of_the_wrong_type(ck, field, value, needle):
    edit_config(ck, **{field: value})
    refused(run_engine(ck, "--ids", "1,2", "--gen", "1"), needle, "fix config.json")


def test_absurd_config_values_are_bounded(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    for path, value in (("linear_attn_config.head_dim", 1 << 20),
                        ("num_attention_heads", 1 << 20), ("kv_lora_rank", 1 << 30),
                        ("intermediate_size", 1 << 40), ("num_shared_experts", 10**6)):
        bad = json.loads(json.dumps(cfg))
        *outer, key = path.split(".")
        node = bad["text_config"]
        for k in outer:
            node = node[k]
        node[key] = value
        with pytest.raises(ConfigError, match=f"text_config.{path} is {value}, expected an int"):
            ModelConfig.from_dict(bad)


def test_config_quantization_groups_of_the_wrong_type(ck):
    cfg = json.loads((ck / "config.json").read_text())
    cfg["text_config"]["quantization_config"]["config_groups"] = ["group_0"]
    (ck / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_dir(ck).num_experts == 8  # a list of groups names no bits


def test_deeply_nested_config_is_one_line(ck):
    (ck / "config.json").write_text('{"text_config": ' + DEEP)
    refused(run_engine(ck, "--ids", "1,2", "--gen", "1"),
            "config.json nests deeper than 64 levels", "re-download config.json")


# ---- safetensors headers and the index ----------------------------------------------------


def first_shard(ck: Path) -> Path:
    return min(ck.glob("*.safetensors"))


def rewrite_header(shard: Path, edit) -> None:
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()  # offsets count from the header's end: still true
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def a_tensor(header: dict) -> dict:
    return next(v for k, v in header.items() if k != "__metadata__" and "norm" in k)


def test_header_length_over_the_format_limit_is_refused_unread(tmp_path):
    shard = tmp_path / "model.safetensors"
    with open(shard, "wb") as f:  # 200 MB header inside a 300 MB (sparse) file
        f.write(struct.pack("<Q", 200_000_000))
        f.truncate(300_000_000)
    with pytest.raises(CheckpointError, match="over the format's limit of 100 MB"):
        read_header(shard)


def test_header_dtype_that_is_not_a_name(ck):
    rewrite_header(first_shard(ck), lambda h: a_tensor(h).update(dtype=["F32"]))
    refused(run_engine(ck, "--ids", "1,2", "--gen", "1"),
            first_shard(ck).name, "has dtype ['F32'], not one of F64", "re-download the file")


def test_header_negative_shape(ck):
    def negate(h):  # two negative dims multiply to the right byte count
        t = a_tensor(h)
        t["shape"] = [-1, -t["shape"][0]]
    rewrite_header(first_shard(ck), negate)
    refused(run_engine(ck, "--ids", "1,2", "--gen", "1"),
            "shape is [-1, -", "not a list of non-negative integers")


def test_header_string_offsets(ck):
    def stringify(h):
        t = a_tensor(h)
        t["data_offsets"] = [str(x) for x in t["data_offsets"]][:2]
    rewrite_header(first_shard(ck), stringify)
    with pytest.raises(CheckpointError, match=r"data_offsets is \['"):
        SafetensorsIndex.open(ck)


def test_header_overlap_hidden_behind_an_empty_tensor(tmp_path):
    shard = tmp_path / "model.safetensors"
    header = {"a": {"dtype": "U8", "shape": [100], "data_offsets": [0, 100]},
              "b": {"dtype": "U8", "shape": [0], "data_offsets": [10, 10]},
              "c": {"dtype": "U8", "shape": [10], "data_offsets": [50, 60]}}
    text = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + bytes(100))
    with pytest.raises(CheckpointError, match="tensors a and c overlap"):
        read_header(shard)


def test_deeply_nested_header_and_index(ck, tmp_path):
    shard = tmp_path / "deep.safetensors"
    shard.write_bytes(struct.pack("<Q", len(DEEP)) + DEEP.encode())
    with pytest.raises(CheckpointError, match="deep.safetensors's header nests deeper than 64"):
        read_header(shard)
    (ck / "model.safetensors.index.json").write_text('{"weight_map": ' + DEEP)
    refused(run_engine(ck, "--ids", "1,2", "--gen", "1"),
            "model.safetensors.index.json nests deeper than 64 levels")


def test_index_naming_a_file_outside_the_checkpoint(ck):
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../" + index["weight_map"][name]
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a file name in the checkpoint folder"):
        SafetensorsIndex.open(ck)


# ---- trunk.json ---------------------------------------------------------------------------


@pytest.fixture
def bad_trunk(trunk, tmp_path) -> Path:
    return Path(shutil.copytree(trunk, tmp_path / "trunk"))


def edit_trunk(trunk: Path, edit) -> None:
    meta = json.loads((trunk / "trunk.json").read_text())
    edit(meta)
    (trunk / "trunk.json").write_text(json.dumps(meta))


def specs(tiny: Path, trunk: Path):
    index = SafetensorsIndex.open(tiny)
    return trunk_specs(trunk, index, TensorNames.detect(index), 7, tiny)


def test_trunk_tensor_pointing_into_another_layer(tiny, bad_trunk):
    def aim(meta):  # layer 1's first tensor moved onto layer 2's bytes
        layer = meta["layers"][1]
        first = next(iter(layer["tensors"].values()))
        first["off"] = layer["nbytes"] + 64
    edit_trunk(bad_trunk, aim)  # on main: exit 0 on layer 2's weights
    refused(run_engine(tiny, "--trunk", bad_trunk, "--ids", "1,2", "--gen", "1"),
            "trunk.json", "points outside its own layer", "re-pack it", "engine pack")


def test_trunk_tensor_past_the_end_of_trunk_bin(tiny, bad_trunk):
    edit_trunk(bad_trunk, lambda m: next(iter(m["layers"][6]["tensors"].values())).update(
        off=1 << 40))
    with pytest.raises(CheckpointError, match="spans bytes .* of layer 6, which holds only"):
        specs(tiny, bad_trunk)


def test_trunk_layers_overlapping(tiny, bad_trunk):
    edit_trunk(bad_trunk, lambda m: m["layers"][3].update(file_off=m["layers"][2]["file_off"]))
    with pytest.raises(CheckpointError, match="layers 2 and 3 overlap in trunk.bin; re-pack"):
        specs(tiny, bad_trunk)


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m["layers"][2].pop("nbytes"), r"layers\[2\].nbytes is missing"),
    (lambda m: m.pop("layers"), "layers is missing, expected a JSON list"),
    (lambda m: m["layers"][0].update(file_off="0"), r"layers\[0\].file_off is '0', expected a"),
    (lambda m: m["layers"][4].update(layer=True), r"layers\[4\].layer is True"),
    (lambda m: next(iter(m["layers"][1]["tensors"].values())).update(off="4"),
     r"tensors\['.*'\].off is '4', expected a non-negative integer"),
    (lambda m: m["layers"].__setitem__(5, "layer 5"), r"layers\[5\].layer is missing"),
    (lambda m: m["layers"][2].update(sha256="0" * 63),
     r"layers\[2\].sha256 or source_sha256 is not a sha256 in hex"),
    (lambda m: m["layers"][3].update(source_sha256=5), r"layers\[3\].source_sha256 is 5"),
    (lambda m: m.update(sources=[]), r"sources is \[\], expected a JSON object"),
])
def test_trunk_json_schema(tiny, bad_trunk, edit, needle):
    edit_trunk(bad_trunk, edit)
    with pytest.raises(CheckpointError, match=needle + ".*re-pack it with `python -m engine pack"):
        specs(tiny, bad_trunk)


def test_trunk_layer_with_a_gap_its_digest_does_not_cover(tiny, bad_trunk):
    """The digest covers a layer's bytes from file_off to its last tensor's end: a tensor
    moved into the padding would leave bytes the model reads that no digest checked."""
    def gap(meta):
        layer = next(e for e in meta["layers"]
                     if e["nbytes"] - max(t["off"] + t["nbytes"] for t in e["tensors"].values())
                     >= 64)
        last = max(layer["tensors"].values(), key=lambda t: t["off"])
        last["off"] += 64
    edit_trunk(bad_trunk, gap)
    with pytest.raises(CheckpointError, match="tensors leave a gap before .* which its digest "
                       "does not cover"):
        specs(tiny, bad_trunk)


def test_deeply_nested_trunk_json(tiny, bad_trunk):
    (bad_trunk / "trunk.json").write_text('{"layers": ' + DEEP)
    refused(run_engine(tiny, "--trunk", bad_trunk, "--ids", "1,2", "--gen", "1"),
            "trunk.json nests deeper than 64 levels", "re-pack")


# ---- tokenizer_config.json ----------------------------------------------------------------


def test_deeply_nested_tokenizer_config(ck):
    (ck / "tokenizer_config.json").write_text('{"added_tokens_decoder": ' + DEEP)
    refused(run_engine(ck, "--ids", "1,2", "--gen", "1"),
            "tokenizer_config.json nests deeper than 64 levels", "--stop")


def test_tokenizer_added_id_too_large(tmp_path):
    small = synthesize(tmp_path / "small", "small", seed=1)
    conf = json.loads((small / "tokenizer_config.json").read_text())
    conf["added_tokens_decoder"][str(10**15)] = {"content": "[X]"}  # a 10**15-entry table
    (small / "tokenizer_config.json").write_text(json.dumps(conf))
    with pytest.raises(CheckpointError, match=f"added token {10**15} is not a string with an id"):
        Tokenizer.from_dir(small)


# ---- labels -------------------------------------------------------------------------------


def test_sampling_flags_are_checked_before_the_checkpoint(ck):
    (ck / "config.json").write_text("{}")
    refused(run_engine(ck, "--ids", "1,2", "--top-p", "0"),
            "top_p must be in (0, 1]; check the sampling flags")


def test_serve_names_the_config_field_too(tmp_path):
    ck = synthesize(tmp_path / "small", "small", seed=1)  # small: it ships a tokenizer
    edit_config(ck, num_experts=10**15)
    out = subprocess.run([sys.executable, "-m", "engine", "serve", str(ck), "--port", "0"],
                         check=False, capture_output=True, text=True, cwd=REPO, timeout=120,
                         preexec_fn=_cap_memory, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    last = out.stderr.splitlines()[-1]
    assert "the model failed to load" in last and "text_config.num_experts" in last, last
