"""The configured backend as a detached service: one per configuration, shared.

The backend runs inside a job (k3tui/jobs.py: its own session, state file, log, pid;
`k3tui jobs` lists it), so no terminal, chat or SSH session that closes takes it along; an
answer hours long needs that. Its target is the launch it runs (`service_key`: the kind
and the decided command), so a second `k3tui serve --detach`, `k3tui chat` or
`k3tui ask` with the same configuration finds it (`find`) instead of starting another,
and the job lock makes two starts race-free. The job writes the URL into its state once
the backend answers. `k3tui serve stop` cancels the job, which stops the backend.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3tui import jobs
from k3tui.backends.launch import prepare_launch
from k3tui.backends.running import LoadProgress, tail_lines
from k3tui.errors import K3Error
from k3tui.jobs import JobReporter, k3tui_argv, start_job

KIND = "backend"
POLL_S = 0.25


def service_key(ready: Any) -> str:
    """The job target for a decided launch (`launch.Launchable`): the same configuration
    gives the same key."""
    digest = hashlib.sha1(f"{ready.kind}\n{ready.describe()}".encode()).hexdigest()[:12]
    return f"{ready.kind} backend {digest}"


@dataclass(frozen=True)
class Service:
    job_id: str
    url: str            # without /v1; "" while it loads
    pid: int | None
    log: str
    status: str
    message: str


def _service(state: Mapping[str, Any]) -> Service:
    return Service(state["id"], state["url"], state["pid"], state["log"], state["status"],
                   state["message"])


def find(key: str | None = None) -> Service | None:
    """The running service for `key` (None: any running service), newest first."""

    for state in jobs.list_jobs():
        if state["kind"] == KIND and state["status"] == "running" \
                and (key is None or state["target"] == key):
            return _service(state)
    return None


def start(ready: Any, serve_args: list[str] | None = None) -> str:
    """Start the service job for `ready` (decided from the config and `serve_args`, which
    the job decides again the same way); its job id (K3Error when one runs already)."""

    return start_job(KIND, k3tui_argv("serve", "--as-job", *(serve_args or [])),
                     service_key(ready), command="k3tui serve --detach")


def wait_ready(job_id: str, on_progress: Any = None, timeout_s: float = 4 * 3600.0) -> Service:
    """Until the service's job has written its URL; K3Error with its log if it ends first."""

    t0, said = time.monotonic(), None
    while True:
        state = jobs.read_state(job_id)
        if state["status"] != "running":
            raise K3Error(f"The backend service {job_id} ended while it loaded "
                          f"({state['message']}).\nlast log lines ({state['log']}):\n"
                          f"{tail_lines(Path(state['log']), 15)}",
                          "read the log, fix the cause, then start it again")
        if state["url"]:
            return _service(state)
        if time.monotonic() - t0 > timeout_s:
            raise K3Error(f"The backend service {job_id} did not get ready in "
                          f"{timeout_s:.0f} s.", f"look at `k3tui jobs log {job_id}`")
        if on_progress is not None and state["message"] != said:
            said = state["message"]
            on_progress(LoadProgress(time.monotonic() - t0, message=said))
        time.sleep(POLL_S)


def attach_or_start(cfg: Any, on_progress: Any = None, serve_args: list[str] | None = None,
                    **options: Any) -> tuple[Service, bool]:
    """The service for this configuration, started if none runs; and whether it was
    already running. Two callers at once: the job lock lets one start it, the other finds
    it."""
    ready = prepare_launch(cfg, **options)
    key = service_key(ready)
    found = find(key)
    if found is not None:
        return (wait_ready(found.job_id, on_progress) if not found.url else found), True
    try:
        job_id = start(ready, serve_args)
    except K3Error:
        found = find(key)               # started by another caller a moment ago
        if found is None:
            raise
        return wait_ready(found.job_id, on_progress), True
    return wait_ready(job_id, on_progress), False


def stop(key: str | None = None) -> Service | None:
    """Stop the service (the one for `key`, or the newest); None when none runs."""

    found = find(key)
    if found is None:
        return None
    jobs.cancel_job(found.job_id, wait_s=30.0)
    return found


def run_as_job(ready: Any) -> int:
    """The service job's body: start the backend, publish its URL, serve until cancelled
    (SIGTERM from `k3tui serve stop`) or until the backend ends."""

    reporter = JobReporter.from_env()
    if reporter is None:
        raise K3Error("`k3tui serve --as-job` runs only as the service's job.",
                      "use `k3tui serve --detach`", 2)
    stop_event = reporter.install_signals()

    def progress(p: LoadProgress) -> None:
        reporter.update(message=p.line())

    try:
        backend = ready.start(progress)
    except K3Error as exc:
        reporter.finish("failed", str(exc).splitlines()[0])
        return 1
    try:
        reporter.update(url=backend.base_url, message=f"ready: {backend.base_url}/v1 "
                        f"(model {backend.model}); log {backend.log_path}")
        print(f"{backend.kind} ready: {backend.base_url}/v1", flush=True)
        while not stop_event.wait(1.0):
            if not backend.alive():
                reporter.finish("failed", f"the backend {backend.exit_reason()}; "
                                f"its log: {backend.log_path}")
                return 1
    finally:
        backend.stop()
    reporter.finish("cancelled", "stopped by `k3tui serve stop`")
    return 0
