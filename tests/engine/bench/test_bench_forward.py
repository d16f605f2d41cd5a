"""`python -m engine bench forward` code path at toy widths (the real run needs ~3 GB)."""

from __future__ import annotations

import argparse
import json

from engine.bench import forward as bench_forward
from engine.checkpoint.synth import flat_config, synthesize


def test_bench_forward_reports_fractions(monkeypatch, tmp_path, capsys):
    toy = flat_config("small", dict(num_hidden_layers=4, full_attn_layers=[4]))
    monkeypatch.setattr(bench_forward, "REAL_WIDTHS", toy)
    ckpt = synthesize(tmp_path / "m", "tiny")
    parser = argparse.ArgumentParser()
    bench_forward.add_arguments(parser)
    args = parser.parse_args(["--json", "--tokens", "1", "--pool", "4", "--copy-gb", "0.01",
                              "--checkpoint", str(ckpt), "--gen", "2"])
    assert bench_forward.main(args) == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("bf16_fraction_of_bandwidth", "mxfp4_fraction_of_bandwidth",
                "memory_bandwidth_gb_per_s", "kda_moe_layer_ms", "mla_moe_layer_ms"):
        assert res[key] > 0
    assert res["checkpoint_decode"]["seconds_per_token"] > 0
    assert len(res["checkpoint_decode"]["generated_ids"]) == 3
