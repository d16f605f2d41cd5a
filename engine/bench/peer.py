"""`bench stream --peer PATH`: the C peer (kimi-k3-in-c v1.0.0, `k3`) beside the engine.

At each budget the engine's own CLI (`python -m engine run`) and the peer decode the same
prompt from the same packed trunk, taking turns (engine, peer, engine, peer, ...), each in
its own child process so the peak RSS is its own. The peer is given the trunk / expert-cache
split the engine's plan chose (`--trunk-gb` / `--cache-gb`), `--incremental` (the engine
carries its state too), and OMP_NUM_THREADS = the engine's compute threads.

Like with like: the engine's first token (the prompt's forward pass) is not timed, and the
peer's `seconds_per_token` averages over every step *including* step 0, so step 0's seconds
(from the peer's step table) are taken out of its total.

Everything the peer prints or writes is outside input: the --out JSON and the step table
are size-bounded and type-checked, and anything else is one sentence, never a traceback.
"""

from __future__ import annotations

import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import EngineError
from engine.jsonfile import parse_json
from engine.kernels import compute_threads
from engine.weights.planner import make_plan
from engine.weights.streaming import CheckpointMap
from k3vocab import GB

MAX_OUT_BYTES = 1 << 20  # a real --out for 4096 tokens is ~70 KB
MAX_STDOUT_BYTES = 8 << 20
DEFAULT_TIMEOUT_S = 600.0
# The peer prints step seconds to 2 decimals and seconds_per_token to 4; the two must agree
# within that rounding, else the table is not the run's.
STEP_ROUNDING_S = 0.005 + 0.0001
# STEP TOKEN SECONDS CACHE-HIT READ-GB TOK/S, printed by k3_run.c after a "STEP" header
_STEP_ROW = re.compile(r"^(\d+)\s+(-?\d+)\s+(\d+(?:\.\d+)?)\s")
_PINNED = re.compile(r"^trunk stream: .*?(\d+)/(\d+) layers PINNED")


class PeerError(EngineError):
    """The peer binary is unusable, failed, or wrote something that is not its report."""


def check_binary(path: str) -> Path:
    """`path` as an executable file, else one sentence (checked before anything runs)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise PeerError(f"--peer {path}: no such file; pass the path of the peer's built "
                        "`k3` binary (kimi-k3-in-c: `make`, then bin/k3).")
    if not p.is_file() or not os.access(p, os.X_OK):
        raise PeerError(f"--peer {path} is not an executable file; pass the peer's built "
                        "`k3` binary (bin/k3), or `chmod +x` it.")
    return p.resolve()


@dataclass(frozen=True)
class Split:
    """What the engine's plan gives the trunk (pinned + ring) and the expert arena."""

    budget: str  # the --budget-gb both engine runs get
    trunk_gb: float
    cache_gb: float
    pinned_layers: int
    expert_slots: int
    budget_gb: float

    def peer_args(self) -> list[str]:
        return ["--trunk-gb", f"{self.trunk_gb:.9f}", "--cache-gb", f"{self.cache_gb:.9f}"]


