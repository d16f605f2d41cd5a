"""A folder's download records (`.k3tui/records.jsonl`): the work per file does not grow with
the listing, a kill -9 at any point loses at most the line being written, and the repo a
folder holds is recorded, so another repo is refused there."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from hub_helpers import BIG, REPO_ID, SMALL, k3

from k3tui.errors import K3Error
from k3tui.hub import download, fetch_snapshot, plan_download
from k3tui.hub.metadata import RemoteFile, RepoSnapshot
from k3tui.hub.progress import FAILED_LISTED, Progress
from k3tui.hub.store import COMPACT_SLACK, LocalStore
from fakehub import FakeHub, git_blob_sha1


def io_bytes() -> tuple[int, int]:
    """Bytes this process has read and written through syscalls so far (the kernel's count)."""
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


def tiny_folder(root, n: int) -> RepoSnapshot:
    """`n` tiny files in `root` (two folders deep) and the snapshot that lists them."""
    files = []
    for i in range(n):
        data = b"%d\n" % i
        name = f"d{i // 500}/f{i}.txt"
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
        files.append(RemoteFile(name, len(data), None, git_blob_sha1(data)))
    return RepoSnapshot(REPO_ID, "main", "c" * 40, tuple(files), False, "http://127.0.0.1:9")


def record_all(store: LocalStore, snap: RepoSnapshot) -> None:
    for rf in snap.files:
        st = store.final(rf.name).stat()
        store.record(rf.name, st.st_size, st.st_mtime_ns, rf.blob_id, snap.commit)


def bookkeeping_per_file(tmp_path, n: int) -> tuple[float, float, float]:
    """(bytes written, bytes read) per file while recording the last 100 of `n` files, and
    bytes read per file by the plan of a rerun that finds all `n` recorded."""
    out = tmp_path / f"n{n}"
    snap = tiny_folder(out, n)
    store = LocalStore(out)
    store.ensure()
    head, tail = snap.files[:-100], snap.files[-100:]
    record_all(store, RepoSnapshot(REPO_ID, "main", snap.commit, head, False, ""))
    r0, w0 = io_bytes()
    record_all(store, RepoSnapshot(REPO_ID, "main", snap.commit, tail, False, ""))
    r1, w1 = io_bytes()
    store.close()
    plan = plan_download(snap, out)
    r2, _ = io_bytes()
    assert len(plan.complete) == n
    return (w1 - w0) / 100, (r1 - r0) / 100, (r2 - r1) / n


def test_records_work_per_file_does_not_grow_with_the_listing(tmp_path):
    """verified.json was read and rewritten whole after every file: 2,000 files cost 45 s of
    bookkeeping, and 20,000 never finished. Each file's record is now one line."""
    small = bookkeeping_per_file(tmp_path, 200)
    large = bookkeeping_per_file(tmp_path, 20_000)
    print(f"per file: 200 files {small}, 20,000 files {large} (written, read, plan read)")
    written, read, plan_read = large
    assert written <= small[0] + 16 and written < 400    # one line per file, both times
    assert read <= small[1] + 16 and read < 400          # nothing re-read while recording
    assert plan_read <= 2 * small[2] + 64 and plan_read < 1000   # the records read once


def test_records_compaction_keeps_the_work_per_change_bounded(tmp_path):
    """A --verify --rehash run records every file again: the superseded lines are dropped by
    a rewrite now and then, costing at most a few lines per change on average."""
    out = tmp_path / "out"
    snap = tiny_folder(out, 3000)
    store = LocalStore(out)
    store.ensure()
    for _ in range(4):
        record_all(store, snap)
    journal = store.journal
    store.close()
    line = journal.end / journal.lines
    assert journal.bytes_written < 4 * 3000 * line * 2          # amortised: < 2 lines each
    assert journal.lines <= 2 * 3000 + COMPACT_SLACK + 1          # compacted on the way
    again = LocalStore(out).journal
    assert again.verified == journal.verified and len(again.verified) == 3000


def test_records_progress_events_list_only_the_files_being_worked_on():
    """An event listed all files: 20,000 files made each tick (4 a second, written to the
    job's state file) cost ~0.2 s. It lists the working and the first failed ones, and
    counts the rest."""
    n = 100_000
    p = Progress([(f"f{i}", 10) for i in range(n)])
    for i in range(50_000):
        p.initial_bytes(f"f{i}", 10)
        p.status(f"f{i}", "done")
    for i in range(50_000, 50_008):
        p.status(f"f{i}", "downloading")
        p.add(f"f{i}", 5)
    for i in range(60_000, 60_100):
        p.status(f"f{i}", "failed")
    ev = p.snapshot()
    assert len(ev.files) == 8 + FAILED_LISTED
    assert [f["name"] for f in ev.files[:8]] == [f"f{i}" for i in range(50_000, 50_008)]
    assert ev.counts == {"done": 50_000, "downloading": 8, "failed": 100,
                         "pending": n - 50_108}
    assert (ev.done_bytes, ev.total_bytes) == (50_000 * 10 + 8 * 5, n * 10)
    p.reset_file("f50000")
    p.status("f50000", "pending")
    ev = p.snapshot()
    assert ev.done_bytes == 50_000 * 10 + 7 * 5 and len(ev.files) == 7 + FAILED_LISTED


# -- crash safety ------------------------------------------------------------------------------

WRITER = textwrap.dedent("""
    import os, signal, sys
    from k3tui.hub import store as S
    root, mode = sys.argv[1], sys.argv[2]
    st = S.LocalStore(__import__("pathlib").Path(root))
    st.ensure()
    if mode == "kill-in-replace":         # killed between the rewrite and its rename
        real = os.replace
        def replace(a, b):
            if str(b).endswith("records.jsonl"):
                os.kill(os.getpid(), signal.SIGKILL)
            real(a, b)
        os.replace = replace
    if mode == "kill-in-write":           # killed with half a line written
        real_write = os.write
        def write(fd, data):
            if b'"f1500"' in data:
                real_write(fd, data[:len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            return real_write(fd, data)
        os.write = write
    S.COMPACT_SLACK = 0
    for i in range(3000 if mode != "plain" else 10**9):
        name = f"f{i % 1000}" if mode == "kill-in-replace" else f"f{i}"
        st.record(name, i, i, "d" * 40, "c" * 40)
        print(i, flush=True)
""")


def run_writer(tmp_path, mode: str) -> list[int]:
    p = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path / "out"), mode],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert p.returncode == -signal.SIGKILL, p.stderr
    return [int(x) for x in p.stdout.split()]


