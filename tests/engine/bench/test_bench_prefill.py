"""`python -m engine bench prefill` code path at toy widths (the real run takes ~a minute)."""

from __future__ import annotations

import argparse
import json

from engine.bench import prefill as bench_prefill
from engine.checkpoint.synth import synthesize


def test_bench_prefill_reports_fractions_and_equal_ids(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench_prefill, "LATENT_DOWN", (40, 200))
    monkeypatch.setattr(bench_prefill, "EXPERT_W1", (36, 96))
    monkeypatch.setattr(bench_prefill, "TOKENS", (1, 5, 16))
    ckpt = synthesize(tmp_path / "m", "tiny", seed=2)
    parser = argparse.ArgumentParser()
    bench_prefill.add_arguments(parser)
    args = parser.parse_args(["--json", "--reps", "1", "--checkpoint", str(ckpt),
                              "--prompts", "9,20"])
    assert bench_prefill.main(args) == 0
    res = json.loads(capsys.readouterr().out)
    products = res["products"]
    assert {(p["kernel"], p["tokens"]) for p in products} == {
        (k, t) for k in ("bf16", "c12", "mxfp4") for t in (1, 5, 16)}
    assert all(p["kernel_gflops"] > 0 and p["gemm_gflops"] > 0 for p in products)
    assert res["prefill_flops_fraction"] == min(p["fraction"] for p in products
                                                if p["tokens"] >= 16)
    runs = res["prompt"]["runs"]
    assert [r["tokens"] for r in runs] == [9, 20]
    assert res["ids_equal"] and all(r["ids_equal"] and len(r["ids"]) == 4 for r in runs)
    assert all(r["logits_equal"] for r in runs)  # prefilled whole = token by token, bitwise
    assert res["blas"]["name"] and len(res["load_average"]) == 3


def test_bench_prefill_refuses_a_folder_without_a_checkpoint(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench_prefill.add_arguments(parser)
    assert bench_prefill.main(parser.parse_args(["--checkpoint", str(tmp_path)])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no config.json" in err
    assert bench_prefill.main(parser.parse_args(["--prompts", "64,x"])) == 2
    assert capsys.readouterr().err.count("\n") == 1
