"""The test fakes live in k3tui.testing, and every other part of k3tui is fenced off from
them by the import-linter contract (tests/architecture runs `lint-imports`)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_product_module_is_fenced_off_from_the_fakes():
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    fence = next(c for c in contracts["contracts"] if c.get("forbidden_modules") == ["k3tui.testing"])
    parts = {f"k3tui.{p.stem}" for p in (REPO / "k3tui").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert set(fence["source_modules"]) == parts - {"k3tui.testing"}


def test_no_fake_ships_inside_a_product_package():
    for name in ("fakehub.py", "scripted.py", "scenes.py"):
        homes = [p.parent.name for p in (REPO / "k3tui").rglob(name)]
        assert homes == ["testing"], (name, homes)