def test_records_kill9_mid_line_loses_only_that_line(tmp_path):
    done = run_writer(tmp_path, "kill-in-write")
    assert done[-1] == 1499                     # reported written before the torn one
    store = LocalStore(tmp_path / "out")
    raw = store.journal_file.read_bytes()
    assert not raw.endswith(b"\n")              # the torn half line is there…
    assert sorted(store.journal.verified) == sorted(f"f{i}" for i in range(1500))  # …ignored
    store.record("next", 1, 1, "d" * 40, "c" * 40)    # and cut before the next line
    store.close()
    again = LocalStore(tmp_path / "out").journal
    assert len(again.verified) == 1501 and again.verified["next"]["size"] == 1
    assert b'"f1500"' not in store.journal_file.read_bytes()


def test_records_kill9_during_a_rewrite_keeps_the_old_journal(tmp_path):
    done = run_writer(tmp_path, "kill-in-replace")
    store = LocalStore(tmp_path / "out")
    # every record reported written is there, with its last value
    last = {f"f{i % 1000}": i for i in done}
    assert {n: r["size"] for n, r in store.journal.verified.items()} == last
    store.record("f0", 7, 7, "d" * 40, "c" * 40)      # a later writer goes on from there
    store.close()
    assert LocalStore(tmp_path / "out").journal.verified["f0"]["size"] == 7


