#!/usr/bin/env python
"""What the disk's reads cost the streamed decode, apart from the schedule.

    python scripts/read_cost.py [--budget-gb 2.1] [--tokens 40] [--checkpoint DIR] [--json]

One process, one streamed model and its resident twin (as `bench stream` pairs them),
decoded two tokens at a time in turn, twice: first with real reads, then with every read
replaced by a sleep until the disk, one queue served at the raw speed, would deliver it,
each expert slot first filled with harmless random bytes (the kernels' work is the same;
the ids of that phase are not the model's). The second phase is the engine's
schedule on a disk whose reads cost no CPU. Each phase prints s/token of both, the
streamed one against bench stream's bound (max of the twin and useful bytes / raw), and
the CPU each group of threads spent per token.

An experiment, not a benchmark: `python -m engine bench stream` prints the figures the
README quotes; this says how much of its overlap is the reads' cost on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GROUPS = (("k3-read", "readers"), ("k3-expert", "expert pool"), ("MainThread", "main"))


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + sys) per thread group: readers, the expert pool, the main
    thread, and the kernels' own workers (threads Python did not start)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        name = names.get(int(tid), "")
        group = next((g for prefix, g in GROUPS if name.startswith(prefix)), "kernel workers")
        out[group] = out.get(group, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def alternate(twin, model, src, prompt: list[int], tokens: int, raw_gb_per_s: float) -> dict:
    """Two tokens of each in turn; the streamed turns wait for their reads to drain. The
    bound is bench stream's: max(the twin, useful bytes / raw)."""
    from engine.decode.generate import GenParams, generate

    gens = [generate(m, prompt, GenParams(max_tokens=tokens)) for m in (twin, model)]
    ids: list[list[int]] = [[next(gens[0]).id], [next(gens[1]).id]]  # prefills: not timed
    secs, n = [0.0, 0.0], [0, 0]
    cpu: list[dict[str, float]] = [{}, {}]
    s0 = src.stats()
    while n[1] < tokens - 1:
        for which in (0, 1):
            c0, t0 = thread_cpu(), time.perf_counter()
            for _ in range(2):
                tok = next(gens[which], None)
                if tok is not None:
                    ids[which].append(tok.id)
                    n[which] += 1
            while which == 1 and src.pool.busy():
                time.sleep(0.0005)
            secs[which] += time.perf_counter() - t0
            for group, v in thread_cpu().items():
                cpu[which][group] = cpu[which].get(group, 0.0) + v - c0.get(group, 0.0)
    s1 = src.stats()
    useful = sum(s1[k] - s0[k] for k in ("gb_read_trunk", "gb_read_experts")) / n[1]
    twin_s, stream_s = secs[0] / n[0], secs[1] / n[1]
    bound = max(twin_s, useful / raw_gb_per_s)
    return {"twin_s_per_token": twin_s, "streamed_s_per_token": stream_s,
            "useful_gb_per_token": useful, "bound_s_per_token": bound,
            "wait_experts_s_per_token": (s1["wait_experts_s"] - s0["wait_experts_s"]) / n[1],
            "overlap_ratio": stream_s / bound, "ids_agree": ids[0] == ids[1],
            "twin_cpu_per_token": {g: v / n[0] for g, v in cpu[0].items()},
            "streamed_cpu_per_token": {g: v / n[1] for g, v in cpu[1].items()}}


def free_reads(src, raw_gb_per_s: float) -> None:
    """Fill the expert slots with random bytes that are harmless read at any page offset
    (0x70-0x77: tiny E8M0 scales, so the routed experts add almost nothing and the routing
    follows the real trunk from token to token; a real expert in every slot would be read
    shifted by another layer's page offset, NaNs that freeze the routing onto cached
    experts), then make every read a sleep: the disk becomes one queue served at the raw
    speed (a read ends when the bytes queued before it and its own have passed at raw
    GB/s), whatever the number in flight."""
    import numpy as np

    from engine.weights import io

    cache, rng = src.cache, np.random.default_rng(0)
    for slot in range(cache.nslots):
        cache.buffer(slot)[:] = rng.integers(0x70, 0x78, cache.slot_bytes, dtype=np.uint8)
    lock, free_at = threading.Lock(), [0.0]

    def sleep_read(self, dest, offset, need):  # in place of DirectFile.read_into
        with lock:
            free_at[0] = max(time.perf_counter(), free_at[0]) + dest.nbytes / (raw_gb_per_s * 1e9)
            end = free_at[0]
        time.sleep(max(0.0, end - time.perf_counter()))
        return dest.nbytes

    io.DirectFile.read_into = sleep_read


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="default: bench stream's synthesised checkpoint")
    ap.add_argument("--budget-gb", type=float, default=2.1)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from engine.bench.stream import _idle, _open, _resident, default_workdir, reference_raw
    from engine.weights.streaming import CheckpointMap

    import numpy as np

    ck = Path(args.checkpoint) if args.checkpoint else default_workdir() / "ck-bench-seed0"
    if not (ck / "config.json").is_file():
        print(f"no checkpoint at {ck}; run `python -m engine bench stream` first or pass "
              "--checkpoint DIR.", file=sys.stderr)
        return 2
    cmap = CheckpointMap(ck)
    prompt = [int(x) for x in np.random.default_rng(1).integers(0, cmap.config.vocab_size, 4)]
    twin = _resident(ck)
    src, model = _open(cmap, args.budget_gb, 0)
    _idle(src)
    raw = reference_raw(cmap, src.plan, np.random.default_rng(7))  # bench stream's raw
    out = {"checkpoint": str(ck), "budget_gb": args.budget_gb, "threads": src.plan.threads,
           "raw_gb_per_s": raw["raw_gb_per_s"],
           "real_reads": alternate(twin, model, src, prompt, args.tokens,
                                   raw["raw_gb_per_s"])}
    free_reads(src, raw["raw_gb_per_s"])
    with np.errstate(all="ignore"):  # one expert's bytes in every slot: odd activations
        out["cpu_free_reads"] = alternate(twin, model, src, prompt, args.tokens,
                                          raw["raw_gb_per_s"])
    src.close()
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{ck} at {args.budget_gb:g} GB, {src.plan.threads} readers, raw "
          f"{raw['raw_gb_per_s']:.2f} GB/s")
    for phase in ("real_reads", "cpu_free_reads"):
        r = out[phase]
        print(f"{phase.replace('_', ' ')}: twin {r['twin_s_per_token']:.4f}, streamed "
              f"{r['streamed_s_per_token']:.4f} s/token, useful "
              f"{r['useful_gb_per_token']:.3f} GB/token: {r['overlap_ratio']:.2f}x "
              f"max(twin, useful / raw); waited {r['wait_experts_s_per_token']:.4f} s/token "
              "for experts")
        for who in ("twin", "streamed"):
            cpu = r[f"{who}_cpu_per_token"]
            print(f"  {who} CPU s/token: " + ", ".join(f"{g} {v:.4f}" for g, v in
                                                     sorted(cpu.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
