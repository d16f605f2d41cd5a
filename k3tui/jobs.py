"""Detached job processes (downloads, packing) that outlive the terminal that started them.

A job is a child process in its own session (`start_new_session`: no controlling
terminal, so closing the terminal, the tmux session or the SSH connection sends it no
SIGHUP). It writes `<jobs_dir>/<id>.json` (state, replaced atomically) and `<id>.log`.
State keys, read by `k3tui jobs` and the TUI:

    id, kind, pid, status ("running"|"done"|"failed"|"cancelled"), started, updated,
    message, log, total_bytes, done_bytes, rate_bps, eta_s, stalled,
    files (download: [{name, size, done, status}]), layer (pack)
    (+ target, argv, pid_start, retries, errors)

One job per target: the parent takes an flock on the target's lock file (a download's lives
in its folder, `<dir>/.k3tui/download.lock`, so it holds across homes and users; others use
`<jobs_dir>/locks/<hash>.lock`) and the child inherits it, so the lock lives exactly as
long as the job process. The file says who holds it: pid, command, job id, home.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from k3tui.errors import K3Error
from k3tui.paths import get_paths, private_dir, private_open

STATUSES = ("running", "done", "failed", "cancelled")
ENV_ID, ENV_LOCK = "K3TUI_JOB_ID", "K3TUI_JOB_LOCK_FD"
START_GRACE_S = 30.0      # a job that has not written its pid yet is "starting"


def jobs_dir() -> Path:
    return private_dir(get_paths().jobs_dir)


def state_path(job_id: str) -> Path:
    return jobs_dir() / f"{job_id}.json"


def k3tui_argv(*args: str) -> list[str]:
    """The argv that runs `k3tui ARGS` with this interpreter (for `start_job`)."""
    return [sys.executable, "-m", "k3tui", *args]


def _write_state(state: dict) -> None:
    path = state_path(state["id"])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with private_open(tmp, "w") as fh:
        fh.write(json.dumps(state, indent=1))
    os.replace(tmp, path)


def _read_raw(job_id: str) -> dict:
    try:
        state = json.loads(state_path(job_id).read_text())
    except FileNotFoundError:
        raise K3Error(f"There is no job {job_id}.", "list jobs with `k3tui jobs`", 2) from None
    except (OSError, ValueError):   # a concurrent writer uses os.replace: this is damage
        state = None
    if not isinstance(state, dict):
        raise K3Error(f"The state file of job {job_id} is damaged.",
                      f"look at its log in {jobs_dir()}")
    return state


# -- the target lock -----------------------------------------------------------------------
def _lock_file(target_key: str) -> Path:
    d = jobs_dir() / "locks"
    d.mkdir(exist_ok=True)
    return d / (hashlib.sha1(target_key.encode()).hexdigest()[:16] + ".lock")


def _write_holder(fd: int, **holder) -> None:
    data = json.dumps(holder).encode()
    try:
        os.pwrite(fd, data, 0)              # write, then cut: a reader never sees it empty
        os.ftruncate(fd, len(data))
    except OSError:                         # another user's lock file, opened read-only
        pass


def _holder_of(path: Path) -> dict:
    try:
        text = path.read_text().strip()
    except OSError:
        return {}
    try:
        holder = json.loads(text)
    except ValueError:
        return {"command": text} if text else {}
    return holder if isinstance(holder, dict) else {}


def lock_target(target_key: str, command: str, *, job_id: str | None = None,
                path: Path | None = None) -> int:
    """flock the target (`path`: its lock file, default one in the jobs folder); returns the
    fd (close it to release). K3Error naming the holder if taken."""
    path = path or _lock_file(target_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except PermissionError:                 # another user's lock file: flock works read-only
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _holder_of(path)
        jid = holder.get("job")
        if jid and state_path(jid).exists():
            raise K3Error(f"Job {jid} is already working on {target_key}.",
                          f"watch it with `k3tui jobs attach {jid}` or stop it with "
                          f"`k3tui jobs cancel {jid}`", 2) from None
        pid, cmd = holder.get("pid"), holder.get("command") or "a k3tui command"
        who = f"pid {pid}: `{cmd}`" if pid else f"`{cmd}`"
        home = holder.get("home")
        where = f", with K3TUI_HOME={home}" if home and home != str(get_paths().root) else ""
        raise K3Error(f"Another k3tui ({who}{where}) is already working on {target_key}.",
                      "wait for it to finish" + (f" or stop it with `kill {pid}` (it keeps "
                      "its partial files)" if pid else "") + "; only one job per folder",
                      2) from None
    _write_holder(fd, pid=os.getpid(), command=command, job=job_id,
                  home=str(get_paths().root))
    return fd


# -- starting and inspecting jobs ----------------------------------------------------------
def new_state(job_id: str, kind: str, argv: list[str], target_key: str) -> dict:
    now = time.time()
    return {"id": job_id, "kind": kind, "pid": None, "status": "running", "started": now,
            "updated": now, "message": "starting", "log": str(jobs_dir() / f"{job_id}.log"),
            "total_bytes": 0, "done_bytes": 0, "rate_bps": 0.0, "eta_s": None,
            "stalled": False, "files": [], "layer": None, "target": target_key,
            "argv": argv, "pid_start": None, "retries": 0, "errors": []}


def start_job(kind: str, argv: list[str], target_key: str, *, lock_file: Path | None = None,
              command: str | None = None) -> str:
    """Run `argv` as a detached job; returns its id. K3Error if the target is busy.
    `lock_file`: where the target's lock lives (see `lock_target`); `command`: what the
    lock says the job runs (default: argv)."""
    job_id = f"{kind}-{time.strftime('%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    command = command or " ".join(argv)
    lock_fd = lock_target(target_key, command, job_id=job_id, path=lock_file)
    try:
        state = new_state(job_id, kind, argv, target_key)
        _write_state(state)
        env = dict(os.environ, **{ENV_ID: job_id, ENV_LOCK: str(lock_fd)})
        # the job must import this same k3tui even from an uninstalled checkout
        src = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        with private_open(state["log"]) as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    pass_fds=(lock_fd,), env=env, close_fds=True)
        _write_holder(lock_fd, pid=proc.pid, command=command, job=job_id,
                      home=str(get_paths().root))   # the job holds it from now on
    finally:
        os.close(lock_fd)       # the child keeps the lock alive through its inherited copy
    # Reap it if we outlive it (a TUI), so it never lingers as a zombie.
    threading.Thread(target=proc.wait, name=f"reap-{job_id}", daemon=True).start()
    return job_id


def _alive(pid: int | None, pid_start: float | None) -> bool:
    import psutil

    if not pid:
        return False
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return pid_start is None or abs(p.create_time() - pid_start) < 1.0
    except psutil.Error:
        return False


def resume_hint(state: dict) -> str:
    """`rerun `k3tui download … --dir …` to resume`: the command the job recorded, since
    "the same command" is one a user typed hours ago, maybe with the config's defaults."""
    argv = state.get("argv") or []
    if "--resume-as" in argv[:-1]:
        return f"rerun `{argv[argv.index('--resume-as') + 1]}` to resume"
    if state.get("kind") == "pack":
        return "rerun `k3tui pack` with the same folders to resume (it resumes per layer)"
    return "rerun the same command to resume"