def test_records_a_real_kill9_at_a_random_moment_never_damages_them(tmp_path):
    """SIGKILL while files are recorded as fast as they can be: what the writer reported
    is all there, a rerun appends after it."""
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(out), "plain"],
                         stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    seen = 0
    for line in p.stdout:
        seen = int(line)
        if seen >= 700:
            break
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    store = LocalStore(out)
    got = set(store.journal.verified)
    assert all(f"f{i}" in got for i in range(seen + 1))
    assert got == {f"f{i}" for i in range(len(got))}          # a prefix, nothing invented
    store.record("after", 1, 1, "d" * 40, "c" * 40)
    store.close()
    assert set(LocalStore(out).journal.verified) == got | {"after"}


def test_records_a_full_disk_refuses_the_record_and_leaves_no_half_line(small_fs):
    """A real full filesystem: the record that does not fit is an ENOSPC (the download stops
    as disk-full), what was recorded stays, and once there is room the next line fits."""
    out = small_fs / "out"
    store = LocalStore(out)
    store.ensure()
    filler = small_fs / "filler"
    with open(filler, "wb", buffering=0) as fh:
        try:
            while fh.write(b"\0" * 4096):
                pass
        except OSError:
            pass
    recorded = 0
    with pytest.raises(OSError) as full:
        while True:
            store.record(f"f{recorded}-" + "x" * 150, 1, 1, "d" * 64, "c" * 40)
            recorded += 1
    assert full.value.errno == errno.ENOSPC
    assert store.journal_file.read_bytes().endswith(b"\n") or recorded == 0
    assert len(LocalStore(out).journal.verified) == recorded
    filler.unlink()
    store.record("after", 1, 1, "d" * 64, "c" * 40)
    store.close()
    assert len(LocalStore(out).journal.verified) == recorded + 1


@pytest.mark.parametrize("damage", [
    b'{"op":"verified","name":"x","size":"1","mtime_ns":1,"digest":"d","commit":"c"}\n',
    b'{"op":"verified","name":"x","size":true,"mtime_ns":1,"digest":"d","commit":"c"}\n',
    b'{"op":["verified"]}\n', b"[1,2]\n", b"\x00\x00\x00\n", b"[" * 50_000 + b"\n",
    b"{" * 100_000 + b"\n",
    b'{"op":"verified","name":"' + b"y" * 200_000 + b'"}\n',
])
def test_records_a_damaged_line_is_skipped_and_the_others_kept(tmp_path, damage):
    out = tmp_path / "out"
    store = LocalStore(out)
    store.ensure()
    store.record("a", 1, 1, "d", "c")
    store.close()
    with open(store.journal_file, "ab") as fh:
        fh.write(damage)
    store = LocalStore(out)
    store.record("b", 2, 2, "d", "c")
    store.close()
    assert sorted(LocalStore(out).journal.verified) == ["a", "b"]


def test_records_a_fifo_in_place_of_the_journal_does_not_hang(tmp_path):
    out = tmp_path / "out"
    LocalStore(out).ensure()
    os.mkfifo(LocalStore(out).journal_file)
    assert LocalStore(out).journal.verified == {}


def test_records_an_older_k3tuis_verified_json_is_taken_over(hub, repo_dir, tmp_path):
    """A folder verified by an older k3tui is not re-hashed: its verified.json becomes the
    journal on the next change."""
    out = tmp_path / "out"
    snap = fetch_snapshot(REPO_ID)
    assert download(snap, out, log=lambda m: None).ok
    journal = LocalStore(out).journal
    legacy = {n: r for n, r in journal.verified.items()}
    (out / ".k3tui" / "verified.json").write_text(json.dumps(legacy))
    (out / ".k3tui" / "records.jsonl").unlink()
    plan = plan_download(snap, out)
    assert sorted(plan.complete) == sorted(f.name for f in snap.files)
    assert download(snap, out, log=lambda m: None).ok            # records the origin
    assert not (out / ".k3tui" / "verified.json").exists()
    assert LocalStore(out).journal.verified == journal.verified


# -- the repo a folder holds -------------------------------------------------------------------

@pytest.fixture
def other_hub(tmp_path):
    d = tmp_path / "other-remote"
    d.mkdir()
    (d / BIG).write_bytes(b"another model's shard\n" * 1000)   # the same name, other bytes
    (d / "config.json").write_text('{"model_type": "other"}\n')
    h = FakeHub(d, "other/tiny")
    yield h
    h.stop()


