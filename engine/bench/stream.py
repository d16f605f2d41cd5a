"""`python -m engine bench stream`: decode speed under a memory budget vs the disk's own speed.

Everything is measured side by side in one run, because the machine is shared and noisy:
* the disk's raw O_DIRECT throughput for the engine's own read pattern (the streamed
  trunk runs whole, expert-sized reads at random experts, the same reader pool and queue
  depth), per budget;
* decoding at each budget of a small ladder, each rung in its own process so its peak RSS
  is its own, with `s/token`, GB read per token and the compute time;
* compute-only s/token: the same decode with every weight already in RAM;
* where only experts stream, that decode again under the streamed decode's reads
  (engine/bench/readload.py): what the reads cost here (the compute slowed beside them,
  or the disk where they outlast the compute), apart from the schedule;
* the trunk packer against a plain copy of the same bytes;
* with --peer PATH, the C peer's `k3` beside the engine at every budget (engine/bench/peer.py).
efficiency = (GB read per token / raw GB/s) / (s/token): 1.0 means the disk never idled.
The default checkpoint is the peer's "bench" shape (6.38 GB), synthesised once into
`$K3TUI_HOME/bench` (or --workdir) and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from platformdirs import user_data_path

from engine.bench import peer
from engine.bench.disk import DiskCounters, raw_sweep
from engine.bench.peer import check_binary, compare
from engine.bench.readload import ReadLoad
from engine.checkpoint.synth import checkpoint_bytes, synthesize
from engine.checkpoint.trunk import TRUNK_BIN, drop_cache, pack, plain_copy
from engine.core.directio import CHUNK
from engine.decode.generate import GenParams, generate
from engine.errors import EngineError
from engine.model.transformer import Model, load_model
from engine.weights.planner import gb_arg, make_plan
from engine.weights.resident import ResidentSource
from engine.weights.streaming import EXPERT_CHUNK, CheckpointMap, StreamingSource
from engine.weights.sysmem import peak_rss, read_memory_facts
from k3vocab import GB

BENCH_EXPERTS = 256  # the bench shape: 13 layers, 256 experts top-16, ~6.38 GB
DEFAULT_LADDER = "0.53,1.06,2.1,max"
MAX_TURNS = 2  # decodes of each kind at the top rung, taking turns


def default_workdir() -> Path:
    home = os.environ.get("K3TUI_HOME")
    if home:
        return Path(home) / "bench"

    return user_data_path("k3tui") / "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", metavar="DIR", help="an existing checkpoint instead of "
                        "the synthesised bench one")
    parser.add_argument("--checkpoint-gb", type=float, default=None, metavar="N",
                        help="size of the synthesised checkpoint (bench shape, expert count "
                        "scaled; default 6.38)")
    parser.add_argument("--budget-gb", type=float, default=0.53, metavar="M",
                        help="the headline budget (default 0.53, 1/12 of the bench checkpoint)")
    # 16: twice the alternating turns of 8 for ~30 s more; the overlap still moves between
    # runs on a shared 2-core VM (1.53-1.64 at 1.06 GB), which "by turn" shows
    parser.add_argument("--tokens", type=int, default=16, metavar="K",
                        help="tokens decoded per budget (the first, the prompt, is not timed)")
    parser.add_argument("--ladder", default=DEFAULT_LADDER,
                        help="budgets in GB for the ladder, 'max' = everything resident")
    parser.add_argument("--threads", type=int, default=0, help="reader threads (0 = plan's)")
    parser.add_argument("--guess-experts", choices=("auto", "on", "off"), default="auto",
                        help="expert read-ahead from a guess (default auto: where the trunk "
                        "is resident)")
    parser.add_argument("--workdir", metavar="DIR", help="where the synthesised checkpoint is "
                        "kept (default $K3TUI_HOME/bench)")
    parser.add_argument("--no-pack", action="store_true", help="skip the packer vs copy ratio")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--peer", metavar="PATH", help="also run the C peer's `k3` binary "
                        "(kimi-k3-in-c v1.0.0) at every budget, in turn with the engine, and "
                        "print the ratio and whether the ids agree (engine/bench/peer.py)")
    parser.add_argument("--peer-runs", type=int, default=3, metavar="N",
                        help="runs of each engine per budget with --peer (default 3)")
    parser.add_argument("--peer-timeout", type=float, default=600.0, metavar="S",
                        help="seconds one peer run may take before it is stopped")
    parser.add_argument("--rung", help=argparse.SUPPRESS)  # internal: one budget, one process


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the checkpoint -------------------------------------------------------------------


def ensure_checkpoint(workdir: Path, checkpoint_gb: float | None) -> Path:
    """The bench-shape checkpoint in `workdir`, synthesised once (a marker says complete)."""
    experts = BENCH_EXPERTS
    if checkpoint_gb is not None:
        # Size is linear in the expert count; everything else keeps the bench shape.
        per_expert = (checkpoint_bytes("bench") - checkpoint_bytes(
            "bench", {"num_experts": BENCH_EXPERTS // 2})) / (BENCH_EXPERTS // 2)
        base = checkpoint_bytes("bench") - per_expert * BENCH_EXPERTS
        experts = max(17, int(round((checkpoint_gb * 1e9 - base) / per_expert)))
    overrides = None if experts == BENCH_EXPERTS else {"num_experts": experts}
    out = workdir / ("ck-bench-seed0" if overrides is None else f"ck-bench-{experts}e-seed0")
    if (out / ".complete").is_file():
        return out
    need = checkpoint_bytes("bench", overrides)
    workdir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(workdir).free
    if free < need * 1.1:
        raise EngineError(
            f"synthesising the {need / 1e9:.2f} GB bench checkpoint needs that much free space "
            f"in {workdir} but {free / 1e9:.2f} GB is free; pass --workdir on a larger disk."
        )
    if out.exists():
        shutil.rmtree(out)
    _log(f"synthesising the bench checkpoint ({need / 1e9:.2f} GB) into {out}; reused next time")
    t0 = time.perf_counter()
    synthesize(out, "bench", seed=0, overrides=overrides,
               progress=lambda m: _log(f"  {m} [{time.perf_counter() - t0:.0f} s]"))
    (out / ".complete").write_text("ok\n")
    return out


# ---- one rung, in its own process -------------------------------------------------------


def reference_raw(cmap, plan, rng: np.random.Generator) -> dict:
    """The best of a sweep over the engine's request sizes (a demand chunk, an expert, a
    read-ahead chunk) and queue depths (the plan's readers, twice that), on this
    checkpoint's files, through the engine's pool and buffers."""
    g = plan.geometry
    files = sorted({Path(t.file) for t in cmap.index.tensors.values()})
    sizes = sorted({EXPERT_CHUNK, g.expert_slot_bytes, CHUNK})
    return raw_sweep(files, sizes, sorted({plan.threads, 2 * plan.threads}), rng)


def _decode(model, prompt: list[int], tokens: int, src=None, disk=None) -> tuple[list, dict]:
    """Greedy tokens; CPU seconds of the decode steps (compute + readers) and, with `disk`,
    the device's counters and the engine's own device bytes over the same steps."""
    toks = []
    cpu0 = 0.0
    a = pool0 = None
    for tok in generate(model, prompt, GenParams(max_tokens=tokens)):
        toks.append(tok)
        if tok.index == 0:
            cpu0 = _cpu_s()
            a = disk.sample() if disk else None
            pool0 = src.pool.bytes_read if src is not None else 0
    info: dict = {"cpu_s": _cpu_s() - cpu0}
    if disk is not None and src is not None:
        b = disk.sample()
        info.update(DiskCounters.between(a, b))
        secs = sum(t.seconds for t in toks[1:])
        read = src.pool.bytes_read - (pool0 or 0)
        info["engine_device_gb_per_s"] = read / 1e9 / secs if secs > 0 else None
        info["device_bytes_per_token"] = read / max(len(toks) - 1, 1)
    return toks, info


def _open(cmap, budget_gb: float, threads: int, guess: str = "auto"):
    """A StreamingSource under `budget_gb` and its model."""
    plan = make_plan(cmap.geometry(), budget_gb=budget_gb, threads=threads,
                     guess_experts=guess)
    src = StreamingSource(cmap, plan)
    return src, load_model(cmap.root, src)


def _resident(ck: Path):
    """The same engine without a memory flag: every weight in RAM."""
    return load_model(ck, ResidentSource(ck))  # read O_DIRECT: nothing left in the cache


def _room_for_twin(g) -> bool:
    """Whether a resident twin fits beside a source that holds every weight already."""
    need = g.all_weights_bytes + g.model_bytes
    return read_memory_facts().available > 1.2 * need  # it counts the cgroup's limit too


def _alternate(models: list, pools: list, prompt: list[int],
               tokens: int) -> tuple[list, list, list]:
    """Decode the same prompt on each model two tokens at a time, so all are timed under the
    same machine load (the resident twin first). After a model's turn its reader pool (if
    any) drains, and that time is charged to its tokens: reads still in flight would finish
    during the next model's turn for free. Returns each model's tokens, its drain time per
    token and, turn by turn, each model's s/token (drain included): the spread."""
    gens = [generate(m, prompt, GenParams(max_tokens=tokens)) for m in models]
    runs: list[list] = [[next(g)] for g in gens]  # prefills: not timed
    drained = [0.0] * len(models)
    rounds = []
    while len(runs[0]) < tokens:
        turn = []
        for k, (gen, pool) in enumerate(zip(gens, pools)):
            toks = [t for t in (next(gen, None) for _ in range(2)) if t is not None]
            t0 = time.perf_counter()
            while pool is not None and pool.busy():
                time.sleep(0.0005)
            drain = time.perf_counter() - t0
            drained[k] += drain
            runs[k] += toks
            turn.append((sum(t.seconds for t in toks) + drain) / len(toks) if toks else None)
        if None not in turn:
            rounds.append(tuple(turn))
    return runs, [d / max(len(r) - 1, 1) for d, r in zip(drained, runs)], rounds


