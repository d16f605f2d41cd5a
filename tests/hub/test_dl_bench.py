"""`k3tui bench download --json` runs both clients and prints the agreed keys."""

from __future__ import annotations

import json
import subprocess
import sys


def test_dl_bench_both_clients_fetch_the_source_bytes():
    """What a broken bench would get wrong: the bytes it reports are the source's, and what
    each client wrote is byte-identical to the source (the timings themselves cannot be
    checked, only that each client took some)."""
    from k3tui.paths import get_paths

    p = subprocess.run([sys.executable, "-m", "k3tui", "bench", "download", "--json", "--keep",
                        "--size-mb", "24", "--files", "2", "--rounds", "1"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    base = get_paths().bench_dir / "download"
    sources = sorted((base / "src").iterdir())
    assert out["bytes"] == sum(f.stat().st_size for f in sources) == 24_000_000
    assert out["files"] == len(sources) == 2
    for who in ("hf", "k3tui"):
        assert sorted(f.name for f in (base / f"out-{who}").iterdir()
                      if f.is_file()) == [f.name for f in sources]
        for f in sources:
            assert (base / f"out-{who}" / f.name).read_bytes() == f.read_bytes(), (who, f.name)
    assert out["hf_s"] > 0 and out["k3tui_s"] > 0


def test_dl_core_modules_import_no_ui(tmp_path):
    """A whole download (metadata, HEAD, GET, jobs module) without rich/textual loaded."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "w.safetensors").write_bytes(b"x" * (2 << 20))
    code = f"""
import os, sys
from k3tui.testing.fakehub import FakeHub
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
