"""Config refusals, safetensors checks, MXFP4 round trips, fused kernels == reference."""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint.safetensors import SafetensorsIndex
from engine.checkpoint.schema import TensorNames
from engine.checkpoint.synth import flat_config, nested_config, synthesize, to_bf16
from engine.errors import CheckpointError, ConfigError
from engine.kernels import mxfp4, reference
from engine.core.config import ModelConfig
from engine.model.transformer import load_model
from engine.weights.resident import ResidentSource


# ---- config --------------------------------------------------------------------------------
@pytest.fixture
def nested() -> dict:
    return nested_config(flat_config("tiny"))


def test_nested_and_flat_forms_agree(nested):
    flat = flat_config("tiny")
    a, b = ModelConfig.from_dict(nested), ModelConfig.from_dict(flat)
    assert a == b
    assert a.mla_layers == (3, 6)  # one-based [4, 7] in the file
    assert a.kda_layers == (0, 1, 2, 4, 5)


def test_tiny_a_config_layer_map(tiny_a):
    cfg = ModelConfig.from_dir(tiny_a)
    assert cfg.mla_layers == (3, 7, 11, 12)
    assert cfg.kda_num_heads == 4 and cfg.kda_head_dim == 16
    assert cfg.situ_beta == 4.0 and cfg.situ_linear_beta == 25.0


@pytest.mark.parametrize("path", [
    ("text_config", "linear_attn_config", "full_attn_layers"),
    ("text_config", "linear_attn_config", "num_heads"),
    ("text_config", "kv_lora_rank"),
    ("text_config", "activation_situ_beta"),
    ("text_config", "attn_res_block_size"),
])
def test_missing_field_is_refused_by_name(nested, path):
    d = copy.deepcopy(nested)
    node = d
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_dict(d)
    assert ".".join(path) in str(exc.value)


def test_missing_linear_attn_config_is_refused(nested):
    del nested["text_config"]["linear_attn_config"]
    with pytest.raises(ConfigError, match="text_config.linear_attn_config.full_attn_layers"):
        ModelConfig.from_dict(nested)


@pytest.mark.parametrize("change,needle", [
    (lambda t: t["linear_attn_config"].update(kda_layers=[1, 2, 3, 4, 5]), "contradict"),
    (lambda t: t["linear_attn_config"].update(full_attn_layers=[0, 7]), "full_attn_layers"),
    (lambda t: t["linear_attn_config"].update(full_attn_layers=[4, 8]), "full_attn_layers"),
    (lambda t: t.update(num_expert_group=2), "num_expert_group"),
    (lambda t: t.update(mla_use_nope=False), "mla_use_nope"),
    (lambda t: t.update(num_key_value_heads=1), "num_key_value_heads"),
    (lambda t: t.update(num_experts_per_token=99), "num_experts_per_token"),
    (lambda t: t.update(hidden_size="64"), "hidden_size"),
    (lambda t: t["linear_attn_config"].update(use_full_rank_gate=False), "use_full_rank_gate"),
])
def test_contradictory_or_unsupported_fields_are_refused(nested, change, needle):
    change(nested["text_config"])
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(nested)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)


# ---- safetensors ----------------------------------------------------------------------------
def write_st(path: Path, tensors: dict[str, tuple[str, list[int], list[int]]], data: bytes) -> None:
    header = {name: {"dtype": dt, "shape": shape, "data_offsets": offs}
              for name, (dt, shape, offs) in tensors.items()}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_reads_all_dtypes(tmp_path):
    f32 = np.arange(6, dtype=np.float32)
    f16 = np.arange(4, dtype=np.float16)
    bf = to_bf16(np.array([1.5, -2.0], np.float32))
    u8 = np.array([1, 2, 255], np.uint8)
    blobs = [f32.tobytes(), f16.tobytes(), bf.tobytes(), u8.tobytes()]
    offs, pos = [], 0
    for b in blobs:
        offs.append([pos, pos + len(b)])
        pos += len(b)
    write_st(tmp_path / "one.safetensors", {
        "a": ("F32", [2, 3], offs[0]), "b": ("F16", [4], offs[1]),
        "c": ("BF16", [2], offs[2]), "d": ("U8", [3], offs[3])}, b"".join(blobs))
    idx = SafetensorsIndex.open(tmp_path / "one.safetensors")
    assert np.array_equal(idx.read("a"), f32.reshape(2, 3))
    assert np.array_equal(idx.read("b"), f16)
    assert np.array_equal(reference.widen_bf16(idx.read("c")), [1.5, -2.0])
    assert idx.read("d").tolist() == [1, 2, 255]
    assert idx.tensors["c"].dtype == "BF16" and idx.tensors["a"].shape == (2, 3)
    assert SafetensorsIndex.open(tmp_path).tensors.keys() == idx.tensors.keys()  # dir of shards


def test_header_pointing_outside_the_file(tmp_path):
    write_st(tmp_path / "x.safetensors", {"w": ("F32", [4], [0, 16])}, b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"x\.safetensors.*tensor w.*ends at byte"):
        SafetensorsIndex.open(tmp_path / "x.safetensors")


