"""The download loop against the loopback hub, in-process: faults, auth, verify, ENOSPC."""

from __future__ import annotations

import errno
import hashlib
import os
import threading

import pytest
from hub_helpers import BIG, REPO_ID, SMALL

from k3tui.errors import K3Error
from k3tui.hub import CHUNK_BYTES, Options, download, fetch_snapshot, plan_download, transfer
from fakehub import Fault
from k3tui.hub.metadata import check_access
from k3tui.hub.store import LocalStore

FAST = dict(backoff_s=0.02, timeout_s=10.0)   # generous: the box is shared and busy


def same_tree(a, b) -> None:
    for p in a.rglob("*"):
        if p.is_file():
            q = b / p.relative_to(a)
            assert q.read_bytes() == p.read_bytes(), f"{q} differs"


def fetch(hub, out, **kw):
    snap = fetch_snapshot(REPO_ID)
    opts = Options(**{**FAST, **kw.pop("opts", {})})
    return snap, download(snap, out, workers=kw.pop("workers", 2), opts=opts,
                          log=lambda m: None, **kw)


def test_dl_clean_download_matches_and_pins_commit(hub, repo_dir, tmp_path):
    out = tmp_path / "out"
    snap, res = fetch(hub, out)
    assert res.ok, res
    same_tree(repo_dir, out)
    assert snap.commit == hub.commit and len(snap.files) == 4
    big = next(f for f in snap.files if f.name == BIG)
    assert big.sha256 == hashlib.sha256((repo_dir / BIG).read_bytes()).hexdigest()
    # every content request used the pinned commit, not "main"
    resolves = [e["path"] for e in hub.requests(method="HEAD")]
    assert resolves and all(f"/resolve/{hub.commit}/" in p for p in resolves)
    assert not list((out / ".k3tui" / "partial").rglob("*.part"))


@pytest.mark.parametrize("fault", [
    Fault.cut(2_500_000), Fault.reset(2_500_000), Fault.http_status(503),
    Fault.http_status(429), Fault.stall(1_500_000, 2.5), Fault.ignore_range(),
], ids=lambda f: f.kind + (str(f.status) if f.status else ""))
def test_dl_faults_are_retried_to_a_verified_file(hub, repo_dir, tmp_path, fault):
    # a cut first, so the next fault meets a Range request (matters for ignore_range)
    hub.faults[BIG] = [Fault.cut(1_200_000), fault, fault]
    out = tmp_path / "out"
    _, res = fetch(hub, out, opts={"timeout_s": 1.0} if fault.kind == "stall" else {})
    assert res.ok, res
    assert (out / BIG).read_bytes() == (repo_dir / BIG).read_bytes()
    gets = [e for e in hub.requests(method="GET") if e["path"].startswith("/cdn/")
            and e["port"] != int(hub.endpoint.rsplit(":", 1)[1])]
    ranges = [e["range"] for e in gets if e["range"]]
    assert ranges and ranges[0] == "bytes=1200000-", ranges   # resumed, not restarted


def test_dl_cut_mid_file_resends_nothing(hub, repo_dir, tmp_path):
    """After a clean cut the pending partial chunk is kept: not one byte comes twice."""
    hub.faults[BIG] = [Fault.cut(1_234_567), Fault.cut(2_000_000)]
    _, res = fetch(hub, tmp_path / "out")
    assert res.ok
    assert hub.body_bytes(BIG) == (repo_dir / BIG).stat().st_size


def test_dl_corrupt_byte_is_caught_and_refetched(hub, repo_dir, tmp_path):
    hub.faults[SMALL] = [Fault.corrupt(777_777)]
    out = tmp_path / "out"
    _, res = fetch(hub, out)
    assert res.ok
    assert (out / SMALL).read_bytes() == (repo_dir / SMALL).read_bytes()
    assert hub.body_bytes(SMALL) == 2 * (repo_dir / SMALL).stat().st_size


def test_dl_permanent_503_gives_up_keeps_partial(hub, tmp_path):
    hub.faults[BIG] = [Fault.cut(1_500_000)] + [Fault.http_status(503)] * 50
    out = tmp_path / "out"
    _, res = fetch(hub, out, opts={"max_failures": 3})
    assert not res.ok and res.failed == [BIG]
    assert "could not be downloaded" in res.error.message and "rerun" in res.error.next_step
    assert "last error: gave up" in res.error.message and "503" in res.error.message  # why
    part = LocalStore(out).part(BIG)
    assert part.stat().st_size == 1_500_000          # the prefix survives for the rerun
    hub.faults[BIG] = []
    _, res = fetch(hub, out)
    assert res.ok
    assert hub.requests(range="bytes=1500000-")


