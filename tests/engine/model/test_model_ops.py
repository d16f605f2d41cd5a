"""Every per-kernel fixture in tests/fixtures/kimi-k3/ops/, within MANIFEST's tolerance."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.kernels.mxfp4 import mxfp4_decode
from engine.model.attnres import attn_res
from engine.core.config import ModelConfig
from engine.model.kda import (
    KDAState,
    decay,
    kda_mixer,
    recurrence,
    short_conv,
)
from engine.model.mla import MLAState, mla_mixer
from engine.model.moe import DenseExpert, latent_moe, route
from engine.model.ops import rmsnorm, situ_glu
from engine.model.transformer import Model
from engine.weights.source import ExpertTable

ABS, REL = 1e-5, 1e-4


@pytest.fixture
def ops(ops_fixtures) -> Path:
    return ops_fixtures


def load(ops: Path, name: str) -> dict:
    j = json.loads((ops / f"{name}.json").read_text())
    return {k: (np.asarray(v["data"], np.float32).reshape(v["shape"])
                if isinstance(v, dict) and "data" in v else v) for k, v in j.items()}


def close(got, want, floor: float = 0.0) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    err = np.abs(got - want) - (ABS + REL * np.abs(want) + floor)
    assert err.max() <= 0, (
        f"worst excess {err.max():.3g} at {np.unravel_index(err.argmax(), err.shape)}"
    )


def tiny_cfg(ops: Path, **over) -> ModelConfig:
    c = dict(json.loads((ops / "MANIFEST.json").read_text())["config"])
    c.update(over)
    return ModelConfig.from_dict(c)


def test_manifest_tolerance_is_what_we_apply(ops):
    tol = json.loads((ops / "MANIFEST.json").read_text())["tolerance"]
    assert (tol["fp32_abs"], tol["fp32_rel"]) == (ABS, REL)


def test_rmsnorm(ops):
    f = load(ops, "rmsnorm")
    close(rmsnorm(f["in"], f["weight"], f["eps"]), f["out"])


def test_situ_glu(ops):
    f = load(ops, "situ_glu")
    out = situ_glu(f["in"][:, :8], f["in"][:, 8:], f["beta"], f["linear_beta"])
    close(out, f["out"])
    assert np.abs(out).max() <= 100.0


def test_shortconv_with_carried_state(ops):
    f = load(ops, "shortconv")
    hist = np.zeros((3, 64), np.float32)
    y, hist = short_conv(f["in"][0], f["weight"], hist)
    close(y, f["out"][0])
    close(hist.T, f["state_after"][0])  # fixture stores [channel, oldest..newest]
    y2, _ = short_conv(f["in_next"][0], f["weight"], hist)
    close(y2, f["out_next"][0])


def test_kda_decay(ops):
    f = load(ops, "kda_decay")
    alpha = decay(f["z"][0], f["A_log"], f["dt_bias"], 4, f["lower_bound"])
    close(alpha, f["alpha"][0])
    close(np.log(alpha), f["g"][0])


@pytest.mark.parametrize("name", ["kda_recur1", "kda_recur8"])
def test_kda_recurrence(ops, name):
    f = load(ops, name)
    S = np.zeros((4, 16, 16), np.float32)
    out = recurrence(f["q"], f["k"], f["v"], f["alpha"], f["beta"], S, f["q_scale"])
    close(out, f["out"])
    close(S, f["state_out"])


def kda_weights(f: dict, prefix: str = "self_attn.", key=lambda n: n) -> dict:
    names = {
        "q_proj": "q_proj.weight",
        "k_proj": "k_proj.weight",
        "v_proj": "v_proj.weight",
        "g_proj": "g_proj.weight",
        "o_proj": "o_proj.weight",
        "f_a": "f_a_proj.weight",
        "f_b": "f_b_proj.weight",
        "b_proj": "b_proj.weight",
        "q_conv": "q_conv1d.weight",
        "k_conv": "k_conv1d.weight",
        "v_conv": "v_conv1d.weight",
        "A_log": "A_log",
        "dt_bias": "dt_bias",
        "o_norm": "o_norm.weight",
    }
    return {prefix + v: f[key(k)] for k, v in names.items()}


@pytest.mark.parametrize("name", ["kda_layer1", "kda_layer8"])
def test_kda_layer(ops, name):
    f = load(ops, name)
    cfg = tiny_cfg(ops)
    state = KDAState.zeros(cfg)
    out = kda_mixer(f["in"][0], kda_weights(f), cfg, state)
    close(out, f["out"][0])
    close(state.S, f["state_out"][0])


def test_kda_layer_token_by_token_equals_sequence(ops):
    f = load(ops, "kda_layer8")
    cfg = tiny_cfg(ops)
    state = KDAState.zeros(cfg)
    w = kda_weights(f)
    outs = [kda_mixer(f["in"][0][t : t + 1], w, cfg, state) for t in range(8)]
    close(np.concatenate(outs), f["out"][0])


def test_router(ops):
    f = load(ops, "router")
    ids, weights = route(f["in"], f["gate_weight"], f["bias"], 2, 1.0)
    want_ids = f["topk_idx"].astype(int)
    for r in range(ids.shape[0]):
        assert set(ids[r]) == set(want_ids[r])
        got = dict(zip(ids[r], weights[r]))
        close([got[i] for i in want_ids[r]], f["topk_weight"][r])
    unbiased, _ = route(f["in"], f["gate_weight"], np.zeros(8, np.float32), 2, 1.0)
    changed = sum(set(a) != set(b) for a, b in zip(ids, unbiased))
    assert changed == f["rows_where_bias_changed_selection"]


def test_attnres(ops):
    f = load(ops, "attnres")
    w = f["norm_weight"] * f["proj_weight"]
    sources = [f["block_residual"][:, j] for j in range(8)] + [f["prefix_sum"]]
    close(attn_res(sources, w, f["eps"]), f["out"])


def mla_weights(f: dict, src: str = "", prefix: str = "self_attn.") -> dict:
    names = [
        "q_a_proj",
        "q_a_layernorm",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_a_layernorm",
        "kv_b_proj",
        "o_proj",
        "g_proj",
    ]
    return {f"{prefix}{n}.weight": f[f"{src}{n}_weight"] for n in names}


def test_mla_with_latent_cache(ops):
    f = load(ops, "mla")
    cfg = tiny_cfg(ops)
    assert cfg.qk_head_dim**-0.5 == pytest.approx(f["scale"])
    state = MLAState.empty(cfg, capacity=2)  # forces the cache to grow
    out = mla_mixer(f["in"][0], mla_weights(f), cfg, state)
    close(out, f["out"][0])
    assert state.length == 6 and state.latent.shape[1] == 32 + 8  # latent, not expanded
    close(state.latent[:6, :32], f["kv_latent"][0])
    close(state.latent[:6, 32:], f["k_rope"][0])
    step_state = MLAState.empty(cfg)
    steps = [mla_mixer(f["in"][0][t : t + 1], mla_weights(f), cfg, step_state) for t in range(6)]
    close(np.concatenate(steps), f["out"][0])


def moe_weights(f: dict, src: str = "", prefix: str = "block_sparse_moe.") -> tuple[dict, dict]:
    w = {
        f"{prefix}gate.weight": f[f"{src}gate_weight"],
        f"{prefix}gate.e_score_correction_bias": f[f"{src}e_score_correction_bias"],
        f"{prefix}routed_expert_down_proj.weight": f[f"{src}down_weight"],
        f"{prefix}routed_expert_up_proj.weight": f[f"{src}up_weight"],
        f"{prefix}routed_expert_norm.weight": f[f"{src}norm_weight"],
        f"{prefix}shared_experts.gate_proj.weight": f[f"{src}shared_w1_weight"],
        f"{prefix}shared_experts.up_proj.weight": f[f"{src}shared_w3_weight"],
        f"{prefix}shared_experts.down_proj.weight": f[f"{src}shared_w2_weight"],
    }
    experts = ExpertTable(
        {
            e: DenseExpert(
                f[f"{src}experts_{e}_w1_weight"],
                f[f"{src}experts_{e}_w2_weight"],
                f[f"{src}experts_{e}_w3_weight"],
            )
            for e in range(8)
        }
    )
    return w, experts


def test_latent_moe(ops):
    f = load(ops, "moe")
    cfg = tiny_cfg(ops)
    w, experts = moe_weights(f)
    x = f["in"][0]
    ids, weights = route(
        x,
        w["block_sparse_moe.gate.weight"],
        w["block_sparse_moe.gate.e_score_correction_bias"],
        2,
        1.0,
    )
    out = latent_moe(x, w, experts, ids, weights, cfg)
    # moe.json sits at the fp32 noise floor: README allows an absolute floor of 1e-6·max|want|
    close(out, f["out"][0], floor=1e-6 * float(np.abs(f["out"]).max()))


class _DictSource:
    """A WeightSource over one fixture layer (layer index fixed by the fixture)."""

    wants_guesses = False

    def __init__(self, layer: int, w: dict, experts: dict):
        self._layer, self._w, self._experts = layer, w, experts

    def layer(self, index):
        from contextlib import nullcontext

        assert index == self._layer
        return nullcontext(self._w)

    def experts(self, layer, ids):
        from contextlib import nullcontext

        return nullcontext(ExpertTable({e: self._experts[e] for e in ids}))


@pytest.mark.parametrize("name", ["layer_kda", "layer_mla"])
def test_decoder_layer_with_block_residuals(ops, name):
    f = load(ops, name)
    cfg = tiny_cfg(ops)
    L = int(f["layer_idx"])
    assert cfg.is_mla(L) == bool(f["is_mla"])
    w = {
        "self_attention_res_norm.weight": f["self_attention_res_norm_weight"],
        "self_attention_res_proj.weight": f["self_attention_res_proj_weight"],
        "mlp_res_norm.weight": f["mlp_res_norm_weight"],
        "mlp_res_proj.weight": f["mlp_res_proj_weight"],
        "input_layernorm.weight": f["input_layernorm_weight"],
        "post_attention_layernorm.weight": f["post_attention_layernorm_weight"],
    }
    if f["is_mla"]:
        w.update(mla_weights(f, "self_attn_"))
        state = MLAState.empty(cfg)
    else:
        w.update(
            kda_weights(
                f,
                key=lambda k: (
                    "self_attn_"
                    + {
                        "f_a": "f_a_proj_weight",
                        "f_b": "f_b_proj_weight",
                        "q_conv": "q_conv1d_weight",
                        "k_conv": "k_conv1d_weight",
                        "v_conv": "v_conv1d_weight",
                        "A_log": "A_log",
                        "dt_bias": "dt_bias",
                        "o_norm": "o_norm_weight",
                    }.get(k, k + "_weight")
                ),
            )
        )
        state = KDAState.zeros(cfg)
    moe_w, experts = moe_weights(f, "mlp_")
    w.update(moe_w)
    model = Model(cfg, _DictSource(L, w, experts))
    blocks_in = f["block_residual_in"]
    blocks = [blocks_in[:, j] for j in range(blocks_in.shape[1])]
    h = model.decoder_layer(L, w, f["in"][0], blocks, state)
    close(h, f["out"][0])
    want_blocks = f["block_residual_out"]
    assert len(blocks) == want_blocks.shape[1]
    for j, b in enumerate(blocks):
        close(b, want_blocks[:, j])


def test_mxfp4_real_bytes_exact(ops):
    j = json.loads((ops / "mxfp4.json").read_text())
    packed = np.asarray(j["packed"]["data"], np.uint8).reshape(j["packed"]["shape"])
    scales = np.asarray(j["scales"]["data"], np.uint8).reshape(j["scales"]["shape"])
    want = np.asarray(j["expected"]["data"], np.float32).reshape(j["expected"]["shape"])
    got = mxfp4_decode(packed, scales)
    assert np.array_equal(got, want)
    swapped = np.asarray(j["expected_swapped_nibbles"]["first64"], np.float32)
    assert not np.array_equal(got[0, :64], swapped)
