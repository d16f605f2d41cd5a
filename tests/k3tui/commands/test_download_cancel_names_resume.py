"""A cancelled download said "rerun the same command to resume": hours later, which one? It
now names the command the job recorded (the same repo, folder and globs), in `k3tui jobs
cancel`, in the job's own message and so in `k3tui jobs`."""

from __future__ import annotations

import random
import threading

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
