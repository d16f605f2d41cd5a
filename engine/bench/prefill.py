"""Many tokens per pass: the multi-token kernels against numpy's FP32 GEMM, and a prompt
prefilled whole against token by token, in one run.

`python -m engine bench prefill [--checkpoint DIR] [--json]`:
* kernels: products at Kimi-K3's real widths — the latent down-projection [3584, 7168] as
  BF16 and as compact (c12), an expert's w1 [3072, 3584] as MXFP4 — over T = 1, 4, 16, 64
  and 256 tokens, each beside np.matmul of the same matrix widened to float32 (numpy's BLAS
  given the kernels' thread count): FLOP/s (2·R·C·T per product), medians of interleaved
  repetitions, and their ratio; `prefill_flops_fraction` is the lowest ratio at T ≥ 16;
* BLAS: the library numpy runs and, for OpenBLAS, the core kernel it picked (an
  OPENBLAS_CORETYPE in the environment pins an older, slower one: the ratio then flatters);
* prompt: a 64- and a 256-token prompt (--prompts) on a synthesised checkpoint ("medium",
  made in a temporary folder, or --checkpoint DIR, e.g. `synth DIR --size bench`),
  prefilled whole vs fed token by token through `Model.step`: tokens per second, the last
  logits compared bit for bit and the greedy ids after each.
The load average before and after says how much of the 2 cores the run had.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine import kernels
from engine.checkpoint.compact import encode
from engine.checkpoint.synth import synthesize
from engine.kernels import reference
from engine.kernels.mxfp4 import mxfp4_decode
from engine.model.transformer import load_model

TOKENS = (1, 4, 16, 64, 256)
CONTINUE = 4  # greedy ids compared after each prompt
LATENT_DOWN = (3584, 7168)  # routed_expert_down_proj: hidden 7168 → latent 3584
EXPERT_W1 = (3072, 3584)  # an expert's gate: latent 3584 → 3072


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (median)")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="prompt timings on this checkpoint (default: a synthesised medium)")
    parser.add_argument("--prompts", default="64,256", metavar="N,N",
                        help="prompt lengths in tokens (default 64,256)")
    parser.add_argument("--threads", type=int, default=0, help="compute threads (0 = all cores)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- numpy's BLAS ---------------------------------------------------------------------------
def _openblas() -> ctypes.CDLL | None:
    """The OpenBLAS library numpy loaded (found in this process's memory map), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = sorted({p for p in maps.split() if "openblas" in p.lower() and ".so" in p})
    for path in paths:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _symbol(lib: ctypes.CDLL, name: str):
    for prefix in ("scipy_openblas_", "openblas_"):
        for suffix in ("64_", ""):
            fn = getattr(lib, f"{prefix}{name}{suffix}", None)
            if fn is not None:
                return fn
    return None


def blas_info(threads: int) -> dict[str, Any]:
    """numpy's BLAS: name and version, and for OpenBLAS the core kernel it runs; its
    thread count is set to `threads` (the kernels') when the library allows."""
    info: dict[str, Any] = {"openblas_coretype_env": os.environ.get("OPENBLAS_CORETYPE")}
    try:
        dep = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        info.update(name=dep.get("name"), version=dep.get("version"))
    except (TypeError, KeyError, AttributeError):
        info.update(name="unknown", version=None)
    lib = _openblas()
    core = _symbol(lib, "get_corename") if lib else None
    if core is not None:
        core.restype = ctypes.c_char_p
        info["core"] = core().decode(errors="replace")
    set_threads = _symbol(lib, "set_num_threads") if lib else None
    get_threads = _symbol(lib, "get_num_threads") if lib else None
    if set_threads is not None and get_threads is not None:
        set_threads(ctypes.c_int(threads))
        info["threads"] = int(get_threads())
    else:
        info["threads"] = None  # unknown: the GEMM runs with the library's default
    return info


# ---- kernels against the GEMM -----------------------------------------------------------------
def _weights(rng) -> dict[str, tuple[Any, np.ndarray]]:
    """name → (the kernel's weight, its float32 matrix for the GEMM). BF16 like trained
    weights (a normal spread of exponents, so c12 has its exceptions)."""
    f = rng.standard_normal(LATENT_DOWN, dtype=np.float32) * np.float32(0.02)
    bf16 = (f.view(np.uint32) >> 16).astype(np.uint16)
    dense = reference.widen_bf16(bf16)
    packed = rng.integers(0, 256, (EXPERT_W1[0], EXPERT_W1[1] // 2), dtype=np.uint8)
    scale = rng.integers(118, 124, (EXPERT_W1[0], EXPERT_W1[1] // 32), dtype=np.uint8)
    return {"bf16": (bf16, dense), "c12": (encode(bf16), dense),
            "mxfp4": ((packed, scale), mxfp4_decode(packed, scale))}


def _product(name: str, w):
    if name == "mxfp4":
        return lambda x: kernels.mxfp4_linear(x, *w)
    return lambda x: kernels.linear(x, w)


def measure_kernels(reps: int, rng) -> list[dict[str, Any]]:
    """FLOP/s of each kernel and of np.matmul on its float32 matrix, per T: each repetition
    runs every (matrix, T) once — its kernels, then the GEMM (one for BF16 and c12: the
    same matrix) — so all see the same load."""
    weights = _weights(rng)
    groups: dict[int, list[str]] = {}  # the kernels of each float32 matrix
    for name, (_, dense) in weights.items():
        groups.setdefault(id(dense), []).append(name)
    xs = {(name, T): rng.standard_normal((T, dense.shape[1]), dtype=np.float32)
          for name, (_, dense) in weights.items() for T in TOKENS}
    times: dict[tuple[str, int], list[float]] = {}
    for name, (w, dense) in weights.items():  # compile (one token and several) and warm up
        for T in TOKENS[:2]:
            _product(name, w)(xs[name, T])
            np.matmul(xs[name, T], dense.T)
    for _ in range(reps):
        for names in groups.values():
            dense = weights[names[0]][1]
            for T in TOKENS:
                for name in names:
                    t = time.perf_counter()
                    _product(name, weights[name][0])(xs[name, T])
                    times.setdefault((name, T), []).append(time.perf_counter() - t)
                t = time.perf_counter()
                np.matmul(xs[names[0], T], dense.T)
                times.setdefault((f"gemm {names[0]}", T), []).append(time.perf_counter() - t)
    rows = []
    for names in groups.values():
        R, C = weights[names[0]][1].shape
        for name in names:
            for T in TOKENS:
                flops = 2 * R * C * T
                k = flops / statistics.median(times[name, T]) / 1e9
                g = flops / statistics.median(times[f"gemm {names[0]}", T]) / 1e9
                rows.append({"kernel": name, "shape": [R, C], "tokens": T, "kernel_gflops": k,
                             "gemm_gflops": g, "fraction": k / g})
    return rows


# ---- a prompt whole vs token by token -----------------------------------------------------------
def measure_prompts(path: Path, prompts: list[int], reps: int, rng) -> list[dict[str, Any]]:
    """Per prompt length: the whole prompt's prefill (median of `reps`) and the same ids fed
    one `Model.step` at a time (once: it is the slow side), then CONTINUE greedy ids after
    each."""
    model = load_model(path)
    cfg = model.config
    runs = []
    for n in prompts:
        ids = [int(i) for i in rng.integers(0, cfg.vocab_size, n)]
        model.prefill(ids[:8], model.new_state())  # compile and warm up
        whole = []
        for _ in range(reps):
            state = model.new_state()
            t = time.perf_counter()
            logits = model.prefill(ids, state)
            whole.append(time.perf_counter() - t)
        first = logits
        a = _greedy(model, state, logits)
        state = model.new_state()
        t = time.perf_counter()
        for i in ids:
            logits = model.step(i, state)
        steps = time.perf_counter() - t
        same = np.array_equal(first.view(np.uint32), logits.view(np.uint32))
        b = _greedy(model, state, logits)
        w = statistics.median(whole)
        runs.append({"tokens": n, "whole_s": w, "steps_s": steps, "whole_tok_s": n / w,
                     "steps_tok_s": n / steps, "speedup": steps / w, "logits_equal": same,
                     "ids_equal": a == b, "ids": a})
    return runs


def _greedy(model, state, logits: np.ndarray) -> list[int]:
    out = []
    for _ in range(CONTINUE):
        out.append(int(np.argmax(logits)))
        logits = model.step(out[-1], state)
    return out


def main(args: argparse.Namespace) -> int:
    try:
        prompts = [int(n) for n in args.prompts.split(",")]
    except ValueError:
        prompts = []
    if args.reps < 1 or not prompts or min(prompts) < 1:
        print("error: --reps must be at least 1 and --prompts a list of token counts such as "
              "64,256.", file=sys.stderr)
        return 2
    if args.checkpoint and not (Path(args.checkpoint) / "config.json").is_file():
        print(f"error: {args.checkpoint} holds no config.json; give a checkpoint folder "
              "(python -m engine synth DIR makes one).", file=sys.stderr)
        return 2
    if args.threads:
        try:
            from engine.kernels import fused  # only loads where numba does

            fused.set_threads(args.threads)
        except ImportError:
            pass
    start = time.perf_counter()
    threads = kernels.compute_threads()
    res: dict[str, Any] = {"schema": 1, "load_average": list(os.getloadavg()),
                           "cpus": os.cpu_count(), "threads": threads,
                           "kernels": "fused (numba)" if kernels.FUSED else "numpy reference",
                           "blas": blas_info(threads)}
    rng = np.random.default_rng(0)
    log(f"kernels vs numpy's GEMM at T = {', '.join(map(str, TOKENS))}, {args.reps} reps ...")
    res["products"] = measure_kernels(args.reps, rng)
    res["kernels_s"] = time.perf_counter() - start
    res["prefill_flops_fraction"] = min(r["fraction"] for r in res["products"]
                                        if r["tokens"] >= 16)
    with tempfile.TemporaryDirectory(prefix="k3-bench-prefill-") as tmp:
        path = Path(args.checkpoint) if args.checkpoint else Path(tmp) / "medium"
        if not args.checkpoint:
            log("synthesising a medium checkpoint ...")
            synthesize(path, "medium", seed=1)
        log(f"prompts of {', '.join(map(str, prompts))} tokens: whole vs token by token ...")
        res["prompt"] = {"checkpoint": args.checkpoint or "synthesised medium",
                         "runs": measure_prompts(path, prompts, args.reps, rng)}
    res["ids_equal"] = all(r["ids_equal"] for r in res["prompt"]["runs"])
    res["logits_equal"] = all(r["logits_equal"] for r in res["prompt"]["runs"])
    res["load_average_after"] = list(os.getloadavg())
    res["seconds"] = time.perf_counter() - start
    if args.json:
        print(json.dumps(res))
    else:
        print_report(res)
    return 0


def print_report(r: dict[str, Any]) -> None:
    b = r["blas"]
    core = b.get("core", "?")
    env = b["openblas_coretype_env"]
    print(f"kernels: {r['kernels']}, {r['threads']} threads; numpy's BLAS: {b['name']} "
          f"{b['version']}, core {core}"
          + (f" (pinned by OPENBLAS_CORETYPE={env})" if env else "")
          + f", {b['threads'] if b['threads'] is not None else 'default'} threads")
    print(f"{'product':<8} {'shape':>12} " + " ".join(f"{'T=' + str(T):>15}" for T in TOKENS))
    for name in dict.fromkeys(p["kernel"] for p in r["products"]):
        rows = [p for p in r["products"] if p["kernel"] == name]
        shape = "x".join(map(str, rows[0]["shape"]))
        print(f"{name:<8} {shape:>12} " + " ".join(
            f"{p['kernel_gflops']:5.1f}/{p['gemm_gflops']:5.1f}={p['fraction']:4.2f}"
            .rjust(15) for p in rows))
    print("(GFLOP/s: kernel / numpy FP32 GEMM = ratio, medians of interleaved repetitions)")
    print(f"prefill_flops_fraction (lowest at T >= 16): {r['prefill_flops_fraction']:.2f} "
          "(target >= 0.5)")
    for p in r["prompt"]["runs"]:
        print(f"{r['prompt']['checkpoint']}, {p['tokens']}-token prompt: whole "
              f"{p['whole_tok_s']:.1f} tok/s, token by token {p['steps_tok_s']:.1f} tok/s "
              f"({p['speedup']:.1f}x); last logits "
              f"{'bit-identical' if p['logits_equal'] else 'DIFFER'}, ids after it "
              f"{'equal' if p['ids_equal'] else 'DIFFER'}")
    print(f"load average {r['load_average'][0]:.2f} before, {r['load_average_after'][0]:.2f} "
          f"after, on {r['cpus']} CPUs; {r['seconds']:.0f} s")