def test_records_another_repo_in_the_same_folder_is_refused(hub, other_hub, repo_dir,
                                                            tmp_path, monkeypatch):
    out = tmp_path / "out"
    k3("download", REPO_ID, "--dir", str(out), "--foreground")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and
              ".k3tui" not in p.parts}
    monkeypatch.setenv("HF_ENDPOINT", other_hub.endpoint)
    for extra in ((), ("--foreground",), ("--detach",)):
        p = k3("download", "other/tiny", "--dir", str(out), *extra, check=False)
        assert p.returncode == 2, p.stdout + p.stderr
        first = p.stderr.strip().splitlines()[0]
        assert f"{out} already holds {REPO_ID} (main @ " in first, p.stderr
        assert "so other/tiny is not downloaded into it" in first, p.stderr
        assert f"--dir {tmp_path / 'tiny'}" in p.stderr           # the next step
        assert "Traceback" not in p.stderr
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and
             ".k3tui" not in p.parts}
    assert after == before                             # not one byte of the other repo
    assert not [e for e in other_hub.requests() if "/resolve/" in e["path"]]


def test_records_the_download_itself_refuses_another_repo(hub, other_hub, tmp_path,
                                                          monkeypatch):
    """The check is in the download, not only in the CLI's pre-flight."""
    out = tmp_path / "out"
    assert download(fetch_snapshot(REPO_ID), out, log=lambda m: None).ok
    monkeypatch.setenv("HF_ENDPOINT", other_hub.endpoint)
    with pytest.raises(K3Error, match="already holds acme/tiny"):
        download(fetch_snapshot("other/tiny"), out, log=lambda m: None)


def test_records_a_new_revision_of_the_same_repo_updates_the_folder(hub, repo_dir,
                                                                     tmp_path):
    """Same repo, new commit: the folder is updated in place, and says so. Changed files are
    fetched again; unchanged ones are neither fetched nor re-hashed; the record names the
    new commit, so the next run has nothing to say."""
    out = tmp_path / "out"
    k3("download", REPO_ID, "--dir", str(out), "--foreground")
    old = LocalStore(out).journal.origin
    assert old["repo"] == REPO_ID and old["revision"] == "main"
    (repo_dir / "config.json").write_text('{"model_type": "kimi_k3", "v": 2}\n')
    hub.rescan()
    assert hub.commit != old["commit"]
    hub.log.clear()
    p = k3("download", REPO_ID, "--dir", str(out), "--detach")
    assert (f"holds {REPO_ID} @ {old['commit'][:12]} (main); it is updated to "
            f"{hub.commit[:12]} (main): files that changed are fetched again") in p.stdout
    assert k3("jobs", "attach").returncode == 0
    assert (out / "config.json").read_text() == (repo_dir / "config.json").read_text()
    fetched = {e["path"].rsplit("/", 1)[-1] for e in hub.requests(method="GET")
               if "/resolve/" in e["path"] or e["path"].startswith("/cdn/")}
    assert fetched == {"config.json"}                   # BIG and SMALL were kept as they are
    assert LocalStore(out).journal.origin == {"repo": REPO_ID, "revision": "main",
                                              "commit": hub.commit}
    p = k3("download", REPO_ID, "--dir", str(out))
    assert "updated" not in p.stdout and "already here and verified" in p.stdout


def test_records_a_new_commit_with_the_same_files_is_recorded_without_a_job(hub, repo_dir,
                                                                            tmp_path):
    out = tmp_path / "out"
    k3("download", REPO_ID, "--dir", str(out), "--include", "*.safetensors", "--foreground")
    (repo_dir / "config.json").write_text("{}\n")       # outside --include: same files
    hub.rescan()
    p = k3("download", REPO_ID, "--dir", str(out), "--include", "*.safetensors")
    assert "it is updated to" in p.stdout and "already here and verified" in p.stdout
    assert LocalStore(out).journal.origin["commit"] == hub.commit
    p = k3("download", REPO_ID, "--dir", str(out), "--include", "*.safetensors")
    assert "updated" not in p.stdout
    assert sorted(x.name for x in out.iterdir()) == [".k3tui", BIG, SMALL]
