"""Decode compute at Kimi-K3's real widths, against this machine's memory bandwidth.

Builds one KDA-MoE layer and one MLA-MoE layer at the released widths (hidden 7168,
96 heads, 896 experts top-16, latent 3584, expert width 3072) with random weights in
their on-disk dtypes (BF16 trunk, MXFP4 experts from a pool larger than the CPU cache),
runs single decode tokens through them and reports, in one run:
* milliseconds per layer for one token;
* BF16 weight bytes per second of the fused matmul over every trunk matrix, and MXFP4
  expert bytes per second over 16 experts × 3 matrices — each as a fraction of
* the memory read bandwidth: a large array read by the kernels' threads, bytes per
  second (what a matmul's weights can stream at);
* the numpy reference (widen/decode, then multiply) on the same matrices, for scale.
With `--checkpoint DIR` it also times resident greedy decoding of that checkpoint (e.g.
`python -m engine synth DIR --size bench`, the peer's 6.38 GB benchmark shape).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from engine import kernels
from engine.checkpoint.schema import expected_tensors
from engine.core.config import ModelConfig
from engine.decode.generate import GenParams, generate
from engine.kernels import reference
from engine.model.kda import KDAState
from engine.model.mla import MLAState
from engine.model.moe import run_experts
from engine.model.transformer import Model, load_model
from engine.weights.source import ExpertTable, ExpertWeights

REAL_WIDTHS: dict[str, Any] = dict(
    hidden_size=7168, num_hidden_layers=4, vocab_size=163840, rms_norm_eps=1e-5,
    situ_beta=4.0, situ_linear_beta=25.0, kda_num_heads=96, kda_head_dim=128,
    short_conv_kernel_size=4, gate_lower_bound=-5.0, full_attn_layers=[4],
    num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, num_experts=896, num_experts_per_token=16,
    num_shared_experts=2, routed_expert_hidden_size=3584, moe_intermediate_size=3072,
    routed_scaling_factor=1.0, first_k_dense_replace=1, intermediate_size=33792,
    attn_res_block_size=12,
)
KDA_LAYER, MLA_LAYER = 1, 3  # zero-based: layer 3 is MLA (one-based 4), both MoE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=5, help="timed decode tokens per layer")
    parser.add_argument("--pool", type=int, default=48,
                        help="distinct experts in memory (rotated so reads miss the CPU cache)")
    parser.add_argument("--read-gb", type=float, default=1.0,
                        help="array size for the memory read-bandwidth test")
    parser.add_argument("--context", type=int, default=256,
                        help="MLA cache positions before the timed token")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="also time resident greedy decoding of this checkpoint")
    parser.add_argument("--gen", type=int, default=8, help="tokens to decode with --checkpoint")
    parser.add_argument("--threads", type=int, default=0, help="compute threads (0 = all cores)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- memory bandwidth --------------------------------------------------------------------
def read_bandwidth(gb: float, repeats: int = 5) -> float:
    """Best of `repeats` reads of a `gb`-sized array by the kernels' threads: bytes / second.

    The reference for a matmul's weight throughput must read the way the kernels do (only
    reads, every compute thread streaming its own share): a single-threaded copy counted
    read + write gave kernels "107 % of bandwidth"."""
    words = np.ones(int(gb * 1e9) // 4, np.float32)
    total = memory_reader()
    total(words)  # compile and fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        total(words)
        best = min(best, time.perf_counter() - t)
    return words.nbytes / best


@functools.cache
def memory_reader():
    """A parallel sum with numba over the fused kernels' threads (vectorised: fastmath lets
    the adds reorder), else numpy's; compiled once per process."""
    try:
        import numba  # optional: the engine runs on the numpy reference without it
    except ImportError:
        return np.sum

    @numba.njit(parallel=True, fastmath=True, cache=False)
    def total(words):
        parts = numba.get_num_threads()
        step = -(-words.size // parts)
        acc = np.zeros(parts, np.float32)
        for p in numba.prange(parts):
            chunk = words[p * step:(p + 1) * step]
            s = np.float32(0)
            for i in range(chunk.size):
                s += chunk[i]
            acc[p] = s
        return acc

    return total


# ---- random weights at the real widths -------------------------------------------------------
class _Filler:
    """Cheap random BF16 / bytes: a random block tiled (distinct memory, so no cache reuse)."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        # |w| in [2^-7, 2^-6) with random sign: finite, no denormals, like trained weights
        self.bf16 = (rng.integers(0, 0x80, 1 << 22, dtype=np.uint16) + np.uint16(0x3C00)) | (
            rng.integers(0, 2, 1 << 22, dtype=np.uint16) << np.uint16(15))
        self.bytes = rng.integers(0, 256, 1 << 22, dtype=np.uint8)
        self.rng = rng

    def tile(self, base: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(int(np.prod(shape)), base.dtype)
        for i in range(0, out.size, base.size):
            chunk = out[i : i + base.size]
            chunk[:] = base[: chunk.size]
        return out.reshape(shape)

    def tensor(self, short: str, shape: tuple[int, ...], cfg: ModelConfig) -> np.ndarray:
        if short.endswith("A_log"):
            return np.linspace(-0.4, 1.2, cfg.kda_num_heads).astype(np.float32)
        if short.endswith(("dt_bias", "conv1d.weight")):
            return self.rng.normal(0, 0.4, shape).astype(np.float32)
        if short.endswith("e_score_correction_bias"):
            return np.linspace(-0.15, 0.15, shape[0]).astype(np.float32)
        if len(shape) == 1 or shape[0] == 1:
            return np.full(shape, 0x3F80, np.uint16)  # BF16 1.0
        return self.tile(self.bf16, shape)


class BenchSource:
    """Two layers at the real widths; expert ids map onto a rotating pool of distinct
    experts so consecutive tokens read different memory."""

    def __init__(self, cfg: ModelConfig, pool: int, seed: int = 0):
        fill = _Filler(seed)
        shapes = expected_tensors(cfg)
        self.layers: dict[int, dict[str, np.ndarray]] = {}
        for layer in (KDA_LAYER, MLA_LAYER):
            p = f"layers.{layer}."
            self.layers[layer] = {
                s[len(p):]: fill.tensor(s, shape, cfg)
                for s, shape in shapes.items() if s.startswith(p) and ".experts." not in s
            }
        lat, m = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size

        def scales(rows: int, cols: int) -> np.ndarray:
            return fill.rng.integers(118, 124, (rows, cols // 32), dtype=np.uint8)

        self.pool = [
            ExpertWeights(fill.tile(fill.bytes, (m, lat // 2)), scales(m, lat),
                          fill.tile(fill.bytes, (lat, m // 2)), scales(lat, m),
                          fill.tile(fill.bytes, (m, lat // 2)), scales(m, lat))
            for _ in range(pool)
        ]
        self.next_slot = 0

    @contextmanager
    def layer(self, index: int) -> Iterator[Mapping[str, np.ndarray]]:
        yield self.layers[index]

    wants_guesses = False

    @contextmanager
    def experts(self, layer: int, ids: Sequence[int]) -> Iterator[ExpertTable]:
        out = ExpertTable()
        for e in ids:
            out[int(e)] = self.pool[self.next_slot % len(self.pool)]
            self.next_slot += 1
        yield out

    def guess(self, layer: int, ids: Sequence[int]) -> None:
        pass

    def model_tensor(self, name: str) -> np.ndarray:
        raise KeyError(name)

    def stats(self) -> dict[str, Any]:
        return {}

    def trunk_bytes(self, layer: int) -> int:
        return sum(a.nbytes for a in self.layers[layer].values())


def expert_bytes(ex: ExpertWeights) -> int:
    return sum(a.nbytes for a in (ex.w1_packed, ex.w1_scale, ex.w2_packed, ex.w2_scale,
                                  ex.w3_packed, ex.w3_scale))


# ---- timings --------------------------------------------------------------------------------
def time_layer(model: Model, layer: int, tokens: int, context: int, rng) -> list[float]:
    cfg = model.config
    state = MLAState.empty(cfg, context + tokens + 2) if cfg.is_mla(layer) else KDAState.zeros(cfg)
    if isinstance(state, MLAState):
        state.append(rng.standard_normal((context, cfg.mla_latent_width)).astype(np.float32))
    times = []
    for i in range(tokens + 1):  # the first token compiles and warms up
        h = rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)
        blocks = [rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)]
        with model.source.layer(layer) as w:
            t = time.perf_counter()
            model.decoder_layer(layer, w, h, blocks, state)
            if i:
                times.append(time.perf_counter() - t)
    return times


def time_bf16(src: BenchSource, x_by_width: dict[int, np.ndarray], fn) -> tuple[float, int, float]:
    """Wall seconds, bytes and CPU seconds for one pass of `fn` over every BF16 matrix."""
    total_s, total_b, cpu0 = 0.0, 0, time.process_time()
    for layer in (KDA_LAYER, MLA_LAYER):
        for arr in src.layers[layer].values():
            if arr.dtype != np.uint16 or arr.ndim != 2 or arr.shape[0] == 1:
                continue
            x = x_by_width[arr.shape[1]]
            t = time.perf_counter()
            fn(x, arr)
            total_s += time.perf_counter() - t
            total_b += arr.nbytes
    return total_s, total_b, time.process_time() - cpu0


def time_mxfp4(src: BenchSource, cfg: ModelConfig, n: int, rng) -> tuple[float, int, float]:
    """Wall seconds, bytes and CPU seconds for one decode token through `n` routed experts
    (w1, w3, SiTU, w2), run as the MoE runs them (experts side by side on the threads)."""
    z = rng.standard_normal((1, cfg.routed_expert_hidden_size)).astype(np.float32)
    chosen = ExpertTable()
    for e in range(n):
        chosen[e] = src.pool[src.next_slot % len(src.pool)]
        src.next_slot += 1
    cpu0, t = time.process_time(), time.perf_counter()
    run_experts(z, [np.zeros(1, np.int64)] * n, list(chosen), chosen, cfg)
    wall = time.perf_counter() - t
    return wall, sum(expert_bytes(ex) for ex in chosen.values()), time.process_time() - cpu0


def time_mxfp4_ref(src: BenchSource, cfg: ModelConfig, rng) -> float:
    """GB/s of the numpy reference (decode, then multiply) on one expert."""
    z = rng.standard_normal((1, cfg.routed_expert_hidden_size)).astype(np.float32)
    a = rng.standard_normal((1, cfg.moe_intermediate_size)).astype(np.float32)
    ex = src.pool[0]
    t = time.perf_counter()
    reference.mxfp4_linear_ref(z, ex.w1_packed, ex.w1_scale)
    reference.mxfp4_linear_ref(z, ex.w3_packed, ex.w3_scale)
    reference.mxfp4_linear_ref(a, ex.w2_packed, ex.w2_scale)
    return expert_bytes(ex) / (time.perf_counter() - t) / 1e9


def checkpoint_decode(path: str, gen: int) -> dict[str, Any]:
    t = time.perf_counter()
    model = load_model(path)
    load_s = time.perf_counter() - t
    cfg = model.config
    toks = list(generate(model, [1, 2, 3, 4, 5], GenParams(max_tokens=gen + 1)))
    per_tok = statistics.median(t.seconds for t in toks[1:])
    src = model.source
    trunk = sum(a.nbytes for L in range(cfg.num_hidden_layers) for a in src._layers[L].values())
    model_level = src.model_tensor("lm_head.weight").nbytes
    one_expert = 0
    if cfg.num_hidden_layers > 1:
        one_expert = expert_bytes(src.expert(cfg.first_k_dense_replace, 0))
    active = (
        one_expert
        * cfg.num_experts_per_token
        * sum(cfg.is_moe(L) for L in range(cfg.num_hidden_layers))
    )
    touched = trunk + model_level + active
    return {
        "checkpoint": path,
        "config": cfg.describe(),
        "load_seconds": round(load_s, 2),
        "resident_gb": round(src.nbytes / 1e9, 3),
        "seconds_per_token": round(per_tok, 4),
        "weights_gb_touched_per_token": round(touched / 1e9, 3),
        "weights_gb_per_s": round(touched / per_tok / 1e9, 2),
        "generated_ids": [t.id for t in toks],
    }


def main(args: argparse.Namespace) -> int:
    if args.threads:
        try:
            from engine.kernels import fused  # only loads where numba does

            fused.set_threads(args.threads)
        except ImportError:
            pass
    rng = np.random.default_rng(1)
    load_before = os.getloadavg()[0]
    log(f"measuring memory read bandwidth over {args.read_gb:g} GB ...")
    bw = read_bandwidth(args.read_gb)
    cfg = ModelConfig.from_dict(REAL_WIDTHS)
    log(f"building one KDA-MoE and one MLA-MoE layer at the real widths + {args.pool} experts ...")
    src = BenchSource(cfg, args.pool)
    model = Model(cfg, src)
    res: dict[str, Any] = {
        "memory_bandwidth_gb_per_s": bw / 1e9,
        "kernels": "fused (numba)" if kernels.FUSED else "numpy reference",
        "cpus": os.cpu_count(),
        "load_average_1min_before": load_before,
    }
    try:
        import numba  # optional, as above

        res["threads"] = numba.get_num_threads()
    except ImportError:
        res["threads"] = 1
    log("timing decode tokens through each layer ...")
    kda_t = time_layer(model, KDA_LAYER, args.tokens, args.context, rng)
    mla_t = time_layer(model, MLA_LAYER, args.tokens, args.context, rng)
    res["kda_moe_layer_ms"] = statistics.median(kda_t) * 1000
    res["mla_moe_layer_ms"] = statistics.median(mla_t) * 1000
    res["kda_moe_layer_trunk_gb"] = src.trunk_bytes(KDA_LAYER) / 1e9
    res["mla_moe_layer_trunk_gb"] = src.trunk_bytes(MLA_LAYER) / 1e9
    res["active_experts_gb_per_layer"] = cfg.num_experts_per_token * expert_bytes(src.pool[0]) / 1e9

    xs = {
        w: rng.standard_normal((1, w)).astype(np.float32)
        for w in {
            a.shape[1]
            for L in (KDA_LAYER, MLA_LAYER)
            for a in src.layers[L].values()
            if a.ndim == 2
        }
    }
    log("timing BF16 and MXFP4 matmuls ...")
    kernels.linear(xs[cfg.hidden_size], src.layers[KDA_LAYER]["self_attn.q_proj.weight"])  # warm
    for name, runs in (
        ("bf16", [time_bf16(src, xs, kernels.linear) for _ in range(3)]),
        ("mxfp4", [time_mxfp4(src, cfg, cfg.num_experts_per_token, rng) for _ in range(3)]),
    ):
        s, b, cpu = min(runs)
        res[f"{name}_gb_per_s"] = b / s / 1e9
        res[f"{name}_fraction_of_bandwidth"] = b / s / bw
        # bytes per CPU-second of our own threads: comparable across busy and idle runs
        res[f"{name}_gb_per_cpu_s"] = b / max(cpu, 1e-9) / 1e9

    q = src.layers[KDA_LAYER]["self_attn.q_proj.weight"]
    t = time.perf_counter()
    reference.linear_ref(xs[cfg.hidden_size], q)
    res["bf16_numpy_reference_gb_per_s"] = q.nbytes / (time.perf_counter() - t) / 1e9
    res["mxfp4_numpy_reference_gb_per_s"] = time_mxfp4_ref(src, cfg, rng)
    res["load_average_1min"] = os.getloadavg()[0]

    # the real model: 69 KDA + 24 MLA layers (layer 0's dense FFN counted as a KDA-MoE layer)
    res["real_model_compute_s_per_token_estimate"] = (
        69 * res["kda_moe_layer_ms"] + 24 * res["mla_moe_layer_ms"]
    ) / 1000
    if args.checkpoint:
        del src, model
        log(f"decoding {args.gen} tokens of {args.checkpoint}, fully resident ...")
        res["checkpoint_decode"] = checkpoint_decode(args.checkpoint, args.gen)
    res = {k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}
    if args.json:
        print(json.dumps(res))
    else:
        print_report(res)
    return 0


def print_report(r: dict[str, Any]) -> None:
    bw = r["memory_bandwidth_gb_per_s"]
    print(
        f"memory read bandwidth (kernel threads): {bw:.1f} GB/s; kernels: {r['kernels']}, "
        f"{r['threads']} threads"
    )
    print(
        f"KDA-MoE layer, one decode token: {r['kda_moe_layer_ms']:.1f} ms "
        f"(trunk {r['kda_moe_layer_trunk_gb']:.2f} GB BF16 + experts "
        f"{r['active_experts_gb_per_layer']:.2f} GB MXFP4)"
    )
    print(
        f"MLA-MoE layer, one decode token: {r['mla_moe_layer_ms']:.1f} ms "
        f"(trunk {r['mla_moe_layer_trunk_gb']:.2f} GB BF16 + experts "
        f"{r['active_experts_gb_per_layer']:.2f} GB MXFP4)"
    )
    print(
        f"BF16 matmul:  {r['bf16_gb_per_s']:.2f} GB/s = {r['bf16_fraction_of_bandwidth']:.0%} "
        f"of bandwidth (numpy widen-then-multiply: {r['bf16_numpy_reference_gb_per_s']:.2f} GB/s)"
    )
    print(
        f"MXFP4 matmul: {r['mxfp4_gb_per_s']:.2f} GB/s = {r['mxfp4_fraction_of_bandwidth']:.0%} "
        f"of bandwidth (numpy decode-then-multiply: {r['mxfp4_numpy_reference_gb_per_s']:.2f} GB/s)"
    )
    print(
        f"per CPU-second of our threads: BF16 {r['bf16_gb_per_cpu_s']:.2f} GB, MXFP4 "
        f"{r['mxfp4_gb_per_cpu_s']:.2f} GB (load average {r['load_average_1min_before']:.1f} "
        f"before, {r['load_average_1min']:.1f} after, on {r['cpus']} CPUs: a load above the "
        "CPU count means other processes shared these cores during the run)"
    )
    print(
        f"real model (69 KDA + 24 MLA layers), compute only: "
        f"~{r['real_model_compute_s_per_token_estimate']:.1f} s/token"
    )
    if "checkpoint_decode" in r:
        c = r["checkpoint_decode"]
        print(
            f"{c['checkpoint']} ({c['config']}), resident: {c['seconds_per_token']:.3f} s/token, "
            f"{c['weights_gb_touched_per_token']:.2f} GB of weights per token = "
            f"{c['weights_gb_per_s']:.2f} GB/s"
        )
