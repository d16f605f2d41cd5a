"""`python -m engine bench compact`: the compact (c12) trunk against the BF16 trunk, side by side.

* Format: bits/weight and exception rate of c12 on the checkpoint's trunk matrices and on
  harder weights (Student-t, outlier rows, a few large values per row).
* Kernel: the fused c12 matmul against the BF16 kernel on one real-width matrix, in
  weights per second, and the memory read bandwidth (the kernels' threads) in the same run.
* Decode: the same budgets with the BF16 trunk and the compact one, interleaved (BF16,
  c12, BF16, c12 …), each reporting s/token, trunk bytes read per token and pinned layers;
  the ids must match (they are compared). Beside them the disk's own speed for that
  plan's reads (sampled right after), the bytes read ÷ that speed (the I/O bound of a
  token) and the time compute waited on the trunk: where s/token is well above the I/O
  bound the disk is not what bounds it, and fewer bytes cannot make a token faster.
The default checkpoint is synthesised `medium` in --workdir (reused); `--size bench` takes
`bench stream`'s 6.38 GB one, where the trunk streams from disk at budgets such as
`--budgets-gb 0.53,1.06`. Both trunks are packed once beside the checkpoint (the pack
time is reported) and reused. A separate subcommand so `bench stream` can change without it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.bench.forward import memory_reader
from engine.bench.stream import default_workdir, ensure_checkpoint, reference_raw
from engine.checkpoint.compact import eligible, encode, measure
from engine.checkpoint.safetensors import SafetensorsIndex
from engine.checkpoint.schema import TensorNames
from engine.checkpoint.synth import synthesize
from engine.checkpoint.trunk import pack
from engine.decode.generate import GenParams, generate
from engine.errors import EngineError
from engine.kernels import linear
from engine.model.transformer import load_model
from engine.weights.planner import make_plan
from engine.weights.streaming import CheckpointMap, StreamingSource
from k3vocab import GB

PROMPT = [3, 7, 11, 5, 9, 200, 17]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", metavar="DIR", help="an existing checkpoint")
    parser.add_argument("--size", choices=("medium", "bench"), default="medium",
                        help="the synthesised checkpoint without --checkpoint (bench: the "
                        "6.38 GB one `bench stream` uses)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where to synthesise the checkpoint and pack its trunks (default: "
                        "beside the checkpoint)")
    parser.add_argument("--tokens", type=int, default=6, help="tokens decoded per run")
    parser.add_argument("--budgets", default="0.1,0.5,1.0",
                        help="budgets as fractions of the BF16 trunk + minimal cache")
    parser.add_argument("--budgets-gb", default=None, metavar="LIST",
                        help="budgets in GB instead, e.g. 0.53,1.06 on --size bench")
    parser.add_argument("--json", action="store_true")


def _hard(rng) -> dict[str, np.ndarray]:
    def bf16(f):
        return (np.asarray(f, np.float32).view(np.uint32) >> 16).astype(np.uint16)

    shape = (2048, 2048)
    rows = rng.standard_normal(shape) * 0.02
    rows[::64] *= 1e3
    spikes = rng.standard_normal(shape) * 0.02
    spikes[np.arange(shape[0])[:, None], rng.integers(0, shape[1], (shape[0], 4))] = 50.0
    return {"gaussian": bf16(rng.standard_normal(shape) * 0.02),
            "student_t3": bf16(rng.standard_t(3, shape) * 0.02),
            "student_t1.5": bf16(rng.standard_t(1.5, shape) * 0.02),
            "outlier_rows": bf16(rows), "4_spikes_per_row": bf16(spikes)}


def format_section(ck: Path) -> dict[str, Any]:
    index = SafetensorsIndex.open(ck)
    names = TensorNames.detect(index)
    w = b = e = 0
    for name, t in index.tensors.items():
        if ".layers." in name and not names.is_expert(name) and eligible(t.dtype, t.shape):
            s = measure(index.read(name).view(np.uint16).reshape(t.shape))
            w, b, e = w + s.weights, b + s.nbytes, e + s.exceptions
    out = {"checkpoint_trunk": {"bits_per_weight": 8 * b / w, "exception_rate": e / w}}
    for name, bits in _hard(np.random.default_rng(0)).items():
        s = measure(bits)
        out[name] = {"bits_per_weight": s.bits_per_weight, "exception_rate": s.exception_rate}
    return out


def kernel_section(rows: int = 7168, cols: int = 2048, reps: int = 5) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    bits = (np.float32(0.02) * rng.standard_normal((rows, cols), np.float32)).view(np.uint32)
    bits = (bits >> 16).astype(np.uint16)
    m = encode(bits)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    assert np.array_equal(linear(x, bits).view(np.uint32), linear(x, m).view(np.uint32))

    big, read = np.ones(256 << 20 >> 2, np.float32), memory_reader()
    read(big)  # compiled and faulted in before timing
    best = {"bf16": 1e9, "c12": 1e9, "read": 1e9}
    for _ in range(reps):  # interleaved, best of `reps`
        for key, fn in (("bf16", lambda: linear(x, bits)), ("c12", lambda: linear(x, m)),
                        ("read", lambda: read(big))):
            t0 = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t0)
    n = rows * cols
    return {"matrix": [rows, cols], "bf16_gweights_s": n / best["bf16"] / 1e9,
            "c12_gweights_s": n / best["c12"] / 1e9,
            "c12_over_bf16_time": best["c12"] / best["bf16"],
            "read_gb_s": big.nbytes / best["read"] / 1e9}


def _decode(ck: Path, trunk: Path, budget_gb: float, tokens: int) -> dict[str, Any]:
    cmap = CheckpointMap(ck, trunk)
    plan = make_plan(cmap.geometry(), budget_gb=budget_gb)
    with StreamingSource(cmap, plan) as src:
        model = load_model(ck, src)
        toks = list(generate(model, PROMPT, GenParams(max_tokens=tokens)))
        steady = toks[1:]

        def per_token(field):
            return sum(getattr(t.stats, field) or 0.0 for t in steady) / len(steady)

        gb = per_token("gb_read_trunk") + per_token("gb_read_experts")
        # the disk's speed for this plan's reads, through the same pool, right after
        disk = reference_raw(cmap, plan, np.random.default_rng(0))["raw_gb_per_s"]
        return {"ids": [t.id for t in toks], "pinned": len(plan.pinned),
                "s_per_token": sum(t.seconds for t in steady) / len(steady),
                "trunk_gb_per_token": per_token("gb_read_trunk"),
                "wait_trunk_s": per_token("wait_trunk_s"),
                "disk_gb_s": disk, "io_bound_s": gb * GB / 1e9 / disk,
                "streamed_trunk_gb": plan.streamed_trunk_bytes / GB}


def pack_trunks(ck: Path, work: Path) -> tuple[dict[str, Path], dict[str, dict]]:
    """Both trunks of `ck` in `work`, packed once and reused; each pack's summary."""
    trunks = {"bf16": work / "trunk-bf16", "c12": work / "trunk-c12"}
    packed = {kind: pack(ck, path, compact=kind == "c12") for kind, path in trunks.items()}
    return trunks, packed


