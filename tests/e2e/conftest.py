"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def started():
    """Backends a test started; each is stopped afterwards, whatever the test did."""
    backends = []
    yield backends
    for b in backends:
        b.stop(grace_s=3)
