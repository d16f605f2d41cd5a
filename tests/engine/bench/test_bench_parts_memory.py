"""bench parts runs on the user's machine before a 1.56 TB download: its own memory must be
small, stated, and checked against what is free before it starts."""

import argparse
import json
import subprocess
import sys
import weakref

import numpy as np

from engine.bench import forward, parts
from engine.checkpoint.schema import expected_tensors
from engine.checkpoint.synth import flat_config
from engine.model.config import ModelConfig
from engine.weights import sysmem


def args(tmp_path, **kw):
    ns = argparse.Namespace(dir=str(tmp_path), scratch_gb=1.0, tokens=1, json=True,
                            widths=None, quick=True)
    vars(ns).update(kw)
    return ns


def test_refuses_up_front_when_less_memory_is_available_than_it_needs(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.setattr(sysmem, "read_memory_facts",
                        lambda env=None: sysmem.MemoryFacts(8 * 10**9, 50 * 10**6, None, None))
    assert parts.main(args(tmp_path)) == 2
    out = capsys.readouterr()
    assert out.out == ""
    msg = out.err.strip()
    assert msg.startswith("error: measuring needs ") and "and 0.1 GB is available;" in msg
    assert msg.endswith("close some programs and run it again.") and msg.count("\n") == 0
    assert list(tmp_path.iterdir()) == []  # nothing was measured (no scratch file written)


def test_compute_holds_one_layer_kinds_weights_not_all_of_them(monkeypatch):
    """Every weight the measurement makes is a _Filler tile: count the bytes alive at once."""
    live, peak = [0], [0]
    tile = forward._Filler.tile

    def counted(self, base, shape):
        out = tile(self, base, shape)
        owner = out if out.base is None else out.base
        live[0] += owner.nbytes
        peak[0] = max(peak[0], live[0])
        weakref.finalize(owner, lambda n=owner.nbytes: live.__setitem__(0, live[0] - n))
        return out

    monkeypatch.setattr(forward._Filler, "tile", counted)
    cfg = ModelConfig.from_dict(flat_config("tiny"))
    parts.measure_compute(1, cfg)
    shapes = expected_tensors(cfg)

    def kind(layer):  # a layer kind's matrices (the tiles; 4 KB alignment each), experts aside
        p = f"layers.{layer}."
        return sum(int(np.prod(s)) * 2 + 4096 for n, s in shapes.items()
                   if n.startswith(p) and ".experts." not in n and len(s) == 2 and s[0] > 1)

    head = cfg.vocab_size * cfg.hidden_size * 2
    expert = sum(int(np.prod(s)) for n, s in shapes.items()
                 if n.startswith("layers.1.") and ".experts.0." in n and n.endswith("packed"))
    pool = (cfg.num_experts_per_token + 1) * expert
    # the largest kind or the head (page-aligned), never the dense, KDA, MLA layers and head
    assert peak[0] <= max(kind(0), kind(1), kind(3), head) + pool
    assert peak[0] <= parts.compute_weight_bytes(cfg)


def test_quick_run_states_its_peak_and_stays_under_it(tmp_path):
    out = subprocess.run([sys.executable, "-m", "engine", "bench", "parts", "--dir",
                          str(tmp_path), "--json", "--quick"],
                         capture_output=True, text=True, timeout=300, check=True)
    res = json.loads(out.stdout)
    assert 0 < res["peak_rss_gb"] <= res["expected_peak_rss_gb"]
    assert f"expected peak memory (RSS): {res['expected_peak_rss_gb']:.1f} GB" in out.stderr
