"""Shell completion as a user meets it: bash in a real terminal (tmux), Tab after a flag."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


@pytest.mark.skipif(shutil.which("tmux") is None or shutil.which("bash") is None,
                    reason="needs tmux and bash")
def test_tab_after_plan_machine_offers_the_profiles_and_files(tmp_path):
    """`k3tui plan --machine <Tab>` completed nothing: the flag takes a built-in profile's
    name or a report file, and the completion script knew neither."""
    from tui_helpers import Tmux

    script = tmp_path / "k3tui.bash"
    script.write_text(subprocess.run([sys.executable, "-m", "k3tui", "completion", "bash"],
                                     capture_output=True, text=True, check=True).stdout)
    (tmp_path / "box.json").write_text("{}")
    tmux = Tmux(f"k3comp{os.getpid()}", {"HOME": str(tmp_path)})
    try:
        tmux.start("bash --norc --noprofile")
        tmux.keys(f"cd {tmp_path}; source {script}; clear", "Enter")
        tmux.keys("k3tui plan --machine dg", literal=True)
        tmux.keys("Tab")
        tmux.wait_for(lambda s: "--machine dgx-spark" in s)
        tmux.keys("C-u")
        tmux.keys("k3tui serve --dry-run --machine bo", literal=True)
        tmux.keys("Tab")
        tmux.wait_for(lambda s: "--machine box.json" in s)
    finally:
        tmux.close()
