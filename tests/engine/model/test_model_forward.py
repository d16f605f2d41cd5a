"""The whole model: tiny-a against its oracle, and synthesised models of other shapes
(incremental == full recompute, prefill == single steps)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint.synth import synthesize
from engine.decode.generate import GenParams, generate
from engine.model.transformer import load_model

REPO = Path(__file__).resolve().parents[3]


# ---- tiny-a: the peer's oracle -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_a_model(tiny_a):
    return load_model(tiny_a), json.loads((tiny_a / "expected.json").read_text())


def test_tiny_a_final_logits(tiny_a_model):
    model, exp = tiny_a_model
    logits = model.prefill(exp["prompt_ids"], model.new_state())
    want = np.asarray(exp["final_logits"], np.float32)
    assert np.abs(logits - want).max() <= exp["tolerance"]["logits_abs"]
    assert int(logits.argmax()) == exp["argmax"]


@pytest.mark.parametrize("full", [False, True], ids=["incremental", "full-recompute"])
def test_tiny_a_greedy_ids(tiny_a_model, full):
    model, exp = tiny_a_model
    toks = list(generate(model, exp["prompt_ids"], GenParams(max_tokens=16, full_recompute=full)))
    assert [t.id for t in toks] == exp["greedy_ids"]


def test_tiny_a_teacher_forced(tiny_a_model):
    model, exp = tiny_a_model
    ids = exp["prompt_ids"] + exp["greedy_ids"]
    logits = model.forward_full(ids)
    assert logits.shape == (len(ids), model.config.vocab_size)
    assert logits.argmax(-1).tolist() == exp["teacher_forced_argmax"]
    # the last prompt position of the full pass is the prefill's logits
    want = np.asarray(exp["final_logits"], np.float32)
    assert np.abs(logits[len(exp["prompt_ids"]) - 1] - want).max() <= 1e-4


def test_tiny_a_mla_cache_is_latent(tiny_a_model):
    model, exp = tiny_a_model
    state = model.new_state()
    model.prefill(exp["prompt_ids"], state)
    cfg = model.config
    for layer in cfg.mla_layers:
        st = state.layers[layer]
        assert st.length == 5 and st.latent.shape[1] == cfg.kv_lora_rank + cfg.qk_rope_head_dim


def test_run_cli_prints_expected_ids(tiny_a):
    exp = json.loads((tiny_a / "expected.json").read_text())
    out = subprocess.run(
        [sys.executable, "-m", "engine", "run", str(tiny_a), "--ids", "3,7,11,5,9", "--gen", "16",
         "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["generated_ids"] == exp["greedy_ids"]
    assert result["prompt_ids"] == exp["prompt_ids"]
    assert len(result["seconds_per_token"]) == 16


def test_run_cli_full_and_dump_logits(tiny_a, tmp_path):
    exp = json.loads((tiny_a / "expected.json").read_text())
    dump = tmp_path / "logits.npy"
    out = subprocess.run(
        [sys.executable, "-m", "engine", "run", str(tiny_a), "--ids", "3,7,11,5,9", "--gen", "3",
         "--full", "--dump-logits", str(dump), "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["generated_ids"] == exp["greedy_ids"][:3]
    logits = np.load(dump)
    assert logits.dtype == np.float32 and logits.shape == (256,)
    assert np.abs(logits - np.asarray(exp["final_logits"], np.float32)).max() <= 1e-4


def test_run_cli_bad_input_is_one_sentence(tiny_a):
    out = subprocess.run([sys.executable, "-m", "engine", "run", str(tiny_a), "--ids", "3,400"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2
    assert "outside the vocabulary" in out.stderr and "Traceback" not in out.stderr


# ---- synthesised models of other shapes -------------------------------------------------------
SHAPES = {
    "tiny": ("tiny", {}),
    "small": ("small", {}),
    # layer 0 is MLA (with the dense FFN), two dense layers, every layer a block boundary,
    # top-k = all experts, no shared expert
    "mla-first": ("tiny", dict(num_hidden_layers=5, full_attn_layers=[1, 5], attn_res_block_size=1,
                               num_experts=4, num_experts_per_token=4, num_shared_experts=0,
                               first_k_dense_replace=2)),
    # odd head counts, one block spanning the stack, 12 experts top-3, 3 shared
    "odd-heads": ("tiny", dict(num_hidden_layers=6, full_attn_layers=[2, 3], kda_num_heads=3,
                               kda_head_dim=8, num_attention_heads=3, qk_nope_head_dim=8,
                               qk_rope_head_dim=4, v_head_dim=8, attn_res_block_size=6,
                               num_experts=12, num_experts_per_token=3, num_shared_experts=3,
                               short_conv_kernel_size=3)),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def synth_model(request, tmp_path_factory):
    size, over = SHAPES[request.param]
    path = synthesize(tmp_path_factory.mktemp(request.param), size, seed=3, overrides=over)
    return load_model(path)


PROMPT = [5, 17, 3, 99, 42, 8, 1]


def test_incremental_equals_full_recompute(synth_model):
    model = synth_model
    inc = list(generate(model, PROMPT, GenParams(max_tokens=8)))
    full = list(generate(model, PROMPT, GenParams(max_tokens=8, full_recompute=True)))
    assert [t.id for t in inc] == [t.id for t in full]
    # logits of every step: one full pass over prompt+generated vs the incremental steps
    ids = PROMPT + [t.id for t in inc]
    all_logits = model.forward_full(ids)
    state = model.new_state()
    steps = [model.prefill(PROMPT, state)] + [model.step(t, state) for t in ids[len(PROMPT):]]
    for i, logits in enumerate(steps):
        assert np.abs(logits - all_logits[len(PROMPT) - 1 + i]).max() <= 1e-5


@pytest.mark.parametrize("length", [7, 70])
def test_prefill_equals_single_steps(synth_model, length):
    """A prompt prefilled whole and fed token by token give the same bits: logits and every
    carried state (70 tokens: a long prompt once took a chunked KDA form that rounded
    differently)."""
    model = synth_model
    prompt = (PROMPT * 10)[:length]
    a, b = model.new_state(), model.new_state()
    la = model.prefill(prompt, a)
    for t in prompt:
        lb = model.step(t, b)

    def same(x, y):
        return x.shape == y.shape and np.array_equal(x.view(np.uint32), y.view(np.uint32))

    assert same(la, lb)
    for sa, sb in zip(a.layers, b.layers):
        if hasattr(sa, "S"):
            assert same(sa.S, sb.S) and all(same(sa.conv[p], sb.conv[p]) for p in "qkv")
        else:
            assert sa.length == sb.length == len(prompt)
            assert same(sa.latent[: sa.length], sb.latent[: sb.length])


def test_prefill_kernels_give_every_position_its_one_token_bits(synth_model, monkeypatch):
    """The multi-token kernels change no bit: a prompt's logits at every position are the
    same with every matrix product run one token at a time, and a prompt prefilled whole
    or fed token by token continues with the same ids."""
    from engine import kernels
    from engine.kernels import fused, fused_compact

    model = synth_model
    ids = PROMPT * 3  # 21 positions: whole blocks of 4 tokens and a partial one
    whole = model.forward_full(ids)
    if kernels.FUSED:
        for module, name in ((fused, "linear"), (fused, "mxfp4_linear"),
                             (fused_compact, "c12_linear")):
            product = getattr(module, name)

            def by_token(x, *args, product=product, **kw):
                return np.concatenate([product(x[t : t + 1], *args, **kw) for t in range(len(x))])

            monkeypatch.setattr(module, name, by_token)
        split = model.forward_full(ids)
        monkeypatch.undo()
        assert np.array_equal(whole.view(np.uint32), split.view(np.uint32))
    state = model.new_state()
    for t in ids:
        model.step(t, state)
    fed = [t.id for t in generate(model, ids, GenParams(max_tokens=6), resume=state)]
    assert fed == [t.id for t in generate(model, ids, GenParams(max_tokens=6))]


def test_synth_init_exercises_bias_and_caps(tmp_path):
    """Routing bias changes some selections and SiTU caps saturate on real activations."""
    from engine.kernels import linear
    from engine.kernels.reference import to_f32
    from engine.model.moe import route
    from engine.model.ops import rmsnorm, situ_glu

    model = load_model(synthesize(tmp_path / "m", "small", seed=1))
    cfg = model.config
    x = rmsnorm(model.embed(np.arange(64)), np.ones(cfg.hidden_size, np.float32), 1e-5)
    with model.source.layer(1) as w:
        gate = w["block_sparse_moe.gate.weight"]
        bias = w["block_sparse_moe.gate.e_score_correction_bias"]
        ids, _ = route(x, gate, bias, cfg.num_experts_per_token, 1.0)
        ids0, _ = route(x, gate, np.zeros_like(to_f32(bias)), cfg.num_experts_per_token, 1.0)
        assert any(set(a) != set(b) for a, b in zip(ids, ids0))
        g = linear(x, w["block_sparse_moe.shared_experts.gate_proj.weight"])
        u = linear(x, w["block_sparse_moe.shared_experts.up_proj.weight"])
    assert np.abs(g).max() > 3 * cfg.situ_beta  # gate cap saturates
    assert np.abs(situ_glu(g, u, cfg.situ_beta, cfg.situ_linear_beta)).max() <= 100.0


# ---- generate ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return load_model(synthesize(tmp_path_factory.mktemp("gen"), "small", seed=7))


def _ids(model, prompt, **kw):
    return [t.id for t in generate(model, prompt, GenParams(**kw))]


def test_sampling_is_reproducible_and_seeded(small_model):
    kw = dict(max_tokens=10, temperature=1.0, top_k=50, top_p=0.95)
    a = _ids(small_model, PROMPT, seed=11, **kw)
    assert a == _ids(small_model, PROMPT, seed=11, **kw)
    assert a != _ids(small_model, PROMPT, seed=12, **kw)
    assert a != _ids(small_model, PROMPT, max_tokens=10)  # not greedy


def test_degenerate_sampling_is_greedy(small_model):
    greedy = _ids(small_model, PROMPT, max_tokens=6)
    assert _ids(small_model, PROMPT, max_tokens=6, temperature=0.8, top_k=1, seed=3) == greedy
    assert _ids(small_model, PROMPT, max_tokens=6, temperature=0.5, top_p=1e-6, seed=3) == greedy


def test_stop_ids_and_max_tokens(small_model):
    greedy = _ids(small_model, PROMPT, max_tokens=8)
    stop = greedy[3]
    first = greedy.index(stop)
    toks = list(generate(small_model, PROMPT, GenParams(max_tokens=8, stop_ids=(stop, 10**6))))
    assert [t.id for t in toks] == greedy[: first + 1] and toks[-1].stop
    assert len(_ids(small_model, PROMPT, max_tokens=3)) == 3
    assert _ids(small_model, PROMPT, max_tokens=0) == []


def test_cancel_stops_between_tokens(small_model):
    cancel = threading.Event()
    got = []
    for tok in generate(small_model, PROMPT, GenParams(max_tokens=50), cancel=cancel):
        got.append(tok)
        if tok.index == 2:
            cancel.set()
    assert len(got) == 3
    cancel2 = threading.Event()
    cancel2.set()
    assert list(generate(small_model, PROMPT, GenParams(max_tokens=5), cancel=cancel2)) == []


def test_logits_hook_steers_and_timing_is_reported(small_model):
    seen = []

    def hook(generated, logits):
        seen.append(list(generated))
        out = np.full_like(logits, -1e9)
        out[7] = 0.0  # force token 7
        return out

    toks = list(generate(small_model, PROMPT, GenParams(max_tokens=4), logits_hook=hook))
    assert [t.id for t in toks] == [7, 7, 7, 7]
    assert seen == [[], [7], [7, 7], [7, 7, 7]]
    assert toks[0].prefill_seconds is not None and toks[0].prefill_seconds > 0
    assert all(t.prefill_seconds is None and t.seconds > 0 for t in toks[1:])
    assert [t.index for t in toks] == [0, 1, 2, 3]
    for key in ("compute_s", "wait_trunk_s", "wait_experts_s", "gb_read_trunk", "gb_read_experts",
                "mb_per_s", "true_hit_rate", "evictions", "rss_gb"):
        assert key in toks[1].stats.as_dict()


def test_run_stops_on_both_end_ids(tmp_path):
    """The release's config says eos 163586, its tokenizer [EOS] 163585: stop on both."""
    from engine.commands.run import default_stop_ids

    ckpt = synthesize(tmp_path / "m", "small", seed=2)
    cfg = json.loads((ckpt / "config.json").read_text())
    base = cfg["text_config"]["vocab_size"] - 256
    assert cfg["eos_token_id"] == base + 2  # <|end_of_msg|> in Kimi's order
    assert default_stop_ids(cfg["eos_token_id"], ckpt) == [base + 1, base + 2]