def _idle(src) -> float:
    """Wait until the source's own first reads (pinned layers, an up-front load) are done."""
    t0 = time.perf_counter()
    while src.pool.busy():
        time.sleep(0.001)
    return time.perf_counter() - t0


def run_rung(ck: Path, budget: str, tokens: int, threads: int, trunk: str | None,
             guess: str = "auto") -> dict:
    """One budget: the raw disk (a sweep before and after), a decode alone (its peak RSS and
    disk counters are the rung's), then the same decode alternating with the engine without
    a memory flag (compute-only, under the same machine load). At "max" every weight fits
    the budget and the source loads them up front; the twin alternates with it too where
    the checkpoint fits in RAM twice, else it runs after the source closes."""
    cmap = CheckpointMap(ck, trunk)
    g = cmap.geometry()
    full_gb = g.all_weights_bytes / GB
    prompt = [int(x) for x in np.random.default_rng(1).integers(0, cmap.config.vocab_size, 4)]
    resident = budget == "max"
    t_open = time.perf_counter()
    src, model = _open(cmap, full_gb if resident else float(budget), threads, guess=guess)
    load_s = time.perf_counter() - t_open + _idle(src)
    _log(src.plan.describe())
    rng = np.random.default_rng(7)
    refs = [reference_raw(cmap, src.plan, rng)]
    disk = DiskCounters(ck)
    alone, info = _decode(model, prompt, tokens, src, disk)
    peak = peak_rss() / GB
    ids = [t.id for t in alone]
    streamed = alone[1:]
    drain_per_token = 0.0
    rounds: list[tuple[float, float]] = []  # (twin, streamed) s/token, turn by turn
    loaded: dict = {}  # the twin under the streamed decode's reads, where only experts stream
    if resident and not _room_for_twin(g):
        # Where both at once do not fit (the checkpoint twice in RAM), the two take turns
        # a whole decode at a time (streamed, resident, streamed, resident): noisier, one
        # of each in a row measured 0.09 vs 0.13 s/token and then 0.16 vs 0.10 here.
        plan = src.plan
        stream_runs, twin_runs = [streamed], []
        for turn in range(MAX_TURNS):
            src.close()
            del model
            twin = _resident(ck)
            run, _ = _decode(twin, prompt, tokens)
            del twin
            twin_runs.append(run)
            if turn + 1 == MAX_TURNS:
                break
            src, model = _open(cmap, full_gb, threads, guess=guess)
            _idle(src)
            run, _ = _decode(model, prompt, tokens)
            if [t.id for t in run] != ids:
                raise EngineError("the streamed decode changed between two runs; this is a bug.")
            stream_runs.append(run[1:])
        if any([t.id for t in r] != ids for r in twin_runs):
            raise EngineError("the resident and streamed decodes disagree; this is a bug.")
        twin_toks = [t for r in twin_runs for t in r[1:]]
        streamed = [t for r in stream_runs for t in r]
        rounds = [(float(np.mean([t.seconds for t in tw[1:]])),
                   float(np.mean([t.seconds for t in st])))
                  for tw, st in zip(twin_runs, stream_runs) if tw[1:] and st]
    else:
        twin = _resident(ck)
        models, pools = [twin, model], [None, src.pool]
        load = None
        reads = info.get("device_bytes_per_token", 0) / g.expert_slot_bytes
        if reads and len(src.plan.pinned) == g.n_layers:  # only experts stream: load them
            load = ReadLoad(twin.source, cmap, src.plan.threads, reads / g.moe_layers)
            models.append(Model(twin.config, load))
            pools.append(load.pool)
        runs, drains, turns = _alternate(models, pools, prompt, tokens)
        if any([t.id for t in run] != ids for run in runs):
            raise EngineError("the resident and streamed decodes disagree; this is a bug.")
        twin_toks, streamed = runs[0][1:], runs[1][1:]
        drain_per_token = drains[1]
        rounds = [t[:2] for t in turns]
        if load is not None:
            # Its drain (the time its reads outlast its turns) says which bound it met: what
            # the reads cost the compute, or the disk itself for this pattern while the
            # compute runs (the rate of its reads while any was in flight).
            loaded = {"loaded_s_per_token": float(np.mean([t.seconds for t in runs[2][1:]]))
                      + drains[2], "loaded_drain_s_per_token": drains[2],
                      "loaded_read_gb_per_s": load.pool.bytes_read / 1e9 / load.pool.busy_s
                      if load.pool.busy_s > 0 else None,
                      "loaded_reads_per_layer": load.per_layer}
            load.close()
        refs.append(reference_raw(cmap, src.plan, rng))
        plan = src.plan
        src.close()

    def mean(key: str) -> float:
        return float(np.mean([getattr(t.stats, key) or 0.0 for t in streamed])) if streamed else 0.0

    def total(key: str) -> float:
        return float(sum(getattr(t.stats, key) or 0 for t in streamed))

    guessed, adopted = total("experts_guessed"), total("experts_guessed_used")
    misses = total("expert_misses")
    best = max(refs, key=lambda r: r["raw_gb_per_s"])
    return {
        "budget": budget,
        "budget_gb": plan.budget_bytes / GB,
        "plan_overhead_gb": plan.overhead_bytes / GB,
        "pinned_layers": len(plan.pinned),
        "ring_slots": plan.ring_slots,
        "expert_slots": plan.expert_slots,
        "threads": plan.threads,
        "load_s": load_s,
        "s_per_token": float(np.mean([t.seconds for t in streamed])) + drain_per_token
        if streamed else None,
        "drain_s_per_token": drain_per_token,
        "rounds": rounds,
        "s_per_token_alone": float(np.mean([t.seconds for t in alone[1:]])) if alone[1:] else None,
        "compute_only_s_per_token": float(np.mean([t.seconds for t in twin_toks]))
        if twin_toks else None,
        "gb_read_per_token": mean("gb_read_trunk") + mean("gb_read_experts"),
        "gb_trunk_per_token": mean("gb_read_trunk"),
        "gb_experts_per_token": mean("gb_read_experts"),
        "gb_unused_per_token": mean("gb_read_unused"),
        "guess_experts": plan.guess_experts,
        "guess_recall": adopted / misses if guessed and misses else None,
        "guess_precision": adopted / guessed if guessed else None,
        "compute_s_per_token": mean("compute_s"),
        "wait_trunk_s_per_token": mean("wait_trunk_s"),
        "wait_experts_s_per_token": mean("wait_experts_s"),
        "true_hit_rate": mean("true_hit_rate"),
        "cpu_s_per_token": info["cpu_s"] / len(alone[1:]) if alone[1:] else None,
        "prefill_s": alone[0].prefill_seconds if alone else None,
        "ids": ids,
        "peak_rss_gb": peak,
        "raw_gb_per_s": best["raw_gb_per_s"],
        "raw_best": best["best"],
        "raw_sweep": [r["sweep"] for r in refs],
        "device_gb_per_s": info.get("device_gb_per_s"),
        "engine_device_gb_per_s": info.get("engine_device_gb_per_s"),
        "disk_busy_fraction": info.get("disk_busy_fraction"),
        **loaded,
    }


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _spawn_rung(ck: Path, budget: str, args: argparse.Namespace, trunk: str | None) -> dict:
    cmd = [sys.executable, "-m", "engine.bench.stream", "--rung", budget,
           "--checkpoint", str(ck), "--tokens", str(args.tokens), "--threads",
           str(args.threads), "--guess-experts", args.guess_experts]
    if trunk:
        cmd += ["--trunk", trunk]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise EngineError(f"the {budget} GB rung failed: {tail[0]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- packer vs plain copy ---------------------------------------------------------------


def pack_ratio(ck: Path, scratch: Path) -> dict[str, float]:
    """Pack speed / plain copy speed of the same bytes (both cold, both fsynced), run in
    the order cp, pack, pack, cp so a load change hits both; the best of each counts."""
    def clear() -> None:
        shutil.rmtree(scratch / "trunk", ignore_errors=True)
        (scratch / "copy.bin").unlink(missing_ok=True)

    def run_pack() -> tuple[float, int]:
        drop_cache(sorted(ck.glob("*.safetensors")))
        t0 = time.perf_counter()
        summary = pack(ck, scratch / "trunk")
        secs = time.perf_counter() - t0
        drop_cache([scratch / "trunk" / TRUNK_BIN])
        return summary["bytes"] / 1e6 / secs, summary["bytes"]

    clear()
    scratch.mkdir(parents=True, exist_ok=True)
    cp_mb_s, pack_mb_s, nbytes = [], [], 0
    try:
        for step in ("cp", "pack", "pack", "cp"):
            if step == "cp":       # plain_copy evicts the source itself before timing
                cp_mb_s.append(plain_copy(ck, scratch / "copy.bin")["mb_per_s"])
            else:
                mb_s, nbytes = run_pack()
                pack_mb_s.append(mb_s)
            clear()
    finally:
        clear()
    return {"pack_mb_per_s": max(pack_mb_s), "cp_mb_per_s": max(cp_mb_s),
            "pack_ratio_vs_cp": max(pack_mb_s) / max(cp_mb_s), "pack_gb": nbytes / 1e9}


# ---- main -------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    try:
        if args.rung:
            print(json.dumps(run_rung(Path(args.checkpoint), args.rung, args.tokens,
                                      args.threads, getattr(args, "trunk", None),
                                      args.guess_experts)))
            return 0
        return _main(args)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def assess(r: dict) -> dict:
    """The rung against its bound: max(compute-only, useful bytes / raw). Bytes read on a
    wrong guess are waste, not part of the bound. An efficiency above 1.0, or the engine's
    own reads outrunning the raw figure, means the raw figure is wrong: it is reported as
    a reference bug instead of a result."""
    raw = r.get("raw_gb_per_s")
    s = r["s_per_token"]
    io_s = r["gb_read_per_token"] / raw if raw else 0.0
    bound = max(r["compute_only_s_per_token"] or 0.0, io_s)
    eff = io_s / s if raw and s else None
    errors = []
    if eff is not None and eff > 1.0:
        errors.append(f"useful bytes / raw ({io_s:.3f} s) exceed the s/token ({s:.3f})")
    engine_rate = r.get("engine_device_gb_per_s")
    if raw and engine_rate and engine_rate > raw:
        errors.append(f"the engine read {engine_rate:.2f} GB/s during decode, above the raw "
                      f"{raw:.2f} GB/s")
    # What the reads cost on this machine apart from the schedule (the compute slowed beside
    # them, or the disk delivering this pattern while the compute runs): the twin decoding
    # under the streamed decode's reads (engine/bench/readload.py). Printed beside the
    # headline, which stays against the twin alone.
    loaded = r.get("loaded_s_per_token")
    # The same ratio turn by turn (each turn's twin as its compute-only): how far this VM's
    # load moves the headline between two runs of the bench.
    turns = [st / max(tw, io_s) for tw, st in r.get("rounds") or () if max(tw, io_s) > 0]
    r.update(io_s_per_token=io_s, bound_s_per_token=bound,
             overlap_range=[min(turns), max(turns)] if turns else None,
             overlap_vs_loaded=s / max(loaded, io_s) if loaded and s else None,
             overlap_ratio=s / bound if bound and s else None,
             efficiency=None if errors else eff,
             reference_error=("reference bug: " + "; ".join(errors)
                              + " -- the raw figure is too low") if errors else None)
    return r


def _main(args: argparse.Namespace) -> int:
    peer_bin = None
    if getattr(args, "peer", None):
        peer_bin = check_binary(args.peer)  # refused before anything is synthesised
    workdir = Path(args.workdir) if args.workdir else default_workdir()
    if args.checkpoint:
        ck = Path(args.checkpoint)
        if not ck.is_dir():
            raise EngineError(f"{ck} is not a folder; pass a checkpoint folder.")
    else:
        ck = ensure_checkpoint(workdir, args.checkpoint_gb)
    g = CheckpointMap(ck).geometry()
    ck_gb = g.checkpoint_bytes / GB
    budgets = [b.strip() for b in args.ladder.split(",") if b.strip()]
    head = f"{args.budget_gb:g}"
    if head not in budgets:
        budgets.insert(0, head)
    if "max" not in budgets:
        budgets.append("max")
    _log(f"checkpoint {ck} ({ck_gb:.2f} GB, trunk {g.trunk_bytes / GB:.3f} GB, "
         f"{g.top_k} x {g.expert_bytes / 1e6:.2f} MB experts per MoE layer)")
    if ck_gb < 8 * args.budget_gb:
        _log(f"note: the checkpoint is only {ck_gb / args.budget_gb:.1f}x the budget; the "
             "issue's target is for budgets <= 1/8 of it")
    packed = {} if args.no_pack else pack_ratio(ck, workdir / "scratch")
    peer = None if peer_bin is None else _peer(peer_bin, ck, workdir, budgets, g, args)
    rungs = []
    for b in budgets:
        _log(f"budget {b} ...")
        rungs.append(_spawn_rung(ck, b, args, None))
    ladder = [assess(r) for r in rungs]
    main_rung = next(r for r in ladder if r["budget"] == head)
    same_ids = all(r["ids"] == ladder[0]["ids"] for r in ladder)
    result = {
        "checkpoint": str(ck),
        "checkpoint_gb": ck_gb,
        "budget_gb": main_rung["budget_gb"],
        "s_per_token": main_rung["s_per_token"],
        "gb_read_per_token": main_rung["gb_read_per_token"],
        "mb_per_s": main_rung["gb_read_per_token"] * 1000 / main_rung["s_per_token"],
        "raw_gb_per_s": main_rung.get("raw_gb_per_s"),
        "efficiency": main_rung["efficiency"],
        "reference_error": main_rung["reference_error"],
        "disk_busy_fraction": main_rung["disk_busy_fraction"],
        "device_gb_per_s": main_rung["device_gb_per_s"],
        "raw_best": main_rung["raw_best"],
        "compute_only_s_per_token": main_rung["compute_only_s_per_token"],
        "peak_rss_gb": main_rung["peak_rss_gb"],
        "rss_limit_gb": main_rung["budget_gb"] * 1.1 + main_rung["plan_overhead_gb"],
        "ids_identical": same_ids,
        **packed,
        "pack_ratio_vs_cp": packed.get("pack_ratio_vs_cp"),
        "ladder": [{k: r.get(k) for k in (
            "budget", "budget_gb", "s_per_token", "gb_read_per_token", "compute_s_per_token",
            "compute_only_s_per_token", "s_per_token_alone", "bound_s_per_token",
            "overlap_ratio", "efficiency", "raw_gb_per_s",
            "wait_trunk_s_per_token", "wait_experts_s_per_token", "pinned_layers",
            "ring_slots", "expert_slots", "true_hit_rate", "cpu_s_per_token", "peak_rss_gb",
            "plan_overhead_gb", "gb_unused_per_token", "guess_experts", "guess_recall",
            "guess_precision", "io_s_per_token", "reference_error", "raw_best",
            "device_gb_per_s", "engine_device_gb_per_s", "disk_busy_fraction", "load_s",
            "threads", "raw_sweep", "loaded_s_per_token", "loaded_drain_s_per_token",
            "loaded_read_gb_per_s", "loaded_reads_per_layer",
            "overlap_vs_loaded", "overlap_range", "rounds")}
            for r in ladder],
        "peer": peer,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(render(result))
    return 0


def _peer(binary: Path, ck: Path, workdir: Path, budgets: list[str], g,
          args: argparse.Namespace) -> dict:
    """The peer beside the engine, both streaming the same packed BF16 trunk (the peer
    needs one; it is packed once beside the checkpoint's other trunks and reused)."""
    trunk = workdir / f"{ck.name}-trunks" / "trunk-bf16"
    pack(ck, trunk)
    full = gb_arg(g.all_weights_bytes)
    return compare(binary, ck, trunk, [full if b == "max" else b for b in budgets],
                   args.tokens, max(1, args.peer_runs), args.threads, args.guess_experts,
                   args.peer_timeout, _log)


def _f(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def _range(lo_hi: list[float] | None) -> str:
    return "-" if not lo_hi else f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}"


def render(res: dict[str, Any]) -> str:
    best = res.get("raw_best") or {}
    eff = res.get("efficiency")
    lines = [
        f"checkpoint {res['checkpoint_gb']:.2f} GB, budget {res['budget_gb']:.2f} GB "
        f"(1/{res['checkpoint_gb'] / res['budget_gb']:.1f})",
        f"  s/token {res['s_per_token']:.3f}   GB read/token {res['gb_read_per_token']:.3f}   "
        f"achieved {res['mb_per_s']:.0f} MB/s   raw {_f(res['raw_gb_per_s'], '.0f', 1000)} "
        f"MB/s (O_DIRECT, engine buffers, best at {best.get('request_bytes', 0) / 2**20:.2f} "
        f"MiB x {best.get('queue_depth', '-')} in flight)",
        f"  disk busy {_f(res.get('disk_busy_fraction'), '.0%')} of the decode, device "
        f"{_f(res.get('device_gb_per_s'), '.0f', 1000)} MB/s (/proc/diskstats, every process)"
        + (f"   efficiency {eff:.2f}" if eff is not None else ""),
        f"  compute-only {res['compute_only_s_per_token']:.3f} s/token   peak RSS "
        f"{res['peak_rss_gb']:.2f} GB (limit budget x 1.1 + fixed = {res['rss_limit_gb']:.2f})"
        f"   ids identical at every budget: {'yes' if res['ids_identical'] else 'NO'}",
    ]
    if res.get("pack_ratio_vs_cp") is not None:
        lines.append(f"  pack {res['pack_mb_per_s']:.0f} MB/s vs cp + sync "
                     f"{res['cp_mb_per_s']:.0f} MB/s = {res['pack_ratio_vs_cp']:.2f}x")
    lines.append("")
    lines.append(f"{'budget GB':>10} {'pinned':>6} {'s/token':>8} {'useful GB':>9} "
                 f"{'wasted':>7} {'compute':>8} {'I/O s':>7} {'bound s':>8} {'overlap':>7} "
                 f"{'by turn':>9} "
                 f"{'effic.':>6} {'raw MB/s':>8} {'busy':>5} {'peak RSS':>8} {'loaded':>7} "
                 f"{'ld wait':>7} {'ld MB/s':>7} {'vs load':>7}")
    errors = []
    for r in res["ladder"]:
        if r.get("reference_error"):
            errors.append(f"  {r['budget_gb']:.2f} GB: {r['reference_error']}")
        lines.append(
            f"{r['budget_gb']:>10.2f} {r['pinned_layers']:>6} {r['s_per_token']:>8.3f} "
            f"{r['gb_read_per_token']:>9.3f} {r['gb_unused_per_token']:>7.3f} "
            f"{r['compute_only_s_per_token']:>8.3f} {r['io_s_per_token']:>7.3f} "
            f"{r['bound_s_per_token']:>8.3f} {_f(r['overlap_ratio'], '.2f'):>7} "
            f"{_range(r.get('overlap_range')):>9} "
            f"{('BUG' if r.get('reference_error') else _f(r['efficiency'], '.2f')):>6} "
            f"{_f(r.get('raw_gb_per_s'), '.0f', 1000):>8} "
            f"{_f(r.get('disk_busy_fraction'), '.0%'):>5} {r['peak_rss_gb']:>8.2f} "
            f"{_f(r.get('loaded_s_per_token'), '.3f'):>7} "
            f"{_f(r.get('loaded_drain_s_per_token'), '.3f'):>7} "
            f"{_f(r.get('loaded_read_gb_per_s'), '.0f', 1000):>7} "
            f"{_f(r.get('overlap_vs_loaded'), '.2f'):>7}")
    lines += errors
    if res.get("peer"):
        lines += ["", peer.render(res["peer"]), ""]
    lines.append("useful GB = read per token and used; wasted = read on wrong guesses; compute = "
                 "s/token of the engine without a memory flag, decoded in alternation with the "
                 "streamed one; I/O s = useful GB / raw; bound = max of the two; overlap = "
                 "s/token / bound; by turn = the lowest and highest overlap of the alternating "
                 "turns (each against its own twin turn); busy = the device's share of the "
                 "decode with I/O in flight; "
                 "loaded = s/token of the twin while the streamed decode's reads (as many, "
                 "as large, same readers, never waited for) run beside it, where only experts "
                 "stream; ld wait = the part of it spent waiting for those reads after its "
                 "compute (where it is large, the disk bound it, not the compute); ld MB/s = "
                 "their rate while any was in flight; vs load = s/token / max(loaded, I/O s): "
                 "the schedule alone")
    return "\n".join(lines)


if __name__ == "__main__":
    _p = argparse.ArgumentParser(prog="python -m engine.bench.stream")
    add_arguments(_p)
    _p.add_argument("--trunk", help=argparse.SUPPRESS)
    raise SystemExit(main(_p.parse_args()))
