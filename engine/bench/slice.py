"""The real-width slice under a ladder of budgets, against the forecast from measured parts.

`python -m engine bench slice [--dir DIR] [--budgets 2.7,4.5,7,max] [--gen N] [--json]`
synthesises (or reuses) the slice (`synth --size slice`: real widths, vocab and expert
size; 4 layers, 64 experts, 13.8 GB) under DIR (default ~/.cache/k3-engine/slice; any
checkpoint laid out like the release also runs: dense layer 0, KDA-MoE layer 1, MLA-MoE
layer 3), measures this machine's parts the way `bench parts` does (disk on the slice's
own folder, compute at the checkpoint's widths, memory bandwidth), then runs
`python -m engine run` on it at each budget in a subprocess and prints per rung: measured
s/token and the forecast for the checkpoint's geometry and plan (engine.decode.forecast,
the method that forecasts the real model), each term side by side (compute, waiting for
the trunk and for experts, expert hit rate, GB read per token), and peak RSS against the
plan's forecast. `max` is a budget that holds every weight (the fully resident slice).
Parts are measured just before and just after each rung (a shared machine's load
moves): the forecast is the mean of the two. `--json`: one object with `layers` (the
first rung's) and `ladder`: [{budget_gb, s_per_token, forecast_s_per_token, error,
peak_rss_gb, forecast_rss_gb, gb_read_per_token, forecast_gb_read_per_token,
terms: {name: [measured, forecast]}, layers: per-layer compute with the BF16 and MXFP4
throughput as fractions of the bandwidth measured in the same run, ...}].
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from engine.bench.parts import checkpoint_widths
from engine.checkpoint.synth import synthesize
from engine.decode.forecast import LayerKinds, Parts, forecast
from engine.errors import EngineError
from engine.weights.planner import gb_arg, make_plan
from engine.weights.streaming import CheckpointMap
from k3vocab import GB

DEFAULT_DIR = Path.home() / ".cache" / "k3-engine" / "slice"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=str(DEFAULT_DIR), metavar="DIR",
                        help="where the slice is (or is written: 13.8 GB)")
    parser.add_argument("--budgets", default="2.7,4.5,7,max", metavar="GB,...",
                        help="the ladder of --budget-gb values; max: every weight resident")
    parser.add_argument("--gen", type=int, default=6, help="tokens generated per rung")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_slice(folder: Path) -> Path:
    if (folder / "config.json").is_file():
        try:
            checkpoint_widths(folder)
        except (EngineError, ValueError) as exc:
            raise SystemExit(f"error: {exc}; give --dir a new folder for the slice.") from None
        return folder
    log(f"writing the slice (13.8 GB) to {folder} ...")
    return synthesize(folder, "slice", progress=log)


def _engine(args: list[str]) -> dict[str, Any]:
    """`python -m engine ARGS --json` in a child: its peak RSS is its own (Linux carries a
    parent's high-water mark into children, so the parent stays small and measures nothing)."""
    out = subprocess.run([sys.executable, "-m", "engine", *args, "--json"], capture_output=True,
                         text=True, timeout=1800,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr else "failed")
    return json.loads(out.stdout)


def measure_parts(folder: Path) -> dict[str, Any]:
    """`bench parts` on the slice's folder at its widths, just before a rung: on a shared
    machine only figures measured side by side are comparable."""
    log("measuring disk (on the slice's folder) and compute at its widths ...")
    return _engine(["bench", "parts", "--dir", str(folder), "--widths", str(folder),
                    "--scratch-gb", "2"])


def budget_of(word: str, geometry) -> float:
    """A ladder entry: GB, or `max` (a budget holding every trunk layer and expert)."""
    if word == "max":
        return float(gb_arg(geometry.all_weights_bytes))
    return float(word)


# (measured `run --json` total, forecast replay term) side by side per rung
TERMS = (("compute_s_per_token", "compute_s"), ("wait_trunk_s_per_token", "wait_trunk_s"),
         ("wait_experts_s_per_token", "wait_experts_s"))


def rung(folder: Path, budget: float, gen: int) -> dict[str, Any]:
    """One budget: parts measured just before and just after the run (the load of a shared
    machine moves), the forecast from each, and their mean against what the run measured."""
    cmap = CheckpointMap(folder)
    plan = make_plan(cmap.geometry(), budget_gb=budget, check_memory=False)
    kinds = LayerKinds.of(cmap.config)
    before = measure_parts(folder)
    log(f"budget {budget:g} GB: running {gen} tokens ...")
    ids = f"3,7,11,{min(163000, cmap.config.vocab_size - 1)}"
    t = _engine(["run", str(folder), "--ids", ids, "--gen", str(gen),
                 "--budget-gb", f"{budget:g}"])["totals"]
    after = measure_parts(folder)
    fs = [forecast(_parts(p), kinds, plan) for p in (before, after)]
    f = fs[0]

    def mean(get) -> float:
        return (get(fs[0]) + get(fs[1])) / 2

    s, fc = t["s_per_token"], mean(lambda x: x["s_per_token"])
    head = plan.geometry.table_bytes / 2 / GB if plan.stream_tables else 0.0
    terms = {m: [t[m], mean(lambda x, k=k: x["terms"][k])] for m, k in TERMS}
    terms["expert_hit_rate"] = [t.get("true_hit_rate"), f["expert_hit_rate"]]
    terms["gb_read_experts_per_token"] = [t["gb_read_experts_per_token"],
                                          f["gb_read_experts_per_token"]]
    return {
        "budget_gb": budget, "s_per_token": s, "forecast_s_per_token": fc, "error": fc / s - 1,
        "forecast_s_per_token_before_after": [x["s_per_token"] for x in fs],
        "bound": f["bound"],
        "peak_rss_gb": t["peak_rss_gb"], "forecast_rss_gb": plan.forecast_rss_bytes / GB,
        "gb_read_per_token": t["gb_read_per_token"],
        # the run's count leaves out the streamed head, so the forecast's does here too
        "forecast_gb_read_per_token": f["gb_read_per_token"] - head,
        "gb_read_trunk_per_token": t["gb_read_trunk_per_token"], "terms": terms,
        "layers": layer_table(before), "disk_gb_per_s": {k: [x["disk"][f"{k}_gb_per_s"]
                                                           for x in (before, after)]
                                                       for k in ("sequential", "chunk", "expert")},
        "load_average": before["load_average"],
        "load_average_after": after["load_average_after"],
        "stream_tables": plan.stream_tables, "pinned_layers": len(plan.pinned),
        "ring_slots": plan.ring_slots, "expert_slots": plan.expert_slots,
        "guess_experts": plan.guess_experts, "decode_tokens": t["decode_tokens"],
    }


def _parts(measured: dict[str, Any]):
    return Parts.from_dict(measured)


def layer_table(parts: dict[str, Any]) -> dict[str, Any]:
    c, bw = parts["compute"], parts["memory_bandwidth_gb_per_s"]
    gb = c["trunk_gb"]
    return {
        "kda_moe_s": c["kda_moe_layer_s"], "mla_moe_s": c["mla_moe_layer_s"],
        "dense_s": c["dense_layer0_s"], "head_s": c["head_s"],
        # the head is one BF16 matvec; the experts one MXFP4 token through top-16
        "bf16_fraction_of_bandwidth": gb["head"] / c["head_matvec_s"] / bw,
        "mxfp4_fraction_of_bandwidth": c["mxfp4_gb_per_s"] / bw,
        "memory_bandwidth_gb_per_s": bw,
    }


def main(args: argparse.Namespace) -> int:
    if args.gen < 2:
        print("error: --gen must be at least 2 (the first token carries the prompt).",
              file=sys.stderr)
        return 2
    folder = ensure_slice(Path(args.dir).expanduser())

    geometry = CheckpointMap(folder).geometry()
    try:
        budgets = [budget_of(x.strip(), geometry) for x in args.budgets.split(",") if x.strip()]
    except ValueError:
        print("error: --budgets takes GB values or max separated by commas, e.g. 2.7,4.5,7,max.",
              file=sys.stderr)
        return 2
    res: dict[str, Any] = {"load_average": list(os.getloadavg())}
    try:
        res["ladder"] = [rung(folder, b, args.gen) for b in budgets]
    except (RuntimeError, subprocess.TimeoutExpired, ValueError, EngineError) as exc:
        print(f"error: a rung failed: {exc}", file=sys.stderr)
        return 1
    res["load_average_after"] = list(os.getloadavg())
    if args.json:
        print(json.dumps(res))
        return 0
    lt = res["layers"] = res["ladder"][0]["layers"]
    print(f"per layer at real widths: KDA-MoE {lt['kda_moe_s'] * 1e3:.0f} ms, MLA-MoE "
          f"{lt['mla_moe_s'] * 1e3:.0f} ms, dense {lt['dense_s'] * 1e3:.0f} ms, head "
          f"{lt['head_s'] * 1e3:.0f} ms; BF16 {lt['bf16_fraction_of_bandwidth']:.0%} and MXFP4 "
          f"{lt['mxfp4_fraction_of_bandwidth']:.0%} of {lt['memory_bandwidth_gb_per_s']:.1f} GB/s")
    print("budget_gb  s/token  forecast  error  GB/token (fc)  peak_rss  forecast_rss   "
          "compute (fc)  wait trunk (fc)  wait experts (fc)  hit (fc)")
    for r in res["ladder"]:
        tm = r["terms"]
        pair = "  ".join(f"{tm[m][0]:6.3f} ({tm[m][1]:.3f})" for m, _ in TERMS)
        hit, fgb = tm["expert_hit_rate"], r["forecast_gb_read_per_token"]
        print(f"{r['budget_gb']:9.2f} {r['s_per_token']:8.3f} {r['forecast_s_per_token']:9.3f} "
              f"{r['error']:+6.0%} {r['gb_read_per_token']:6.2f} ({fgb:.2f}) "
              f"{r['peak_rss_gb']:9.2f} {r['forecast_rss_gb']:12.2f}   {pair}  "
              f"{(hit[0] or 0):.2f} ({hit[1]:.2f})")
    print(f"load average {res['load_average'][0]:.2f} before, "
          f"{res['load_average_after'][0]:.2f} after (its own threads count in it)")
    return 0
