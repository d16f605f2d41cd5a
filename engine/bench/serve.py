"""Server and tokenizer overheads, measured side by side in one run.

* serve — the same generation (same prompt, seed, token count) run by `engine.decode.generate`
  in this process and through `python -m engine serve` over HTTP SSE; prints the time
  ratio, i.e. what the server adds per token. Runs are interleaved, best of 3 each.
* tokenizer — encoding throughput of the HF-tokenizers path against tiktoken (the
  parity oracle) on the same text and ranks, when tiktoken is installed.

`python -m engine.bench.serve [CHECKPOINT] [--tokens N]` (default: a synthesised "small"
checkpoint in a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine.checkpoint.synth import synthesize
from engine.decode.generate import GenParams, generate
from engine.decode.steer import NEG
from engine.model.transformer import load_model
from engine.text.bpe_train import TRAINING_TEXT
from engine.text.chat_template import ChatTemplate
from engine.text.tokenizer import SPLIT_PATTERN, Tokenizer, read_ranks

MESSAGES = [{"role": "user", "content": "Hello there"}]


def _direct(ckpt: Path, n: int):
    tpl = ChatTemplate(Tokenizer.from_dir(ckpt))
    ids = tpl.render(MESSAGES)
    model = load_model(ckpt)
    end = list(tpl.end_ids())

    def no_end(generated, logits):  # the server's ignore_eos, so both run exactly n tokens
        logits = logits.copy()
        logits[end] = NEG
        return logits

    def run() -> float:
        t0 = time.perf_counter()
        count = sum(
            1
            for _ in generate(
                model,
                ids,
                GenParams(max_tokens=n, temperature=0.6, seed=1, stop_ids=tuple(end)),
                logits_hook=no_end,
            )
        )
        assert count == n
        return time.perf_counter() - t0

    return run


def _via_http(url: str, n: int):
    body = {
        "messages": MESSAGES,
        "stream": True,
        "max_tokens": n,
        "ignore_eos": True,
        "seed": 1,
        "temperature": 0.6,
        "stream_options": {"include_usage": True},
    }

    def run() -> float:
        t0 = time.perf_counter()
        usage = None
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    usage = json.loads(line[6:])["usage"]
        assert usage and usage["completion_tokens"] == n
        return time.perf_counter() - t0

    return run


def bench_serve(ckpt: Path, n: int) -> None:
    direct = _direct(ckpt, n)
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", str(ckpt), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        url = proc.stdout.readline().split()[-1]
        while httpx.get(url + "/health").status_code != 200:
            time.sleep(0.05)
        http = _via_http(url, n)
        direct(), http()  # warm-up (JIT, caches)
        d, h = [], []
        for _ in range(3):
            d.append(direct())
            h.append(http())
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    bd, bh = min(d), min(h)
    print(
        f"serve: {n} tokens  direct generate {bd:.3f} s ({n / bd:.1f} tok/s)  "
        f"HTTP SSE {bh:.3f} s ({n / bh:.1f} tok/s)  ratio http/direct {bh / bd:.3f}  "
        f"server cost {(bh - bd) * 1000 / n:.2f} ms/token"
    )


def bench_tokenizer(ckpt: Path) -> None:
    try:
        import tiktoken  # a test dependency: the reference tokenizer, when installed
    except ImportError:
        print("tokenizer: tiktoken is not installed; skipped")
        return
    tok = Tokenizer.from_dir(ckpt)
    oracle = tiktoken.Encoding(
        "oracle",
        pat_str=SPLIT_PATTERN,
        mergeable_ranks=read_ranks(ckpt / "tiktoken.model"),
        special_tokens={},
    )
    text = TRAINING_TEXT * 20

    def best(fn) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn(text)
            times.append(time.perf_counter() - t0)
        return min(times)

    ours, theirs = best(tok.encode), best(oracle.encode_ordinary)
    mb = len(text.encode()) / 1e6
    print(
        f"tokenizer: {mb:.2f} MB  ours {mb / ours:.1f} MB/s  tiktoken {mb / theirs:.1f} MB/s  "
        f"ratio ours/tiktoken time {ours / theirs:.2f}  "
        f"same ids: {tok.encode(text) == oracle.encode_ordinary(text)}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        nargs="?",
        default=None,
        help="a checkpoint with tokenizer files (default: synthesise 'small')",
    )
    parser.add_argument("--tokens", type=int, default=200, help="tokens per run (default 200)")


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint:
            ckpt = Path(args.checkpoint)
        else:
            ckpt = synthesize(Path(tmp) / "small", "small", seed=0)
        bench_tokenizer(ckpt)
        bench_serve(ckpt, args.tokens)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        prog="python -m engine.bench.serve", description=__doc__.split("\n")[0]
    )
    add_arguments(p)
    raise SystemExit(main(p.parse_args()))
