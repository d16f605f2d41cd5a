"""The real-width slice under a ladder of budgets, against the forecast from measured parts.

`python -m engine bench slice [--dir DIR] [--budgets 2.7,4.5,7] [--json]` synthesises (or
reuses) the slice (`synth --size slice`: real widths, vocab and expert size; 4 layers,
64 experts, 13.8 GB) under DIR (default ~/.cache/k3-engine/slice), measures this machine's
parts the way `bench parts` does (disk on the slice's own files, real-width layer compute,
memory bandwidth), then runs `python -m engine run` on the slice at each budget in a
subprocess and prints per rung: measured s/token and the forecast for the slice's geometry
(engine.decode.forecast, the method that forecasts the real model), GB read per token, and
peak RSS against the plan's forecast. Parts are re-measured just before each rung
(a shared machine's load moves). `--json`: one object with `layers` (the first rung's) and
`ladder`: [{budget_gb, s_per_token, forecast_s_per_token, error, peak_rss_gb,
forecast_rss_gb, gb_read_per_token, layers: per-layer compute at real widths with the BF16
and MXFP4 throughput as fractions of the bandwidth measured in the same run, ...}].
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

GB = 1e9
DEFAULT_DIR = Path.home() / ".cache" / "k3-engine" / "slice"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=str(DEFAULT_DIR), metavar="DIR",
                        help="where the slice is (or is written: 13.8 GB)")
    parser.add_argument("--budgets", default="2.7,4.5,7", metavar="GB,...",
                        help="the ladder of --budget-gb values")
    parser.add_argument("--gen", type=int, default=4, help="tokens generated per rung")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_slice(folder: Path) -> Path:
    from engine.checkpoint.synth import synthesize
    from engine.model.config import ModelConfig

    if (folder / "config.json").is_file():
        cfg = ModelConfig.from_dir(folder)
        if cfg.hidden_size == 7168 and cfg.vocab_size == 163840:
            return folder
        raise SystemExit(f"error: {folder} holds another checkpoint; give --dir a new folder.")
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
    """`bench parts` on the slice's folder, just before a rung: on a shared machine only
    figures measured side by side are comparable."""
    log("measuring disk (on the slice's folder) and real-width compute ...")
    return _engine(["bench", "parts", "--dir", str(folder), "--scratch-gb", "2"])


def rung(folder: Path, budget: float, gen: int) -> dict[str, Any]:
    from engine.decode.forecast import LayerKinds, Parts, forecast
    from engine.weights.planner import make_plan
    from engine.weights.streaming import CheckpointMap

    parts = measure_parts(folder)
    cmap = CheckpointMap(folder)
    plan = make_plan(cmap.geometry(), budget_gb=budget, check_memory=False)
    f = forecast(Parts.from_dict(parts), LayerKinds.of(cmap.config), plan)
    log(f"budget {budget:g} GB: running {gen} tokens ...")
    t = _engine(["run", str(folder), "--ids", "3,7,11,163000", "--gen", str(gen),
                 "--budget-gb", f"{budget:g}"])["totals"]
    s = t["s_per_token"]
    head = plan.geometry.table_bytes / 2 / GB if plan.stream_tables else 0.0
    return {
        "budget_gb": budget, "s_per_token": s, "forecast_s_per_token": f["s_per_token"],
        "error": f["s_per_token"] / s - 1, "bound": f["bound"],
        "peak_rss_gb": t["peak_rss_gb"], "forecast_rss_gb": plan.forecast_rss_bytes / GB,
        "gb_read_per_token": t["gb_read_per_token"],
        # the run's count leaves out the streamed head, so the forecast's does here too
        "forecast_gb_read_per_token": f["gb_read_per_token"] - head,
        "layers": layer_table(parts), "load_average": parts["load_average"],
        "stream_tables": plan.stream_tables, "pinned_layers": len(plan.pinned),
        "expert_hit_rate": t.get("true_hit_rate"), "forecast_expert_hit_rate": f["expert_hit_rate"],
    }


def layer_table(parts: dict[str, Any]) -> dict[str, Any]:
    c, bw = parts["compute"], parts["memory_bandwidth_gb_per_s"]
    gb = c["trunk_gb"]
    return {
        "kda_moe_s": c["kda_moe_layer_s"], "mla_moe_s": c["mla_moe_layer_s"],
        "dense_s": c["dense_layer0_s"], "head_s": c["head_s"],
        # the head is one BF16 matvec; the experts one MXFP4 token through top-16
        "bf16_fraction_of_bandwidth": gb["head"] / c["head_s"] / bw,
        "mxfp4_fraction_of_bandwidth": c["mxfp4_gb_per_s"] / bw,
        "memory_bandwidth_gb_per_s": bw,
    }


def main(args: argparse.Namespace) -> int:
    try:
        budgets = [float(x) for x in args.budgets.split(",") if x.strip()]
    except ValueError:
        print("error: --budgets takes GB values separated by commas, e.g. 2.7,4.5,7.",
              file=sys.stderr)
        return 2
    folder = ensure_slice(Path(args.dir).expanduser())
    res: dict[str, Any] = {"load_average": list(os.getloadavg())}
    try:
        res["ladder"] = [rung(folder, b, args.gen) for b in budgets]
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
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
    print("budget_gb  s/token  forecast  error   GB/token  peak_rss  forecast_rss")
    for r in res["ladder"]:
        print(f"{r['budget_gb']:9.2f} {r['s_per_token']:8.2f} {r['forecast_s_per_token']:9.2f} "
              f"{r['error']:+6.0%} {r['gb_read_per_token']:9.2f} {r['peak_rss_gb']:9.2f} "
              f"{r['forecast_rss_gb']:12.2f}")
    print(f"load average {res['load_average'][0]:.2f} before, "
          f"{res['load_average_after'][0]:.2f} after (shared machine)")
    return 0