def read_state(job_id: str) -> dict:
    """The job's state; a 'running' job whose process is gone is reported (and saved) as
    failed, so a SIGKILL or a reboot never leaves a job 'running' forever."""
    state = _read_raw(job_id)
    if state.get("status") != "running":
        return state
    if state.get("pid") is None:
        if time.time() - state.get("started", 0) < START_GRACE_S:
            return state
    elif _alive(state["pid"], state.get("pid_start")):
        return state
    state.update(status="failed", updated=time.time(), stalled=False, rate_bps=0.0,
                 eta_s=None, message="the job process ended without reporting (killed or "
                 f"rebooted); {resume_hint(state)}")
    _write_state(state)
    return state


def list_jobs() -> list[dict]:
    """Every job, newest first."""
    out = []
    for p in jobs_dir().glob("*.json"):
        try:
            out.append(read_state(p.stem))
        except K3Error:
            continue
    return sorted(out, key=lambda s: s.get("started") or 0, reverse=True)


def resolve_id(prefix: str | None) -> str:
    """An exact id, a unique prefix/suffix, or (None) the newest running job."""
    jobs = list_jobs()
    if prefix is None:
        running = [j for j in jobs if j["status"] == "running"]
        if not (running or jobs):
            raise K3Error("There are no jobs.", "start one with `k3tui download`", 2)
        return (running or jobs)[0]["id"]
    matches = [j["id"] for j in jobs if j["id"] == prefix]
    matches = matches or [j["id"] for j in jobs if j["id"].startswith(prefix)
                          or j["id"].endswith(prefix)]
    if len(matches) != 1:
        what = "No job matches" if not matches else "Several jobs match"
        raise K3Error(f"{what} '{prefix}'.", "list jobs with `k3tui jobs`", 2)
    return matches[0]


