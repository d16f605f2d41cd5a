"""The documentation site: `mkdocs build --strict` passes (a broken link or anchor fails it),
offline, and the benchmark results page is rendered from its data file by the site's hook."""

from __future__ import annotations

import html
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _hook():
    spec = importlib.util.spec_from_file_location("docs_benchmarks_hook",
                                                  REPO / "docs" / "hooks" / "benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    dead = "http://127.0.0.1:9"  # a plugin that fetches at build time fails here
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", HTTP_PROXY=dead, HTTPS_PROXY=dead,
               http_proxy=dead, https_proxy=dead, NO_PROXY="", no_proxy="")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out


def _page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text(encoding="utf-8")


def test_the_site_builds_strict_and_offline(site):
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "fonts.googleapis.com" not in home  # no web fonts: the theme's font is off
    assert (site / "screenshots" / "chat.svg").is_file()  # the hook's copy of screenshots/
    assert "1.5 Per-sequence state and memory" in _page(site, "spec/kimi-k3")
    # the project pages show the repository's own files
    assert "Glossary" in _page(site, "project/architecture")
    assert "Add a benchmark" in _page(site, "project/contributing")
    assert "Unreleased" in _page(site, "project/changelog")


def test_every_result_is_a_row_of_the_results_page(site):
    page = _page(site, "benchmarks/results")
    assert "<!-- results:" not in page
    _, runs = _hook().load()
    assert len(runs) >= 10
    for run in runs:
        assert f"<td>{html.escape(str(run['date']))}</td>" in page, run["what"]
    assert page.count("<tr>") >= len(runs)


def _results(tmp_path: Path, run: str) -> Path:
    path = tmp_path / "results.yaml"
    path.write_text("machines:\n  vm: a VM\nruns:\n" + run, encoding="utf-8")
    return path


GOOD = ("  - benchmark: tui\n    what: w\n    command: c\n    date: '2026-12-01 10:00'\n"
        "    load: 1.0\n    machine: vm\n    k3tui: 1 s\n")


def test_a_well_formed_record_is_rendered():
    hook = _hook()
    machines, runs = hook.load(_results(Path(os.environ["K3TUI_HOME"]), GOOD))
    out = hook.render("<!-- results: tui -->", machines, runs)
    assert "| 2026-12-01 10:00 | w (`c`) | vm, 1.0 | 1 s |  |" in out


@pytest.mark.parametrize("change, says", [
    (("    load: 1.0\n", ""), "has no load"),
    (("    machine: vm\n", "    machine: other\n"), "machine 'other' is not one of"),
    (("'2026-12-01 10:00'", "'yesterday'"), "must start YYYY-MM-DD"),
    (("    k3tui: 1 s\n", "    k3tui: 1 s\n    figures: 2\n"), "unknown field figures"),
])
def test_a_record_without_its_facts_stops_the_build(tmp_path, change, says):
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match=says):
        _hook().load(_results(tmp_path, GOOD.replace(*change)))


def test_a_marker_that_names_no_benchmark_stops_the_build():
    from mkdocs.exceptions import PluginError

    hook = _hook()
    machines, runs = hook.load()
    with pytest.raises(PluginError, match="names no benchmark"):
        hook.render("<!-- results: nosuch -->", machines, runs)
