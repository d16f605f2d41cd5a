"""`k3tui worker`: lend this machine's memory to a head's pool (llama.cpp RPC).

Starts `ggml-rpc-server` (of the same build as the llama-server k3tui runs) as a detached
job: it survives a closed SSH session, `k3tui jobs` lists it and `k3tui worker stop` ends
it. The job process supervises the server: it starts it under a memory limit it reads back
(systemd-run or a cgroup, as `k3tui serve` does for llama-server), behind the busy-GPU
guard, with its tensor cache (`-c`) in the models folder, and stops it with the job. The
worker listens on 127.0.0.1 unless given a private address of this machine; a wildcard or
public address is refused, because the RPC protocol has no authentication.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from k3tui.errors import K3Error
from k3tui.units import GiB

KIND = "rpc-worker"
READY_PREFIX = "serving "  # the job's message once its worker answers the handshake
START_TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from k3tui.backends.llama.rpc import DEFAULT_PORT

    parser.add_argument("action", nargs="?", default="start", choices=["start", "stop"],
                        help="start (default) or stop workers of this machine")
    parser.add_argument("which", nargs="?", metavar="ID|HOST:PORT",
                        help="with stop: the worker's job id or address (default: all)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on: 127.0.0.1 (default; a head on this "
                             "machine only) or this machine's private address; never a "
                             "public or wildcard one (the RPC protocol has no authentication)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"port to listen on (default {DEFAULT_PORT})")
    parser.add_argument("--memory-limit-gb", type=float, metavar="GIB",
                        help="confine the worker to this much memory (default: "
                             "[llama_server] memory_limit_gb, else what `k3tui serve` "
                             "would give llama-server here)")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="where the worker caches the head's tensors (default: "
                             "rpc-cache in the models folder)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="CPU threads (default: the usable cores)")
    parser.add_argument("--force", action="store_true",
                        help="start despite the busy-GPU guard or a memory limit that cannot "
                             "be applied on unified memory (risks freezing the machine)")
    parser.add_argument("--foreground", action="store_true",
                        help="serve in this process instead of a detached job (Ctrl-C stops)")


def run(args: argparse.Namespace) -> int:
    from k3tui import jobs

    if args.action == "stop":
        return stop(args.which)
    settings = _settings(args)
    reporter = jobs.JobReporter.from_env()
    if reporter is not None or args.foreground:
        return _serve(settings, reporter)
    _check_port_free(settings["host"], settings["port"])
    endpoint = f"{settings['host']}:{settings['port']}"
    argv = jobs.k3tui_argv("worker", "--foreground", "--host", settings["host"],
                           "--port", str(settings["port"]),
                           "--memory-limit-gb", repr(settings["limit_bytes"] / GiB),
                           "--cache-dir", settings["cache_dir"],
                           "--threads", str(settings["threads"]),
                           *(["--force"] if args.force else []))
    job_id = jobs.start_job(KIND, argv, endpoint, command=f"k3tui worker --host "
                            f"{settings['host']} --port {settings['port']}")
    state = _wait_started(job_id)
    if state["status"] != "running":
        raise K3Error(f"The worker did not start: {state['message']}",
                      f"its log: `k3tui jobs log {job_id}`", 2)
    if state["message"].startswith(READY_PREFIX):
        print("worker " + state["message"][len(READY_PREFIX):].replace("\n", "\n  "))
    else:
        print(f"The worker is still starting ({state['message']}); watch it with "
              f"`k3tui jobs log {job_id}`.")
    print(f"job {job_id}: it keeps running if this terminal closes; "
          "`k3tui worker stop` ends it.")
    print(head_line(endpoint))
    return 0


def _settings(args: argparse.Namespace) -> dict:
    """The checked host, port, limit, cache folder, threads and binary, before anything runs."""
    from k3tui.backends.llama.rpc import bind_refusal, find_rpc_server
    from k3tui.config import config_exists, load_config


    why = bind_refusal(args.host)
    if why:
        raise K3Error(why + ".",
                      "listen on 127.0.0.1 (the default) or this machine's address on the "
                      "private network: `k3tui worker --host 192.168.x.y`", 2)
    if not 0 < args.port < 65536:
        raise K3Error(f"--port {args.port} is not a port (1..65535).", "e.g. --port 50052", 2)
    cfg = load_config() if config_exists() else None
    binary = find_rpc_server(cfg.llama_server.binary if cfg else "")
    cache = Path(args.cache_dir or _models_folder(cfg) / "rpc-cache").expanduser().absolute()
    limit_gb = args.memory_limit_gb if args.memory_limit_gb is not None else \
        (cfg.llama_server.memory_limit_gb if cfg else 0.0)
    if limit_gb < 0:
        raise K3Error("--memory-limit-gb must not be negative.", "e.g. --memory-limit-gb 100", 2)
    return {"host": args.host, "port": args.port, "binary": str(binary), "cache_dir": str(cache),
            "limit_bytes": int(limit_gb * GiB), "threads": args.threads or 0,
            "force": args.force}


def _models_folder(cfg) -> Path:
    """The folder that holds (or would hold) the models: the worker's cache goes beside
    them, on the big disk, not in a small home."""
    from k3tui.paths import get_paths

    if cfg is None or not cfg.model.dir:
        return get_paths().models_dir
    path = Path(cfg.model.dir).expanduser()
    return path.parent if path.suffix == ".gguf" else path


def _check_port_free(host: str, port: int) -> None:
    import socket

    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise K3Error(f"Port {port} on {host} cannot be listened on: "
                          f"{exc.strerror or exc}.",
                          "is a worker already running there (`k3tui jobs`)? pick another "
                          "--port", 2) from None


def _wait_started(job_id: str) -> dict:
    from k3tui import jobs

    deadline = time.monotonic() + START_TIMEOUT_S
    state = jobs.read_state(job_id)
    while state["status"] == "running" and not state["message"].startswith(READY_PREFIX) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
        state = jobs.read_state(job_id)
    return state


def running_workers() -> list[dict]:
    """This machine's running worker jobs, newest first."""
    from k3tui import jobs

    return [j for j in jobs.list_jobs() if j["kind"] == KIND and j["status"] == "running"]


