"""`python -m engine run CHECKPOINT --ids 3,7,11 --gen N`: token ids in, ids and timings out.

Greedy and incremental by default; `--full` recomputes the whole prefix every step.
`--dump-logits FILE` writes the first step's last-position logits as float32 .npy;
`--json` prints one JSON object on stdout: the ids, per-token statistics (`per_token`) and
run totals (`totals`: s/token, GB read/token, MB/s, true hit rate, evictions, peak RSS);
without it, a per-step table and a summary ending in the run's peak RSS. Memory flags
(`--budget-gb`, `--preset`, ...) stream the model under a budget; without them everything
is resident.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.decode.generate import GenParams, generate
from engine.decode.sampler import Sampler
from engine.errors import EngineError
from engine.jsonfile import load_json
from engine.model.transformer import load_model
from engine.text.tokenizer import MAX_TOKENIZER_CONFIG
from engine.weights.planner import MemorySettings, add_memory_arguments
from engine.weights.streaming import open_source
from engine.weights.sysmem import peak_rss
from k3vocab import GB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint folder (config.json + safetensors shards)")
    parser.add_argument(
        "--ids", required=True, help="comma-separated prompt token ids, e.g. 3,7,11"
    )
    parser.add_argument("--gen", type=int, default=16, metavar="N", help="tokens to generate")
    parser.add_argument("--full", action="store_true", help="recompute the whole prefix each step")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stop",
        default="",
        metavar="IDS",
        help="comma-separated stop ids (default: the config's eos_token_id)",
    )
    parser.add_argument("--dump-logits", metavar="FILE", help="write first-step logits (.npy)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_memory_arguments(parser)


def _parse_ids(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise EngineError(
            f"{what} must be comma-separated integers like 3,7,11, got {text!r}."
        ) from None


def default_stop_ids(eos_token_id: int | None, checkpoint: Path) -> list[int]:
    """config.json's eos_token_id plus the tokenizer's [EOS] and <|end_of_msg|>: the two
    config files of the release disagree (163586 vs 163585) and the model ends turns with
    either, so stop on both."""
    ids = {eos_token_id} if eos_token_id is not None else set()
    file = checkpoint / "tokenizer_config.json"
    if not file.is_file():
        return sorted(ids)
    added = load_json(
        file, MAX_TOKENIZER_CONFIG, "restore the checkpoint's own copy or pass --stop IDS."
    ).get("added_tokens_decoder")
    for i, tok in added.items() if isinstance(added, dict) else ():
        if (
            isinstance(tok, dict)
            and tok.get("content") in ("[EOS]", "<|end_of_msg|>")
            and i.isdigit()
        ):
            ids.add(int(i))
    return sorted(ids)


def main(args: argparse.Namespace) -> int:
    try:
        ids = _parse_ids(args.ids, "--ids")
        if not ids:
            raise EngineError("--ids is empty; pass at least one token id, e.g. --ids 3,7,11.")
        if args.gen < 0:
            raise EngineError("--gen must be 0 or more.")
        try:  # the flags alone, before minutes of loading
            Sampler(args.temperature, args.top_k, args.top_p, args.seed)
        except ValueError as exc:
            raise EngineError(f"{exc}; check the sampling flags.") from None
        if not Path(args.checkpoint).exists():
            raise EngineError(f"{args.checkpoint} does not exist; pass a checkpoint folder.")
        t0 = time.perf_counter()
        source = open_source(args.checkpoint, MemorySettings.from_args(args))
        model = load_model(args.checkpoint, source)
        load_s = time.perf_counter() - t0
        stops = (
            _parse_ids(args.stop, "--stop")
            if args.stop
            else default_stop_ids(model.config.eos_token_id, Path(args.checkpoint))
        )
        params = GenParams(
            max_tokens=args.gen,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop_ids=tuple(stops),
            full_recompute=args.full,
        )
        first: list[np.ndarray] = []

        def keep_first(generated: list[int], logits: np.ndarray) -> np.ndarray:
            if not generated and not first:
                first.append(np.asarray(logits, np.float32).copy())
            return logits

        tokens = []
        if not args.json:
            print(STEP_HEADER, flush=True)
        for tok in generate(
            model, ids, params, logits_hook=keep_first if args.dump_logits else None
        ):
            tokens.append(tok)
            if not args.json:
                print(step_line(tok), flush=True)
        if args.dump_logits:
            if not first:
                first.append(model.prefill(ids, model.new_state()))
            np.save(args.dump_logits, first[0].astype(np.float32))
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"error: cannot read the checkpoint ({exc}); check the path and permissions.",
            file=sys.stderr,
        )
        return 2

    totals = run_totals(tokens, peak_rss() / GB)
    result = {
        "prompt_ids": ids,
        "generated_ids": [t.id for t in tokens],
        "mode": "full" if args.full else "incremental",
        "load_seconds": round(load_s, 4),
        "prefill_seconds": tokens[0].prefill_seconds if tokens else None,
        "seconds_per_token": [round(t.seconds, 6) for t in tokens],
        "decode_seconds_per_token_mean": totals["s_per_token"],
        "stopped": bool(tokens and tokens[-1].stop),
        "stats": tokens[-1].stats.as_dict() if tokens else {},
        "per_token": [
            {"index": t.index, "id": t.id, "seconds": t.seconds, **t.stats.as_dict()}
            for t in tokens
        ],
        "totals": totals,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(summary(result))
    return 0


# ---- the run report ---------------------------------------------------------------------

STEP_HEADER = f"{'step':>4} {'token':>7} {'seconds':>8} {'hit %':>6} {'GB read':>8} {'tok/s':>6}"


def step_line(tok) -> str:
    hit = tok.stats.true_hit_rate
    gb = tok.stats.gb_read or 0.0
    rate = 1 / tok.seconds if tok.seconds > 0 else 0.0
    return (
        f"{tok.index:>4} {tok.id:>7} {tok.seconds:>8.3f} "
        f"{(f'{hit * 100:.1f}' if hit is not None else '-'):>6} {gb:>8.3f} {rate:>6.2f}"
        + ("  (prompt)" if tok.index == 0 else "")
    )


def run_totals(tokens: list, peak_rss_gb: float) -> dict[str, Any]:
    """Run totals from the per-token stats. Per-token figures are means over the decode
    steps (token 0 also carries the prompt's forward pass, reported apart as prefill);
    hit rate, evictions and MB/s are totalled over the same steps."""
    decode = tokens[1:]
    n = len(decode)

    def total(key: str, toks: list = decode) -> float:
        return float(sum(getattr(t.stats, key) or 0 for t in toks))

    def gb(toks: list) -> float:
        return total("gb_read_trunk", toks) + total("gb_read_experts", toks)

    secs = sum(t.seconds for t in decode)
    hits, misses = int(total("expert_hits")), int(total("expert_misses"))
    return {
        "tokens": len(tokens),
        "decode_tokens": n,
        "s_per_token": secs / n if n else None,
        "compute_s_per_token": total("compute_s") / n if n else None,
        "wait_trunk_s_per_token": total("wait_trunk_s") / n if n else None,
        "wait_experts_s_per_token": total("wait_experts_s") / n if n else None,
        "gb_read_per_token": gb(decode) / n if n else None,
        "gb_read_trunk_per_token": total("gb_read_trunk") / n if n else None,
        "gb_read_experts_per_token": total("gb_read_experts") / n if n else None,
        "mb_per_s": gb(decode) * 1000 / secs if secs > 0 else None,
        "true_hit_rate": hits / (hits + misses) if hits + misses else None,
        "expert_hits": hits,
        "expert_misses": misses,
        "evictions": int(total("evictions")),
        "prefill_seconds": tokens[0].prefill_seconds if tokens else None,
        "prefill_gb_read": gb(tokens[:1]),
        "gb_read": gb(tokens),
        "budget_gb": tokens[-1].stats.budget_gb if tokens else None,
        "peak_rss_gb": peak_rss_gb,
    }


def summary(result: dict[str, Any]) -> str:
    t = result["totals"]
    ids = ",".join(map(str, result["generated_ids"]))
    lines = [f"generated {t['tokens']} tokens" + (f": {ids}" if ids else "")]
    if t["s_per_token"]:
        s = t["s_per_token"]
        lines.append(
            f"decode {s:.3f} s/token ({1 / s:.2f} tokens/s): compute {t['compute_s_per_token']:.3f}"
            f" + waiting for trunk {t['wait_trunk_s_per_token']:.3f} + experts "
            f"{t['wait_experts_s_per_token']:.3f} s"
        )
        if t["gb_read"] > 0:
            lines.append(
                f"read {t['gb_read_per_token']:.3f} GB/token (trunk "
                f"{t['gb_read_trunk_per_token']:.3f} + experts "
                f"{t['gb_read_experts_per_token']:.3f})"
                f" at {t['mb_per_s'] or 0:.0f} MB/s"
            )
        if t["true_hit_rate"] is not None:
            asked = t["expert_hits"] + t["expert_misses"]
            lines.append(
                f"experts: true resident hit rate {t['true_hit_rate'] * 100:.1f}% "
                f"({t['expert_hits']} of {asked}), {t['evictions']} evictions"
            )
    if t["prefill_seconds"] is not None:
        read = f", {t['prefill_gb_read']:.3f} GB read" if t["gb_read"] > 0 else ""
        lines.append(
            f"prefill {t['prefill_seconds']:.3f} s ({len(result['prompt_ids'])} ids"
            f"{read}), load {result['load_seconds']:.2f} s"
        )
    budget = f" (budget {t['budget_gb']:.3g} GB)" if t["budget_gb"] else ""
    lines.append(f"PEAK RSS for the whole run: {t['peak_rss_gb']:.2f} GB{budget}")
    return "\n".join(lines)
