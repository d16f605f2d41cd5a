"""The compact (c12) trunk: lossless on hard weights, the fused kernel bit-identical to
the BF16 one, a compact pack that streams fewer bytes and gives the same ids and logits
as the BF16 trunk at every budget and thread count, and hostile trunk.json / bytes
refused with one sentence."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from engine import kernels
from engine.checkpoint.compact import c12_nbytes, encode, from_bytes, measure, to_bytes
from engine.checkpoint.synth import synthesize
from engine.checkpoint.trunk import pack
from engine.errors import CheckpointError
from engine.kernels.compact import CompactMatrix
from engine.model.transformer import load_model
from engine.weights.planner import make_plan
from k3vocab import GB
from engine.weights.streaming import CheckpointMap, StreamingSource

PROMPT = [3, 7, 11, 5, 9, 200, 17]


def bf16(f: np.ndarray) -> np.ndarray:
    return (np.asarray(f, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def hard_weights(rng, rows=96, cols=200) -> dict[str, np.ndarray]:
    """Weights harder than Gaussian: heavy tails, outlier rows, a few huge values per row,
    tiny/denormal/zero/inf/nan bit patterns."""
    t = rng.standard_t(2, (rows, cols)) * 0.02
    rows_out = rng.standard_normal((rows, cols)) * 0.02
    rows_out[::7] *= 1e4
    spikes = rng.standard_normal((rows, cols)) * 0.02
    spikes[np.arange(rows), rng.integers(0, cols, rows)] = 3e5
    odd = rng.integers(0, 1 << 16, (rows, cols)).astype(np.uint16)  # every exponent
    return {"student_t": bf16(t), "outlier_rows": bf16(rows_out), "spikes": bf16(spikes),
            "random_bits": odd}


def test_compact_codec_is_lossless_on_hard_weights():
    rng = np.random.default_rng(1)
    for name, bits in hard_weights(rng).items():
        m = encode(bits)
        raw = np.frombuffer(to_bytes(m), np.uint8)
        assert raw.size == c12_nbytes(bits.shape, m.exc_col.size)
        back = from_bytes(raw, bits.shape, m.exc_col.size, name)
        assert np.array_equal(back.bf16(), bits), name
        assert np.array_equal(back.bf16(slice(5, 9)), bits[5:9]), name
    gauss = measure(bf16(rng.standard_normal((256, 512)) * 0.02))
    assert gauss.exception_rate < 1e-3 and gauss.bits_per_weight < 12.2


@pytest.mark.parametrize("threads", [1, 2])
def test_compact_kernel_bits_equal_the_bf16_kernel(threads):
    rng = np.random.default_rng(2)
    kernels_fused = pytest.importorskip("engine.kernels.fused")
    kernels_fused.set_threads(threads)
    try:
        for bits in [*hard_weights(rng).values(), bf16(rng.standard_normal((1100, 1000)))]:
            m = encode(bits)
            for T in (1, 3, 5):
                x = rng.standard_normal((T, bits.shape[1])).astype(np.float32)
                want = kernels.linear(x, bits)
                got = kernels.linear(x, m)
                assert isinstance(m, CompactMatrix)
                np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    finally:
        kernels_fused.set_threads(2)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("compact")
    ck = synthesize(root / "ck", "small", seed=5)
    pack(ck, root / "bf16")
    summary = pack(ck, root / "c12", compact=True)
    return ck, root / "bf16", root / "c12", summary


def run(ck, trunk, budget_gb, n=6):
    cmap = CheckpointMap(ck, trunk)
    plan = make_plan(cmap.geometry(), budget_gb=budget_gb, threads=2)
    with StreamingSource(cmap, plan) as src:
        model = load_model(ck, src)
        state = model.new_state()
        logits = [model.prefill(PROMPT, state)]
        ids = []
        for _ in range(n):
            ids.append(int(logits[-1].argmax()))
            logits.append(model.step(ids[-1], state))
        return ids, np.stack(logits), src.stats(), plan


def test_compact_trunk_same_ids_and_logits_at_every_budget(packed):
    ck, bf, c12, summary = packed
    assert 0.7 < summary["ratio"] < 0.85 and summary["format"] == "k3-c12"
    meta = json.loads((c12 / "trunk.json").read_text())
    assert meta["format"] == "k3-c12" and meta["packer"].startswith("k3tui")
    assert pack(ck, c12, compact=True)["already_packed"]
    g_bf, g_c = CheckpointMap(ck, bf).geometry(), CheckpointMap(ck, c12).geometry()
    assert g_c.trunk_bytes < 0.85 * g_bf.trunk_bytes  # the planner sees compact sizes
    assert all(len(lay.runs) == 1 for lay in CheckpointMap(ck, c12).layers)  # one read each
    slots = g_bf.min_expert_slots * g_bf.expert_slot_bytes
    for budget in ((max(g_bf.layer_bytes) * 2 + slots) / GB,  # trunk streams
                   (g_bf.trunk_bytes // 2 + slots) / GB,  # about half pinned
                   (g_bf.trunk_bytes + slots + g_bf.all_experts_bytes) / GB):  # all resident
        ids_b, log_b, st_b, plan_b = run(ck, bf, budget)
        ids_c, log_c, st_c, plan_c = run(ck, c12, budget)
        assert ids_b == ids_c
        np.testing.assert_array_equal(log_b.view(np.uint32), log_c.view(np.uint32))
        assert len(plan_c.pinned) >= len(plan_b.pinned)
        if plan_b.streamed_trunk_bytes:
            assert st_c["gb_read_trunk"] <= 0.85 * st_b["gb_read_trunk"]


def test_compact_pack_cli_and_forecast_say_which_trunk(packed, tmp_path):
    ck, _, _, _ = packed
    out = subprocess.run([sys.executable, "-m", "engine", "pack", str(ck), str(tmp_path / "t"),
                          "--compact"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "compact trunk" in out.stdout and "% of its BF16 size" in out.stdout
    assert "trunk.bin" not in out.stderr.split("\n")[-1]
    assert CheckpointMap(ck, tmp_path / "t").trunk_kind.startswith("the compact trunk")


def _corrupt(c12, tmp_path, edit) -> object:
    import shutil

    dst = tmp_path / "bad"
    shutil.copytree(c12, dst)
    meta = json.loads((dst / "trunk.json").read_text())
    edit(meta, dst)
    (dst / "trunk.json").write_text(json.dumps(meta))
    return dst


def _first_c12(meta):
    for layer in meta["layers"]:
        for t in layer["tensors"].values():
            if t.get("encoding") == "c12":
                return layer, t
    raise AssertionError("no c12 tensor")


def test_compact_hostile_trunk_is_refused_in_one_sentence(packed, tmp_path):
    ck, _, c12, _ = packed

    def unknown_format(meta, _):
        meta["format"] = "k3-c99"

    def exceptions_lie(meta, _):
        _first_c12(meta)[1]["exceptions"] += 1000

    def exceptions_negative(meta, _):
        _first_c12(meta)[1]["exceptions"] = -1

    for edit, msg in ((unknown_format, "not one this engine reads"),
                      (exceptions_lie, "in .* bytes but the checkpoint's"),
                      (exceptions_negative, "expected a non-negative integer")):
        with pytest.raises(CheckpointError, match=msg):
            CheckpointMap(ck, _corrupt(c12, tmp_path / edit.__name__, edit))


def test_compact_corrupt_exception_index_never_reaches_the_kernel():
    rng = np.random.default_rng(3)
    bits = hard_weights(rng)["spikes"]
    m = encode(bits)
    raw = np.frombuffer(to_bytes(m), np.uint8).copy()
    n = m.exc_col.size
    col_off = [off for name, off, _, _ in __import__("engine.checkpoint.compact",
               fromlist=["parts"]).parts(bits.shape, n) if name == "exc_col"][0]
    raw[col_off:col_off + 4] = np.array([bits.shape[1] + 5], np.int32).view(np.uint8)
    with pytest.raises(CheckpointError, match="corrupt .* re-pack the trunk"):
        from_bytes(raw, bits.shape, n, "w")


def test_compact_unsorted_exceptions_are_refused():
    """The kernel patches a row's exceptions in column order: bytes listing them out of
    order (or twice) would decode differently there than in numpy, so they are refused."""
    rng = np.random.default_rng(4)
    bits = hard_weights(rng)["random_bits"]
    m = encode(bits)
    row = int(np.argmax(np.diff(m.row_ptr) >= 2))
    lo = int(m.row_ptr[row])
    for cols in (m.exc_col[[lo + 1, lo]], m.exc_col[[lo, lo]]):
        exc_col = m.exc_col.copy()
        exc_col[lo:lo + 2] = cols
        raw = np.frombuffer(to_bytes(CompactMatrix(m.exp_bits, m.sm, m.codes, m.row_ptr,
                                                   exc_col, m.exc_val)), np.uint8)
        with pytest.raises(CheckpointError, match="corrupt .* re-pack the trunk"):
            from_bytes(raw, bits.shape, exc_col.size, "w")
    from_bytes(np.frombuffer(to_bytes(m), np.uint8), bits.shape, m.exc_col.size, "w")


def test_compact_every_exponent_lookup_gives_the_same_bits():
    """vpermd (AVX-512), pshufb (SSSE3) and the select tree (any CPU) decode alike: each
    one's kernel against the BF16 kernel, on exception-heavy rows and odd widths."""
    numba = pytest.importorskip("numba")
    fc = pytest.importorskip("engine.kernels.fused_compact")
    rng = np.random.default_rng(5)
    needs = {fc._lookup_vpermd: "avx512f", fc._lookup_pshufb: "ssse3", fc._lookup_select: None}
    tried = 0
    for lookup, feature in needs.items():
        if feature and not fc._host_has(feature):
            continue
        dot = fc._make_c12_row_dot(lookup)

        @numba.njit
        def matmul(e, s, c, p, ec, ev, x, out):
            for r in range(s.shape[0]):
                for t in range(x.shape[0]):
                    out[t, r] = dot(e, s, c, p, ec, ev, r, x, t)

        for bits in (*hard_weights(rng, 40, 232).values(), bf16(rng.standard_normal((9, 98)))):
            m = encode(bits)
            x = rng.standard_normal((2, bits.shape[1])).astype(np.float32)
            got = np.empty((2, bits.shape[0]), np.float32)
            matmul(*fc._parts(m), x, got)
            want = kernels.linear(x, bits)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        tried += 1
    assert tried >= 1


def test_compact_k3tui_pack_flag(packed, tmp_path):
    ck, _, _, _ = packed
    env = dict(os.environ, K3TUI_HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-m", "k3tui", "pack", str(ck), str(tmp_path / "t"),
                          "--foreground", "--compact"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "t" / "trunk.json").read_text())["format"] == "k3-c12"
