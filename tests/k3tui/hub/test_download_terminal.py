"""What a user sees in an 80-column terminal: job listings, attach, a detached --verify."""

from __future__ import annotations

from hub_helpers import REPO_ID, SMALL, k3
from rich.console import Console

from k3tui.commands.jobs import render_state


def test_dl_detached_verify_says_what_it_refetched(hub, repo_dir, tmp_path):
    out = tmp_path / "out"
    k3("download", REPO_ID, "--dir", str(out), "--foreground")
    with open(out / SMALL, "r+b") as fh:
        b = fh.read(1)
        fh.seek(0)
        fh.write(bytes([b[0] ^ 0x01]))
    k3("download", REPO_ID, "--dir", str(out), "--verify", "--detach")
    p = k3("jobs", "attach")
    assert f"Refetched 1 files that did not match: {SMALL}" in p.stdout, p.stdout
    assert "done: Done" not in p.stdout
    assert (out / SMALL).read_bytes() == (repo_dir / SMALL).read_bytes()
    listing = k3("jobs").stdout.splitlines()
    # id + status and the progress line fit an 80-column SSH window
    assert len(listing[0]) <= 80 and len(listing[1]) <= 80, listing
    assert "100.0%" in listing[1] and "Refetched" in k3("jobs").stdout


def test_dl_attach_progress_line_is_not_cut_at_80_columns():
    state = {"kind": "download", "id": "download-1129-102439-7802", "status": "running",
             "message": "acme/qa @ 03e9c118fc28", "total_bytes": 120e6, "done_bytes": 35e6,
             "rate_bps": 4e6, "eta_s": 20, "files": []}
    console = Console(width=80, record=True, force_terminal=True, color_system=None)
    console.print(render_state(state, console.width), crop=True, overflow="crop")
    lines = console.export_text().splitlines()
    assert any("29.2%" in line and line.strip().endswith("ETA 0m20s") for line in lines), lines