def forget_finished() -> list[str]:
    """Delete the state files and logs of jobs that are not running; returns their ids."""
    gone = []
    for state in list_jobs():
        if state["status"] != "running":
            state_path(state["id"]).unlink(missing_ok=True)
            if state.get("log"):
                Path(state["log"]).unlink(missing_ok=True)
            gone.append(state["id"])
    return gone


def cancel_job(job_id: str, wait_s: float = 10.0) -> dict:
    """Ask the job to stop (SIGTERM: it keeps its partial files), SIGKILL if it hangs."""
    state = read_state(job_id)
    if state["status"] != "running":
        return state
    pid = state.get("pid")
    if pid and _alive(pid, state.get("pid_start")):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _alive(pid, state.get("pid_start")):
            time.sleep(0.1)
        if _alive(pid, state.get("pid_start")):
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
    state = _read_raw(job_id)
    if state["status"] == "running" or (state["status"] == "failed" and not pid):
        state.update(status="cancelled", message="cancelled", updated=time.time(),
                     stalled=False, rate_bps=0.0, eta_s=None)
        _write_state(state)
    return state


# -- inside the job process ------------------------------------------------------------------
def release_inherited_lock() -> None:
    """Close the target lock a job process inherited from `start_job` (once)."""
    fd = os.environ.pop(ENV_LOCK, "")
    if fd.isdigit():
        try:
            os.close(int(fd))
        except OSError:
            pass


class JobReporter:
    """Writes this job's state file. Use `JobReporter.from_env()` in the job process."""

    def __init__(self, job_id: str):
        import psutil

        self.state = _read_raw(job_id)
        self.stop = threading.Event()
        self.state.update(pid=os.getpid(), pid_start=psutil.Process().create_time(),
                          status="running", message="running")
        self._lock = threading.Lock()
        self.update()

    @classmethod
    def from_env(cls) -> JobReporter | None:
        job_id = os.environ.get(ENV_ID)
        return cls(job_id) if job_id else None

    def install_signals(self) -> threading.Event:
        """SIGTERM/SIGINT = cancel (sets `self.stop`); SIGHUP is ignored (no terminal)."""
        def on_term(signum, frame):
            self.stop.set()
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        return self.stop

    def update(self, **fields) -> None:
        with self._lock:
            self.state.update(fields)
            self.state["updated"] = time.time()
            _write_state(self.state)

    def finish(self, status: str, message: str) -> None:
        assert status in STATUSES
        # Free the target first: whoever reads the final status may start the next job on
        # it at once, while this process may take a moment more to exit.
        release_inherited_lock()
        self.update(status=status, message=message, stalled=False, rate_bps=0.0, eta_s=None)
