"""The Kimi-K3 text model: embedding, the decoder stack with Block Attention Residuals,
the final aggregation, norm and head (spec 1.4).

The model asks its `WeightSource` for one layer at a time, in order 0..n−1, and for the
routed experts a layer needs; it holds no weights itself, and when and in what order the
bytes come (read-ahead, expert guesses, arrival order) is the weights' business
(`engine.weights.schedule`): the model only hands it its router. Per-sequence state (KDA
recurrent state + conv history, MLA latent cache) lives in `ModelState`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from engine import kernels
from engine.checkpoint.safetensors import SafetensorsIndex
from engine.checkpoint.schema import open_checked
from engine.errors import EngineError
from engine.kernels import linear
from engine.kernels.reference import to_f32
from engine.model.attnres import attn_res, fold
from engine.core.config import ModelConfig
from engine.model.kda import KDAState, kda_mixer
from engine.model.mla import MLAState, mla_mixer
from engine.model.moe import dense_ffn, distinct, latent_moe, route
from engine.model.ops import rmsnorm
from engine.model.state import ModelState
from engine.weights import schedule
from engine.weights.resident import ResidentSource
from engine.weights.source import WeightSource


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
        h_f = attn_res(
            blocks + [h], fold(self._model_vectors(), "output_attn_res"), cfg.rms_norm_eps
        )
        rows = h_f if all_positions else h_f[-1:]
        xn = rmsnorm(rows, src.model_tensor("norm.weight"), cfg.rms_norm_eps)
        head = src.model_tensor("lm_head.weight")  # a StreamedMatrix under a small budget
        logits = head.linear(xn) if hasattr(head, "linear") else linear(xn, head)
        state.position += len(ids)
        state.ids.extend(int(i) for i in ids)
        state.logits = logits[-1].copy()  # a row, not a view that keeps all T alive
        return logits

    def decoder_layer(
        self,
        layer: int,
        w: Mapping[str, np.ndarray],
        h: np.ndarray,
        blocks: list[np.ndarray],
        layer_state: KDAState | MLAState,
    ) -> np.ndarray:
        cfg = self.config
        eps = cfg.rms_norm_eps
        prefix: np.ndarray | None = h
        x = attn_res(blocks + [h], fold(w, "self_attention_res"), eps) if blocks else h
        if layer % cfg.attn_res_block_size == 0:  # block boundary: snapshot, then reset
            blocks.append(h)
            prefix = None
        xn = rmsnorm(x, w["input_layernorm.weight"], eps)
        schedule.guess_at_attention(self.source, cfg, layer, w, x, self.routed)
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
            schedule.guess_ahead(self.source, cfg, layer, x, self.routed)
            return latent_moe(x, w, experts, ids, weights, cfg)

    def router(self, w: Mapping[str, np.ndarray], x: np.ndarray,
               top_k: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The layer's router on x (normalised): expert ids and weights [T, top-k]."""
        cfg = self.config
        return route(
            x,
            w["block_sparse_moe.gate.weight"],
            w["block_sparse_moe.gate.e_score_correction_bias"],
            top_k or cfg.num_experts_per_token,
            cfg.routed_scaling_factor,
        )

    def routed(self, w: Mapping[str, np.ndarray], h: np.ndarray, top_k: int) -> list[int]:
        """The distinct experts among the top-k that the router of the layer whose tensors
        are `w` picks for the residual stream `h` (normalised as its FFN input would be):
        what the weight source may read early (`engine.weights.schedule`)."""
        xn = rmsnorm(h, w["post_attention_layernorm.weight"], self.config.rms_norm_eps)
        return distinct(self.router(w, xn, top_k)[0])

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return to_f32(self.source.model_tensor("embed_tokens.weight")[ids]).astype(np.float32)

    def _model_vectors(self) -> dict[str, np.ndarray]:
        src = self.source
        return {
            n: src.model_tensor(n)
            for n in ("output_attn_res_norm.weight", "output_attn_res_proj.weight")
        }

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(list(ids), dtype=np.int64)
        if arr.ndim != 1 or arr.size == 0:
            raise EngineError("no token ids were given; pass at least one id.")
        bad = arr[(arr < 0) | (arr >= self.config.vocab_size)]
        if bad.size:
            raise EngineError(
                f"token id {int(bad[0])} is outside the vocabulary "
                f"(0..{self.config.vocab_size - 1}); "
                "check the ids or the tokenizer."
            )
        return arr


def load_model(checkpoint_dir: str | Path, source: WeightSource | None = None) -> Model:
    """Read config.json strictly, check the checkpoint's tensors, wrap `source`
    (default: everything resident)."""
    index = getattr(source, "index", None)
    cfg, index, _ = open_checked(
        checkpoint_dir, index if isinstance(index, SafetensorsIndex) else None
    )
    if kernels.FUSED:
        from engine.kernels import fused  # numba is optional: only there when FUSED

        fused.warm_up()
    return Model(cfg, source or ResidentSource(checkpoint_dir, index=index))
