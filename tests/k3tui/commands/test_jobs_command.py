"""`k3tui jobs` as a user meets it: a cancelled download said "rerun the same command to
resume" (hours later, which one?) and now names the command the job recorded (the same repo,
folder and globs) in `k3tui jobs cancel`, the job's message and `k3tui jobs`; a job whose log
is gone is one sentence, not a FileNotFoundError traceback."""

from __future__ import annotations

import random
import threading

import pytest

from hub_helpers import BIG, REPO_ID, k3, wait_for

from k3tui import jobs
from k3tui.hub import CHUNK_BYTES
from k3tui.testing.fakehub import FakeHub, Fault


def test_cancel_names_the_command_that_resumes(tmp_path, monkeypatch):
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / BIG).write_bytes(random.Random(7).randbytes(4 * CHUNK_BYTES + 12345))
    (remote / "config.json").write_text('{"model_type": "kimi_k3"}\n')
    out = tmp_path / "my models" / "tiny"          # a space: the command must be quoted
    with FakeHub(remote, REPO_ID, cdn=True) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        release = threading.Event()
        hub.faults[BIG] = [Fault.hold(CHUNK_BYTES + 1000, release)]
        try:
            k3("download", REPO_ID, "--dir", str(out), "--detach", "--timeout", "120")
            job = wait_for(lambda: jobs.list_jobs() and jobs.list_jobs()[0], what="a job")
            wait_for(lambda: any(f["name"] == BIG and f["done"] > 0
                                 for f in jobs.read_state(job["id"]).get("files", [])),
                     what="the held file to start")
            cancelled = k3("jobs", "cancel", job["id"])
        finally:
            release.set()
    command = f"k3tui download {REPO_ID} --dir '{out}' --timeout 120"
    assert cancelled.stdout.strip().endswith(f"partial files are kept; rerun `{command}` "
                                             "to resume."), cancelled.stdout
    state = jobs.read_state(job["id"])
    assert state["status"] == "cancelled"
    assert state["message"] == f"Cancelled; partial files are kept. Rerun `{command}` to resume."
    assert f"Rerun `{command}`" in " ".join(k3("jobs").stdout.split())


@pytest.mark.parametrize("status, step", [
    ("done", "next: `k3tui jobs` still shows how it ended"),
    ("cancelled", "next: `k3tui jobs` still shows how it ended; rerun `k3tui download "
                  "acme/tiny --dir /data/tiny` to resume"),
])
def test_jobs_log_of_a_job_whose_log_is_gone(status, step):
    state = jobs.new_state(f"download-1201-000000-{status[:4]}", "download",
                           ["python", "-m", "k3tui", "download", "acme/tiny", "--foreground",
                            "--resume-as", "k3tui download acme/tiny --dir /data/tiny"],
                           "/data/tiny")
    state.update(status=status, message="ended")
    jobs._write_state(state)                     # its log was never written, or was removed
    res = k3("jobs", "log", state["id"], check=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.splitlines() == [
        f"k3tui: The log of job {state['id']} cannot be read ({state['log']}: No such file "
        "or directory).", f"  {step}"]


def test_a_job_whose_process_died_names_the_command_that_resumes():
    """A download killed with SIGKILL (or a reboot) is found 'running' with no process: it
    is reported failed, with the recorded command rather than "the same command"."""
    import os

    import psutil

    state = jobs.new_state("download-1201-000000-dead", "download",
                           ["python", "-m", "k3tui", "download", "acme/tiny", "--foreground",
                            "--resume-as", "k3tui download acme/tiny --dir /data/tiny"],
                           "/data/tiny")
    # this very process's pid, with another start time: the pid was reused, the job is gone
    state.update(status="running", pid=os.getpid(),
                 pid_start=psutil.Process().create_time() - 3600)
    jobs._write_state(state)
    listed = " ".join(k3("jobs").stdout.split())
    ended = jobs.read_state(state["id"])
    assert ended["status"] == "failed"
    assert ended["message"].endswith("rerun `k3tui download acme/tiny --dir /data/tiny` "
                                     "to resume"), ended["message"]
    assert "rerun `k3tui download acme/tiny --dir /data/tiny` to resume" in listed, listed