def test_dl_token_goes_to_hub_never_to_cdn(repo_dir, tmp_path, monkeypatch):
    from fakehub import FakeHub

    with FakeHub(repo_dir, REPO_ID, cdn=True, gated_token="hf_good") as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_TOKEN", "hf_good")
        hub.faults[BIG] = [Fault.cut(3_000_000), Fault.http_status(503)]
        snap = fetch_snapshot(REPO_ID)
        lines: list[str] = []
        res = download(snap, tmp_path / "out", opts=Options(token="hf_good", **FAST),
                       log=lines.append)
        assert res.ok
        assert any("503" in line for line in lines)
        assert not any("hf_good" in line or "sig=" in line for line in lines), lines
        hub_port = int(hub.endpoint.rsplit(":", 1)[1])
        on_hub = [e for e in hub.requests() if e["port"] == hub_port]
        on_cdn = [e for e in hub.requests() if e["port"] != hub_port]
        assert on_cdn and not any(e["auth"] for e in on_cdn)
        assert all(e["auth"] for e in on_hub if "/resolve/" in e["path"])
        # small files are served by the hub itself, with the token
        assert any(e["path"].endswith("config.json") and e["method"] == "GET" for e in on_hub)


@pytest.mark.parametrize("token,expect", [
    (None, "hf auth login"), ("hf_pending", "request or accept access"),
    ("hf_bogus", "refused (invalid or expired)"),
])
def test_dl_gated_and_bad_tokens_explained(repo_dir, monkeypatch, token, expect):
    from fakehub import FakeHub

    with FakeHub(repo_dir, REPO_ID, gated_token="hf_good", noaccess_tokens=("hf_pending",)) \
            as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        if token:
            monkeypatch.setenv("HF_TOKEN", token)
        with pytest.raises(K3Error) as ei:
            snap = fetch_snapshot(REPO_ID)           # metadata is public when gated
            assert snap.gated
            check_access(snap)
        assert expect in str(ei.value)
        assert "hf_" not in ei.value.message or token is None   # never echo the token


def test_dl_repo_and_revision_not_found(hub):
    with pytest.raises(K3Error, match="was not found"):
        fetch_snapshot("acme/nope")
    with pytest.raises(K3Error, match="no revision 'v9'"):
        fetch_snapshot(REPO_ID, "v9")
    with pytest.raises(K3Error, match="No file of acme/tiny matches"):
        fetch_snapshot(REPO_ID, include=["*.gguf"])
    snap = fetch_snapshot(REPO_ID, include=["*.safetensors"])
    assert {f.name for f in snap.files} == {BIG, SMALL}


def test_dl_hub_down_is_one_sentence(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")     # nothing listens there
    with pytest.raises(K3Error, match="Could not reach the Hub"):
        fetch_snapshot(REPO_ID, timeout=1, attempts=2, backoff_s=0.01)


def test_dl_enospc_keeps_partial_then_resumes(hub, repo_dir, tmp_path, monkeypatch):
    """Disk full at the write seam: a clear message, the partial and sidecar stay, and
    the rerun continues from exactly the bytes that reached the disk."""
    real, budget = os.pwritev, [2 * CHUNK_BYTES + 1000]

    def tight_pwritev(fd, pieces, offset):       # a short write, then ENOSPC, like Linux
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real(fd, [b"".join(pieces)[:budget[0]]], offset)
        budget[0] -= n
        return n

    monkeypatch.setattr(transfer, "pwritev", tight_pwritev)
    out = tmp_path / "out"
    _, res = fetch(hub, out, workers=1)
    assert not res.ok and "is full" in res.error.message
    assert "rerun `k3tui download`" in res.error.next_step
    store = LocalStore(out)
    parts = {p.name: p.stat().st_size for p in (out / ".k3tui" / "partial").rglob("*.part")}
    finals = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()
                 and ".k3tui" not in p.parts)
    assert sum(parts.values()) + finals == 2 * CHUNK_BYTES + 1000   # all that fit is kept
    monkeypatch.setattr(transfer, "pwritev", real)
    name = next(iter(parts))[:-len(".part")]
    assert store.sidecar(name).exists()
    before = len(hub.log)
    _, res = fetch(hub, out)
    assert res.ok
    same_tree(repo_dir, out)
    sent = sum(e["sent"] for e in hub.log[before:] if e.get("event") == "body")
    total = sum(p.stat().st_size for p in repo_dir.rglob("*") if p.is_file())
    assert sent == total - (2 * CHUNK_BYTES + 1000)   # nothing that reached the disk again


