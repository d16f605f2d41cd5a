"""`k3tui bench download --json` runs both clients and prints the agreed keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_dl_bench_download_json_keys():
    p = subprocess.run([sys.executable, "-m", "k3tui", "bench", "download", "--json",
                        "--size-mb", "24", "--files", "2", "--rounds", "1",
                        "--throttle-mbps", "40"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["bytes"] == 24_000_000 and out["files"] == 2
    assert out["reference"] == "huggingface_hub.snapshot_download"
    free, capped = out["runs"]
    assert free["throttle_mb_s_per_connection"] is None
    assert capped["throttle_mb_s_per_connection"] == 40
    # The cap really applied to each connection of both clients (without it loopback gives
    # hundreds of MB/s): snapshot_download has one per file (2); k3tui cuts each 12 MB file
    # into an 8 MiB and a 4 MiB range (its smallest), so it has at most 4.
    assert capped["hf_mb_s"] <= 2 * 40 * 1.05 and capped["k3tui_mb_s"] <= 4 * 40 * 1.05
    assert out["k3tui_connections"] == 8 and out["hf_connections"] == 2
    assert out["loadavg"]
    assert out["ratio_vs_hf"] > 0 and out["cpu_s_per_gb"] > 0


def test_dl_core_modules_import_no_ui(tmp_path):
    """A whole download (metadata, HEAD, GET, jobs module) without rich/textual loaded."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "w.safetensors").write_bytes(b"x" * (2 << 20))
    support = Path(__file__).resolve().parents[2] / "support"
    code = f"""
import os, sys
sys.path.insert(0, {str(support)!r})
from fakehub import FakeHub
hub = FakeHub({str(tmp_path / 'src')!r}, "acme/x", cdn=True)
os.environ["HF_ENDPOINT"] = hub.endpoint
import k3tui.jobs
from k3tui.hub import download, fetch_snapshot
res = download(fetch_snapshot("acme/x"), {str(tmp_path / 'out')!r}, log=lambda m: None)
assert res.ok, res
bad = [m for m in ("rich", "textual", "questionary", "prompt_toolkit") if m in sys.modules]
print(bad)
sys.exit(1 if bad else 0)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
