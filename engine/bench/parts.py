"""Measure this machine's parts for the real model's forecast, in about a minute.

`python -m engine bench parts [--dir PATH] [--json]`:
* disk under PATH (default: the current folder) with the engine's read pattern: a scratch
  file is written, then read O_DIRECT through the engine's ReadPool at the plan's queue
  depth as trunk-sized runs at read-ahead priority (the ring's), as the streamed head's
  64 MB urgent chunks, and as 17.5 MB expert reads at unaligned offsets, top-k at once,
  urgent, in the engine's 1 MB expert chunks; the scratch file is removed;
* compute of one real-width KDA-MoE layer, MLA-MoE layer, dense layer 0 and the head
  (BF16 163,840 x 7168), one decode token each through the engine's decoder layer and
  kernels on this machine's cores (random weights in the on-disk dtypes; the router, the
  shared and the routed experts included; the MoE layers also timed up to the moment they
  ask for their experts), the token's work outside its layers (embedding row, output
  aggregation, norm, head: `head_s`), all timed inside decode tokens through the engine's
  `Model.step`; the top-k routed experts alone, the head's matvec alone, and the share of
  the routed experts that the attention-time guess (the engine's expert read-ahead) names;
  `--widths DIR`: at the widths of the checkpoint in DIR instead (bench slice uses it);
* the memory read bandwidth: the head's own bytes read by the kernels' threads, in turns
  with the head's matvec, for the kernels' fraction of it.
Its own memory is small and stated: the layer kinds' matrices and the head are views of one
shared array (about 2.4 GB at the real widths, ~3.4 GB peak RSS in all); it prints its
expected peak first, and refuses, before measuring, when less memory is available here.
With `--json`, one object on stdout (a k3tui command consumes it), schema:
  {"schema": 1, "load_average": [1, 5, 15 min],
   "disk": {"dir": str, "direct": bool, "scratch_gb": float,
            "sequential_gb_per_s", "chunk_gb_per_s", "expert_gb_per_s": float,
            "queue_depth": int},
   "compute": {"kda_moe_layer_s", "mla_moe_layer_s", "dense_layer0_s", "head_s",
               "kda_moe_pre_experts_s", "mla_moe_pre_experts_s", "routed_experts_s",
               "head_matvec_s", "guess_hit_rate": float, "threads": int,
               "kernels": "fused (numba)" | "numpy reference"},
   "memory_bandwidth_gb_per_s": float,
   "presets": [{"name", "fits" (bool: forecast peak RSS <= 95 % of available memory here),
                "s_per_token", "bound" ("disk"|"compute"), "first_token_s" (50-token prompt),
                "first_token_s_by_prompt": {"50", "500"}, "prefill_expert_gb_by_prompt",
                "peak_rss_gb", "gb_read_per_token"}],
   "expected_peak_rss_gb", "peak_rss_gb" (this process's, by getrusage at the end): float,
   "note": str}
`presets` is the real 93-layer model's forecast (engine.decode.forecast) per preset.
Hidden `--quick`, or K3_BENCH_PARTS_QUICK=1 in the environment (so a test can run any
command that measures, e.g. `k3tui setup --yes --forecast`, end to end): a 32 MB scratch
file and the tiny synth widths (or --widths') instead of the real ones, in a few seconds.
Its figures are not the machine's; only the schema is the same (and "quick": true).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from engine import kernels
from engine.bench.forward import REAL_WIDTHS, BenchSource, _Filler, memory_reader, time_mxfp4
from engine.checkpoint.schema import expected_tensors
from engine.checkpoint.synth import flat_config
from engine.core.config import ModelConfig
from engine.core.directio import FileTable, Layout, ReadPool, TensorSpec, aligned_buffer
from engine.decode.forecast import LayerKinds, Parts, forecast
from engine.errors import EngineError
from engine.model.mla import MLAState
from engine.model.transformer import Model
from engine.weights.geometry import geometry_from_config, plan_for, real_config
from engine.weights.planner import HEAD_CHUNK_BYTES, default_threads
from engine.weights.source import ExpertWeights
from engine.weights.streaming import EXPERT_CHUNK, EXPERT_PRIORITY, TRUNK_PRIORITY
from engine.weights.sysmem import current_rss, peak_rss, read_memory_facts
from k3vocab import GB, PRESETS

NOTE = ("a forecast from measured parts (this disk, these cores, real-width layers with "
        "random weights), not a run of the real model")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=".", metavar="PATH",
                        help="measure the disk holding PATH (where the model would live)")
    parser.add_argument("--scratch-gb", type=float, default=1.0, metavar="X",
                        help="size of the scratch file read back (default 1)")
    parser.add_argument("--tokens", type=int, default=4, help="timed decode tokens")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--widths", metavar="DIR",
                        help="measure compute at the widths of the checkpoint in DIR")
    parser.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- disk ---------------------------------------------------------------------------------
def measure_disk(folder: Path, scratch_bytes: int, expert_bytes: int, top_k: int,
                 threads: int, trunk_run: int) -> dict[str, Any]:
    """The three ways the engine reads, each as the engine issues it: trunk runs at
    read-ahead priority (the ring's), the streamed head's chunks urgent and one at a time,
    and top-k experts at once, urgent, in the engine's expert chunks."""
    fd, name = tempfile.mkstemp(prefix=".k3-bench-parts-", dir=folder)
    path = Path(name)
    try:
        block = np.random.default_rng(0).integers(0, 256, 1 << 24, dtype=np.uint8)
        with os.fdopen(fd, "wb") as f:
            for _ in range(max(1, scratch_bytes // block.size)):
                f.write(block.data)
            f.flush()
            os.fsync(f.fileno())
        size = path.stat().st_size
        files, pool = FileTable(), ReadPool(threads)
        try:
            direct = files.get(path).direct
            seq = _runs(pool, files, path, size, min(trunk_run, size // 2), (TRUNK_PRIORITY, 0))
            chunk = _runs(pool, files, path, size, min(HEAD_CHUNK_BYTES, size // 2),
                          (EXPERT_PRIORITY, -1))
            ebuf = aligned_buffer(top_k * (expert_bytes + 8192))
            ebuf[:] = 0
            rng = np.random.default_rng(1)
            secs, n = 0.0, 0
            for _ in range(3):
                offs = rng.choice((size - expert_bytes) // 4099, top_k, replace=False) * 4099
                t = time.perf_counter()
                pos, batches = 0, []
                for i, o in enumerate(sorted(offs)):
                    lay = _layout(path, int(o), expert_bytes)
                    batches.append(pool.submit(lay.reads(files, ebuf[pos : pos + lay.nbytes]),
                                               (EXPERT_PRIORITY, i), chunk=EXPERT_CHUNK))
                    pos += lay.nbytes
                for b in batches:
                    b.wait()
                secs += time.perf_counter() - t
                n += top_k * expert_bytes
        finally:
            pool.close()
            files.close()
    finally:
        path.unlink(missing_ok=True)
    return {"dir": str(folder), "direct": bool(direct), "scratch_gb": size / GB,
            "sequential_gb_per_s": seq / GB, "chunk_gb_per_s": chunk / GB,
            "expert_gb_per_s": n / secs / GB, "queue_depth": threads}


def _layout(path: Path, start: int, nbytes: int):
    return Layout([TensorSpec("t", path, start, nbytes, np.dtype(np.uint8), (nbytes,))])


def _runs(pool, files, path: Path, size: int, run: int, priority: tuple) -> float:
    """Bytes per second reading the file start to end in runs of `run` bytes, one at a time."""
    buf = aligned_buffer(run + 8192)
    buf[:] = 0  # the engine's buffers are touched once; page faults are not disk time
    secs, n = 0.0, 0
    for start in range(0, size - run + 1, run):
        lay = _layout(path, start, run)
        t = time.perf_counter()
        pool.submit(lay.reads(files, buf[: lay.nbytes]), priority).wait()
        secs += time.perf_counter() - t
        n += run
    return n / secs


# ---- compute ------------------------------------------------------------------------------
_TILE = 1 << 22  # _Filler's random block: a matrix starting at a multiple of it holds the
# values a tile of its own would (the attention-time guess's hit rate depends on them)
_PAGE = 2048  # BF16 elements in 4 KB
_F32 = ("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias")  # _Filler's F32


def _shared_layout(cfg) -> tuple[dict[int, dict[str, tuple[int, tuple]]], list[tuple]]:
    """Where each layer kind's (0 dense, 1 KDA-MoE, 3 MLA-MoE) BF16 matrices lie in one
    shared array, every kind from its start and each matrix at a multiple of _TILE, the
    head at the start too; and the union of those ranges in whole pages (the rest of the
    array is never touched, so never resident)."""
    shapes = expected_tensors(cfg)
    kinds: dict[int, dict[str, tuple[int, tuple]]] = {}
    used = [(0, cfg.vocab_size * cfg.hidden_size)]
    for kind in (0, 1, 3):
        p, at = f"layers.{kind}.", 0
        kinds[kind] = {}
        for name, shape in shapes.items():
            if name.startswith(p) and ".experts." not in name and len(shape) == 2 \
                    and shape[0] > 1 and not name.endswith(_F32):  # _Filler.tensor's tiles
                n = int(np.prod(shape))
                kinds[kind][name[len(p):]] = (at, shape)
                used.append((at, at + n))
                at += -(-n // _TILE) * _TILE
    union: list[tuple] = []
    for lo, hi in sorted(used):
        hi = -(-hi // _PAGE) * _PAGE
        if union and lo <= union[-1][1]:
            union[-1] = (union[-1][0], max(union[-1][1], hi))
        else:
            union.append((lo, hi))
    return kinds, union


def compute_weight_bytes(cfg) -> int:
    """What the compute measurement's weights hold: the shared array's used ranges (about
    the largest layer kind or the head), each kind's vectors (F32 at most) and the routed
    experts' pool."""
    layout, union = _shared_layout(cfg)
    shapes = expected_tensors(cfg)
    vectors = sum(4 * int(np.prod(shape)) for kind in layout for name, shape in shapes.items()
                  if name.startswith(f"layers.{kind}.") and ".experts." not in name
                  and name[len(f"layers.{kind}."):] not in layout[kind])
    expert = geometry_from_config(cfg).expert_bytes
    return (sum(2 * (hi - lo) for lo, hi in union) + vectors
            + (cfg.num_experts_per_token + 1) * expert)


def _filled(union: list[tuple], fill) -> np.ndarray:
    """The shared array with _Filler.tile's values (by position in the tile) in `union`."""
    shared = np.zeros(union[-1][1], np.uint16)  # calloc'd: only the pages written are resident
    for lo, hi in union:
        for b in range(lo // _TILE * _TILE, hi, _TILE):
            i, j = max(b, lo), min(b + _TILE, hi)
            shared[i:j] = fill.bf16[i - b : j - b]
    return shared


def _timed_source(cfg, pool: int, fill):
    """The bench's in-memory source with every layer of `cfg` (the dense, KDA-MoE and
    MLA-MoE layers' weights shared by the layers of their kind) and the model tensors (the
    embedding shares the head's array: same shape). The matrices of all kinds and the head
    are views of one array of random BF16 (`_shared_layout`): each layer still streams its
    own bytes from memory through the same kernels, and the RAM held is that of the
    largest, not of them all. It notes the wall time spent inside each layer, when each
    layer asks for its experts, and how many of the routed experts the guesses named (the
    model guesses a layer ahead and at the attention, as under expert read-ahead)."""
    shapes = expected_tensors(cfg)
    layout, union = _shared_layout(cfg)
    shared = _filled(union, fill)
    lat, m = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size

    def view(at: int, shape: tuple) -> np.ndarray:
        return shared[at : at + int(np.prod(shape))].reshape(shape)

    def weights(kind: int) -> dict[str, np.ndarray]:
        p, mats, out = f"layers.{kind}.", layout[kind], {}
        for name, shape in shapes.items():
            short = name[len(p):]
            if name.startswith(p) and ".experts." not in name:
                out[short] = view(*mats[short]) if short in mats else fill.tensor(name, shape, cfg)
        return out

    def expert() -> ExpertWeights:
        def scales(rows: int, cols: int) -> np.ndarray:
            return fill.rng.integers(118, 124, (rows, cols // 32), dtype=np.uint8)

        return ExpertWeights(fill.tile(fill.bytes, (m, lat // 2)), scales(m, lat),
                             fill.tile(fill.bytes, (lat, m // 2)), scales(lat, m),
                             fill.tile(fill.bytes, (m, lat // 2)), scales(m, lat))

    class TimedSource(BenchSource):
        wants_guesses = True

        def __init__(self) -> None:  # not BenchSource's: it builds layers 1 and 3 apart
            self.pool = [expert() for _ in range(pool)]
            self.next_slot = 0
            kinds = {kind: weights(kind) for kind in layout}
            self.layers = {L: kinds[0 if not cfg.is_moe(L) else 3 if cfg.is_mla(L) else 1]
                           for L in range(cfg.num_hidden_layers)}
            head = view(0, (cfg.vocab_size, cfg.hidden_size))
            self.model = {"lm_head.weight": head, "embed_tokens.weight": head}
            for short in ("norm.weight", "output_attn_res_norm.weight",
                          "output_attn_res_proj.weight"):
                self.model[short] = fill.tensor(short, shapes[short], cfg)
            self.inside: dict[int, float] = {}
            self.asked: dict[int, float] = {}
            self.guessed: dict[int, set[int]] = {}
            self.named = self.routed = 0

        @contextmanager
        def layer(self, index):
            t = time.perf_counter()
            self.asked[index] = t
            try:
                yield self.layers[index]
            finally:
                self.inside[index] = time.perf_counter() - t
                self.asked[index] -= t

        def model_tensor(self, name):
            return self.model[name]

        def resident_layer(self, index):
            return self.layers[index]  # all in memory: the model also guesses a layer ahead

        def guess(self, layer, ids):
            self.guessed.setdefault(layer, set()).update(int(e) for e in ids)

        @contextmanager
        def experts(self, layer, ids):
            self.asked[layer] = time.perf_counter()
            self.named += len(self.guessed.pop(layer, set()) & {int(e) for e in ids})
            self.routed += len(ids)
            with super().experts(layer, ids) as out:
                yield out

    return TimedSource()


def measure_compute(tokens: int, cfg) -> dict[str, Any]:
    """Decode tokens through the engine's `Model.step` at `cfg`'s widths (its kernels and
    threads, weights in memory): per layer kind the median seconds of a layer (router,
    shared and routed experts included) and of its start until it asks for its experts;
    the token's work outside its layers (embedding row, output aggregation, norm, head);
    the top-k routed experts alone; and the head's BF16 matvec alone."""
    rng = np.random.default_rng(2)
    fill = _Filler(3)
    src = _timed_source(cfg, cfg.num_experts_per_token + 1, fill)  # more than the CPU cache
    model = Model(cfg, src)
    state = model.new_state()
    context = 256  # MLA cache positions before the timed tokens
    for layer_state in state.layers:
        if isinstance(layer_state, MLAState):
            layer_state.append(rng.standard_normal((context, cfg.mla_latent_width))
                               .astype(np.float32))
    state.position = context
    kinds = {L: "dense" if not cfg.is_moe(L) else "mla_moe" if cfg.is_mla(L) else "kda_moe"
             for L in range(cfg.num_hidden_layers)}
    full: dict[str, list[float]] = {k: [] for k in set(kinds.values())}
    pre: dict[str, list[float]] = {k: [] for k in full}
    outside = []
    for i in range(tokens + 1):  # the first token compiles and warms up
        t = time.perf_counter()
        model.step(int(rng.integers(cfg.vocab_size)), state)
        wall = time.perf_counter() - t
        if i:
            for L, kind in kinds.items():
                full[kind].append(src.inside[L])
                pre[kind].append(src.asked[L])
            outside.append(wall - sum(src.inside.values()))
    out: dict[str, Any] = {"kda_moe_layer_s": statistics.median(full["kda_moe"]),
                           "mla_moe_layer_s": statistics.median(full["mla_moe"]),
                           "dense_layer0_s": statistics.median(full["dense"]),
                           "kda_moe_pre_experts_s": statistics.median(pre["kda_moe"]),
                           "mla_moe_pre_experts_s": statistics.median(pre["mla_moe"]),
                           "head_s": statistics.median(outside),
                           "guess_hit_rate": src.named / max(src.routed, 1)}
    trunk = {1: src.trunk_bytes(1), 3: src.trunk_bytes(3), 0: src.trunk_bytes(0)}
    runs = [time_mxfp4(src, cfg, cfg.num_experts_per_token, rng) for _ in range(3)]
    wall, nbytes, _ = min(runs)
    out["routed_experts_s"] = statistics.median(r[0] for r in runs)
    out["mxfp4_gb_per_s"] = nbytes / wall / GB  # one token through top-16 experts
    head = src.model["lm_head.weight"]
    x = rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)
    # The bandwidth reference reads the head's own bytes with the kernels' threads, taking
    # turns with the matvec: measured apart, a VM's swings put the kernel above it.

    words, read = head.reshape(-1).view(np.float32), memory_reader()
    times, reads = [], []
    for _ in range(tokens + 1):
        t = time.perf_counter()
        kernels.linear(x, head)
        times.append(time.perf_counter() - t)
        t = time.perf_counter()
        read(words)
        reads.append(time.perf_counter() - t)
    out["head_matvec_s"] = statistics.median(times[1:])
    out["read_gb_per_s"] = words.nbytes / min(reads[1:]) / GB
    out["trunk_gb"] = {"kda_moe": trunk[1] / GB, "mla_moe": trunk[3] / GB, "dense": trunk[0] / GB,
                       "head": head.nbytes / GB}
    out["kernels"] = "fused (numba)" if kernels.FUSED else "numpy reference"
    out["threads"] = kernels.compute_threads()
    return out


def preset_forecasts(parts_json: dict[str, Any]) -> list[dict[str, Any]]:
    """The real 93-layer model's forecast for each preset, from a parts measurement."""
    parts = Parts.from_dict(parts_json)
    kinds = LayerKinds.of(real_config())
    avail = read_memory_facts().available
    rows = []
    for name in PRESETS:
        plan = plan_for("real", name)
        f = forecast(parts, kinds, plan)
        rows.append({"name": name, "fits": bool(avail) and plan.forecast_rss_bytes <= 0.95 * avail,
                     **f})
    return rows


def checkpoint_widths(folder: Path):
    """The config of the checkpoint in `folder`, to measure compute at its widths: its
    layers 0, 1 and 3 must be dense, KDA-MoE and MLA-MoE, as in the release."""
    cfg = ModelConfig.from_dir(folder)
    if cfg.num_hidden_layers < 4 or cfg.is_moe(0) or cfg.is_mla(1) or not cfg.is_mla(3) \
            or not (cfg.is_moe(1) and cfg.is_moe(3)):
        raise ValueError(f"{folder}'s layers 0, 1 and 3 are not dense, KDA-MoE and MLA-MoE "
                         "as in the release")
    return cfg


RUNTIME_BYTES = 800 * 10**6  # interpreter, numpy, numba and its compiler, activations, slack


def expected_peak_bytes(cfg, g, scratch_bytes: int) -> int:
    """This measurement's own peak RSS above what the process holds now: the runtime and
    the largest of its phases, each freeing its memory before the next: the disk's read
    buffers, the compute's weights (`compute_weight_bytes`; the numpy reference also widens
    a matrix to F32 at a time; the bandwidth test reads the head among them)."""
    run = min(max(g.layer_bytes[1:]), scratch_bytes // 2)
    disk = (1 << 24) + run + g.top_k * (g.expert_bytes + 8192)
    widen = 0 if kernels.FUSED else 4 * max(int(np.prod(s)) for s in
                                            expected_tensors(cfg).values())  # F32 copy
    return RUNTIME_BYTES + max(disk, compute_weight_bytes(cfg) + widen)


def measure(folder: Path, scratch_gb: float, tokens: int, quick: bool = False,
            cfg=None) -> dict[str, Any]:
    """Disk, compute and bandwidth; compute at `cfg`'s widths (default: the release's).
    Refuses (EngineError) before measuring when the memory available here is less than
    the measurement's expected peak needs."""
    if quick:  # the schema at toy cost: for tests of the consumers, not a measurement
        scratch_gb = 0.032
        cfg = cfg or ModelConfig.from_dict(flat_config("tiny"))
    own = cfg is not None
    cfg = cfg or ModelConfig.from_dict(REAL_WIDTHS)
    g = geometry_from_config(cfg if own else real_config())
    expert, top_k, run = g.expert_bytes, g.top_k, max(g.layer_bytes[1:])
    need = expected_peak_bytes(cfg, g, int(scratch_gb * GB))
    avail = read_memory_facts().available
    if avail < need:
        raise EngineError(f"measuring needs {need / GB:.1f} GB of free memory and "
                          f"{avail / GB:.1f} GB is available; close some programs and run it "
                          "again.")
    expected = current_rss() + need
    log(f"expected peak memory (RSS): {expected / GB:.1f} GB")
    res: dict[str, Any] = {"schema": 1, "quick": quick, "load_average": list(os.getloadavg())}
    log(f"disk under {folder}: {scratch_gb:g} GB scratch file, trunk runs and expert reads ...")
    res["disk"] = measure_disk(folder, int(scratch_gb * GB), expert, top_k, default_threads(g),
                               run)
    log(("compute: " + ("the checkpoint's" if own else "real") + "-width KDA-MoE, MLA-MoE, "
         "dense layer 0 and head (their weights in one array) ..."))
    res["compute"] = measure_compute(tokens, cfg)
    res["memory_bandwidth_gb_per_s"] = res["compute"]["read_gb_per_s"]
    res["presets"] = preset_forecasts(res)
    res["load_average_after"] = list(os.getloadavg())
    res["expected_peak_rss_gb"] = expected / GB
    res["peak_rss_gb"] = peak_rss() / GB
    res["note"] = NOTE
    return res


def main(args: argparse.Namespace) -> int:
    folder = Path(args.dir)
    if not folder.is_dir():
        print(f"error: {folder} is not a folder; give --dir a folder on the disk to measure.",
              file=sys.stderr)
        return 2
    if not 0.1 <= args.scratch_gb <= 64 or args.tokens < 1:
        print("error: --scratch-gb must be 0.1 to 64 and --tokens at least 1.", file=sys.stderr)
        return 2
    quick = args.quick or os.environ.get("K3_BENCH_PARTS_QUICK") == "1"
    try:
        cfg = checkpoint_widths(Path(args.widths)) if args.widths else None
    except (EngineError, ValueError) as exc:
        print(f"error: --widths: {exc}; give a checkpoint folder laid out as the release.",
              file=sys.stderr)
        return 2
    try:
        res = measure(folder, args.scratch_gb, args.tokens, quick, cfg)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot measure the disk under {folder} ({exc.strerror or exc}); "
              "check it is writable and has space.", file=sys.stderr)
        return 1  # failed; 2 is for what was refused before measuring
    if args.json:
        print(json.dumps(res))
        return 0
    d, c = res["disk"], res["compute"]
    print(f"disk {d['dir']}: sequential {d['sequential_gb_per_s']:.2f} GB/s, experts "
          f"{d['expert_gb_per_s']:.2f} GB/s (queue depth {d['queue_depth']}"
          f"{'' if d['direct'] else ', page cache: O_DIRECT refused'})")
    print(f"compute ({c['kernels']}, {c['threads']} threads): KDA-MoE {c['kda_moe_layer_s']:.3f}"
          f" s, MLA-MoE {c['mla_moe_layer_s']:.3f} s, dense {c['dense_layer0_s']:.3f} s, head "
          f"{c['head_s']:.3f} s; load {res['load_average'][0]:.2f}")
    print(f"this measurement's peak memory (RSS): {res['peak_rss_gb']:.2f} GB "
          f"(expected at most {res['expected_peak_rss_gb']:.2f} GB)")
    print(f"real 93-layer Kimi-K3 on this machine — {NOTE}:")
    for p in res["presets"]:
        print(f"  {p['name']:<12} fits={'yes' if p['fits'] else 'no ':<3} "
              f"{p['s_per_token']:8.1f} s/token ({p['bound']}-bound)  first token "
              f"{p['first_token_s_by_prompt']['50']:.0f} s / "
              f"{p['first_token_s_by_prompt']['500']:.0f} s (50/500-token prompt)  "
              f"peak RSS {p['peak_rss_gb']:.1f} GB")
    return 0
