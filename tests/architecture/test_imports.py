"""Layer boundaries: core modules and `engine` never pull in a UI toolkit.

Modules are discovered at test time, so modules other areas add later are covered too.
Each import runs in a fresh interpreter: a static import graph cannot see deferred imports.

One third-party exception: `import httpx` imports `rich` itself (httpx/__init__ loads its
command-line module, which uses rich when it is installed). An import hook records who
imported each UI package, so rich arriving through httpx is told apart from our code
importing it; every other route into a UI package fails the test.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UI = ["textual", "questionary", "prompt_toolkit", "rich"]
CORE_FIXED = ["k3tui.config", "k3tui.probe", "k3tui.planning.plan", "k3tui.paths"]
CORE_OPTIONAL = ["k3tui.hub", "k3tui.jobs", "k3tui.history", "k3tui.backends", "k3tui.monitor",
                 "k3tui.planning.capacity", "k3tui.planning.recipes"]


def _submodules(package: str) -> list[str]:
    """`package` and, when it is a package, every module under it (not importing them)."""
    path = REPO / Path(*package.split("."))
    if path.is_dir():
        found = [package]
        for info in pkgutil.walk_packages([str(path)], prefix=package + "."):
            if not info.name.rsplit(".", 1)[-1].startswith("_") or info.ispkg:
                found.append(info.name)
        return found
    return [package] if path.with_suffix(".py").is_file() else []


def core_modules() -> list[str]:
    mods = []
    for name in CORE_FIXED + CORE_OPTIONAL:
        mods += _submodules(name)
    return mods


def engine_modules() -> list[str]:
    return [m for m in _submodules("engine") if m != "engine.__main__"]


ALLOWED_IMPORTERS = ["/httpx/"]  # third-party modules that pull a UI package in by themselves

HOOK = """
import importlib, json, sys
UI = set(%r)
seen = {}
class Recorder:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in UI and top not in seen:
            f = sys._getframe(1)
            while f and (f.f_code.co_filename.startswith("<frozen")
                         or "importlib" in f.f_code.co_filename):
                f = f.f_back
            seen[top] = f.f_code.co_filename if f else "?"
        return None
sys.meta_path.insert(0, Recorder())
importlib.import_module(%r)
print(json.dumps({"modules": sorted(sys.modules), "importers": seen}))
"""


def loaded_after_import(module: str) -> tuple[set[str], dict[str, str]]:
    """Modules loaded by importing `module`, and which file first imported each UI package."""
    res = subprocess.run([sys.executable, "-c", HOOK % (UI, module)], capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    if res.returncode != 0:
        pytest.fail(f"importing {module} failed:\n{res.stderr[-2000:]}")
    data = json.loads(res.stdout.strip().splitlines()[-1])
    return set(data["modules"]), data["importers"]


def test_the_hook_catches_our_own_ui_import(tmp_path):
    (tmp_path / "fnd_bad_mod.py").write_text("import prompt_toolkit\n")
    code = "import sys; sys.path.insert(0, %r)\n" % str(tmp_path)
    res = subprocess.run([sys.executable, "-c", code + HOOK % (UI, "fnd_bad_mod")],
                         capture_output=True, text=True, cwd=REPO)
    importers = json.loads(res.stdout.strip().splitlines()[-1])["importers"]
    assert importers["prompt_toolkit"].endswith("fnd_bad_mod.py")


def test_discovery_finds_the_foundation():
    mods = core_modules()
    for name in ["k3tui.config", "k3tui.planning.plan", "k3tui.probe", "k3tui.probe.gpu",
                 "k3tui.probe.storage", "k3tui.paths"]:
        assert name in mods


def _check(modules: list[str]) -> None:
    # one interpreter per module: a module that only *another* one imports is still tested
    bad = {}
    for module in modules:
        loaded, importers = loaded_after_import(module)
        for top in sorted({m.split(".")[0] for m in loaded} & set(UI)):
            who = importers.get(top, "?")
            if not any(ok in who for ok in ALLOWED_IMPORTERS):
                bad[f"{module} -> {top}"] = who
    assert not bad, f"UI toolkits imported by core modules (package: first importer): {bad}"


def test_core_modules_import_no_ui():
    _check(core_modules())


def test_engine_imports_no_ui_and_no_k3tui():
    mods = engine_modules()
    assert "engine" in mods
    bad = {}
    for module in mods:
        loaded, importers = loaded_after_import(module)
        hits = sorted({m.split(".")[0] for m in loaded} & set(UI + ["k3tui"]))
        hits = [h for h in hits if not any(ok in importers.get(h, "") for ok in
                                          ALLOWED_IMPORTERS)]
        if hits:
            bad[module] = hits
    assert not bad, f"engine modules import UI toolkits or k3tui: {bad}"
