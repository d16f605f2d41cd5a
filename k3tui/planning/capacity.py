"""`k3tui plan --users …`: how many machines a team needs, and what that implies.

The sizing model is the DGX Spark study's: every machine serves one request at a time
(one slot), a working day is 8 hours, machines are sized for 70 % utilisation, and an
answer's tokens include its reasoning tokens. Demand and capacity are both counted in
machine-seconds per day:

    demand   = users × requests_per_user_day × tokens_per_answer / tok_per_s
    capacity = hours × 3600 × utilisation                    (per machine)
    machines = ceil(demand / capacity)
    latency  = tokens_per_answer / tok_per_s                 (per answer, any fleet size)

Arithmetic is exact (fractions of the decimal inputs), so a demand that is a whole
multiple of the capacity is not pushed one machine up by float rounding. With 50 users
at 0.37 tok/s this gives the study's Table 8: light 5 × 300 → 11, moderate 20 × 500 → 68,
heavy 50 × 800 → 269.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from k3tui.errors import K3Error
from k3tui.planning.plan import GGUF_BYTES, SAFETENSORS_BYTES
from k3tui.units import GB

HOURS_PER_DAY = 8.0
TARGET_UTILISATION = 0.7
# Assumption, stated wherever it is used: a DGX Spark's power supply is rated ~240 W;
# real draw while decoding is lower, so power and energy figures are upper bounds.
WATTS_PER_MACHINE = 240.0
# Every machine keeps a whole checkpoint: the safetensors release (bundled engine).
CHECKPOINT_GB = round(SAFETENSORS_BYTES / GB, 1)  # 1,560.9 GB, as `k3tui plan` says
GGUF_GB = GGUF_BYTES / GB  # the IQ1_S GGUF llama-server runs (579.5 GB = 539.7 GiB)

FORMULA = (
    "machines = ceil(users × requests_per_user_day × tokens_per_answer / tok_per_s"
    " / (hours × 3600 × utilisation)); latency_s = tokens_per_answer / tok_per_s"
)


@dataclass(frozen=True)
class Sizing:
    users: int
    requests_per_user_day: float
    tokens_per_answer: float
    tok_per_s: float
    tok_per_s_source: str
    hours_per_day: float
    target_utilisation: float
    machines: int
    latency_s: float
    demand_machine_s_per_day: float
    capacity_s_per_machine: float
    exact_machines: float
    utilisation_at_machines: float
    answers_per_machine_day: float
    watts_per_machine: float
    peak_kw: float
    kwh_per_day_max: float
    wh_per_answer: float
    checkpoint_gb_per_machine: float
    storage_tb: float
    formula: str = FORMULA


def _exact(x: float | Fraction) -> Fraction:
    """The decimal the user typed (repr of a float is its shortest round-trip form)."""
    return (
        x if isinstance(x, Fraction) else Fraction(repr(x)) if isinstance(x, float) else Fraction(x)
    )


def machines_needed(
    users: int,
    requests_per_user_day: float,
    tokens_per_answer: float,
    tok_per_s: float,
    *,
    hours: float = HOURS_PER_DAY,
    utilisation: float = TARGET_UTILISATION,
) -> int:
    """The study's formula, in exact arithmetic: ceil(demand / capacity), at least 1."""
    demand = (
        _exact(users)
        * _exact(requests_per_user_day)
        * _exact(tokens_per_answer)
        / _exact(tok_per_s)
    )
    capacity = _exact(hours) * 3600 * _exact(utilisation)
    return max(1, math.ceil(demand / capacity))


def size(
    users: int,
    requests_per_user_day: float,
    tokens_per_answer: float,
    tok_per_s: float,
    *,
    source: str = "--tok-per-s",
    hours: float = HOURS_PER_DAY,
    utilisation: float = TARGET_UTILISATION,
    watts: float = WATTS_PER_MACHINE,
    checkpoint_gb: float = CHECKPOINT_GB,
) -> Sizing:
    _check_inputs(
        users,
        requests_per_user_day,
        tokens_per_answer,
        tok_per_s,
        hours,
        utilisation,
        watts,
        checkpoint_gb,
    )
    machines = machines_needed(
        users,
        requests_per_user_day,
        tokens_per_answer,
        tok_per_s,
        hours=hours,
        utilisation=utilisation,
    )
    latency = tokens_per_answer / tok_per_s
    demand = users * requests_per_user_day * latency
    capacity = hours * 3600 * utilisation
    return Sizing(
        users=users,
        requests_per_user_day=requests_per_user_day,
        tokens_per_answer=tokens_per_answer,
        tok_per_s=tok_per_s,
        tok_per_s_source=source,
        hours_per_day=hours,
        target_utilisation=utilisation,
        machines=machines,
        latency_s=latency,
        demand_machine_s_per_day=demand,
        capacity_s_per_machine=capacity,
        exact_machines=demand / capacity,
        utilisation_at_machines=demand / (machines * hours * 3600),
        answers_per_machine_day=capacity / latency,
        watts_per_machine=watts,
        peak_kw=machines * watts / 1000,
        kwh_per_day_max=machines * watts * hours / 1000,
        wh_per_answer=watts * latency / 3600,
        checkpoint_gb_per_machine=checkpoint_gb,
        storage_tb=machines * checkpoint_gb / 1000,
    )