def test_header_length_beyond_the_file(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(CheckpointError, match=r"x\.safetensors.*header claims"):
        SafetensorsIndex.open(tmp_path / "x.safetensors")


def test_overlapping_tensors(tmp_path):
    write_st(tmp_path / "x.safetensors",
             {"a": ("F32", [4], [0, 16]), "b": ("F32", [4], [8, 24])}, b"\0" * 24)
    with pytest.raises(CheckpointError, match=r"x\.safetensors: tensors a and b overlap"):
        SafetensorsIndex.open(tmp_path / "x.safetensors")


def test_wrong_byte_count_for_shape(tmp_path):
    write_st(tmp_path / "x.safetensors", {"a": ("F32", [5], [0, 16])}, b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"tensor a .*needs 20 bytes"):
        SafetensorsIndex.open(tmp_path / "x.safetensors")


def test_truncated_shard_in_a_checkpoint(tmp_path):
    ckpt = synthesize(tmp_path / "m", "tiny")
    shard = ckpt / "model-00002-of-000008.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError) as exc:
        load_model(ckpt)
    msg = str(exc.value)
    assert "model-00002-of-000008.safetensors" in msg
    assert "layers.1.block_sparse_moe.experts.7" in msg


def test_missing_tensor_names_file_and_tensor(tmp_path):
    ckpt = synthesize(tmp_path / "m", "tiny")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    name = "language_model.model.layers.2.self_attn.q_proj.weight"
    # the index still maps it, but the shard's header lost it
    shard = ckpt / index["weight_map"][name]
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    del header[name]
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    shard.write_bytes(raw[:8] + new + raw[8 + n :])
    with pytest.raises(CheckpointError) as exc:
        SafetensorsIndex.open(ckpt)
    assert name in str(exc.value) and shard.name in str(exc.value)
    # absent from the index too: refused at load, naming the tensor
    del index["weight_map"][name]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_model(ckpt)


def test_index_naming_a_missing_file(tmp_path):
    ckpt = synthesize(tmp_path / "m", "tiny")
    (ckpt / "model-00003-of-000008.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"model-00003-of-000008\.safetensors.*does not exist"
    ):
        SafetensorsIndex.open(ckpt)


def test_shape_disagreeing_with_config(tmp_path):
    ckpt = synthesize(tmp_path / "m", "tiny")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["moe_intermediate_size"] = 64
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json implies"):
        load_model(ckpt)


def test_resident_source_layout_matches_the_release(tmp_path):
    ckpt = synthesize(tmp_path / "m", "tiny")
    idx = SafetensorsIndex.open(ckpt)
    names = TensorNames.detect(idx)
    # one shard per layer + a final one; a layer's trunk precedes its experts, each
    # expert's six tensors are one contiguous run in w1, w2, w3 order
    layer1 = [t for t in idx.tensors.values() if ".layers.1." in t.name]
    assert len({t.file for t in layer1}) == 1
    run = [idx.tensors[n] for n in names.expert(1, 3)]
    assert all(a.end == b.offset for a, b in zip(run, run[1:]))
    trunk_end = max(t.end for t in layer1 if ".experts." not in t.name)
    assert trunk_end <= min(t.offset for t in layer1 if ".experts." in t.name)
    src = ResidentSource(ckpt)
    with src.experts(1, [3]) as ex:
        assert np.array_equal(ex[3].w2_scale, idx.read(names.expert(1, 3)[3]))


# ---- MXFP4 ----------------------------------------------------------------------------------
def test_mxfp4_decode_positions_and_scales():
    packed = np.array([[0x21, 0xF8] + [0] * 14], np.uint8)  # codes 1,2 | 8(−0),15
    scale = np.array([[128]], np.uint8)
    row = mxfp4.mxfp4_decode(packed, scale)[0]
    assert row[:4].tolist() == [1.0, 2.0, 0.0, -12.0]  # low nibble = even element, ×2
    assert mxfp4.mxfp4_decode(packed, np.array([[255]], np.uint8)).max() == 0  # NaN scale → 0


def test_mxfp4_round_trip():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 128)).astype(np.float32) * np.float32(0.3)
    packed, scale = mxfp4.mxfp4_encode(w)
    decoded = mxfp4.mxfp4_decode(packed, scale)
    p2, s2 = mxfp4.mxfp4_encode(decoded)
    assert np.array_equal(p2, packed) and np.array_equal(s2, scale)
    assert np.array_equal(mxfp4.mxfp4_decode(p2, s2), decoded)
    # nearest-value quantisation within half a step of the largest magnitude's grid
    assert np.abs(decoded - w).max() <= np.abs(w).max() / 2


# ---- fused kernels == reference --------------------------------------------------------------
from engine.kernels import fused  # noqa: E402


@pytest.mark.parametrize("rows,cols,tokens", [(7, 64, 1), (300, 96, 3), (1100, 1024, 2)])
def test_fused_bf16_and_f32_equal_reference(rows, cols, tokens):
    rng = np.random.default_rng(rows)
    w32 = rng.standard_normal((rows, cols)).astype(np.float32)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    bf = to_bf16(w32)
    for w in (bf, w32):
        got = fused.linear(x, w)
        want = reference.linear_ref(x, w)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        # a row computed alone gives the same bits as inside a batch
        assert np.array_equal(fused.linear(x[-1:], w)[0], got[-1])


@pytest.mark.parametrize("rows,cols,tokens", [(48, 64, 1), (1030, 1024, 4)])
def test_fused_mxfp4_equals_reference(rows, cols, tokens):
    rng = np.random.default_rng(cols)
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scale = rng.integers(115, 135, (rows, cols // 32), dtype=np.uint8)
    scale[0, 0] = 255
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    got = fused.mxfp4_linear(x, packed, scale)
    want = reference.mxfp4_linear_ref(x, packed, scale)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.array_equal(fused.mxfp4_linear(x[:1], packed, scale)[0], got[0])


def test_fused_results_do_not_depend_on_threads():
    import numba

    rng = np.random.default_rng(5)
    w = to_bf16(rng.standard_normal((2048, 1024)).astype(np.float32))
    x = rng.standard_normal((2, 1024)).astype(np.float32)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = fused.linear(x, w)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = fused.linear(x, w)
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(one, many)
