"""`python -m engine synth OUT --size NAME`: write a random-weight checkpoint of the
Kimi-K3 architecture (engine/checkpoint/synth.py), or only its test tokenizer.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from engine.checkpoint.synth import (
    N_SPECIAL,
    SIZES,
    write_tokenizer,
    checkpoint_bytes,
    flat_config,
    nested_config,
    slice_overrides,
    synthesize,
)
from engine.core.config import ModelConfig
from engine.errors import EngineError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output folder")
    parser.add_argument("--size", default="tiny", choices=list(SIZES),
                        help="tiny/small/medium (tests), demo (chat demo), bench (~6.2 GB), "
                        "slice (real widths, ~13.8 GB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, metavar="N",
                        help="slice only: decoder layers (default 4: dense, KDA-MoE x2, MLA-MoE)")
    parser.add_argument("--experts", type=int, default=None, metavar="N",
                        help="slice only: routed experts per MoE layer (default 64; 896 = real)")
    parser.add_argument("--tokenizer-only", action="store_true",
                        help="write only the test tokenizer (tiktoken.model, "
                        "tokenizer_config.json) for the checkpoint already in OUT, or for "
                        "--size's vocabulary; the shards are left as they are")


def _tokenizer_only(out: Path, size: str) -> int:
    """Add the test tokenizer to a checkpoint folder (e.g. a slice written before synth
    could make one at the real vocabulary) without touching its shards."""
    have = [p.name for p in (out / "tiktoken.model", out / "tokenizer_config.json") if p.exists()]
    if have:
        print(f"error: {out} already has {' and '.join(have)}; move them away first to "
              "write the test tokenizer there.", file=sys.stderr)
        return 2
    try:
        cfg = (ModelConfig.from_dir(out) if (out / "config.json").is_file()
               else ModelConfig.from_dict(nested_config(flat_config(size))))
    except (EngineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.vocab_size <= N_SPECIAL:
        print(f"error: a vocabulary of {cfg.vocab_size} has no room for the {N_SPECIAL} "
              "special tokens.", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, cfg.vocab_size - N_SPECIAL)
    if not (out / "tiktoken.model").is_file():
        return 1
    print(f"{out}: test tokenizer of {cfg.vocab_size} ids written (not Kimi's vocabulary)")
    return 0


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.tokenizer_only:
        return _tokenizer_only(out, args.size)
    if out.exists() and any(out.glob("*.safetensors")):
        print(f"error: {out} already holds a checkpoint; choose an empty folder.", file=sys.stderr)
        return 2
    layers, experts = args.layers, args.experts
    if args.size != "slice" and (layers is not None or experts is not None):
        print("error: --layers and --experts apply to --size slice only.", file=sys.stderr)
        return 2
    try:
        overrides = slice_overrides(layers, experts)
        need = checkpoint_bytes(args.size, overrides)
    except ValueError as exc:
        print(f"error: {exc}.", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if need > free:
        print(f"error: the {args.size} checkpoint needs {need / 1e9:.1f} GB and {out} has "
              f"{free / 1e9:.1f} GB free; free some space or choose fewer --experts.",
              file=sys.stderr)
        return 2
    print(f"writing the {args.size} checkpoint ({need / 1e9:.3f} GB) to {out}", file=sys.stderr)
    synthesize(out, args.size, args.seed, overrides,
               progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    cfg = ModelConfig.from_dir(out)
    print(f"{out}: {cfg.describe()}")
    return 0
