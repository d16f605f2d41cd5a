"""The Kimi-K3 text model: embedding, the decoder stack with Block Attention Residuals,
the final aggregation, norm and head (spec 1.4).

The model asks its `WeightSource` for one layer at a time, in order 0..n−1, and for the
routed experts a layer needs; it holds no weights itself. Per-sequence state (KDA
recurrent state + conv history, MLA latent cache) lives in `ModelState`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from engine import kernels
from engine.model.attnres import attn_res, fold
from engine.model.config import ModelConfig
from engine.errors import CheckpointError, EngineError
from engine.model.kda import KDAState, kda_mixer
from engine.kernels import linear
from engine.model.ops import rmsnorm
from engine.kernels.reference import to_f32
from engine.model.mla import MLAState, mla_mixer
from engine.model.moe import dense_ffn, distinct, latent_moe, route
from engine.model.state import ModelState
from engine.safetensors import SafetensorsIndex
from engine.weights import ResidentSource, TensorNames, WeightSource


class Cancelled(Exception):
    """Generation was cancelled between layers or tokens."""


class Model:
    def __init__(self, config: ModelConfig, source: WeightSource):
        self.config = config
        self.source = source

    def new_state(self) -> ModelState:
        cfg = self.config
        return ModelState(
            [MLAState.empty(cfg) if cfg.is_mla(i) else KDAState.zeros(cfg)
             for i in range(cfg.num_hidden_layers)]
        )

    # ---- public entry points --------------------------------------------------------------
    def prefill(self, ids: Sequence[int], state: ModelState,
                cancel: threading.Event | None = None) -> np.ndarray:
        """Consume `ids`, advance `state`; logits [vocab] at the last position."""
        return self.forward(ids, state, all_positions=False, cancel=cancel)[-1]

    def step(self, token_id: int, state: ModelState,
             cancel: threading.Event | None = None) -> np.ndarray:
        return self.forward([token_id], state, all_positions=False, cancel=cancel)[-1]

    def forward_full(self, ids: Sequence[int],
                     cancel: threading.Event | None = None) -> np.ndarray:
        """A fresh forward over `ids`: logits [T, vocab] at every position."""
        return self.forward(ids, self.new_state(), all_positions=True, cancel=cancel)

    # ---- the forward pass -----------------------------------------------------------------
    def forward(self, ids: Sequence[int], state: ModelState, all_positions: bool,
                cancel: threading.Event | None = None) -> np.ndarray:
        cfg, src = self.config, self.source
        ids = self._check_ids(ids)
        h = self.embed(ids)
        blocks: list[np.ndarray] = []  # per-token block snapshots; the first is the embedding
        for layer in range(cfg.num_hidden_layers):
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            with src.layer(layer) as w:
                h = self.decoder_layer(layer, w, h, blocks, state.layers[layer])
        h_f = attn_res(blocks + [h], fold(self._model_vectors(), "output_attn_res"), cfg.rms_norm_eps)
        rows = h_f if all_positions else h_f[-1:]
        logits = linear(rmsnorm(rows, src.model_tensor("norm.weight"), cfg.rms_norm_eps),
                        src.model_tensor("lm_head.weight"))
        state.position += len(ids)
        state.ids.extend(int(i) for i in ids)
        return logits

    def decoder_layer(self, layer: int, w: Mapping[str, np.ndarray], h: np.ndarray,
                      blocks: list[np.ndarray], layer_state: KDAState | MLAState) -> np.ndarray:
        cfg = self.config
        eps = cfg.rms_norm_eps
        prefix: np.ndarray | None = h
        x = attn_res(blocks + [h], fold(w, "self_attention_res"), eps) if blocks else h
        if layer % cfg.attn_res_block_size == 0:  # block boundary: snapshot, then reset
            blocks.append(h)
            prefix = None
        xn = rmsnorm(x, w["input_layernorm.weight"], eps)
        if len(x) == 1 and cfg.is_moe(layer) and getattr(self.source, "wants_guesses", False):
            self.source.guess(layer, self.likely_experts(w, x))
        if cfg.is_mla(layer):
            a = mla_mixer(xn, w, cfg, layer_state)
        else:
            a = kda_mixer(xn, w, cfg, layer_state)
        prefix = a if prefix is None else prefix + a
        x2 = attn_res(blocks + [prefix], fold(w, "mlp_res"), eps)  # no emptiness guard
        x2n = rmsnorm(x2, w["post_attention_layernorm.weight"], eps)
        return prefix + self.ffn(layer, w, x2n)

    def ffn(self, layer: int, w: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        cfg = self.config
        if not cfg.is_moe(layer):
            return dense_ffn(x, w, cfg)
        ids, weights = self.router(w, x)
        # Entering issues the reads; latent_moe computes the shared experts before it
        # touches a routed one, so that compute overlaps the disk.
        with self.source.experts(layer, distinct(ids)) as experts:
            return latent_moe(x, w, experts, ids, weights, cfg)

    def router(self, w: Mapping[str, np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The layer's router on x (normalised): expert ids and weights [T, top-k]."""
        cfg = self.config
        return route(x, w["block_sparse_moe.gate.weight"],
                     w["block_sparse_moe.gate.e_score_correction_bias"],
                     cfg.num_experts_per_token, cfg.routed_scaling_factor)

    def likely_experts(self, w: Mapping[str, np.ndarray], x: np.ndarray) -> list[int]:
        """The router applied to the attention's input instead of its output: one mixer
        moves the residual stream little, so this names most of the experts the layer
        will choose (~90 % on the synthesised checkpoints), early enough for their reads
        to overlap the attention. Only a hint for the weight source."""
        xn = rmsnorm(x, w["post_attention_layernorm.weight"], self.config.rms_norm_eps)
        return distinct(self.router(w, xn)[0])

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return to_f32(self.source.model_tensor("embed_tokens.weight")[ids]).astype(np.float32)

    def _model_vectors(self) -> dict[str, np.ndarray]:
        src = self.source
        return {n: src.model_tensor(n) for n in ("output_attn_res_norm.weight",
                                                 "output_attn_res_proj.weight")}

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(list(ids), dtype=np.int64)
        if arr.ndim != 1 or arr.size == 0:
            raise EngineError("no token ids were given; pass at least one id.")
        bad = arr[(arr < 0) | (arr >= self.config.vocab_size)]
        if bad.size:
            raise EngineError(
                f"token id {int(bad[0])} is outside the vocabulary (0..{self.config.vocab_size - 1}); "
                "check the ids or the tokenizer."
            )
        return arr


