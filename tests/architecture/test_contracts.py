"""The layering rules hold: import-linter checks the contracts in pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept():
    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    out = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_ruff_is_clean():
    """ruff's rules in pyproject (E, F, W and the complexity limit C901 <= 15) hold everywhere."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    out = subprocess.run([ruff, "check", "--no-cache", "."], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
