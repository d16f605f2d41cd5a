"""Detached job processes (downloads, packing) that outlive the terminal that started them.

A job is a child process in its own session (`start_new_session`: no controlling
terminal, so closing the terminal, the tmux session or the SSH connection sends it no
SIGHUP). It writes `<jobs_dir>/<id>.json` (state, replaced atomically) and `<id>.log`.
State keys, read by `k3tui jobs` and the TUI (`JobState`):

    id, kind, pid, status ("running"|"done"|"failed"|"cancelled"), started, updated,
    message, log, total_bytes, done_bytes, rate_bps, eta_s, stalled,
    files (download: [{name, size, done, status}]), layer, layers (pack)
    (+ target, argv, pid_start, retries, errors)

A state file is data, never an instruction: it is read through one checked reader (a field
of the wrong type makes the file *damaged*, listed with its reason and otherwise skipped);
the only files touched are `<id>.json` and `<id>.log`, named from the id (a strict pattern),
never from a path inside the file; and a pid is signalled only when that process is the
job's own: its start time, its command line and the job id in its environment.

One job per target: the parent takes an flock on the target's lock file (a download's lives
in its folder, `<dir>/.k3tui/download.lock`, so it holds across homes and users; others use
`<jobs_dir>/locks/<hash>.lock`) and the child inherits it, so the lock lives exactly as
long as the job process. The file says who holds it: pid, command, job id, home.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import secrets
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple, TypedDict

from k3tui.errors import K3Error
from k3tui.paths import get_paths, private_dir, private_open
from k3tui.textsafe import clean
from k3tui.units import MiB

STATUSES = ("running", "done", "failed", "cancelled")
ENV_ID, ENV_LOCK = "K3TUI_JOB_ID", "K3TUI_JOB_LOCK_FD"
START_GRACE_S = 30.0      # a job that has not written its pid yet is "starting"
# A job id is a file name in the jobs folder: no dots, no slashes, nothing to climb out with.
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,79}")
KIND_PATTERN = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# A download of 100,000 files writes ~15 MB of state; anything far larger is not a job's.
MAX_STATE_BYTES = 32 * MiB


class FileRow(TypedDict):
    name: str
    size: int
    done: int
    status: str


class JobState(TypedDict):
    id: str
    kind: str
    pid: int | None
    pid_start: float | None
    status: str
    started: float
    updated: float
    message: str
    log: str                  # always jobs_dir/<id>.log, whatever the file said
    total_bytes: int
    done_bytes: int
    rate_bps: float
    eta_s: float | None
    stalled: bool
    files: list[FileRow]
    file_counts: dict[str, int]  # download: files per status (the files list holds only the active)
    layer: int | None         # pack: the zero-based layer being copied
    layers: int | None        # pack: how many the checkpoint has
    target: str
    argv: list[str]
    retries: int
    errors: list[str]
    url: str                  # a backend service: where it answers, once it does


class Damaged(NamedTuple):
    """A state file that could not be read as a job's: listed with why, then skipped."""
    id: str
    reason: str


class DamagedState(K3Error):
    def __init__(self, job_id: str, reason: str):
        super().__init__(f"The state file of job {job_id} is damaged: {reason}.",
                         f"look at it, or remove it: `rm {jobs_folder() / (job_id + '.json')}`")
        self.reason = reason


def jobs_folder() -> Path:
    """Where the jobs live, without creating it (reading needs no writable home)."""
    return get_paths().jobs_dir


def jobs_dir() -> Path:
    return private_dir(jobs_folder())


def valid_id(job_id: str) -> bool:
    return bool(ID_PATTERN.fullmatch(job_id))


def _checked_id(job_id: str) -> str:
    if not valid_id(job_id):
        raise K3Error(f"{job_id!r} is not a job id.", "list jobs with `k3tui jobs`", 2)
    return job_id


def state_path(job_id: str) -> Path:
    return jobs_folder() / f"{_checked_id(job_id)}.json"


def log_path(job_id: str) -> Path:
    """The job's log: named from its id, never from what its state file says."""
    return jobs_folder() / f"{_checked_id(job_id)}.log"


def k3tui_argv(*args: str) -> list[str]:
    """The argv that runs `k3tui ARGS` with this interpreter (for `start_job`)."""
    return [sys.executable, "-m", "k3tui", *args]