# ---- the checkpoint's expected tensors ---------------------------------------------------------
def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Short name (relative to the model prefix; `lm_head.weight` for the head) → shape.
    Routed experts are listed per layer and expert. A_log is listed with H values; the
    checkpoint may hold more (the real one stores 128, of which the first H are used)."""
    return dict(iter_expected(cfg))


def iter_expected(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """`expected_tensors` one at a time, each layer's router gate before its experts: a
    checker stops at the first tensor the header lacks, so a config claiming more
    experts than the file holds costs one lookup, not a table of them."""
    E, V = cfg.hidden_size, cfg.vocab_size
    H, D, P, K = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_width, cfg.short_conv_kernel_size
    Hm, nope, rope, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    lat, M, N = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    yield from {
        "embed_tokens.weight": (V, E),
        "norm.weight": (E,),
        "output_attn_res_norm.weight": (E,),
        "output_attn_res_proj.weight": (1, E),
        "lm_head.weight": (V, E),
    }.items()
    for L in range(cfg.num_hidden_layers):
        p = f"layers.{L}."
        out: dict[str, tuple[int, ...]] = {}  # this layer's trunk
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                  "mlp_res_norm"):
            out[f"{p}{n}.weight"] = (E,)
        out[f"{p}self_attention_res_proj.weight"] = (1, E)
        out[f"{p}mlp_res_proj.weight"] = (1, E)
        a = p + "self_attn."
        if cfg.is_mla(L):
            out.update({
                f"{a}q_a_proj.weight": (cfg.q_lora_rank, E),
                f"{a}q_a_layernorm.weight": (cfg.q_lora_rank,),
                f"{a}q_b_proj.weight": (Hm * (nope + rope), cfg.q_lora_rank),
                f"{a}kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + rope, E),
                f"{a}kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                f"{a}kv_b_proj.weight": (Hm * (nope + vd), cfg.kv_lora_rank),
                f"{a}g_proj.weight": (Hm * vd, E),
                f"{a}o_proj.weight": (E, Hm * vd),
            })
        else:
            for n in "qkv":
                out[f"{a}{n}_proj.weight"] = (P, E)
                out[f"{a}{n}_conv1d.weight"] = (P, 1, K)
            out.update({
                f"{a}f_a_proj.weight": (D, E),
                f"{a}f_b_proj.weight": (P, D),
                f"{a}b_proj.weight": (H, E),
                f"{a}A_log": (H,),
                f"{a}dt_bias": (P,),
                f"{a}g_proj.weight": (P, E),
                f"{a}o_norm.weight": (D,),
                f"{a}o_proj.weight": (E, P),
            })
        if not cfg.is_moe(L):
            I = cfg.intermediate_size
            out.update({f"{p}mlp.gate_proj.weight": (I, E), f"{p}mlp.up_proj.weight": (I, E),
                        f"{p}mlp.down_proj.weight": (E, I)})
            yield from out.items()
            continue
        m = p + "block_sparse_moe."
        out.update({
            f"{m}gate.weight": (N, E),
            f"{m}gate.e_score_correction_bias": (N,),
            f"{m}routed_expert_down_proj.weight": (lat, E),
            f"{m}routed_expert_up_proj.weight": (E, lat),
            f"{m}routed_expert_norm.weight": (lat,),
        })
        if cfg.num_shared_experts:
            S = cfg.shared_width
            out.update({f"{m}shared_experts.gate_proj.weight": (S, E),
                        f"{m}shared_experts.up_proj.weight": (S, E),
                        f"{m}shared_experts.down_proj.weight": (E, S)})
        yield from out.items()
        for e in range(N):
            x = f"{m}experts.{e}."
            yield from {
                f"{x}w1.weight_packed": (M, lat // 2), f"{x}w1.weight_scale": (M, lat // 32),
                f"{x}w2.weight_packed": (lat, M // 2), f"{x}w2.weight_scale": (lat, M // 32),
                f"{x}w3.weight_packed": (M, lat // 2), f"{x}w3.weight_scale": (M, lat // 32),
            }.items()


def check_tensors(cfg: ModelConfig, index: SafetensorsIndex, names: TensorNames) -> None:
    """Every tensor the config implies is present with the implied shape (once per index:
    the source's constructor and load_model both ask)."""
    if index.checked_against == cfg:
        return
    for short, shape in iter_expected(cfg):
        full = names.model(short)
        info = index.info(full)  # raises naming the tensor when missing
        got = info.shape
        if short.endswith("A_log"):
            ok = math.prod(got) >= shape[0]
        elif len(shape) == 1 or shape[0] == 1 or short.endswith("conv1d.weight"):
            ok = math.prod(got) == math.prod(shape)
        else:
            ok = got == shape
        if not ok:
            raise CheckpointError(
                f"{info.file.name}: tensor {full} has shape {list(got)} but config.json implies "
                f"{list(shape)}; the config and the weights belong to different models."
            )
        if ".experts." in short and info.dtype != "U8":
            raise CheckpointError(
                f"{info.file.name}: tensor {full} is {info.dtype}; routed experts must be MXFP4 "
                "(U8 packed + U8 scales)."
            )
    index.checked_against = cfg


def open_checked(checkpoint_dir: str | Path, index: SafetensorsIndex | None = None
                 ) -> tuple[ModelConfig, SafetensorsIndex, TensorNames]:
    """config.json (bounded), the safetensors headers, and every tensor the config implies
    checked against them: what each source does first, before anything sized by the
    config (expert tables, KDA state, KV cache, the memory plan) is allocated."""
    cfg = ModelConfig.from_dir(checkpoint_dir)
    index = index or SafetensorsIndex.open(checkpoint_dir)
    names = TensorNames.detect(index)
    check_tensors(cfg, index, names)
    return cfg, index, names


def load_model(checkpoint_dir: str | Path, source: WeightSource | None = None) -> Model:
    """Read config.json strictly, check the checkpoint's tensors, wrap `source`
    (default: everything resident)."""
    index = getattr(source, "index", None)
    cfg, index, _ = open_checked(checkpoint_dir,
                                 index if isinstance(index, SafetensorsIndex) else None)
    if kernels.FUSED:
        from engine.kernels import fused

        fused.warm_up()
    return Model(cfg, source or ResidentSource(checkpoint_dir, index=index))