def test_dl_whole_chunks_are_written_o_direct(hub, repo_dir, tmp_path, monkeypatch):
    """Whole chunks go to an O_DIRECT descriptor (no page-cache copy, nothing left for the
    final fdatasync); only each file's tail is buffered. Also after a cut mid-chunk, whose
    odd resume offset is written buffered up to the next chunk boundary."""
    import fcntl

    probe = tmp_path / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except (AttributeError, OSError):
        pytest.skip("this filesystem has no O_DIRECT")
    real, direct = os.pwritev, {}

    def counting_pwritev(fd, pieces, offset):
        n = real(fd, pieces, offset)
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            assert offset % CHUNK_BYTES == 0 and n == CHUNK_BYTES   # whole aligned chunks
            direct[fd] = direct.get(fd, 0) + n
        return n

    monkeypatch.setattr(transfer, "pwritev", counting_pwritev)
    hub.faults[BIG] = [Fault.cut(CHUNK_BYTES + 12_345)]
    out = tmp_path / "out"
    _, res = fetch(hub, out, workers=1)
    assert res.ok, res
    same_tree(repo_dir, out)
    sizes = [p.stat().st_size for p in repo_dir.rglob("*") if p.is_file()]
    whole = sum(s // CHUNK_BYTES for s in sizes) * CHUNK_BYTES
    assert sum(direct.values()) == whole - CHUNK_BYTES   # the chunk the cut split: buffered


def test_dl_without_a_listener_runs_no_ticker(hub, tmp_path, monkeypatch):
    """No on_progress: no progress thread, so the return is not held up to space a last
    event nobody receives (it cost a download up to one tick, 0.1 s)."""
    from k3tui.hub.progress import Ticker

    started, real_enter = [], Ticker.__enter__
    monkeypatch.setattr(Ticker, "__enter__", lambda self: started.append(self) or real_enter(self))
    _, res = fetch(hub, tmp_path / "out")
    assert res.ok and not started
    res = download(fetch_snapshot(REPO_ID), tmp_path / "again", opts=Options(**FAST),
                   on_progress=lambda ev: None, log=lambda m: None)
    assert res.ok and len(started) == 1     # a listener still gets its ticker


def test_dl_space_preflight_refuses_with_numbers(hub, tmp_path, monkeypatch):
    from k3tui.hub import sync as dl

    monkeypatch.setattr(dl, "free_bytes", lambda p: 5_000_000)
    plan = plan_download(fetch_snapshot(REPO_ID), tmp_path / "out")
    with pytest.raises(K3Error) as ei:
        plan.refuse_if_short()
    msg = str(ei.value)
    assert "Not enough space" in msg and "5.0 MB free" in msg and "10.5 MB still" in msg
    assert "free 6.5 MB" in ei.value.next_step


def test_dl_verify_detects_flipped_byte_and_refetches(hub, repo_dir, tmp_path):
    out = tmp_path / "out"
    snap, res = fetch(hub, out)
    assert res.ok
    assert plan_download(snap, out, check="stat").complete.__len__() == 4
    with open(out / SMALL, "r+b") as fh:          # bit rot / a stray write
        fh.seek(1000)
        b = fh.read(1)
        fh.seek(1000)
        fh.write(bytes([b[0] ^ 1]))
    plan = plan_download(snap, out, check="stat")
    assert plan.to_check == [SMALL]
    res = download(snap, out, opts=Options(**FAST), check="stat", log=lambda m: None)
    assert res.ok and res.replaced == [SMALL]
    same_tree(repo_dir, out)
    # unchanged files were not re-hashed: their records were trusted
    assert plan_download(snap, out, check="stat").complete.__len__() == 4
    # --rehash re-reads everything, and finds it fine
    res = download(snap, out, opts=Options(**FAST), check="hash", log=lambda m: None)
    assert res.ok and sorted(res.verified_now) == sorted(f.name for f in snap.files)


def test_dl_untracked_file_on_disk_is_hashed_not_trusted(hub, repo_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / BIG).write_bytes(b"\0" * (repo_dir / BIG).stat().st_size)   # right size, wrong
    (out / SMALL).write_bytes((repo_dir / SMALL).read_bytes())         # right
    _, res = fetch(hub, out)
    assert res.ok and res.replaced == [BIG] and res.verified_now == [SMALL]
    same_tree(repo_dir, out)
    assert hub.body_bytes(SMALL) == 0


def test_dl_progress_events_throttled_and_resume_counts_initial_bytes(hub, repo_dir, tmp_path,
                                                                       monkeypatch):
    from k3tui.hub.progress import Ticker

    hub.throttle_bps = 8e6
    out = tmp_path / "out"
    stop = threading.Event()
    events = []
    # When each event is decided (the ticker's emit begins), not when the callback gets to
    # run: on a loaded box a snapshot can wait tens of ms for the GIL, which made two
    # callbacks look closer together than the ticker ever emitted them.
    emitted: list[float] = []
    real_emit = Ticker._emit

    def timed_emit(self):
        emitted.append(__import__("time").monotonic())
        real_emit(self)

    monkeypatch.setattr(Ticker, "_emit", timed_emit)

    def on(ev):
        events.append((__import__("time").monotonic(), ev))
        if ev.done_bytes > 4_000_000:
            stop.set()

    snap = fetch_snapshot(REPO_ID)
    res = download(snap, out, opts=Options(**FAST), on_progress=on, stop=stop,
                   log=lambda m: None)
    assert res.cancelled and not res.ok
    assert len(emitted) == len(events) > 1    # every event came through the ticker
    # at most 10 per second
    assert all(b - a >= 0.08 for a, b in zip(emitted, emitted[1:])), emitted
    have = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()
               and (p.suffix == ".part" or ".k3tui" not in p.parts))
    assert have >= 2_000_000
    hub.throttle_bps = 4e6
    events.clear()
    res = download(snap, out, opts=Options(**FAST), on_progress=on, log=lambda m: None)
    assert res.ok
    first = events[0][1]
    assert first.initial_bytes == have and first.done_bytes >= have
    # the resumed bytes never show up as speed: no event claims more than the throttle
    assert max(ev.rate_bps for _, ev in events) < 3 * 4e6 * 2      # ≤ 2 workers × throttle
    last = events[-1][1]
    assert last.done_bytes == last.total_bytes == snap.total_bytes
    assert last.counts == {"done": len(snap.files)} and last.files == []


