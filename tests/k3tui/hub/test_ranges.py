"""A file split into byte ranges over several connections: concurrency, resume after a
real kill, a server without Range support, and 206 answers that lie (issue 17)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from hub_helpers import BIG, REPO_ID, SMALL, wait_for

from k3tui.hub import CHUNK_BYTES, Options, download, fetch_snapshot
from k3tui.hub.store import LocalStore
from fakehub import Fault

FAST = dict(backoff_s=0.02, timeout_s=10.0, range_bytes=CHUNK_BYTES)   # 7 ranges in BIG



def test_ranges_large_file_is_fetched_over_several_connections_at_once(hub, repo_dir,
                                                                        tmp_path):
    release = threading.Event()
    hub.faults[BIG] = [Fault.hold(1000, release)]   # the first range waits for another
    snap = fetch_snapshot(REPO_ID, include=[BIG])
    out, res = tmp_path / "out", []
    t = threading.Thread(target=lambda: res.append(download(
        snap, out, workers=4, opts=Options(**FAST), log=lambda m: None)))
    t.start()
    try:
        wait_for(lambda: hub.peak_in_flight.get(BIG, 0) >= 2, timeout=20,
                 what="two ranges of one file in flight at once")
    finally:
        release.set()
        t.join(60)
    assert res and res[0].ok, res
    assert (out / BIG).read_bytes() == (repo_dir / BIG).read_bytes()
    ranges = sorted(e["range"] for e in hub.requests(method="GET") if e["range"])
    size = (repo_dir / BIG).stat().st_size
    want = [f"bytes={k * CHUNK_BYTES}-{min(size, (k + 1) * CHUNK_BYTES) - 1}"
            for k in range(6)] + [f"bytes={6 * CHUNK_BYTES}-"]
    assert ranges == sorted(want)                  # each range asked for once
    assert hub.body_bytes(BIG) == size             # and no byte twice


def test_ranges_killed_mid_file_rerun_fetches_only_the_missing_ranges(hub, repo_dir,
                                                                       tmp_path):
    out = tmp_path / "out"
    hub.throttle_bps = 1.5e6                        # per connection: the kill lands mid-file
    env = dict(os.environ, K3TUI_DL_RANGE_MIB="1")
    child = subprocess.Popen(
        [sys.executable, "-m", "k3tui", "download", REPO_ID, "--dir", str(out), "--include",
         BIG, "--foreground", "--workers", "3"], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    snap = fetch_snapshot(REPO_ID, include=[BIG])
    rf, store = snap.files[0], LocalStore(out)

    def on_disk() -> list[int]:
        state = store.resume_state(rf, CHUNK_BYTES) if store.sidecar(BIG).exists() else None
        return state[1] if state else []

    try:
        wait_for(lambda: sum(on_disk()) >= 2_000_000 and sum(map(bool, on_disk())) >= 3,
                 timeout=60, what="three ranges under way")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    wait_for(hub.idle, what="the killed client's answers to end")
    have = on_disk()
    kept, size = sum(have), rf.size
    assert 0 < kept < size and sum(map(bool, have)) >= 3, have
    hub.throttle_bps = None
    before = len(hub.log)
    res = download(snap, out, workers=3, opts=Options(**FAST), log=lambda m: None)
    assert res.ok, res
    assert (out / BIG).read_bytes() == (repo_dir / BIG).read_bytes()
    asked = [e["range"] for e in hub.log[before:] if e.get("method") == "GET"]
    starts = {int(r.split("=")[1].split("-")[0]) for r in asked}
    missing = {k * CHUNK_BYTES + got for k, got in enumerate(have)
               if k * CHUNK_BYTES + got < min(size, (k + 1) * CHUNK_BYTES)}
    assert starts == missing, (asked, have)         # each range resumed where its bytes end
    sent = sum(e["sent"] for e in hub.log[before:] if e.get("event") == "body")
    assert sent == size - kept                      # only what the disk did not have


def test_ranges_server_that_ignores_range_is_still_downloaded_correctly(hub, repo_dir,
                                                                        tmp_path):
    hub.honour_range = False                        # every Range answered 200, whole file
    lines: list[str] = []
    snap = fetch_snapshot(REPO_ID, include=[BIG, SMALL])
    res = download(snap, tmp_path / "out", workers=3, opts=Options(**FAST), log=lines.append)
    assert res.ok, res
    for name in (BIG, SMALL):
        assert (tmp_path / "out" / name).read_bytes() == (repo_dir / name).read_bytes()
    assert [e for e in hub.requests(method="GET") if e["range"]]    # ranges were asked for
    assert any("ignored Range" in line for line in lines), lines


@pytest.mark.parametrize("lie", ["total", "garbage", "short", "length"])
def test_ranges_a_lying_206_is_refused_and_nothing_is_kept_as_verified(hub, repo_dir,
                                                                       tmp_path, lie):
    hub.faults[BIG] = [Fault.range_lie(lie)] * 30
    out = tmp_path / "out"
    snap = fetch_snapshot(REPO_ID)
    res = download(snap, out, workers=2, opts=Options(**FAST, max_failures=3),
                   log=lambda m: None)
    assert not res.ok and res.failed == [BIG]
    msg = res.error.message
    assert "\n" not in msg and "Traceback" not in msg and "gave up" in msg, msg
    assert ("Content-Range" in msg) if lie in ("total", "garbage", "short") else \
        ("announced" in msg), msg
    assert not (out / BIG).exists()
    assert BIG not in LocalStore(out).journal.verified
    assert (out / SMALL).read_bytes() == (repo_dir / SMALL).read_bytes()   # the others came


def test_ranges_fake_hub_answers_range_as_the_cdn_does(hub, repo_dir):
    """206 + Content-Range for one range (open, closed, suffix), 416 past the end, 200 for
    several ranges or none: what the client's checks are measured against."""
    body = (repo_dir / BIG).read_bytes()
    size = len(body)
    url = next(f"{hub.cdn_base}/cdn/{f['sha256']}" for f in hub.files.values()
               if f["path"] == BIG)
    with httpx.Client() as c:
        def get(rng: str | None) -> httpx.Response:
            return c.get(url, headers={"Range": rng} if rng else {})

        r = get("bytes=10-19")
        assert (r.status_code, r.headers["Content-Range"], r.content) == \
            (206, f"bytes 10-19/{size}", body[10:20])
        r = get(f"bytes={size - 5}-")
        assert (r.status_code, r.content) == (206, body[-5:])
        r = get("bytes=-7")
        assert (r.headers["Content-Range"], r.content) == (f"bytes {size - 7}-{size - 1}/{size}",
                                                           body[-7:])
        r = get(f"bytes={size - 2}-{size + 100}")       # clipped to the end
        assert (r.status_code, r.content) == (206, body[-2:])
        r = get(f"bytes={size}-")
        assert (r.status_code, r.headers["Content-Range"]) == (416, f"bytes */{size}")
        for rng in ("bytes=0-1,5-6", None):
            r = get(rng)
            assert (r.status_code, r.content) == (200, body)
