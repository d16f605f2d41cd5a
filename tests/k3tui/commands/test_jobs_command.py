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
from fakehub import FakeHub, Fault


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


# -- job files are data, not instructions ----------------------------------------------------
def _put(job_id: str, name: str | None = None, **fields) -> dict:
    import json

    state = jobs.new_state(job_id, "download", ["python", "-m", "k3tui", "download",
                                                "acme/tiny", "--foreground", "--resume-as",
                                                "k3tui download acme/tiny --dir /data/tiny"],
                           "/data/tiny")
    state.update({"status": "done", "message": "Done.", **fields})
    (jobs.jobs_dir() / f"{name or job_id}.json").write_text(json.dumps(state))
    return state


def test_a_damaged_state_file_is_one_line_in_every_jobs_command():
    _put("download-1201-000000-good")
    _put("download-1201-000000-pid", status="running", pid="12345")
    _put("download-1201-000000-null", status="running", pid=None, started=None)
    listed = k3("jobs")
    assert "Traceback" not in listed.stderr
    assert "download-1201-000000-good  done" in listed.stdout
    assert "download-1201-000000-pid  damaged, skipped: 'pid' is not a process id or null" \
        in listed.stdout
    assert "download-1201-000000-null  damaged, skipped: 'started' is not a time in seconds" \
        in listed.stdout
    import json

    as_json = k3("jobs", "--json")
    assert [s["id"] for s in json.loads(as_json.stdout)] == ["download-1201-000000-good"]
    assert "download-1201-000000-pid  damaged" in as_json.stderr
    for action in ("log", "cancel", "attach"):
        res = k3("jobs", action, "download-1201-000000-pid", check=False)
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.splitlines()[0] == (
            "k3tui: The state file of job download-1201-000000-pid is damaged: 'pid' is not a "
            "process id or null."), res.stderr
    cleaned = k3("jobs", "clean")
    assert "Forgot 1 finished job(s)" in cleaned.stdout
    assert "download-1201-000000-pid  damaged, skipped" in cleaned.stdout
    assert (jobs.jobs_dir() / "download-1201-000000-pid.json").exists()


def test_clean_deletes_only_the_jobs_own_files(tmp_path):
    """`jobs clean` deleted whatever path a state named as its log, and a state whose id
    climbed out of the jobs folder (`../x`) deleted files outside it."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    home = jobs.jobs_dir().parent
    outside = home / "outside.json"
    outside.write_text("{}")
    _put("download-1201-000000-logs", log=str(victim))
    own_log = jobs.jobs_dir() / "download-1201-000000-logs.log"
    own_log.write_text("the job's own log")
    _put("download-1201-000000-evil", name="download-1201-000000-evil", id="../outside")
    res = k3("jobs", "clean")
    assert "Forgot 1 finished job(s)" in res.stdout
    assert "download-1201-000000-evil  damaged, skipped: it names another job id" in res.stdout
    assert victim.read_text() == "keep me" and outside.exists()
    assert not own_log.exists()
    assert not (jobs.jobs_dir() / "download-1201-000000-logs.json").exists()


def test_jobs_log_reads_the_jobs_own_log_not_the_path_in_its_state(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not the job's")
    _put("download-1201-000000-read", log=str(secret))
    (jobs.jobs_dir() / "download-1201-000000-read.log").write_text("12:00 started\n")
    assert k3("jobs", "log", "download-1201-000000-read").stdout == "12:00 started\n"


@pytest.mark.parametrize("forged", ["pid only", "pid, start time and command line"])
def test_cancel_never_signals_a_process_that_is_not_the_job(forged):
    """`jobs cancel` signalled whatever pid a state named: an unrelated process was killed.
    A real `sleep` that is not the job, named by a state (at worst with its real start time
    and command line), survives, and the answer says the job's process is gone."""
    import subprocess

    import psutil

    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        me = psutil.Process(sleeper.pid)
        fields = {"pid": sleeper.pid, "pid_start": None}
        if forged != "pid only":
            fields.update(pid_start=me.create_time(), argv=me.cmdline())
        _put("download-1201-000000-kill", status="running", **fields)
        res = k3("jobs", "cancel", "download-1201-000000-kill")
        assert sleeper.poll() is None and me.is_running(), "an unrelated process was signalled"
        assert res.stdout.startswith(
            "Job download-1201-000000-kill is not running (failed): its process is gone "
            "without reporting (killed, or the machine restarted); rerun "), res.stdout
        assert len(res.stdout.splitlines()) == 1
        assert jobs.read_state("download-1201-000000-kill")["status"] == "failed"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_cancel_stops_the_jobs_own_process(tmp_path):
    import sys

    code = ("from k3tui.jobs import JobReporter\n"
            "r = JobReporter.from_env()\nstop = r.install_signals()\nstop.wait(600)\n"
            "r.finish('cancelled', 'Cancelled; partial files are kept.')\n")
    job_id = jobs.start_job("download", [sys.executable, "-c", code], str(tmp_path / "t"))
    state = wait_for(lambda: (s := jobs.read_state(job_id))["pid"] and s, what="its pid")
    try:
        res = k3("jobs", "cancel", job_id)
        assert res.stdout.startswith(f"Job {job_id}: cancelled."), res.stdout
        assert jobs._job_process(state) is None          # it ended
        assert jobs.read_state(job_id)["message"] == "Cancelled; partial files are kept."
    finally:
        proc = jobs._job_process(state)
        if proc is not None:
            proc.kill()


def test_a_job_after_which_another_finished_the_folder_has_nothing_to_resume():
    """A killed download still said "rerun … to resume" after a later one finished it."""
    _put("download-1201-000000-kild", status="failed", started=1000.0,
         message="its process is gone without reporting (killed, or the machine "
                 "restarted); rerun `k3tui download acme/tiny --dir /data/tiny` to resume")
    _put("download-1201-000000-pack", kind="pack", status="done", started=3000.0)
    _put("download-1202-000000-done", status="done", started=2000.0)
    listed = " ".join(k3("jobs").stdout.split())
    assert "rerun" not in listed, listed
    assert ("download-1201-000000-kild failed") in listed
    assert ("/data/tiny nothing to resume: a later job (download-1202-000000-done) finished "
            "it") in listed, listed


def test_a_finished_pack_says_every_layer_is_packed(tiny_a, tmp_path):
    """A finished 12-layer pack showed "layer 11"; the real pack of the reference checkpoint,
    as a job, ends with "N of N layers"."""
    from engine.core.config import ModelConfig

    n = ModelConfig.from_dir(tiny_a).num_hidden_layers
    k3("pack", str(tiny_a), str(tmp_path / "trunk"), "--detach")
    assert k3("jobs", "attach", timeout=300).returncode == 0
    listed = k3("jobs").stdout
    assert f"{n} of {n} layers" in listed and f"layer {n - 1}" not in listed, listed
