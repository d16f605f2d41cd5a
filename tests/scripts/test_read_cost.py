"""scripts/read_cost.py on a small real-format checkpoint whose trunk is pinned and whose
experts stream: the real phase decodes the twin's ids, and the CPU-free phase still asks
for experts at about the real rate (on the bench checkpoint a filler read at another
layer's page offset froze the routing onto cached ones; this small one has too few
experts to show that)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.checkpoint.synth import synthesize
from engine.weights.planner import GB
from engine.weights.streaming import CheckpointMap

REPO = Path(__file__).resolve().parents[2]


def test_read_cost_real_and_cpu_free_phases(tmp_path):
    ck = synthesize(tmp_path / "ck", "small", seed=5)
    g = CheckpointMap(ck).geometry()
    budget = (g.trunk_bytes + 3 * g.min_expert_slots * g.expert_slot_bytes) / GB
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "read_cost.py"), "--checkpoint", str(ck),
         "--budget-gb", f"{budget:.6f}", "--tokens", "9", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    real, free = res["real_reads"], res["cpu_free_reads"]
    assert real["ids_agree"] is True
    assert real["useful_gb_per_token"] > 0
    assert free["useful_gb_per_token"] > 0.5 * real["useful_gb_per_token"]
    for phase in (real, free):
        assert phase["overlap_ratio"] > 0 and phase["twin_s_per_token"] > 0


def test_read_cost_without_a_checkpoint_is_one_sentence(tmp_path):
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "read_cost.py"), "--checkpoint",
         str(tmp_path / "none")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