def _check_inputs(
    users: int,
    requests: float,
    tokens: float,
    tok_per_s: float,
    hours: float,
    utilisation: float,
    watts: float,
    checkpoint_gb: float,
) -> None:
    def bad(what: str, value: Any, rule: str) -> K3Error:
        return K3Error(
            f"{what} must be {rule} (got {value}).",
            "e.g. `k3tui plan --users 50 --requests-per-user-day 20 "
            "--tokens-per-answer 500 --tok-per-s 0.37`",
            2,
        )

    for what, value in (
        ("--users", users),
        ("--requests-per-user-day", requests),
        ("--tokens-per-answer", tokens),
        ("the throughput (tok/s)", tok_per_s),
        ("--hours", hours),
        ("--watts", watts),
    ):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise bad(what, value, "a positive number")
    if not 0 < utilisation <= 1:
        raise bad("--utilisation", utilisation, "between 0 and 1")
    if hours > 24:
        raise bad("--hours", hours, "at most 24")
    if not (math.isfinite(checkpoint_gb) and checkpoint_gb >= 0):
        raise bad("--checkpoint-gb", checkpoint_gb, "zero or more")


# --- throughput from a measurement -------------------------------------------------------

# Keys a benchmark or server reports, in order of preference, and how to get tok/s.
_RATE_KEYS: tuple[tuple[str, str], ...] = (
    ("s_per_token", "inverse"),  # the engine's `bench stream` JSON, `k3` chunks
    ("predicted_per_second", "direct"),  # llama-server `timings`
    ("predicted_per_token_ms", "inverse_ms"),
    ("tok_per_s", "direct"),
    ("tokens_per_s", "direct"),
)


