"""Job state files are outside input: one checked reader; a damaged file is named with its
reason and skipped, never a traceback, and the other jobs are still listed (the jobs screen
and `k3tui jobs` read them through `scan`)."""

from __future__ import annotations

import json
import os

import pytest

from k3tui import jobs
from k3tui.jobs import DamagedState, Damaged, jobs_dir, read_state, scan


def put(job_id: str, name: str | None = None, **fields) -> dict:
    state = jobs.new_state(job_id, "download", ["k3tui", "download"], "/data/tiny")
    state.update({"status": "done", "started": 1000.0, **fields})
    (jobs_dir() / f"{name or job_id}.json").write_text(json.dumps(state))
    return state


def test_a_damaged_state_file_is_named_and_skipped():
    d = jobs_dir()
    put("ok")
    put("pid-text", status="running", pid="12345")        # a traceback in `k3tui jobs`
    put("no-start", status="running", started=None)        # ... and in the F3 screen
    put("bool-pid", status="running", pid=True)
    put("bad-status", status="paused")
    put("bad-files", files=[{"name": "a", "size": "1", "done": 0, "status": "done"}])
    put("stalled-text", stalled="no")
    put("other-id", name="evil", id="../outside")
    put("dotted", name="a.b")
    (d / "not-json.json").write_text('{"kind": "download"')
    (d / "a-list.json").write_text("[]")
    (d / "nan.json").write_text('{"id": "nan", "kind": "download", "status": "done", '
                                '"started": NaN}')
    (d / "no-kind.json").write_text('{"id": "no-kind", "status": "done", "started": 1}')
    (d / "deep.json").write_text("[" * 200_000)                     # a RecursionError
    with open(d / "huge.json", "wb") as fh:                         # sparse: no disk used
        fh.truncate(jobs.MAX_STATE_BYTES + 1)
    os.mkfifo(d / "fifo.json")                                      # would block a reader
    os.symlink(d / "ok.json", d / "link.json")

    found, damaged = scan()
    assert [s["id"] for s in found] == ["ok"]
    assert sorted(damaged) == sorted([
        Damaged("pid-text", "'pid' is not a process id or null"),
        Damaged("no-start", "'started' is not a time in seconds"),
        Damaged("bool-pid", "'pid' is not a process id or null"),
        Damaged("bad-status", "'status' is not one of running, done, failed, cancelled"),
        Damaged("bad-files", "'files' is not a list of {name, size, done, status}"),
        Damaged("stalled-text", "'stalled' is not true or false"),
        Damaged("evil", "it names another job id"),
        Damaged("a.b", "its name is not a job id"),
        Damaged("not-json", "it is not JSON"),
        Damaged("a-list", "it is not a JSON object"),
        Damaged("nan", "'started' is not a time in seconds"),
        Damaged("no-kind", "'kind' is missing"),
        Damaged("deep", "it is not JSON"),
        Damaged("huge", "it is larger than 32 MiB"),
        Damaged("fifo", "it is not a regular file"),
        Damaged("link", "it cannot be opened (Too many levels of symbolic links)"),
    ])
    with pytest.raises(DamagedState, match=r"job pid-text is damaged: 'pid' is not"):
        read_state("pid-text")
    with pytest.raises(DamagedState, match="job no-start is damaged"):
        jobs.resolve_id("no-start")


@pytest.mark.parametrize("job_id", ["../x", "..", "a/b", "x.json", "", "-x", "a" * 81])
def test_a_job_id_is_a_name_in_the_jobs_folder(job_id):
    with pytest.raises(jobs.K3Error, match="is not a job id"):
        jobs.state_path(job_id)
    with pytest.raises(jobs.K3Error, match="is not a job id"):
        jobs.log_path(job_id)


def test_layers_read_from_one_not_from_zero():
    """A finished 12-layer pack said "layer 11"."""
    assert jobs.layer_progress({"status": "done", "layer": 11, "layers": 12}) == \
        "12 of 12 layers"
    assert jobs.layer_progress({"status": "running", "layer": 5, "layers": 12}) == \
        "layer 6 of 12"
    assert jobs.layer_progress({"status": "failed", "layer": 0}) == "layer 1"
    assert jobs.layer_progress({"status": "running", "layer": None}) == ""


def test_a_finished_job_frees_its_target_before_it_says_so(tmp_path):
    # `k3tui jobs attach` returns on the final status; a pack right after it must not be
    # refused because the finished job's process has not exited yet
    import signal
    import sys
    import time

    code = ("import time\nfrom k3tui.jobs import JobReporter\n"
            "JobReporter.from_env().finish('done', 'packed')\ntime.sleep(60)\n")
    target = str(tmp_path / "trunk")
    job_id = jobs.start_job("pack", [sys.executable, "-c", code], target)
    try:
        deadline = time.monotonic() + 60
        while jobs.read_state(job_id)["status"] != "done":
            assert time.monotonic() < deadline, "the job never finished"
            time.sleep(0.05)
        os.close(jobs.lock_target(target, "k3tui pack"))  # free: no K3Error
    finally:
        pid = jobs.read_state(job_id).get("pid")
        if pid:
            os.kill(pid, signal.SIGKILL)


def test_the_target_locks_folder_is_made_private():
    """A 0755 locks folder (made with the umask) made the next command announce that k3tui's
    files 'were readable by other users' and tighten them, on every fresh home."""
    os.umask(0o022)
    os.close(jobs.lock_target("/data/tiny", "k3tui download"))
    locks = jobs_dir() / "locks"
    assert locks.stat().st_mode & 0o777 == 0o700
