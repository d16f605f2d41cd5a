"""`python -m engine run CHECKPOINT --ids 3,7,11 --gen N`: token ids in, ids and timings out.

Greedy and incremental by default; `--full` recomputes the whole prefix every step.
`--dump-logits FILE` writes the first step's last-position logits as float32 .npy;
`--json` prints one JSON object on stdout. Memory flags (`--budget-gb`, `--preset`, ...)
stream the model under a budget; without them everything is resident.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from engine.errors import EngineError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint folder (config.json + safetensors shards)")
    parser.add_argument("--ids", required=True, help="comma-separated prompt token ids, e.g. 3,7,11")
    parser.add_argument("--gen", type=int, default=16, metavar="N", help="tokens to generate")
    parser.add_argument("--full", action="store_true", help="recompute the whole prefix each step")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", default="", metavar="IDS",
                        help="comma-separated stop ids (default: the config's eos_token_id)")
    parser.add_argument("--dump-logits", metavar="FILE", help="write first-step logits (.npy)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    try:
        from engine.planner import add_memory_arguments
    except ImportError:  # streaming not installed: everything resident
        return
    add_memory_arguments(parser)


def _parse_ids(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise EngineError(f"{what} must be comma-separated integers like 3,7,11, got {text!r}.") from None


def default_stop_ids(eos_token_id: int | None, checkpoint: Path) -> list[int]:
    """config.json's eos_token_id plus the tokenizer's [EOS] and <|end_of_msg|>: the two
    config files of the release disagree (163586 vs 163585) and the model ends turns with
    either, so stop on both."""
    ids = {eos_token_id} if eos_token_id is not None else set()
    try:
        added = json.loads((checkpoint / "tokenizer_config.json").read_text())["added_tokens_decoder"]
        ids |= {int(i) for i, tok in added.items() if tok.get("content") in ("[EOS]", "<|end_of_msg|>")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return sorted(ids)


def open_source(checkpoint: str, args: argparse.Namespace):
    """STR's planned source when memory flags were given; the resident one otherwise."""
    try:
        from engine.streaming import open_source as streaming_open_source
    except ImportError:
        return None
    return streaming_open_source(checkpoint, args)


def main(args: argparse.Namespace) -> int:
    from engine.generate import GenParams, generate
    from engine.model import load_model

    try:
        ids = _parse_ids(args.ids, "--ids")
        if not ids:
            raise EngineError("--ids is empty; pass at least one token id, e.g. --ids 3,7,11.")
        if args.gen < 0:
            raise EngineError("--gen must be 0 or more.")
        if not Path(args.checkpoint).exists():
            raise EngineError(f"{args.checkpoint} does not exist; pass a checkpoint folder.")
        t0 = time.perf_counter()
        model = load_model(args.checkpoint, open_source(args.checkpoint, args))
        load_s = time.perf_counter() - t0
        stops = _parse_ids(args.stop, "--stop") if args.stop else default_stop_ids(
            model.config.eos_token_id, Path(args.checkpoint))
        params = GenParams(max_tokens=args.gen, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed, stop_ids=tuple(stops),
                           full_recompute=args.full)
        first: list[np.ndarray] = []

        def keep_first(generated: list[int], logits: np.ndarray) -> np.ndarray:
            if not generated and not first:
                first.append(np.asarray(logits, np.float32).copy())
            return logits

        tokens = []
        for tok in generate(model, ids, params, logits_hook=keep_first if args.dump_logits else None):
            tokens.append(tok)
            if not args.json:
                print(f"{tok.index:4d}  id {tok.id:7d}  {tok.seconds * 1000:9.1f} ms", flush=True)
        if args.dump_logits:
            if not first:
                first.append(model.prefill(ids, model.new_state()))
            np.save(args.dump_logits, first[0].astype(np.float32))
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}; check the sampling flags.", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot read the checkpoint ({exc}); check the path and permissions.",
              file=sys.stderr)
        return 2

    decode = [t.seconds for t in tokens[1:]]
    result = {
        "prompt_ids": ids,
        "generated_ids": [t.id for t in tokens],
        "mode": "full" if args.full else "incremental",
        "load_seconds": round(load_s, 4),
        "prefill_seconds": tokens[0].prefill_seconds if tokens else None,
        "seconds_per_token": [round(t.seconds, 6) for t in tokens],
        "decode_seconds_per_token_mean": float(np.mean(decode)) if decode else None,
        "stopped": bool(tokens and tokens[-1].stop),
        "stats": tokens[-1].stats if tokens else {},
    }
    if args.json:
        print(json.dumps(result))
    else:
        mean = result["decode_seconds_per_token_mean"]
        print(f"generated {len(tokens)} tokens: {','.join(str(t.id) for t in tokens)}")
        if mean is not None:
            print(f"decode {mean:.4f} s/token ({1 / mean:.1f} tokens/s), "
                  f"prefill {result['prefill_seconds']:.3f} s, load {load_s:.2f} s")
    return 0
