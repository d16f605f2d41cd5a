"""`python -m engine bench stream`: decode speed under a memory budget vs the disk's own speed.

Everything is measured side by side in one run, because the machine is shared and noisy:
* the disk's raw O_DIRECT throughput for the engine's own read pattern (the streamed
  trunk runs whole, expert-sized reads at random experts, the same reader pool and queue
  depth), per budget;
* decoding at each budget of a small ladder, each rung in its own process so its peak RSS
  is its own, with `s/token`, GB read per token and the compute time;
* compute-only s/token: the same decode with every weight already in RAM;
* the trunk packer against a plain copy of the same bytes.
efficiency = (GB read per token / raw GB/s) / (s/token): 1.0 means the disk never idled.
The default checkpoint is the peer's "bench" shape (6.38 GB), synthesised once into
`$K3TUI_HOME/bench` (or --workdir) and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import EngineError

BENCH_EXPERTS = 256  # the bench shape: 13 layers, 256 experts top-16, ~6.38 GB
DEFAULT_LADDER = "0.53,1.06,2.1,max"


def default_workdir() -> Path:
    home = os.environ.get("K3TUI_HOME")
    if home:
        return Path(home) / "bench"
    from platformdirs import user_data_path

    return user_data_path("k3tui") / "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", metavar="DIR", help="an existing checkpoint instead of "
                        "the synthesised bench one")
    parser.add_argument("--checkpoint-gb", type=float, default=None, metavar="N",
                        help="size of the synthesised checkpoint (bench shape, expert count "
                        "scaled; default 6.38)")
    parser.add_argument("--budget-gb", type=float, default=0.53, metavar="M",
                        help="the headline budget (default 0.53, 1/12 of the bench checkpoint)")
    parser.add_argument("--tokens", type=int, default=8, metavar="K",
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
    parser.add_argument("--rung", help=argparse.SUPPRESS)  # internal: one budget, one process


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the checkpoint -------------------------------------------------------------------


def ensure_checkpoint(workdir: Path, checkpoint_gb: float | None) -> Path:
    """The bench-shape checkpoint in `workdir`, synthesised once (a marker says complete)."""
    from engine.checkpoint.synth import checkpoint_bytes, synthesize

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


def raw_throughput(src, rng: np.random.Generator, passes: int = 2) -> dict[str, float]:
    """The disk's O_DIRECT speed for this plan's per-token pattern, through the same pool.
    The disk is shared and its speed drifts, so the bench samples it before, between and
    after the timed decode blocks."""
    from engine.weights.io import aligned_buffer
    from engine.weights.streaming import EXPERT_CHUNK, EXPERT_PRIORITY, TRUNK_PRIORITY

    plan, cmap, pool = src.plan, src.map, src.pool
    g = plan.geometry
    streamed = [i for i in range(g.n_layers) if i not in set(plan.pinned)]
    tbuf = aligned_buffer(max((cmap.layers[i].nbytes for i in streamed), default=4096))
    ebuf = aligned_buffer(g.top_k * g.expert_slot_bytes)
    moe = [i for i in range(g.n_layers) if cmap.config.is_moe(i)]
    for p in src._pinned.values():  # the source's own first reads must not overlap
        p.batch.finished()
    for slot in src._ring:
        if slot.batch is not None:
            slot.batch.finished()
    total = 0
    t0 = time.perf_counter()
    for _ in range(passes):
        batches = []
        for i in streamed:  # read-ahead of whole layers, as the ring does
            lay = cmap.layers[i]
            batches.append(pool.submit(lay.reads(src.files, tbuf[: lay.nbytes]),
                                       (TRUNK_PRIORITY, i)))
            total += lay.payload
        for i in moe:  # each layer's top-k at once, sorted by offset, ahead of the trunk
            ids = sorted(rng.choice(g.n_experts, size=g.top_k, replace=False))
            reads = []
            for k, e in enumerate(ids):
                lay = cmap.expert_layout(i, int(e))
                start = k * g.expert_slot_bytes
                reads += lay.reads(src.files, ebuf[start:start + lay.nbytes])
                total += lay.payload
            batches.append(pool.submit(reads, (EXPERT_PRIORITY, i), chunk=EXPERT_CHUNK))
        for b in batches:
            b.wait()
    secs = time.perf_counter() - t0
    return {"raw_gb": total / 1e9, "raw_s": secs, "raw_gb_per_s": total / 1e9 / secs}


def _decode(model, prompt: list[int], tokens: int) -> tuple[list, float]:
    """Greedy tokens and the CPU seconds of the decode steps (compute + readers)."""
    from engine.decode.generate import GenParams, generate

    toks = []
    cpu0 = 0.0
    for tok in generate(model, prompt, GenParams(max_tokens=tokens)):
        toks.append(tok)
        if tok.index == 0:
            cpu0 = _cpu_s()
    return toks, _cpu_s() - cpu0


def _open(cmap, budget_gb: float, threads: int, warm: bool = False, guess: str = "auto"):
    """A StreamingSource under `budget_gb`; with `warm`, every weight read before the clock."""
    from engine.model.transformer import load_model
    from engine.weights.planner import make_plan
    from engine.weights.streaming import StreamingSource

    g = cmap.geometry()
    plan = make_plan(g, budget_gb=budget_gb, threads=threads, guess_experts=guess)
    src = StreamingSource(cmap, plan)
    if warm:
        for L in range(g.n_layers):
            with src.layer(L):
                pass
            if cmap.config.is_moe(L):
                with src.experts(L, range(g.n_experts)) as ex:
                    for e in range(g.n_experts):
                        ex[e]
    return src, load_model(cmap.root, src)


def run_rung(ck: Path, budget: str, tokens: int, threads: int, trunk: str | None,
             guess: str = "auto") -> dict:
    """One budget: raw disk speed, a decode alone (its peak RSS is the rung's), then the
    same decode alternating with a fully resident twin so that compute-only time and
    streamed time are measured under the same machine load."""
    from engine.weights.planner import GB
    from engine.weights.streaming import CheckpointMap
    from engine.weights.sysmem import peak_rss

    cmap = CheckpointMap(ck, trunk)
    g = cmap.geometry()
    full_gb = (g.trunk_bytes + g.all_experts_bytes) / GB
    prompt = [int(x) for x in np.random.default_rng(1).integers(0, cmap.config.vocab_size, 4)]
    resident = budget == "max"
    src, model = _open(cmap, full_gb if resident else float(budget), threads, warm=resident,
                       guess=guess)
    _log(src.plan.describe())
    rng = np.random.default_rng(7)
    raw = [] if resident else [raw_throughput(src, rng)]
    alone, cpu = _decode(model, prompt, tokens)
    peak = peak_rss() / GB
    ids = [t.id for t in alone]
    streamed, twin_toks = alone[1:], alone[1:]
    drain_per_token = 0.0
    if not resident:
        # The same decode on a fully resident twin, alternating two tokens at a time, so
        # compute-only and streamed tokens are timed under the same machine load.
        from engine.decode.generate import GenParams, generate

        twin, twin_model = _open(cmap, full_gb, threads, warm=True)
        gens = [generate(twin_model, prompt, GenParams(max_tokens=tokens)),
                generate(model, prompt, GenParams(max_tokens=tokens))]
        runs: list[list] = [[next(gens[0])], [next(gens[1])]]  # prefills: not timed
        drained = 0.0
        while len(runs[1]) < tokens:
            for which in (0, 1):
                for _ in range(2):
                    tok = next(gens[which], None)
                    if tok is not None:
                        runs[which].append(tok)
            # Reads the streamed source still has in flight would finish during the twin's
            # turn for free; charge the time they take to the streamed tokens instead.
            t0 = time.perf_counter()
            while src.pool.busy():
                time.sleep(0.0005)
            drained += time.perf_counter() - t0
            raw.append(raw_throughput(src, rng, passes=1))  # sample the disk meanwhile too
        if [t.id for t in runs[0]] != ids or [t.id for t in runs[1]] != ids:
            raise EngineError("the resident and streamed decodes disagree; this is a bug.")
        twin_toks, streamed = runs[0][1:], runs[1][1:]
        drain_per_token = drained / max(len(streamed), 1)
        raw.append(raw_throughput(src, rng))
        twin.close()
    plan = src.plan
    src.close()

    def mean(key: str) -> float:
        return float(np.mean([getattr(t.stats, key) or 0.0 for t in streamed])) if streamed else 0.0

    def total(key: str) -> float:
        return float(sum(getattr(t.stats, key) or 0 for t in streamed))

    guessed, adopted = total("experts_guessed"), total("experts_guessed_used")
    misses = total("expert_misses")
    raw_gb = sum(r["raw_gb"] for r in raw)
    raw_s = sum(r["raw_s"] for r in raw)
    return {
        "budget": budget,
        "budget_gb": plan.budget_bytes / GB,
        "plan_overhead_gb": plan.overhead_bytes / GB,
        "pinned_layers": len(plan.pinned),
        "ring_slots": plan.ring_slots,
        "expert_slots": plan.expert_slots,
        "threads": plan.threads,
        "s_per_token": float(np.mean([t.seconds for t in streamed])) + drain_per_token
        if streamed else None,
        "drain_s_per_token": drain_per_token,
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
        "cpu_s_per_token": cpu / len(alone[1:]) if alone[1:] else None,
        "prefill_s": alone[0].prefill_seconds if alone else None,
        "ids": ids,
        "peak_rss_gb": peak,
        "raw_gb_per_s": raw_gb / raw_s if raw else None,
    }


def _cpu_s() -> float:
    import resource

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
    """Pack speed / plain copy speed of the same bytes (both cold, both fsynced)."""
    from engine.checkpoint.trunk import TRUNK_BIN, drop_cache, pack, plain_copy

    for p in (scratch / "trunk", scratch / "copy.bin"):
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        cp = plain_copy(ck, scratch / "copy.bin")
        (scratch / "copy.bin").unlink()
        drop_cache(sorted(ck.glob("*.safetensors")))
        t0 = time.perf_counter()
        summary = pack(ck, scratch / "trunk")
        secs = time.perf_counter() - t0
        drop_cache([scratch / "trunk" / TRUNK_BIN])
    finally:
        shutil.rmtree(scratch / "trunk", ignore_errors=True)
        (scratch / "copy.bin").unlink(missing_ok=True)
    pack_mb_s = summary["bytes"] / 1e6 / secs
    return {"pack_mb_per_s": pack_mb_s, "cp_mb_per_s": cp["mb_per_s"],
            "pack_ratio_vs_cp": pack_mb_s / cp["mb_per_s"], "pack_gb": summary["bytes"] / 1e9}


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


def _main(args: argparse.Namespace) -> int:
    from engine.weights.planner import GB
    from engine.weights.streaming import CheckpointMap

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
    rungs = []
    for b in budgets:
        _log(f"budget {b} ...")
        rungs.append(_spawn_rung(ck, b, args, None))
    ladder = []
    for r in rungs:
        raw = r.get("raw_gb_per_s")
        # A wrong guess's bytes are disk time too: the bound counts every byte read.
        io_s = (r["gb_read_per_token"] + r["gb_unused_per_token"]) / raw if raw else 0.0
        bound = max(r["compute_only_s_per_token"], io_s)
        r["bound_s_per_token"] = bound
        r["overlap_ratio"] = r["s_per_token"] / bound if bound else None
        r["efficiency"] = io_s / r["s_per_token"] if raw and r["s_per_token"] else None
        ladder.append(r)
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
            "guess_precision")}
            for r in ladder],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(render(result))
    return 0


def render(res: dict[str, Any]) -> str:
    lines = [
        f"checkpoint {res['checkpoint_gb']:.2f} GB, budget {res['budget_gb']:.2f} GB "
        f"(1/{res['checkpoint_gb'] / res['budget_gb']:.1f})",
        f"  s/token {res['s_per_token']:.3f}   GB read/token {res['gb_read_per_token']:.3f}   "
        f"achieved {res['mb_per_s']:.0f} MB/s   raw O_DIRECT {res['raw_gb_per_s'] * 1000:.0f} "
        f"MB/s   efficiency {res['efficiency']:.2f}",
        f"  compute-only {res['compute_only_s_per_token']:.3f} s/token   peak RSS "
        f"{res['peak_rss_gb']:.2f} GB (limit budget x 1.1 + fixed = {res['rss_limit_gb']:.2f})"
        f"   ids identical at every budget: {'yes' if res['ids_identical'] else 'NO'}",
    ]
    if res.get("pack_ratio_vs_cp") is not None:
        lines.append(f"  pack {res['pack_mb_per_s']:.0f} MB/s vs plain copy "
                     f"{res['cp_mb_per_s']:.0f} MB/s = {res['pack_ratio_vs_cp']:.2f}x")
    lines.append("")
    lines.append(f"{'budget GB':>10} {'pinned':>6} {'s/token':>8} {'GB/token':>9} "
                 f"{'compute':>8} {'I/O s':>7} {'bound s':>8} {'overlap':>7} {'effic.':>6} "
                 f"{'raw MB/s':>8} {'peak RSS':>8} {'guesses':>13}")
    for r in res["ladder"]:
        raw = r.get("raw_gb_per_s")
        eff = r.get("efficiency")
        io_s = (r["gb_read_per_token"] + r["gb_unused_per_token"]) / raw if raw else 0.0
        guesses = "off"
        if r.get("guess_experts"):
            guesses = (f"{r['guess_recall'] or 0:.0%} used, +{r['gb_unused_per_token']:.3f}"
                       if r.get("guess_recall") is not None else "on")
        lines.append(
            f"{r['budget_gb']:>10.2f} {r['pinned_layers']:>6} {r['s_per_token']:>8.3f} "
            f"{r['gb_read_per_token']:>9.3f} {r['compute_only_s_per_token']:>8.3f} "
            f"{io_s:>7.3f} {r['bound_s_per_token']:>8.3f} {r['overlap_ratio']:>7.2f} "
            f"{(f'{eff:.2f}' if eff is not None else '-'):>6} "
            f"{(f'{raw * 1000:.0f}' if raw else '-'):>8} {r['peak_rss_gb']:>8.2f} {guesses:>13}")
    lines.append("compute = compute-only s/token of a fully resident twin decoded in alternation "
                 "with the streamed one; I/O s = GB/token (plus unused guessed bytes) / raw; "
                 "bound = max of the two; overlap = s/token / bound (1.0 = I/O fully hidden); "
                 "guesses = share of the experts read that a guess had started, + GB/token "
                 "read on wrong guesses")
    return "\n".join(lines)


if __name__ == "__main__":
    _p = argparse.ArgumentParser(prog="python -m engine.bench.stream")
    add_arguments(_p)
    _p.add_argument("--trunk", help=argparse.SUPPRESS)
    raise SystemExit(main(_p.parse_args()))