def head_line(endpoint: str) -> str:
    """What to run on the head: this worker and every other one running here, as the
    config's list."""
    host = endpoint.split(":")[0]
    endpoints = sorted({endpoint} | {j["target"] for j in running_workers()})
    line = ("On the head, pool " + ("them" if len(endpoints) > 1 else "it") + ":\n"
            f"  k3tui config set llama_server.rpc '{json.dumps(endpoints)}'\n"
            f"  (or for one start: k3tui serve --rpc {','.join(endpoints)})")
    if host in ("127.0.0.1", "localhost"):
        line += ("\nIt listens on loopback: only a head on this machine reaches it "
                 "(`--host <private address>` for a head on another machine).")
    return line


def stop(which: str | None) -> int:
    from k3tui import jobs

    workers = running_workers()
    if which:
        workers = [j for j in workers if which in (j["id"], j["target"])
                   or j["id"].startswith(which)]
    if not workers:
        what = f"matching {which!r} " if which else ""
        print(f"No worker {what}is running here (`k3tui jobs` lists them all).")
        return 1 if which else 0
    for job in workers:
        state, _ = jobs.cancel_job(job["id"])
        print(f"worker {job['target']} (job {job['id']}): {state['status']}.")
    return 0


# --- the job process: start the server, watch it, stop it -----------------------------------

def _serve(settings: dict, reporter) -> int:
    """Run the worker until it exits or the job is cancelled (Ctrl-C in --foreground)."""
    from k3tui.backends.llama.binary import binary_env
    from k3tui.backends.llama.server import choose_memory_limit, gpu_guard, unconfined_guard
    from k3tui.planning.plan import make_plan
    from k3tui.probe import probe_machine

    say = _sayer(reporter)
    host, port = settings["host"], settings["port"]
    cache = Path(settings["cache_dir"])
    stop_event = reporter.install_signals() if reporter is not None else None
    try:
        cache.mkdir(parents=True, exist_ok=True)
        report = probe_machine(cache, check_isolation=False)
        notes = [w for w in (gpu_guard(report, force=settings["force"]),) if w]
        want = settings["limit_bytes"] or make_plan(report, "gguf").memory_limit_bytes
        limit = choose_memory_limit(want, name=f"k3tui-rpc-worker-{port}-{os.getpid()}",
                                    what="the worker")
        unified = bool(getattr(report.gpu, "unified_memory", False))
        notes += [w for w in (unconfined_guard(limit, unified, force=settings["force"],
                                               what="the worker", command="k3tui worker"),)
                  if w]
    except K3Error as exc:
        return _failed(reporter, str(exc), exc.exit_code)
    except OSError as exc:
        return _failed(reporter, f"the cache folder {cache} cannot be made "
                                 f"({exc.strerror or exc}); pass another --cache-dir", 1)
    threads = settings["threads"] or report.cpu.usable
    argv = limit.wrap([settings["binary"], "-H", host, "-p", str(port), "-t", str(threads),
                       "-c"])
    env = binary_env(Path(settings["binary"])) | {"LLAMA_CACHE": str(cache),
                                                   "GGML_NO_BACKTRACE": "1"}
    say(f"starting: {' '.join(argv)}")
    try:
        # restore_signals=False keeps SIGPIPE ignored, as Python has it: ggml-rpc-server
        # does not ignore it, so a head that died mid-answer killed every worker still
        # sending to it; with EPIPE instead it drops that client and serves the next.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sys.stdout,
                                stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent,
                                restore_signals=False)
    except OSError as exc:
        limit.cleanup()
        return _failed(reporter, f"ggml-rpc-server cannot start: {exc.strerror or exc}", 1)
    try:
        ready = _until_serving(proc, host, port, stop_event)
        if ready is None:
            return _ended(reporter, proc, limit,
                          stopped=bool(stop_event and stop_event.is_set()))
        line = _ready_line(host, port, ready, limit, proc.pid, cache, notes)
        if reporter is not None:
            reporter.update(message=READY_PREFIX + line)
        else:
            print(f"worker {line}\n{head_line(f'{host}:{port}')}\nCtrl-C stops it.",
                  flush=True)
        while proc.poll() is None and not (stop_event and stop_event.is_set()):
            if stop_event is not None:
                stop_event.wait(0.5)
            else:
                time.sleep(0.5)
        return _ended(reporter, proc, limit, stopped=proc.poll() is None)
    except KeyboardInterrupt:
        return _ended(reporter, proc, limit, stopped=True)