def plan_split(geometry, budget_gb: str, threads: int, guess: str) -> Split:
    """The split `python -m engine run --budget-gb budget_gb` will use. The cache gets half
    a slot more than its slots' bytes so the peer's floor(cache / slot) cannot lose one to
    float rounding of the GB figure."""
    plan = make_plan(geometry, budget_gb=float(budget_gb), threads=threads,
                     guess_experts=guess, check_memory=False)
    slot = geometry.expert_slot_bytes
    return Split(budget=budget_gb, trunk_gb=(plan.pinned_bytes + plan.ring_bytes) / GB,
                 cache_gb=(plan.cache_bytes + slot // 2) / GB,
                 pinned_layers=len(plan.pinned), expert_slots=plan.expert_slots,
                 budget_gb=plan.budget_bytes / GB)


def peer_argv(binary: Path, ck: Path, trunk: Path, prompt: list[int], tokens: int,
              split: Split, out: Path) -> list[str]:
    return [str(binary), str(ck), "--ids", ",".join(map(str, prompt)), "--gen", str(tokens),
            "--incremental", "--trunk", str(trunk), *split.peer_args(), "--out", str(out)]


def engine_argv(ck: Path, trunk: Path, prompt: list[int], tokens: int, split: Split,
                threads: int, guess: str) -> list[str]:
    # --stop -1: v1.0.0 decodes greedily to --gen and never stops early; neither do we here.
    argv = [sys.executable, "-m", "engine", "run", str(ck), "--ids",
            ",".join(map(str, prompt)), "--gen", str(tokens), "--budget-gb", split.budget,
            "--trunk", str(trunk), "--stop", "-1", "--guess-experts", guess, "--json"]
    return argv + (["--threads", str(threads)] if threads else [])


# ---- one child ----------------------------------------------------------------------------


@dataclass
class Child:
    status: int | None  # exit status; None = killed at the timeout
    peak_rss_gb: float
    stdout: bytes
    stderr_tail: str


def run_child(argv: list[str], timeout: float, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Child:
    """Run `argv` in its own session; its peak RSS from wait4 (its own, not ours). At the
    timeout the whole process group is killed."""
    timed_out = threading.Event()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    env=env, cwd=cwd, start_new_session=True)
        except OSError as exc:
            raise PeerError(f"cannot start {argv[0]} ({exc.strerror}).") from None

        def kill() -> None:
            timed_out.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, wstatus, usage = os.wait4(proc.pid, 0)
        except BaseException:  # Ctrl-C: leave no peer running behind us
            kill()
            proc.wait()
            raise
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(wstatus)  # reaped here, not by Popen
        out.seek(0)
        stdout = out.read(MAX_STDOUT_BYTES)
        err.seek(0)
        lines = err.read(MAX_STDOUT_BYTES).decode("utf-8", "replace").strip().splitlines()
    return Child(status=None if timed_out.is_set() else proc.returncode,
                 peak_rss_gb=usage.ru_maxrss * 1024 / GB, stdout=stdout,
                 stderr_tail=lines[-1][:300] if lines else "")


# ---- what the peer wrote ----------------------------------------------------------------


def _int_list(data: dict, key: str, where: str) -> list[int]:
    v = data.get(key)
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise PeerError(f"{where} has no list of integer ids under {key!r}; is the binary "
                        "kimi-k3-in-c v1.0.0?")
    return v


def parse_out(raw: bytes, where: str, prompt: list[int], tokens: int,
              layers: int) -> dict[str, Any]:
    """The peer's --out JSON, checked against what it was asked to do."""
    advice = "is the binary kimi-k3-in-c v1.0.0?"
    if len(raw) > MAX_OUT_BYTES:
        raise PeerError(f"{where} is over {MAX_OUT_BYTES // 1000} KB, far more than a run "
                        f"report; {advice}")
    data = parse_json(raw, where, advice, PeerError)
    got_prompt = _int_list(data, "prompt_ids", where)
    gen = _int_list(data, "generated_ids", where)
    full = _int_list(data, "full_ids", where)
    spt = data.get("seconds_per_token")
    if type(spt) not in (int, float) or not math.isfinite(spt) or spt <= 0:
        raise PeerError(f"{where} has no positive seconds_per_token; {advice}")
    if got_prompt != prompt:
        raise PeerError(f"{where} reports a different prompt than the ids it was given.")
    if not 1 <= len(gen) <= tokens or full != prompt + gen:
        raise PeerError(f"{where} does not hold the prompt followed by at most {tokens} "
                        f"generated ids; {advice}")
    if type(data.get("layers")) is not int or data["layers"] != layers:
        raise PeerError(f"{where} says the peer ran {data.get('layers')!r} layers, not the "
                        f"checkpoint's {layers}; the runs would not be comparable.")
    return {"generated_ids": gen, "seconds_per_token": float(spt)}


def parse_steps(stdout: bytes, generated: list[int], spt: float) -> dict[str, Any]:
    """Step seconds from the peer's step table, and the layers it pinned. The table must
    name the same tokens as --out and add up to its seconds_per_token."""
    rows, pinned, in_table = [], None, False
    for line in stdout.decode("utf-8", "replace").splitlines():
        if (m := _PINNED.match(line)) is not None:
            pinned = int(m.group(1))
        elif line.startswith("STEP"):
            in_table, rows = True, []
        elif in_table and (m := _STEP_ROW.match(line)) is not None:
            rows.append((int(m.group(1)), int(m.group(2)), float(m.group(3))))
        elif in_table and rows:
            in_table = False  # the closing rule
    n = len(generated)
    if [r[:2] for r in rows] != list(zip(range(n), generated)):
        raise PeerError("the peer's step table does not list one step per generated id "
                        "(run without --spec); is the binary kimi-k3-in-c v1.0.0?")
    secs = [r[2] for r in rows]
    if abs(sum(secs) - spt * n) > STEP_ROUNDING_S * n:
        raise PeerError(f"the peer's step seconds add up to {sum(secs):.2f} s but its "
                        f"seconds_per_token says {spt * n:.2f} s; they are not the same run.")
    # Step 0 is the prompt: out of the total, as the engine's first token is untimed.
    steady = (spt * n - secs[0]) / (n - 1) if n > 1 else None
    return {"s_per_token": steady, "step0_s": secs[0], "pinned_layers": pinned}


def run_peer(binary: Path, ck: Path, trunk: Path, prompt: list[int], tokens: int,
             split: Split, threads: int, layers: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="k3-peer-") as tmp:
        out = Path(tmp) / "k3_run.json"
        argv = peer_argv(binary, ck, trunk, prompt, tokens, split, out)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        child = run_child(argv, timeout, env=env, cwd=Path(tmp))
        if child.status is None:
            raise PeerError(f"the peer did not finish within {timeout:g} s at the "
                            f"{split.budget} GB budget and was stopped; pass a longer "
                            "--peer-timeout or check that it runs on its own.")
        if child.status != 0:
            why = {4: "a routed expert failed to load (RUN INVALID)"}.get(
                child.status, child.stderr_tail or "no message")
            raise PeerError(f"the peer failed at the {split.budget} GB budget (exit "
                            f"{child.status}): {why}")
        if not out.is_file():
            raise PeerError("the peer exited 0 but wrote no --out file; is the binary "
                            "kimi-k3-in-c v1.0.0?")
        with open(out, "rb") as f:
            raw = f.read(MAX_OUT_BYTES + 1)
        report = parse_out(raw, "the peer's --out file", prompt, tokens, layers)
    steps = parse_steps(child.stdout, report["generated_ids"], report["seconds_per_token"])
    return {"ids": report["generated_ids"], "s_per_token": steps["s_per_token"],
            "seconds_per_token_reported": report["seconds_per_token"],
            "step0_s": steps["step0_s"], "pinned_layers": steps["pinned_layers"],
            "peak_rss_gb": child.peak_rss_gb, "argv": argv}


def run_engine(ck: Path, trunk: Path, prompt: list[int], tokens: int, split: Split,
               threads: int, guess: str, timeout: float) -> dict[str, Any]:
    child = run_child(engine_argv(ck, trunk, prompt, tokens, split, threads, guess), timeout)
    if child.status != 0:
        raise EngineError(f"the engine's run at the {split.budget} GB budget failed: "
                          f"{child.stderr_tail or 'no message'}")
    lines = child.stdout.decode("utf-8", "replace").strip().splitlines()
    res = parse_json(lines[-1] if lines else "", "the engine's run output",
                     "this is a bug.", EngineError)
    used = res["stats"].get("budget_gb")
    if used is None or abs(used - split.budget_gb) > 1e-6:
        raise EngineError(f"the engine's run planned {used} GB of weights, not the "
                          f"{split.budget_gb:.6f} GB the peer is given; this is a bug.")
    return {"ids": res["generated_ids"], "s_per_token": res["decode_seconds_per_token_mean"],
            "peak_rss_gb": child.peak_rss_gb}


# ---- the comparison -----------------------------------------------------------------------


def compare(binary: Path, ck: Path, trunk: Path, budgets: list[str], tokens: int, runs: int,
            reader_threads: int = 0, guess: str = "auto",
            timeout: float = DEFAULT_TIMEOUT_S, log=None) -> dict[str, Any]:
    """Per budget: `runs` engine runs and `runs` peer runs, taking turns; medians."""
    cmap = CheckpointMap(ck, trunk)
    g = cmap.geometry()
    prompt = [int(x) for x in np.random.default_rng(1).integers(0, cmap.config.vocab_size, 4)]
    threads = compute_threads()
    rungs = []
    for budget in budgets:
        split = plan_split(g, budget, reader_threads, guess)
        engine, peer = [], []
        for i in range(runs):
            if log:
                log(f"peer comparison at {budget} GB: run {i + 1} of {runs} (engine, peer)")
            engine.append(run_engine(ck, trunk, prompt, tokens, split, reader_threads, guess,
                                     timeout))
            peer.append(run_peer(binary, ck, trunk, prompt, tokens, split, threads,
                                 g.n_layers, timeout))
        e_s = _median([r["s_per_token"] for r in engine])
        p_s = _median([r["s_per_token"] for r in peer])
        rungs.append({
            "budget": budget, "budget_gb": split.budget_gb, "trunk_gb": split.trunk_gb,
            "cache_gb": split.cache_gb, "engine_pinned_layers": split.pinned_layers,
            "expert_slots": split.expert_slots,
            "peer_pinned_layers": peer[0]["pinned_layers"],
            "engine_s_per_token": e_s, "peer_s_per_token": p_s,
            "ratio": p_s / e_s if e_s and p_s else None,
            "ids_agree": all(r["ids"] == engine[0]["ids"] for r in engine + peer),
            "engine_ids": engine[0]["ids"], "peer_ids": peer[0]["ids"],
            "engine_peak_rss_gb": max(r["peak_rss_gb"] for r in engine),
            "peer_peak_rss_gb": max(r["peak_rss_gb"] for r in peer),
            "engine_runs": [r["s_per_token"] for r in engine],
            "peer_runs": [r["s_per_token"] for r in peer],
            "peer_step0_s": [r["step0_s"] for r in peer],
            "peer_argv": peer[0]["argv"],
        })
    return {"binary": str(binary), "trunk": str(trunk), "threads": threads, "runs": runs,
            "tokens": tokens, "prompt_ids": prompt, "rungs": rungs}


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def render(res: dict[str, Any]) -> str:
    lines = [
        f"the C peer {res['binary']} beside `python -m engine run`, {res['runs']} runs each "
        f"in turn per budget, {res['tokens']} tokens, OMP_NUM_THREADS={res['threads']}, "
        f"--incremental, the same packed trunk ({res['trunk']})",
        "  the peer gets the engine plan's split: --trunk-gb = its pinned layers + ring, "
        "--cache-gb = its expert slots; s/token = medians over the steps after the first "
        "(the prompt) for both",
        f"{'budget GB':>10} {'trunk GB':>9} {'cache GB':>9} {'pinned':>9} {'engine s':>9} "
        f"{'peer s':>9} {'peer/eng':>8} {'ids agree':>9} {'eng RSS':>8} {'peer RSS':>8}",
    ]
    for r in res["rungs"]:
        pinned = f"{r['engine_pinned_layers']}/{_opt(r['peer_pinned_layers'], 'd')}"
        lines.append(
            f"{r['budget_gb']:>10.2f} {r['trunk_gb']:>9.3f} {r['cache_gb']:>9.3f} "
            f"{pinned:>9} {_opt(r['engine_s_per_token'], '.3f'):>9} "
            f"{_opt(r['peer_s_per_token'], '.3f'):>9} {_opt(r['ratio'], '.2f'):>8} "
            f"{'yes' if r['ids_agree'] else 'NO':>9} {r['engine_peak_rss_gb']:>8.2f} "
            f"{r['peer_peak_rss_gb']:>8.2f}")
    lines.append("pinned = layers the engine / the peer kept in RAM from the same trunk "
                 "budget; peer/eng > 1: the engine is faster; RSS in GB, each child's own")
    return "\n".join(lines)


def _opt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)