def decode_section(ck: Path, work: Path, fractions: list[float], tokens: int,
                   budgets_gb: list[float] | None = None) -> list[dict]:
    """BF16 vs c12 interleaved at each budget: `budgets_gb`, else `fractions` of the BF16
    trunk above the smallest budget that decodes."""
    trunks, _ = pack_trunks(ck, work)
    g = CheckpointMap(ck, trunks["bf16"]).geometry()
    floor = max(g.layer_bytes) * 2 + g.min_expert_slots * g.expert_slot_bytes
    budgets = budgets_gb or [(floor + f * g.trunk_bytes) / GB for f in fractions]
    rows = []
    for budget in budgets:
        runs: dict[str, list] = {"bf16": [], "c12": []}
        for _ in range(2):  # interleaved
            for kind in ("bf16", "c12"):
                runs[kind].append(_decode(ck, trunks[kind], budget, tokens))
        b, c = (min(runs[k], key=lambda r: r["s_per_token"]) for k in ("bf16", "c12"))
        rows.append({"budget_gb": budget, "bf16": b, "c12": c, "ids_equal": b["ids"] == c["ids"],
                     "bytes_ratio": c["trunk_gb_per_token"] / max(b["trunk_gb_per_token"], 1e-12),
                     "time_ratio": c["s_per_token"] / b["s_per_token"]})
    return rows


