"""bench parts runs on the user's machine before a 1.56 TB download: its own memory must be
small, stated, and checked against what is free before it starts."""

import argparse
import json
import subprocess
import sys

import numpy as np

from engine.bench import parts
from engine.checkpoint.schema import expected_tensors
from engine.checkpoint.synth import flat_config
from engine.core.config import ModelConfig
from engine.weights import sysmem


def args(tmp_path, **kw):
    ns = argparse.Namespace(dir=str(tmp_path), scratch_gb=1.0, tokens=1, json=True,
                            widths=None, quick=True)
    vars(ns).update(kw)
    return ns


def test_refuses_up_front_when_less_memory_is_available_than_it_needs(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.setattr(parts, "read_memory_facts",
                        lambda env=None: sysmem.MemoryFacts(8 * 10**9, 50 * 10**6, None, None))
    assert parts.main(args(tmp_path)) == 2
    out = capsys.readouterr()
    assert out.out == ""
    msg = out.err.strip()
    assert msg.startswith("error: measuring needs ") and "and 0.1 GB is available;" in msg
    assert msg.endswith("close some programs and run it again.") and msg.count("\n") == 0
    assert list(tmp_path.iterdir()) == []  # nothing was measured (no scratch file written)


def test_compute_holds_the_layer_kinds_weights_in_one_place_not_side_by_side(monkeypatch):
    """The distinct bytes the layers' weights and the head occupy during the timed tokens:
    about the largest kind's, not every kind's and the head's side by side."""
    made = []
    timed = parts._timed_source
    monkeypatch.setattr(parts, "_timed_source", lambda *a: made.append(timed(*a)) or made[-1])
    cfg = ModelConfig.from_dict(flat_config("tiny"))
    parts.measure_compute(1, cfg)
    (src,) = made
    arrays = [a for w in src.layers.values() for a in w.values()] + [src.model["lm_head.weight"]]
    spans, end, distinct = [], 0, 0
    for a in arrays:
        lo = a.__array_interface__["data"][0]
        spans.append((lo, lo + a.nbytes))
    for lo, hi in sorted(spans):  # the union of the arrays' byte ranges
        distinct += max(0, hi - max(lo, end))
        end = max(end, hi)
    shapes = expected_tensors(cfg)
    side_by_side = cfg.vocab_size * cfg.hidden_size * 2 + sum(
        int(np.prod(s)) * 2 for n, s in shapes.items()
        if n.split(".")[1] in ("0", "1", "3") and ".experts." not in n)
    # at the real widths 2.36 of 7.1 GB; at these, where every matrix gets a 4M-element slot
    # of the shared array, a little more than half (each kind apart and the head: 252 KB)
    assert distinct <= 0.6 * side_by_side
    assert distinct + (cfg.num_experts_per_token + 1) * sum(
        int(np.prod(s)) for n, s in shapes.items()
        if n.startswith("layers.1.") and ".experts.0." in n and n.endswith("packed")) \
        <= parts.compute_weight_bytes(cfg)


def test_quick_run_states_its_peak_and_stays_under_it(tmp_path):
    out = subprocess.run([sys.executable, "-m", "engine", "bench", "parts", "--dir",
                          str(tmp_path), "--json", "--quick"],
                         capture_output=True, text=True, timeout=300, check=True)
    res = json.loads(out.stdout)
    assert 0 < res["peak_rss_gb"] <= res["expected_peak_rss_gb"]
    assert f"expected peak memory (RSS): {res['expected_peak_rss_gb']:.1f} GB" in out.stderr
