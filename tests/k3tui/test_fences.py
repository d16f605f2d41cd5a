"""The test fakes (loopback hub, scripted backend, screenshot scenes) live in tests/support/,
outside every installed package: the wheel does not carry them and no product module imports
them. `k3tui bench download` runs the fake hub from a clone and says so from a wheel."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
from setuptools import find_namespace_packages

from k3tui.errors import K3Error
from k3tui.hub import bench

REPO = Path(__file__).resolve().parents[2]
FAKES = ("fakehub", "scripted", "scenes")


def _wheel_packages() -> list[str]:
    """The packages setuptools puts in the wheel, found as pyproject.toml tells it."""
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]
    return find_namespace_packages(str(REPO), include=find["include"])


def test_no_fake_ships_in_the_wheel():
    packages = _wheel_packages()
    assert {"k3tui", "engine", "k3vocab"} <= set(packages)
    shipped = [f"{pkg}/{name}.py" for pkg in packages for name in FAKES
               if (REPO / pkg.replace(".", "/") / f"{name}.py").is_file()]
    assert shipped == [] and not [p for p in packages if "testing" in p.split(".")]
    assert (REPO / "tests" / "support" / "fakehub.py").is_file()


def test_no_product_module_imports_the_fakes():
    bad = []
    for pkg in ("k3tui", "engine", "k3vocab"):
        for path in (REPO / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                bad += [f"{path.relative_to(REPO)}: {n}" for n in names
                        if n.split(".")[0] in (*FAKES, "support") or n.startswith("k3tui.testing")]
    assert bad == []


def test_bench_download_without_the_test_support_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "FAKEHUB", tmp_path / "fakehub.py")  # as from a wheel
    with pytest.raises(K3Error) as exc:
        bench.main(["--size-mb", "1", "--files", "1", "--rounds", "1"])
    assert "an installed wheel has no tests" in exc.value.message
    assert "clone" in exc.value.next_step