def throughput_from_bench(path: str | Path) -> tuple[float, str]:
    """tok/s measured in FILE, and where in the file it was found.

    Accepts the engine's `bench stream` JSON (`s_per_token`) and llama-server timings
    (`predicted_per_second`, a whole response or just its `timings` object). The
    shallowest match wins, so a summary at the top beats per-run entries below it.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise K3Error(
            f"{path} does not exist.",
            "pass the JSON written by `python -m engine bench stream` or a "
            "llama-server response with `timings`",
            2,
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise K3Error(
            f"{path} is not a JSON file ({exc}).",
            "pass the JSON written by `python -m engine bench stream` or a "
            "llama-server response with `timings`",
            2,
        ) from None
    for key, how in _RATE_KEYS:
        found = _find_key(data, key)
        if found is None:
            continue
        where, value = found
        if isinstance(value, dict):  # e.g. {"median": …, "mean": …}
            value = value.get("median", value.get("mean"))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            continue
        rate = {"direct": value, "inverse": 1.0 / value, "inverse_ms": 1000.0 / value}[how]
        return float(rate), f"{path.name}: {where} = {value:g}"
    raise K3Error(
        f"{path} holds no throughput (no s_per_token or predicted_per_second).",
        "run `python -m engine bench stream --json` or save a llama-server "
        "response, or give --tok-per-s yourself",
        2,
    )


def _find_key(data: Any, key: str) -> tuple[str, Any] | None:
    level: list[tuple[str, Any]] = [("", data)]
    while level:
        nxt: list[tuple[str, Any]] = []
        for where, node in level:
            if isinstance(node, dict):
                if key in node and node[key] is not None:
                    return (f"{where}.{key}" if where else key), node[key]
                nxt += [(f"{where}.{k}" if where else str(k), v) for k, v in node.items()]
            elif isinstance(node, list):
                nxt += [(f"{where}[{i}]", v) for i, v in enumerate(node)]
        level = nxt
    return None


# --- output --------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    minutes = seconds / 60
    if minutes < 90:
        return f"{int(minutes)} min {round(seconds - 60 * int(minutes))} s"
    return f"{int(minutes // 60)} h {round(minutes % 60)} min"


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.2f}".rstrip("0").rstrip(".")


WHY_LATENCY = (
    "Why more machines do not make an answer faster: each answer is generated token by\n"
    "token on one machine, and every token waits for the one before it. The speed of one\n"
    "token is set by that machine (how fast it reads the experts and trunk the token needs),\n"
    "so extra machines add slots — more answers at once — not speed. To cut latency, make\n"
    "one machine faster (more RAM, so less is read from disk per token) or hold the whole\n"
    "model in fast memory across machines: the routes below."
)


def render_text(s: Sizing) -> str:
    lines = [
        (
            f"Sizing Kimi-K3 for {s.users} users × {_num(s.requests_per_user_day)} requests/day × "
            f"{_num(s.tokens_per_answer)} tokens (reasoning included)"
        ),
        f"throughput of one machine: {s.tok_per_s:.4g} tok/s ({s.tok_per_s_source})",
        (
            f"model: {s.hours_per_day:g}-hour working day, {s.target_utilisation:.0%} target "
            "utilisation, one request per machine at a time"
        ),
        "",
        f"machines needed     {s.machines}",
        (
            f"  demand {_num(s.demand_machine_s_per_day)} machine-s/day ÷ "
            f"{_num(s.capacity_s_per_machine)} s/machine = {s.exact_machines:.2f} → "
            f"{s.machines} ({s.utilisation_at_machines:.1%} busy)"
        ),
        (
            f"latency per answer  {_duration(s.latency_s)} ({_num(s.tokens_per_answer)} tokens ÷ "
            f"{s.tok_per_s:.4g} tok/s), with 1 machine or {s.machines}"
        ),
        f"  one machine answers {s.answers_per_machine_day:.1f} requests per working day",
        (
            f"power               ≤ {s.peak_kw:.1f} kW: {s.machines} × {s.watts_per_machine:g} W "
            "(assumed: a DGX Spark's PSU rating)"
        ),
        f"  ≤ {s.kwh_per_day_max:.1f} kWh per working day, ≤ {s.wh_per_answer:.1f} Wh per answer",
        (
            f"storage             {s.storage_tb:.1f} TB: {s.machines} × "
            f"{s.checkpoint_gb_per_machine:g} GB, a whole checkpoint on every machine"
        ),
        f"  (with the {GGUF_GB:.1f} GB GGUF instead: {s.machines * GGUF_GB / 1000:.1f} TB)",
        "",
        WHY_LATENCY,
        "",
        "formula: machines = ceil(users × requests × tokens / tok_per_s",
        "                         / (hours × 3600 × utilisation))",
        "         latency  = tokens / tok_per_s",
    ]
    return "\n".join(lines)


def render_routes() -> str:
    from k3tui.planning.recipes import ROUTES, summary

    lines = ["Routes beyond one machine (k3tui connects to them as a remote backend):"]
    lines += [f"  {route:<7} {summary(route)}" for route in ROUTES]
    lines.append("  `k3tui plan --recipe ROUTE`: what fits, the launch commands, why each flag")
    return "\n".join(lines)


def add_capacity_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `main` reads; `commands/plan.py` may use this or declare its own."""
    g = parser.add_argument_group("cluster sizing (the DGX Spark study's model)")
    g.add_argument("--users", type=int, metavar="N", help="people using the service")
    g.add_argument(
        "--requests-per-user-day", type=float, metavar="R", help="requests per person per day"
    )
    g.add_argument(
        "--tokens-per-answer", type=float, metavar="T", help="tokens per answer, reasoning included"
    )
    src = g.add_mutually_exclusive_group()
    src.add_argument(
        "--tok-per-s", type=float, metavar="X", help="measured tokens/s of one machine"
    )
    src.add_argument(
        "--from-bench",
        metavar="FILE",
        help="JSON from `python -m engine bench stream` or llama-server timings",
    )
    g.add_argument(
        "--hours", type=float, default=HOURS_PER_DAY, metavar="H", help="working hours per day"
    )
    g.add_argument(
        "--utilisation",
        type=float,
        default=TARGET_UTILISATION,
        metavar="U",
        help="target utilisation of each machine (0-1)",
    )
    g.add_argument(
        "--watts",
        type=float,
        default=WATTS_PER_MACHINE,
        metavar="W",
        help="power per machine (assumed: a DGX Spark's 240 W PSU rating)",
    )
    g.add_argument(
        "--checkpoint-gb",
        type=float,
        default=CHECKPOINT_GB,
        metavar="GB",
        help="checkpoint size each machine stores (GB)",
    )
    g.add_argument(
        "--recipe",
        choices=("rpc", "sglang", "vllm"),
        help="print the launch recipe of one multi-machine route",
    )
    g.add_argument(
        "--node-gib",
        type=float,
        default=121.0,
        metavar="GIB",
        help="memory of each machine pooled by the rpc recipe (DGX Spark: 121)",
    )
    g.add_argument(
        "--gguf-gib",
        type=float,
        default=539.0,
        metavar="GIB",
        help="size of the GGUF the rpc recipe keeps resident",
    )


