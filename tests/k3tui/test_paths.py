"""Finding the log a backend is writing while it starts (k3tui.paths)."""

from __future__ import annotations

import os

from k3tui.paths import get_paths, log_stamps, newest_log_since


def test_a_log_dated_before_the_start_by_a_coarse_clock_is_still_found():
    """The start-up screen shows the log written since it opened. A kernel that stamps files
    with a coarse clock may date that log a tick *before* the start: found all the same, and
    a log left from an earlier run is not taken for it until it is written again."""
    logs = get_paths().logs_dir
    logs.mkdir(parents=True)
    old = logs / "engine-earlier.log"
    old.write_text("yesterday\n")
    os.utime(old, ns=(10**18, 10**18))
    before = log_stamps()
    assert newest_log_since(before) is None
    new = logs / "llama-server-now.log"
    new.write_text("# k3tui: loading\n")
    os.utime(new, ns=(10**18 - 10**6, 10**18 - 10**6))   # a millisecond before the old one
    assert newest_log_since(before) == new
    old.write_text("yesterday\nand again today\n")          # rewritten: it changed too
    os.utime(old, ns=(10**18 + 10**6, 10**18 + 10**6))
    assert newest_log_since(before) == old
    new.unlink()                                            # removed meanwhile: no error
    assert newest_log_since(before) == old