def _write_state(state: dict) -> None:
    path = state_path(state["id"])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with private_open(tmp, "w") as fh:
        fh.write(json.dumps(state, indent=1))
    os.replace(tmp, path)


# -- the one reader of state files -----------------------------------------------------------
def _count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and v >= 0


def _text(v: Any) -> bool:
    return isinstance(v, str)


def _texts(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _optional(check):
    return lambda v: v is None or check(v)


def _file_rows(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(f, dict) and _text(f.get("name")) and _count(f.get("size"))
        and _count(f.get("done")) and _text(f.get("status")) for f in v)


_REQUIRED = object()
# key: (check, what it must be, the value when absent)
_FIELDS: dict[str, tuple[Any, str, Any]] = {
    "kind": (lambda v: _text(v) and KIND_PATTERN.fullmatch(v), "a kind name", _REQUIRED),
    "status": (lambda v: v in STATUSES, "one of " + ", ".join(STATUSES), _REQUIRED),
    "started": (_number, "a time in seconds", _REQUIRED),
    "pid": (_optional(lambda v: type(v) is int and v > 0), "a process id or null", None),
    "pid_start": (_optional(_number), "a time in seconds or null", None),
    "updated": (_optional(_number), "a time in seconds", None),
    "message": (_text, "text", ""),
    "total_bytes": (_count, "a whole number of bytes", 0),
    "done_bytes": (_count, "a whole number of bytes", 0),
    "rate_bps": (_number, "a rate", 0.0),
    "eta_s": (_optional(_number), "seconds or null", None),
    "stalled": (lambda v: type(v) is bool, "true or false", False),
    "files": (_file_rows, "a list of {name, size, done, status}", []),
    "file_counts": (lambda v: isinstance(v, dict) and all(_text(k) and _count(n)
                                                          for k, n in v.items()),
                    "files per status", {}),
    "layer": (_optional(_count), "a layer number or null", None),
    "layers": (_optional(lambda v: type(v) is int and v > 0), "a layer count or null", None),
    "target": (_text, "text", ""),
    "argv": (_texts, "a list of text", []),
    "retries": (_count, "a whole number", 0),
    "errors": (_texts, "a list of text", []),
    "url": (_text, "text", ""),
}


def parse_state(job_id: str, raw: Any) -> JobState:
    """`raw` (decoded JSON) checked field by field; DamagedState names the first bad one.
    Absent optional fields take their defaults; unknown ones are dropped."""
    if not isinstance(raw, dict):
        raise DamagedState(job_id, "it is not a JSON object")
    if raw.get("id") != job_id:
        raise DamagedState(job_id, "it names another job id")
    state: dict[str, Any] = {"id": job_id}
    for key, (check, what, default) in _FIELDS.items():
        if key not in raw:
            if default is _REQUIRED:
                raise DamagedState(job_id, f"'{key}' is missing")
            state[key] = type(default)(default) if isinstance(default, (list, dict)) else default
        elif not check(raw[key]):
            raise DamagedState(job_id, f"'{key}' is not {what}")
        else:
            state[key] = raw[key]
    # what is shown goes onto terminals: no escape sequences (argv stays exact: it is
    # compared with the process's command line)
    state["files"] = [{"name": clean(f["name"]), "size": f["size"], "done": f["done"],
                       "status": clean(f["status"])} for f in state["files"]]
    for key in ("message", "target", "url"):
        state[key] = clean(state[key])
    state["errors"] = [clean(e) for e in state["errors"]]
    if state["updated"] is None:
        state["updated"] = state["started"]
    state["log"] = str(log_path(job_id))
    return state  # type: ignore[return-value]


def _read_raw(job_id: str) -> JobState:
    path = state_path(job_id)
    try:
        # O_NONBLOCK: a FIFO put in its place must not hang the reader; O_NOFOLLOW: nor a link
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise K3Error(f"There is no job {job_id}.", "list jobs with `k3tui jobs`", 2) from None
    except OSError as exc:
        raise DamagedState(job_id, f"it cannot be opened ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise DamagedState(job_id, "it is not a regular file")
            data = fh.read(MAX_STATE_BYTES + 1)
    except OSError as exc:
        raise DamagedState(job_id, f"it cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_STATE_BYTES:
        raise DamagedState(job_id, f"it is larger than {MAX_STATE_BYTES // MiB} MiB")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):   # writers use os.replace: a bad file is damage
        raise DamagedState(job_id, "it is not JSON") from None
    return parse_state(job_id, raw)


# -- the target lock -----------------------------------------------------------------------
def _lock_file(target_key: str) -> Path:
    d = jobs_dir() / "locks"
    d.mkdir(mode=0o700, exist_ok=True)  # private like jobs/ (else the next run "tightens" it)
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
        if isinstance(jid, str) and valid_id(jid) and state_path(jid).exists():
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
def new_state(job_id: str, kind: str, argv: list[str], target_key: str) -> JobState:
    now = time.time()
    return {"id": job_id, "kind": kind, "pid": None, "status": "running", "started": now,
            "updated": now, "message": "starting", "log": str(log_path(job_id)),
            "total_bytes": 0, "done_bytes": 0, "rate_bps": 0.0, "eta_s": None,
            "stalled": False, "files": [], "layer": None, "layers": None,
            "target": target_key, "argv": argv, "pid_start": None, "retries": 0, "errors": [],
            "url": ""}


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
        with private_open(log_path(job_id)) as log:
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


def _job_process(state: JobState):
    """The job's own live process (a psutil.Process), or None. A pid alone may name any
    process by now (reused after a reboot, or written by something else), so the process
    must also have started when the job recorded, run the job's command line and carry the
    job's id in its environment (`start_job` puts it there)."""
    import psutil

    pid, started = state["pid"], state["pid_start"]
    if pid is None or started is None:
        return None
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE or abs(p.create_time() - started) >= 1.0 \
                or p.cmdline() != state["argv"] or p.environ().get(ENV_ID) != state["id"]:
            return None
        return p
    except psutil.Error:            # gone, or another user's (which no job of ours is)
        return None


def _process_gone(state: JobState) -> bool:
    """A 'running' job with no process of its own (past the start, when it has no pid yet)."""
    if state["pid"] is None:
        return time.time() - state["started"] >= START_GRACE_S
    return _job_process(state) is None


def resume_hint(state: JobState) -> str:
    """`rerun `k3tui download … --dir …` to resume`: the command the job recorded, since
    "the same command" is one a user typed hours ago, maybe with the config's defaults."""
    argv = state["argv"]
    if "--resume-as" in argv[:-1]:
        return f"rerun `{clean(argv[argv.index('--resume-as') + 1])}` to resume"
    if state["kind"] == "rpc-worker":
        return "start it again with `k3tui worker` (with the same --host and --port)"
    if state["kind"] == "pack":
        return "rerun `k3tui pack` with the same folders to resume (it resumes per layer)"
    if state["kind"] == "backend":
        return "start it again with `k3tui serve --detach`"
    if state["kind"] == "llama-build":
        return "rerun `k3tui setup --build-llama` (pip starts the build over)"
    if state["kind"] == "answers":
        return "`k3tui answers` starts a new runner for the answers left"
    return "rerun the same command to resume"


def layer_progress(state: dict) -> str:
    """A pack's layer for people: "layer 6 of 12" (the state's `layer` is zero-based),
    "12 of 12 layers" once done; "" for a job without layers."""
    layer, layers = state.get("layer"), state.get("layers")
    if layer is None:
        return ""
    if state.get("status") == "done":
        return f"{layers} of {layers} layers" if layers else "all layers"
    return f"layer {layer + 1} of {layers}" if layers else f"layer {layer + 1}"


def _save(state: JobState) -> None:
    """Write back what a reader found out; a home it cannot write only loses the note."""
    try:
        _write_state(state)
    except (K3Error, OSError):
        pass


def read_state(job_id: str) -> JobState:
    """The job's checked state (DamagedState if it cannot be read as one); a 'running' job
    whose process is gone is reported (and saved) as failed, so a SIGKILL or a reboot never
    leaves a job 'running' forever."""
    state = _read_raw(job_id)
    if state["status"] == "running" and _process_gone(state):
        state.update(status="failed", updated=time.time(), stalled=False, rate_bps=0.0,
                     eta_s=None, message="its process is gone without reporting (killed, or "
                     f"the machine restarted); {resume_hint(state)}")
        _save(state)
    return state


def _note_superseded(jobs: list[JobState]) -> None:
    """A failed or cancelled job whose target a later job finished has nothing to resume:
    its message says so instead of "rerun … to resume" (on screen only; the file keeps it)."""
    for i, old in enumerate(jobs):          # newest first: the later ones come before
        if old["status"] not in ("failed", "cancelled"):
            continue
        later = next((j for j in jobs[:i] if j["status"] == "done" and j["kind"] == old["kind"]
                      and j["target"] == old["target"] and j["started"] > old["started"]),
                     None)
        if later is not None:
            old["message"] = f"nothing to resume: a later job ({later['id']}) finished it"


def scan() -> tuple[list[JobState], list[Damaged]]:
    """Every job, newest first, and the state files that are damaged (skipped)."""
    jobs: list[JobState] = []
    damaged: list[Damaged] = []
    for path in sorted(jobs_folder().glob("*.json")):
        if not valid_id(path.stem):
            damaged.append(Damaged(clean(path.stem), "its name is not a job id"))
            continue
        try:
            jobs.append(read_state(path.stem))
        except DamagedState as exc:
            damaged.append(Damaged(path.stem, exc.reason))
        except K3Error:
            continue                        # removed meanwhile (`jobs clean` elsewhere)
    jobs.sort(key=lambda s: s["started"], reverse=True)
    _note_superseded(jobs)
    return jobs, damaged


def list_jobs() -> list[JobState]:
    """Every job that can be read, newest first."""
    return scan()[0]


def resolve_id(prefix: str | None) -> str:
    """An exact id, a unique prefix/suffix, or (None) the newest running job. The id of a
    damaged state file is DamagedState, with its reason."""
    jobs, damaged = scan()
    if prefix is None:
        running = [j for j in jobs if j["status"] == "running"]
        if not (running or jobs):
            raise K3Error("There are no jobs.", "start one with `k3tui download`", 2)
        return (running or jobs)[0]["id"]
    bad = next((d for d in damaged if d.id == prefix), None)
    if bad is not None:
        raise DamagedState(bad.id, bad.reason)
    matches = [j["id"] for j in jobs if j["id"] == prefix]
    matches = matches or [j["id"] for j in jobs if j["id"].startswith(prefix)
                          or j["id"].endswith(prefix)]
    if len(matches) != 1:
        what = "No job matches" if not matches else "Several jobs match"
        raise K3Error(f"{what} '{prefix}'.", "list jobs with `k3tui jobs`", 2)
    return matches[0]


def forget_finished() -> tuple[list[str], list[Damaged]]:
    """Delete the state file and log of each job that is not running: `<id>.json` and
    `<id>.log` in the jobs folder, nothing a state file names. Returns their ids, and the
    damaged state files (left alone: whose they are is unknown)."""
    jobs, damaged = scan()
    gone = []
    for state in jobs:
        if state["status"] != "running":
            state_path(state["id"]).unlink(missing_ok=True)
            log_path(state["id"]).unlink(missing_ok=True)
            gone.append(state["id"])
    return gone, damaged


def _wait_gone(state: JobState, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while _job_process(state) is not None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def cancel_job(job_id: str, wait_s: float = 10.0) -> tuple[JobState, bool]:
    """Ask the job to stop (SIGTERM: it keeps its partial files), SIGKILL if it hangs.
    Returns its state and whether it was running. Only the job's own process is signalled:
    one that is gone (or whose pid names another program now) makes it failed, untouched."""
    import psutil

    state = read_state(job_id)
    if state["status"] != "running":
        return state, False
    proc = _job_process(state)      # None while it starts (no pid yet): nothing to signal
    if proc is not None:
        try:
            proc.terminate()        # psutil refuses if the pid was reused meanwhile
            if not _wait_gone(state, wait_s):
                proc.kill()
                _wait_gone(state, 2.0)
        except psutil.NoSuchProcess:
            pass
        except psutil.AccessDenied:
            raise K3Error(f"Job {job_id}'s process ({state['pid']}) may not be stopped by "
                          "this user.", "stop it as the user who started it") from None
    state = _read_raw(job_id)       # the job may have written how it ended
    if state["status"] == "running":
        state.update(status="cancelled", message="cancelled", updated=time.time(),
                     stalled=False, rate_bps=0.0, eta_s=None)
        _write_state(state)
    return state, True


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
