"""Progress arithmetic with a fake clock: windowed rate, ETA, stall, initial bytes."""

from __future__ import annotations

from k3tui.hub.progress import RATE_WINDOW_S, Progress


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_dl_progress_rate_eta_and_stall():
    clock = Clock()
    p = Progress([("a", 1000), ("b", 3000)], stall_after_s=5.0, clock=clock)
    p.initial_bytes("a", 1000)                  # already complete: counted, never a rate
    p.status("a", "done")
    p.status("b", "downloading")
    ev = p.snapshot()
    assert (ev.done_bytes, ev.initial_bytes, ev.rate_bps, ev.eta_s) == (1000, 1000, 0.0, None)
    for _ in range(4):                          # 100 B/s for 4 s
        clock.t += 1
        p.add("b", 100)
        ev = p.snapshot()
    assert abs(ev.rate_bps - 100) < 1e-9
    assert abs(ev.eta_s - (4000 - 1400) / 100) < 1e-6
    assert ev.fraction == 1400 / 4000 and not ev.stalled
    clock.t += 6                                # silence longer than stall_after_s
    ev = p.snapshot()
    assert ev.stalled and ev.eta_s is None
    clock.t += RATE_WINDOW_S + 1                # the old burst leaves the window
    p.add("b", 50)
    clock.t += 1
    ev = p.snapshot()
    assert not ev.stalled and ev.rate_bps < 100
    p.reset_file("b")                           # a corrupt file starts over
    ev = p.snapshot()
    assert ev.done_bytes == 1000 and ev.initial_bytes == 1000


def test_dl_progress_reconnects_that_fetch_nothing_still_stall():
    """A hub that is down: every retry reconnects (status downloading) and fails at once."""
    clock = Clock()
    p = Progress([("a", 1000)], stall_after_s=15.0, clock=clock)
    p.status("a", "downloading")
    p.add("a", 100)
    for _ in range(10):                         # 20 s of refused connections, no bytes
        clock.t += 1
        p.status("a", "retrying")
        clock.t += 1
        p.status("a", "downloading")
    ev = p.snapshot()
    assert ev.stalled and ev.eta_s is None