def _numbers(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v < 1e6 for v in values):
        raise EngineError(f"{flag} takes positive numbers separated by commas, e.g. 0.53,1.06.")
    return values


def _checkpoint(args: argparse.Namespace) -> tuple[Path, Path]:
    """The checkpoint and the folder its trunks are packed into."""
    if args.checkpoint:
        ck = Path(args.checkpoint)
        if not (ck / "config.json").is_file():
            raise EngineError(f"{ck} holds no config.json; pass a checkpoint folder.")
    elif args.size == "bench":
        ck = ensure_checkpoint(args.workdir or default_workdir(), None)
    else:
        ck = (args.workdir or default_workdir() / "compact") / "ck-medium"
        if not (ck / "config.json").is_file():
            synthesize(ck, "medium", seed=0)
    work = args.workdir or ck.parent / f"{ck.name}-trunks"
    work.mkdir(parents=True, exist_ok=True)
    return ck, work


def main(args: argparse.Namespace) -> int:
    try:
        return _main(args)
    except EngineError as exc:  # one sentence, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace) -> int:
    fractions = _numbers(args.budgets, "--budgets")
    budgets_gb = _numbers(args.budgets_gb, "--budgets-gb") if args.budgets_gb else None
    ck, work = _checkpoint(args)
    load = open("/proc/loadavg").read().split()[:3]
    _, packed = pack_trunks(ck, work)  # timed here, once; decode_section reuses them
    result = {"loadavg_start": load, "checkpoint": str(ck), "pack": packed,
              "format": format_section(ck), "kernel": kernel_section(),
              "decode": decode_section(ck, work, fractions, args.tokens, budgets_gb),
              "loadavg_end": open("/proc/loadavg").read().split()[:3]}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"load average {' '.join(load)} (shared machine: ratios only)")
    print(f"checkpoint {ck}")
    for kind, p in packed.items():
        print(f"  trunk {kind}: {p['total_bytes'] / 1e9:.3f} GB, " + (
            "already packed" if p.get("already_packed") else f"packed in {p['seconds']:.1f} s"))
    for name, s in result["format"].items():
        print(f"  {name:18} {s['bits_per_weight']:6.2f} bits/weight, "
              f"exceptions {100 * s['exception_rate']:.3f}%")
    k = result["kernel"]
    print(f"kernel {k['matrix']}: BF16 {k['bf16_gweights_s']:.2f} Gw/s, c12 "
          f"{k['c12_gweights_s']:.2f} Gw/s (time x{k['c12_over_bf16_time']:.2f}), "
          f"memory read {k['read_gb_s']:.1f} GB/s")
    for r in result["decode"]:
        b, c = r["bf16"], r["c12"]
        print(f"budget {r['budget_gb']:.3f} GB: pinned {b['pinned']} -> {c['pinned']}, trunk "
              f"{b['trunk_gb_per_token'] * 1e3:.1f} -> {c['trunk_gb_per_token'] * 1e3:.1f} "
              f"MB/token "
              f"(x{r['bytes_ratio']:.2f}), {b['s_per_token']:.3f} -> {c['s_per_token']:.3f} "
              f"s/token (x{r['time_ratio']:.2f}), ids equal: {r['ids_equal']}")
        print(f"  disk {b['disk_gb_s']:.2f} / {c['disk_gb_s']:.2f} GB/s: bytes read / disk "
              f"{b['io_bound_s']:.3f} -> {c['io_bound_s']:.3f} s/token; waited on the trunk "
              f"{b['wait_trunk_s']:.3f} -> {c['wait_trunk_s']:.3f} s/token")
    print(f"load average at the end {' '.join(result['loadavg_end'])}")
    return 0
