"""Fixtures for the TUI tests."""

from __future__ import annotations

import pytest
from tui_helpers import build_app

from k3tui.tui.app import ChatApp


@pytest.fixture
def app_factory(tmp_path):
    def make(stream=None, **kwargs) -> ChatApp:
        return build_app(tmp_path, stream, **kwargs)
    return make
