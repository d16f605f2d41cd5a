"""`python -m engine bench forward` code path at toy widths (the real run needs ~3 GB)."""

from __future__ import annotations

import argparse
import json

import numpy as np

from engine.bench import forward as bench_forward
from engine.checkpoint.synth import flat_config, synthesize
from engine.decode.generate import GenParams, generate
from engine.core.config import ModelConfig
from engine.model.transformer import load_model


def test_bench_forward_reports_fractions(monkeypatch, tmp_path, capsys):
    toy = flat_config("small", dict(num_hidden_layers=4, full_attn_layers=[4]))
    monkeypatch.setattr(bench_forward, "REAL_WIDTHS", toy)
    ckpt = synthesize(tmp_path / "m", "tiny")
    parser = argparse.ArgumentParser()
    bench_forward.add_arguments(parser)
    args = parser.parse_args(["--json", "--tokens", "1", "--pool", "4", "--read-gb", "0.01",
                              "--checkpoint", str(ckpt), "--gen", "2"])
    assert bench_forward.main(args) == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("bf16_fraction_of_bandwidth", "mxfp4_fraction_of_bandwidth",
                "memory_bandwidth_gb_per_s", "kda_moe_layer_ms", "mla_moe_layer_ms"):
        assert res[key] > 0
    assert res["checkpoint_decode"]["seconds_per_token"] > 0
    # the decode it timed is the real model's: the same ids as a plain generate()
    plain = generate(load_model(ckpt), [1, 2, 3, 4, 5], GenParams(max_tokens=3))
    assert res["checkpoint_decode"]["generated_ids"] == [t.id for t in plain]
    # the expert bytes it divides by are MXFP4's: a packed nibble + one scale byte per 32
    cfg = ModelConfig.from_dict(toy)
    lat, inter = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    one_expert = 3 * (inter * lat // 2 + inter * lat // 32)
    want = round(cfg.num_experts_per_token * one_expert / 1e9, 4)
    assert res["active_experts_gb_per_layer"] == want


def test_memory_reader_reads_every_word_once():
    # the bandwidth reference divides the array's bytes by its time: every word must be read
    read = bench_forward.memory_reader()
    for n in (1, 7, 1001, 1 << 16):
        assert float(read(np.ones(n, np.float32)).sum()) == n