def _until_serving(proc: subprocess.Popen, host: str, port: int, stop_event):
    """The worker's own answer to the handshake once it listens; None if it exits first
    (or the job is stopped)."""
    import psutil

    from k3tui.backends.llama.rpc import probe
    from k3tui.backends.llama.server import listens

    try:
        ps = psutil.Process(proc.pid)
    except psutil.Error:
        return None
    while proc.poll() is None and not (stop_event and stop_event.is_set()):
        if listens(ps, port):
            status = probe(f"{host}:{port}")
            if status.ok:
                return status
        time.sleep(0.1)
    return None


def _ready_line(host: str, port: int, status, limit, pid: int, cache: Path,
                notes: list[str]) -> str:
    import shutil

    from k3tui.backends.llama.rpc import version_text
    from k3tui.backends.llama.server import verify_limit
    from k3tui.units import disk_size

    if limit.method == "none":
        confined = limit.detail
    elif verify_limit(pid, limit):
        confined = limit.describe()
    else:
        confined = ("WARNING: the memory limit could not be read back from the worker's "
                    "cgroup; treat it as unconfined")
    try:
        free = f", {disk_size(shutil.disk_usage(cache).free)} free"
    except OSError:
        free = ""
    return "\n".join([f"{host}:{port} (RPC protocol {version_text(status.version)}, "
                      f"{status.memory()})", confined, f"local cache {cache}{free}", *notes])


def _ended(reporter, proc: subprocess.Popen, limit, *, stopped: bool) -> int:
    from k3tui.backends.running import describe_exit
    from k3tui.probe.limits import oom_kill_seen

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    code = proc.returncode
    oom = oom_kill_seen(proc.pid, limit.cgroup_dir) if code == -signal.SIGKILL else None
    limit.cleanup()
    if stopped:
        _finish(reporter, "cancelled", "stopped")
        return 0
    why = describe_exit(code, memory_limit_bytes=limit.limit_bytes, oom_killed=oom)
    return _failed(reporter, f"ggml-rpc-server {why}; start the worker again with "
                             "`k3tui worker`", 1)


def _failed(reporter, message: str, code: int) -> int:
    if reporter is None:
        raise K3Error(message[0].upper() + message[1:], "", code)
    _finish(reporter, "failed", message)
    return code


def _finish(reporter, status: str, message: str) -> None:
    """The job's end, in its log and its state (in --foreground, the terminal's line)."""
    if reporter is None:
        print(f"worker {message}.", flush=True)
        return
    print(time.strftime("%H:%M:%S"), f"{status}: {message}", flush=True)
    reporter.finish(status, message)


def _sayer(reporter):
    def say(line: str) -> None:
        print(time.strftime("%H:%M:%S"), line, flush=True)
        if reporter is not None:
            reporter.update(message=line[:200])
    return say


def _die_with_parent() -> None:
    """In the child, before exec: the kernel kills the worker when its supervisor dies, so
    a killed job never leaves a worker listening that nothing watches."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
