"""The README stays the short front door: at most 12 KB, the two commands CI runs still
marked (extracted here by .ci/run's own function), and its links lead to files that exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")


def test_the_readme_is_at_most_12_kb():
    assert len(README.encode("utf-8")) <= 12 * 1024


def test_the_readme_keeps_the_two_commands_ci_runs():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    extract = re.search(r"^readme_command\(\) \{.*\}$", ci, re.MULTILINE).group(0)
    for tag, command in (("ci:demo", "pip install -e . && k3tui chat --demo"),
                         ("ci:test", "pip install -e '.[test]' && python -m pytest -q")):
        p = subprocess.run(["bash", "-c", f"{extract}\nreadme_command {tag}"], cwd=REPO,
                           capture_output=True, text=True, timeout=30, check=False)
        assert p.stdout == command + "\n", (tag, p.stdout, p.stderr)


def test_the_readme_links_lead_to_files_in_the_repository():
    targets = re.findall(r"\]\(([^)#\s]+)", README)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert len(local) >= 20
    assert [t for t in local if not (REPO / t).exists()] == []
