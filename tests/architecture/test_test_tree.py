"""The test tree imports its modules by basename (helpers like `hub_helpers` too), so two
files with one name would shadow each other: every name is unique."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_name_is_unique():
    names = Counter(p.name for p in TESTS.rglob("*.py")
                    if p.name not in ("__init__.py", "conftest.py") and "fixtures" not in p.parts)
    assert [n for n, k in names.items() if k > 1] == []