def test_dl_stall_longer_than_timeout_is_cut_short(hub, repo_dir, tmp_path):
    """A server that goes silent for 60 s mid-body costs one timeout (1 s), not 60 s."""
    hub.faults[BIG] = [Fault.stall(2_000_000, 60.0)]
    lines: list[str] = []
    t0 = __import__("time").monotonic()
    snap = fetch_snapshot(REPO_ID)
    res = download(snap, tmp_path / "out", opts=Options(backoff_s=0.02, timeout_s=1.0),
                   log=lines.append)
    assert res.ok
    assert __import__("time").monotonic() - t0 < 20
    assert any("ReadTimeout" in line and "at byte 2,000,000" in line for line in lines), lines


@pytest.mark.skipif(not __import__("shutil").which("fincore"), reason="fincore not installed")
def test_dl_verified_files_leave_the_page_cache(hub, repo_dir, tmp_path):
    """After a file is verified its cached pages are dropped (unified memory needs that)."""
    import subprocess

    out = tmp_path / "out"
    _, res = fetch(hub, out)
    assert res.ok
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(out)], capture_output=True, text=True)
    if fs.stdout.strip() in ("tmpfs", "ramfs"):
        pytest.skip("the page cache is the storage on tmpfs")
    p = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(out / BIG)],
                       capture_output=True, text=True, check=True)
    assert int(p.stdout.split()[0]) < (out / BIG).stat().st_size // 8


def test_dl_trickling_connection_is_reopened(hub, repo_dir, tmp_path):
    """A server that keeps sending a few kB/s never hits the read timeout; the loop drops
    such a connection and reopens it (resuming by Range) instead of crawling for hours."""
    hub.throttle_bps = 40_000
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if "too slow" in line:
            hub.throttle_bps = None           # the next connection is fast again

    snap = fetch_snapshot(REPO_ID, include=[BIG])
    res = download(snap, tmp_path / "out", workers=1, log=log,
                   opts=Options(backoff_s=0.02, low_speed_bps=200_000, low_speed_s=0.5))
    assert res.ok
    assert any("too slow" in line for line in lines), lines
    assert (tmp_path / "out" / BIG).read_bytes() == (repo_dir / BIG).read_bytes()
    assert [e["range"] for e in hub.requests(method="GET") if e["range"]]


def test_dl_empty_and_nested_files(tmp_path, monkeypatch):
    from fakehub import FakeHub

    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "empty.txt").write_bytes(b"")
    (src / "a" / "b" / "deep.bin").write_bytes(b"z" * 3_000_000)
    with FakeHub(src, REPO_ID) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        snap = fetch_snapshot(REPO_ID)
        res = download(snap, tmp_path / "out", opts=Options(**FAST), log=lambda m: None)
        assert res.ok
        assert (tmp_path / "out" / "empty.txt").read_bytes() == b""
        assert (tmp_path / "out" / "a" / "b" / "deep.bin").stat().st_size == 3_000_000
        assert not list((tmp_path / "out" / ".k3tui" / "partial").iterdir())
