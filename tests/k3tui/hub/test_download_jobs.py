"""Detached download jobs through the real CLI: SIGKILL + resume, cancel, one job per
folder, a closed terminal (tmux session killed), a real full filesystem (tmpfs)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid

import pytest
from hub_helpers import BIG, REPO_ID, k3, wait_for

from k3tui import jobs
from k3tui.errors import K3Error
from k3tui.hub import CHUNK_BYTES
from fakehub import Fault
from k3tui.hub.store import LocalStore


def newest_job() -> dict:
    return wait_for(lambda: jobs.list_jobs() and jobs.list_jobs()[0], what="a job")


def file_done(state: dict, name: str) -> int:
    return next((f["done"] for f in state.get("files", []) if f["name"] == name), 0)


def start_held(hub, out, at: int, *extra: str) -> tuple[dict, threading.Event]:
    """Start a detached download whose BIG file stalls (held) after `at` bytes."""
    release = threading.Event()
    hub.faults[BIG] = [Fault.hold(at, release)]
    # a long timeout: the hold must not end in a read timeout + retry on a loaded machine
    k3("download", REPO_ID, "--dir", str(out), "--detach", "--timeout", "120", *extra)
    job = newest_job()
    wait_for(lambda: file_done(jobs.read_state(job["id"]), BIG) > at - CHUNK_BYTES,
             what="the held file to reach the disk")
    return jobs.read_state(job["id"]), release


def test_dl_sigkill_then_rerun_resends_at_most_one_chunk(hub, repo_dir, tmp_path):
    out = tmp_path / "out"
    at = 5 * CHUNK_BYTES + 300_000                 # the kill leaves 300 kB in the buffer
    state, _ = start_held(hub, out, at)
    assert state["status"] == "running" and state["kind"] == "download"
    os.kill(state["pid"], signal.SIGKILL)
    wait_for(lambda: jobs.read_state(state["id"])["status"] != "running", what="death")
    dead = jobs.read_state(state["id"])
    assert dead["status"] == "failed" and "rerun" in dead["message"]
    part = out / ".k3tui" / "partial" / f"{BIG}.part"
    kept = part.stat().st_size
    assert at - CHUNK_BYTES < kept <= at

    k3("download", REPO_ID, "--dir", str(out), "--detach")
    job2 = newest_job()
    assert job2["id"] != state["id"]
    p = k3("jobs", "attach", job2["id"])
    assert "Done: every file" in p.stdout
    for f in repo_dir.rglob("*"):
        if f.is_file():
            assert (out / f.relative_to(repo_dir)).read_bytes() == f.read_bytes()
    ranges = [e["range"] for e in hub.requests(method="GET") if e["range"]]
    assert ranges == [f"bytes={kept}-"]
    resent = at - kept                  # sent before the kill, and asked for again
    assert 0 <= resent < CHUNK_BYTES
    print(f"bytes re-sent after SIGKILL: {resent:,} (chunk {CHUNK_BYTES:,})")
    final = jobs.read_state(job2["id"])
    assert final["status"] == "done" and final["done_bytes"] == final["total_bytes"]
    assert final["file_counts"] == {"done": len(hub.files)} and final["files"] == []
    assert not part.exists()


def test_dl_one_job_per_folder_and_cancel_keeps_partial(hub, repo_dir, tmp_path):
    out = tmp_path / "out"
    state, release = start_held(hub, out, 2 * CHUNK_BYTES + 300_000)
    again = k3("download", REPO_ID, "--dir", str(out), "--detach")
    assert f"Job {state['id']} is already downloading" in again.stdout
    with pytest.raises(K3Error, match=f"Job {state['id']} is already working"):
        jobs.start_job("download", jobs.k3tui_argv("--version"), str(out),
                       lock_file=LocalStore(out).lock_file)
    busy = k3("download", REPO_ID, "--dir", str(out), "--foreground", check=False)
    assert busy.returncode == 2 and "already working" in busy.stderr
    assert "Traceback" not in busy.stderr
    assert len(jobs.list_jobs()) == 1

    listing = k3("jobs").stdout
    assert state["id"] in listing and "running" in listing
    t0 = time.monotonic()
    p = k3("jobs", "cancel", state["id"][-4:])          # a unique suffix is enough
    assert "cancelled" in p.stdout
    # no wait for the 120 s read timeout (the bound leaves room for a loaded box to start
    # the CLI; the job's own line below proves it ended on SIGTERM, before the SIGKILL
    # that `jobs cancel` sends after 10 s)
    assert time.monotonic() - t0 < 60
    st = jobs.read_state(state["id"])
    assert st["status"] == "cancelled"
    assert "Cancelled; partial files are kept" in open(st["log"]).read()   # said by the job
    assert (out / ".k3tui" / "partial" / f"{BIG}.part").stat().st_size > CHUNK_BYTES
    # the lock went with the process: the same folder can be downloaded again
    rerun = k3("download", REPO_ID, "--dir", str(out), "--detach").stdout
    # the partial file is counted once (as partial, not also as missing)
    assert "partial: 1   missing: 0" in rerun, rerun
    assert k3("jobs", "attach").returncode == 0          # newest running job
    assert (out / BIG).read_bytes() == (repo_dir / BIG).read_bytes()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")
def test_dl_job_survives_the_terminal_closing(hub, repo_dir, tmp_path):
    """`k3tui download` in a tmux pane; kill the whole tmux server (terminal gone, SIGHUP
    to the pane); the job goes on; `jobs attach` later sees it finish verified."""
    out = tmp_path / "out"
    release = threading.Event()
    hub.faults[BIG] = [Fault.hold(3 * CHUNK_BYTES, release)]
    sock = f"k3dl-{uuid.uuid4().hex[:8]}"
    cmd = f"python -m k3tui download {REPO_ID} --dir {out} --timeout 120"
    subprocess.run(["tmux", "-L", sock, "new-session", "-d", "-x", "120", "-y", "30", cmd],
                   check=True, env=dict(os.environ))
    try:
        job = newest_job()
        wait_for(lambda: file_done(jobs.read_state(job["id"]), BIG) > 2 * CHUNK_BYTES,
                 what="progress")
        attach_pid = int(subprocess.run(["tmux", "-L", sock, "list-panes", "-F",
                                         "#{pane_pid}"], capture_output=True, text=True)
                         .stdout.split()[0])
        screen = subprocess.run(["tmux", "-L", sock, "capture-pane", "-p"],
                                capture_output=True, text=True).stdout
        assert "Started job" in screen
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)
    wait_for(lambda: not _pid_alive(attach_pid), what="the terminal's process to die")
    time.sleep(0.5)
    st = jobs.read_state(job["id"])
    assert st["status"] == "running"               # the job did not go with the terminal
    release.set()
    p = k3("jobs", "attach", job["id"])
    assert p.returncode == 0 and "verified" in p.stdout
    assert (out / BIG).read_bytes() == (repo_dir / BIG).read_bytes()


def _pid_alive(pid: int) -> bool:
    """Running, not a zombie: with the tmux server gone the pane's process is an orphan,
    and where PID 1 does not reap orphans (some containers) it stays a zombie for good."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_dl_real_full_disk_leaves_resumable_partial(hub, repo_dir, small_fs):
    out = small_fs / "model"
    state, release = start_held(hub, out, 2 * CHUNK_BYTES + 300_000)
    filler = small_fs / "filler"
    with open(filler, "wb") as fh:                 # someone else fills the disk meanwhile
        try:
            while True:
                fh.write(b"\0" * (256 << 10))
                fh.flush()
        except OSError:
            pass
    release.set()
    wait_for(lambda: jobs.read_state(state["id"])["status"] != "running", what="job end")
    st = jobs.read_state(state["id"])
    assert st["status"] == "failed" and "is full" in st["message"], st["message"]
    assert "resumes where it stopped" in st["message"]
    part = out / ".k3tui" / "partial" / f"{BIG}.part"
    kept = part.stat().st_size
    assert kept > CHUNK_BYTES
    side = json.loads((out / ".k3tui" / "partial" / f"{BIG}.part.json").read_text())
    assert side["size"] == (repo_dir / BIG).stat().st_size

    filler.unlink()
    before = len(hub.log)
    k3("download", REPO_ID, "--dir", str(out), "--detach")
    assert k3("jobs", "attach").returncode == 0
    assert (out / BIG).read_bytes() == (repo_dir / BIG).read_bytes()
    assert any(e.get("range") == f"bytes={kept}-" for e in hub.log[before:])


def test_dl_preflight_refuses_on_a_small_disk(hub, small_fs):
    big = small_fs / "big"
    big.write_bytes(b"\0" * (4 << 20))            # 8 MiB left, 10.5 MB needed
    p = k3("download", REPO_ID, "--dir", str(small_fs / "model"), check=False)
    assert p.returncode == 2
    assert "Not enough space" in p.stderr and "MB free" in p.stderr and "Traceback" not in p.stderr
    assert not jobs.list_jobs()