def _recipe_params(args: argparse.Namespace, route: str) -> dict[str, float]:
    if route != "rpc":
        return {}
    node, gguf = getattr(args, "node_gib", 121.0), getattr(args, "gguf_gib", 539.0)
    if not (node > 8 and gguf > 0):
        raise K3Error(
            f"--node-gib must be more than 8 and --gguf-gib positive (got {node:g} and {gguf:g}).",
            "e.g. --node-gib 121 --gguf-gib 539",
            2,
        )
    return {"node_gib": node, "gguf_gib": gguf}


def _recipe_json(route: str, params: dict[str, float]) -> dict[str, Any]:
    from k3tui.planning.recipes import recipe

    r = recipe(route, **params)
    return {
        "route": r.route,
        "title": r.title,
        "checked_against": r.checked_against,
        "sources": list(r.sources),
        "fit": list(r.fit),
        "connect": r.connect,
        "steps": [
            {"where": st.where, "env": list(st.env), "argv": list(st.argv), "why": list(st.why)}
            for st in r.steps
        ],
        "notes": list(r.notes),
    }


def main(args: argparse.Namespace) -> int:
    """Entry point `commands/plan.py` delegates to when `--users` (or `--recipe`) is given."""
    recipe = getattr(args, "recipe", None)
    users = getattr(args, "users", None)
    params = _recipe_params(args, recipe) if recipe else {}
    if recipe and users is None:
        from k3tui.planning.recipes import render

        if getattr(args, "json", False):
            print(json.dumps({"recipe": _recipe_json(recipe, params)}, indent=2))
        else:
            print(render(recipe, **params))
        return 0
    missing = [
        flag
        for flag, attr in (
            ("--users", "users"),
            ("--requests-per-user-day", "requests_per_user_day"),
            ("--tokens-per-answer", "tokens_per_answer"),
        )
        if getattr(args, attr, None) is None
    ]
    if missing:
        raise K3Error(
            f"sizing needs {', '.join(missing)}.",
            "e.g. `k3tui plan --users 50 --requests-per-user-day 20 "
            "--tokens-per-answer 500 --tok-per-s 0.37`",
            2,
        )
    tok_per_s, bench = getattr(args, "tok_per_s", None), getattr(args, "from_bench", None)
    if tok_per_s is not None and bench:
        raise K3Error("give either --tok-per-s or --from-bench, not both.", "drop one of them", 2)
    if bench:
        tok_per_s, source = throughput_from_bench(bench)
    elif tok_per_s is not None:
        source = "--tok-per-s"
    else:
        raise K3Error(
            "sizing needs the throughput of one machine.",
            "measure it (`python -m engine bench stream`) and pass --from-bench "
            "FILE, or pass --tok-per-s X (the DGX Spark study measured 0.37)",
            2,
        )
    sizing = size(
        args.users,
        args.requests_per_user_day,
        args.tokens_per_answer,
        tok_per_s,
        source=source,
        hours=getattr(args, "hours", HOURS_PER_DAY),
        utilisation=getattr(args, "utilisation", TARGET_UTILISATION),
        watts=getattr(args, "watts", WATTS_PER_MACHINE),
        checkpoint_gb=getattr(args, "checkpoint_gb", CHECKPOINT_GB),
    )
    if getattr(args, "json", False):
        out: dict[str, Any] = asdict(sizing)
        out["why_latency"] = " ".join(WHY_LATENCY.split())
        if recipe:
            out["recipe"] = _recipe_json(recipe, params)
        print(json.dumps(out, indent=2))
        return 0
    print(render_text(sizing))
    print()
    if recipe:
        from k3tui.planning.recipes import render

        print(render(recipe, **params))
    else:
        print(render_routes())
    return 0
