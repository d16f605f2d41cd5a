"""Code, docs and messages cite files inside the repository: a clone has nothing beside it,
so a path that climbs out of the repository leads nowhere for a user."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUTSIDE = "../" + "shared/"  # the workspace folder some notes once pointed at
SKIP = {".git", ".venv", "venv", "site", "build", "dist", "__pycache__", "fixtures"}
SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".tcss", ".txt", ".cfg", ""}


def test_no_file_cites_a_path_outside_the_repository():
    cited = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if SKIP & set(rel.parts) or rel.parts[0].endswith(".egg-info"):
            continue
        if path.is_file() and path.suffix in SUFFIXES:
            text = path.read_text(encoding="utf-8", errors="replace")
            cited += [f"{rel}:{n}" for n, line in enumerate(text.splitlines(), 1)
                      if OUTSIDE in line]
    assert cited == []
