"""The memory facts the engine reports about itself."""

from __future__ import annotations



def test_peak_rss_is_this_process_not_the_one_that_spawned_it():
    """ru_maxrss carries the spawning process's peak across exec: an engine started by a fat
    parent (the chat, pytest late in a run) reported the parent's memory as its own peak."""
    import subprocess
    import sys

    fat = bytearray(400 * 2**20)
    fat[::4096] = b"\x01" * len(fat[::4096])  # touch every page: 400 MB resident here
    code = "from engine.weights.sysmem import peak_rss; print(peak_rss())"
    child_peak = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout)
    del fat
    assert child_peak < 200 * 2**20, child_peak
