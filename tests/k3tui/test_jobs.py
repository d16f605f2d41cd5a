"""Job state files are outside input too: a damaged one is named, never a traceback, and the
other jobs are still listed (the jobs screen and `k3tui jobs` read them through list_jobs)."""

from __future__ import annotations

import json

import pytest

from k3tui.errors import K3Error
from k3tui.jobs import jobs_dir, list_jobs, read_state


def test_a_damaged_state_file_is_named_and_skipped():
    d = jobs_dir()
    d.mkdir(parents=True, exist_ok=True)
    (d / "not-a-table.json").write_text("[]")
    (d / "half.json").write_text('{"kind": "download"')
    (d / "no-start.json").write_text(json.dumps({"id": "no-start", "kind": "download",
                                                 "status": "done", "started": None}))
    (d / "ok.json").write_text(json.dumps({"id": "ok", "kind": "download", "status": "done",
                                           "started": 1}))
    assert [s["id"] for s in list_jobs()] == ["ok", "no-start"]
    for job in ("not-a-table", "half"):
        with pytest.raises(K3Error, match="damaged"):
            read_state(job)


def test_a_finished_job_frees_its_target_before_it_says_so(tmp_path):
    # `k3tui jobs attach` returns on the final status; a pack right after it must not be
    # refused because the finished job's process has not exited yet
    import os
    import signal
    import sys
    import time

    from k3tui import jobs

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
