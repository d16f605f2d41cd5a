"""llama-server as a supervised backend: the busy-GPU guard, the memory limit it runs under,
start, readiness and the story of its exit."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from k3tui.backends.llama.binary import (BinaryInfo, binary_env, find_binary, inspect_binary,
                                        install_hint)
from k3tui.backends.llama.command import BASE_ARGS, LlamaCommand, build_command, write_key_file
from k3tui.backends.llama.gguf import check_shards
from k3tui.backends.running import LoadProgress, ProgressCallback, RunningBackend
from k3tui.errors import K3Error
from k3tui.paths import get_paths, private_open
from k3tui.probe.limits import (ISOLATION_NEXT, check_systemd_scope, own_cgroup_v2_dir,
                                pid_reads_back, reads_back, systemd_prefix)
from k3tui.units import gib
from k3vocab import DEFAULT_CONTEXT

if TYPE_CHECKING:
    import psutil

    from k3tui.probe.report import MachineReport



# --- the busy-GPU guard ----------------------------------------------------------------------


def gpu_refusal(report: MachineReport | None) -> tuple[str, str] | None:
    """(why, next step) when llama-server must not start because other processes hold GPU
    memory on a unified-memory machine; None when nothing holds it. The one rule that
    `k3tui serve`, the chat, `k3tui doctor` and `k3tui plan` state."""
    gpu = getattr(report, "gpu", None)
    if gpu is None or not getattr(gpu, "unified_memory", False):
        return None
    holders = list(getattr(gpu, "apps", []))
    if not holders:
        return None
    listing = ", ".join(f"pid {a.pid} {a.name} {gib(a.used_bytes or 0)}" for a in holders)
    return (f"other processes hold GPU memory on this unified-memory machine ({listing}); "
            "with the model's page cache that can exhaust memory and freeze the machine",
            "stop them first (e.g. `sudo systemctl stop ollama`, or `kill <pid>`), or start "
            "anyway with `k3tui serve --force` (then `k3tui chat --url URL`)")


def gpu_guard(report: MachineReport | None, *, force: bool = False) -> str | None:
    """Refuse to start on a unified-memory machine whose GPU memory other processes hold.

    Returns a warning when `force` overrides a refusal; raises K3Error otherwise."""
    refusal = gpu_refusal(report)
    if refusal is None:
        return None
    why, step = refusal
    if force:
        return (f"--force: starting although {why.split('; ')[0]}; on unified memory this "
                "can freeze the whole machine")
    raise K3Error(why[0].upper() + why[1:] + ".", step, exit_code=2)


# --- the memory limit ------------------------------------------------------------------------

Runner = Callable[[list[str]], subprocess.CompletedProcess]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=15,
                          stdin=subprocess.DEVNULL)


@dataclass
class MemoryLimit:
    """How the server's memory is confined: a wrapper argv prefix, or nothing and a warning."""

    method: str  # "systemd-run" | "cgroup" | "none"
    limit_bytes: int | None
    prefix: list[str] = field(default_factory=list)
    cgroup_dir: Path | None = None
    detail: str = ""

    def describe(self) -> str:
        if self.method == "none":
            return self.detail
        how = "systemd-run --user scope" if self.method == "systemd-run" else \
            f"cgroup v2 subtree {self.cgroup_dir}"
        checked = self.detail or "read back: applies"
        return (f"memory limit {gib(self.limit_bytes or 0)} with swap 0 via {how} ({checked}); "
                "no restart after an OOM kill")

    def wrap(self, argv: list[str]) -> list[str]:
        return self.prefix + argv

    def cleanup(self) -> None:
        if self.cgroup_dir is not None:
            with contextlib.suppress(OSError):
                self.cgroup_dir.rmdir()


def assumed_limit(report: MachineReport | None, limit_bytes: int | None) -> MemoryLimit:
    """The limit a machine *profile* says it can apply (shown by `--machine`; the real
    launch on that machine checks it by reading it back)."""
    method = getattr(getattr(report, "isolation", None), "method", "none")
    if limit_bytes and method == "systemd-run":
        return MemoryLimit("systemd-run", limit_bytes, systemd_prefix(limit_bytes),
                           detail="assumed from the machine profile; verified at launch there")
    return MemoryLimit("none", limit_bytes, detail=(
        "the machine profile has no way to apply a memory limit: k3tui would warn and watch "
        "the server's memory" if limit_bytes else "no memory limit requested"))


def choose_memory_limit(limit_bytes: int | None, *, runner: Runner = _run,
                        cgroup_dir: Path | None = None, name: str = "",
                        what: str = "llama-server") -> MemoryLimit:
    """systemd-run user scope if it really applies a limit, else a writable cgroup v2
    subtree, else none with a plain warning. Each is verified by reading the limit back."""
    if not limit_bytes:
        return MemoryLimit("none", None, detail="no memory limit requested")
    reasons: list[str] = []
    if shutil.which("systemd-run") or runner is not _run:
        applies, why = check_systemd_scope(runner, limit_bytes)
        if applies:
            return MemoryLimit("systemd-run", limit_bytes, systemd_prefix(limit_bytes))
        reasons.append(why)
    else:
        reasons.append("systemd-run is not installed")
    base = cgroup_dir if cgroup_dir is not None else own_cgroup_v2_dir()
    if base is not None:
        child = base / (name or f"k3tui-llama-server-{os.getpid()}")
        try:
            child.mkdir(exist_ok=True)
            if not (child / "memory.max").exists():
                with contextlib.suppress(OSError):
                    child.rmdir()
                raise OSError("the memory controller is not enabled for its children")
            (child / "memory.max").write_text(str(limit_bytes))
            if (child / "memory.swap.max").exists():
                (child / "memory.swap.max").write_text("0")
            if reads_back((child / "memory.max").read_text(), limit_bytes):
                procs = shlex.quote(str(child / "cgroup.procs"))
                return MemoryLimit("cgroup", limit_bytes,
                                   ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh"], child)
            raise OSError("memory.max does not read back the limit")
        except OSError as exc:
            reasons.append(f"cgroup v2 subtree {child}: {exc.strerror or exc}")
    else:
        reasons.append("no cgroup v2 hierarchy for this process")
    return MemoryLimit("none", limit_bytes, detail=(
        f"WARNING: could not confine {what} to {gib(limit_bytes)} ("
        + "; ".join(reasons) + "). Risk: if it and the page cache outgrow memory, the kernel "
        "kills it, or on unified memory (DGX Spark) the whole machine can freeze. Keep other "
        "GPU users stopped; k3tui will not restart it after an OOM kill."))


def verify_limit(pid: int, limit: MemoryLimit, *, timeout_s: float = 2.0) -> bool:
    """Read the limit back from the running server's own cgroup."""
    return (limit.method != "none" and limit.limit_bytes is not None
            and pid_reads_back(pid, limit.limit_bytes, timeout_s=timeout_s))


# --- supervision -----------------------------------------------------------------------------


@dataclass
class Prepared:
    """Everything decided before launch, shown to the user first."""

    info: BinaryInfo
    command: LlamaCommand
    limit: MemoryLimit
    notes: list[str]
    pool: list[str] = field(default_factory=list)  # the workers and their share of the layers

    def warnings(self) -> list[str]:
        """What the user must not miss: no memory limit, a forced busy GPU, a missing flag."""
        unconfined = [self.limit.detail] if self.limit.method == "none" and \
            self.limit.limit_bytes else []
        return unconfined + self.notes + self.command.warnings

    def describe(self, *, warnings: bool = True) -> str:
        """The command, why each flag, the memory limit; with `warnings=False` the
        warnings are left out (a screen that shows `warnings()` on its own)."""
        shown = self.command.shown()
        if self.limit.prefix:
            shown = shlex.join(self.limit.prefix) + " " + shown
        lines = [f"llama-server {self.info.version} at {self.info.path}", f"command: {shown}",
                 "why:"]
        width = max((len(f) for f, _ in self.command.reasons), default=0)
        lines += [f"  {flag:<{width}}  {reason}" for flag, reason in self.command.reasons]
        if self.limit.method != "none" or not self.limit.limit_bytes:
            lines.append(self.limit.describe())
        lines += self.pool
        if warnings:
            lines += self.warnings()
        return "\n".join(lines)


def prepare(model: Path, *, binary: str = "", plan_args: Sequence[str] = (),
            memory_limit_bytes: int | None = None, ctx_size: int | None = None,
            reasoning_budget: int | None = None, n_gpu_layers: int | None = None,
            threads: int | None = None, extra_args: Sequence[str] = (),
            host: str = "127.0.0.1", port: int = 0, alias: str = "kimi-k3",
            api_key: str | None = None, plan_reasons: dict[str, str] | None = None,
            report: MachineReport | None = None, force: bool = False, notes: Sequence[str] = (),
            help_text: str | None = None, version_text: str | None = None,
            runner: Runner = _run, cgroup_dir: Path | None = None,
            limit: MemoryLimit | None = None, rpc: Sequence[str] = (),
            probe_pool: bool = True) -> Prepared:
    """Find and inspect the binary, check the shards and the GPU, build the command, pick
    the memory limit; with `rpc` workers, check the pool (`probe_pool`: ask each worker;
    off for a machine profile). Raises K3Error before anything starts; `notes` are warnings
    decided before (e.g. a refusal that --force overrode)."""
    path = find_binary(binary)
    info = inspect_binary(path, help_text=help_text, version_text=version_text)
    shards = check_shards(model)
    notes = list(notes)
    unified = bool(getattr(getattr(report, "gpu", None), "unified_memory", False))
    warning = gpu_guard(report, force=force) if report is not None else None
    if warning:
        notes.append(warning)
    pool = _check_pool(rpc, binary, shards, ctx_size, report, force, notes) \
        if rpc and probe_pool else []
    overrides: list[str] = []
    defaults = [("--ctx-size", ctx_size), ("--reasoning-budget", reasoning_budget),
                ("--n-gpu-layers", n_gpu_layers), ("--threads", threads or None)]
    for flag, val in defaults:
        if val is not None:
            overrides += [flag, str(val)]
    cmd = build_command(info, shards, plan_args=BASE_ARGS + list(plan_args), overrides=overrides,
                        extra_args=extra_args, host=host, port=port, alias=alias,
                        api_key=api_key, plan_reasons=plan_reasons, unified_memory=unified,
                        rpc=rpc)
    tag = hashlib.sha1(str(shards[0]).encode()).hexdigest()[:8]
    if limit is None:
        limit = choose_memory_limit(memory_limit_bytes, runner=runner, cgroup_dir=cgroup_dir,
                                    name=f"k3tui-llama-server-{os.getpid()}-{tag}")
    warning = unconfined_guard(limit, unified, force=force)
    if warning:
        notes.append(warning)
    return Prepared(info, cmd, limit, notes, pool)


def _check_pool(endpoints: Sequence[str], binary: str, shards: list[Path],
                ctx_size: int | None, report: MachineReport | None, force: bool,
                notes: list[str]) -> list[str]:
    """The pool checked before the head starts (see `rpc.check_pool`); its lines for the
    description. The head's own protocol comes from the RPC server of its build."""
    from k3tui.backends.llama import rpc
    from k3tui.backends.llama.gguf import read_gguf_header

    try:
        protocol = rpc.server_protocol(rpc.find_rpc_server(binary))
    except K3Error:
        protocol = None
    if protocol is None:
        notes.append("the head's RPC protocol is unknown (no ggml-rpc-server of its build "
                     "prints one): only llama-server's own handshake checks the workers")
    head_free = None
    if report is not None and report.gpu.present:
        head_free = report.memory.available_bytes if report.gpu.unified_memory else \
            report.gpu.discrete_memory_bytes
    n_layers = None
    with contextlib.suppress(OSError, ValueError, EOFError, KeyError, UnicodeError):
        n_layers = read_gguf_header(shards[0]).block_count
    checked = rpc.check_pool(endpoints, head_protocol=protocol,
                             model_bytes=sum(p.stat().st_size for p in shards),
                             ctx=ctx_size or DEFAULT_CONTEXT, n_layers=n_layers,
                             head_free_bytes=head_free, force=force)
    notes += checked.notes
    return checked.lines


def unconfined_guard(limit: MemoryLimit, unified: bool, *, force: bool,
                     what: str = "llama-server", command: str = "k3tui serve") -> str | None:
    """Refuse to start `what` unconfined on unified memory (the DGX Spark lockup: its page
    cache and the GPU share one memory); with `force`, the warning instead."""
    if not (unified and limit.method == "none" and limit.limit_bytes):
        return None

    if not force:
        raise K3Error(f"{what} cannot be confined to {gib(limit.limit_bytes)} "
                      "on this unified-memory machine, and without a limit its page cache "
                      "can starve the GPU and freeze the machine.\n" + limit.detail,
                      f"{ISOLATION_NEXT}; or start anyway with `{command} --force` "
                      "(risk: a frozen machine)", exit_code=2)
    return (f"--force: starting {what} unconfined on unified memory (risk: the page cache "
            "can starve the GPU and freeze the machine)")


def start(prepared: Prepared, *, on_progress: ProgressCallback | None = None,
          load_timeout_s: float = 4 * 3600.0, log_path: Path | None = None) -> RunningBackend:
    """Launch under the chosen limit, report load progress until /health is 200."""
    cmd = prepared.command
    logs = get_paths().logs_dir
    log_path = log_path or logs / f"llama-server-{time.strftime('%Y%m%d-%H%M%S')}-{cmd.port}.log"
    argv = prepared.limit.wrap(cmd.argv)
    env = binary_env(prepared.info.path) | cmd.env
    if cmd.rpc:  # a lost worker aborts the head: at once, its log ending on why (not gdb's
        env["GGML_NO_BACKTRACE"] = "1"  # attach and 40 frames, ~1-3 s later)

    def cleanup() -> None:
        prepared.limit.cleanup()
        if cmd.key_file is not None:
            with contextlib.suppress(OSError):
                cmd.key_file.unlink()

    if cmd.key_file is not None:
        write_key_file(cmd.key_file, cmd.api_key or "")
    with private_open(log_path) as log:
        log.write(f"# k3tui: {prepared.limit.describe()}\n# {cmd.shown()}\n".encode())
        log.flush()
        # Same process group as k3tui: a closed terminal (SSH drop) hangs the server up too,
        # instead of leaving an orphan holding tens of GB.
        try:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env)
        except OSError as exc:
            cleanup()
            raise K3Error(f"Could not start llama-server: {exc}.", install_hint()) from None
    scheme_host = cmd.host if cmd.host not in ("0.0.0.0", "::") else "127.0.0.1"
    if ":" in scheme_host:
        scheme_host = f"[{scheme_host}]"
    backend = RunningBackend(
        kind="llama-server", base_url=f"http://{scheme_host}:{cmd.port}", api_key=cmd.api_key,
        model=cmd.alias, pid=proc.pid, log_path=log_path, command=argv,
        notes=list(prepared.notes) + list(cmd.warnings), process=proc,
        cgroup_dir=prepared.limit.cgroup_dir, rpc_workers=list(cmd.rpc),
        memory_limit_bytes=prepared.limit.limit_bytes if prepared.limit.method != "none" else None)
    backend.on_stop.append(cleanup)
    if prepared.limit.method == "none":
        if prepared.limit.limit_bytes:
            backend.notes.insert(0, prepared.limit.detail)
    elif not verify_limit(proc.pid, prepared.limit):
        backend.notes.insert(0, "WARNING: the memory limit could not be read back from the "
                                "server's cgroup; treat the server as unconfined")
    try:
        wait_ready(backend, total_bytes=cmd.model_bytes, on_progress=on_progress,
                   timeout_s=load_timeout_s, listen_port=cmd.port)
        _check_pool_loaded(backend)
    except BaseException:
        backend.stop()
        raise
    return backend


def _check_pool_loaded(backend: RunningBackend) -> None:
    """A worker lost between the check and the load: this llama-server says "Failed to
    connect" and puts that worker's layers on the others, so the head is stopped instead."""
    from k3tui.backends.llama.rpc import dropped, log_start

    lost = dropped(log_start(backend.log_path), backend.rpc_workers) \
        if backend.rpc_workers else []
    if lost:
        raise K3Error(f"llama-server could not connect to worker {', '.join(lost)} while "
                      "loading and went on without it, so k3tui stopped it.",
                      "check the workers (`k3tui doctor`), then start the head again")


def wait_ready(backend: RunningBackend, *, total_bytes: int | None = None,
               on_progress: ProgressCallback | None = None, timeout_s: float = 3600.0,
               interval_s: float = 0.25, ready_line: str | None = None,
               url_from_line: bool = False, listen_port: int | None = None) -> None:
    """Poll /health until 200, reporting elapsed time, read bytes and RSS; a process that
    exits first becomes a K3Error carrying its log's reason and last lines. With
    `url_from_line` the server chose its own port: the base URL is the one its `ready_line`
    names. With `listen_port`, a 200 counts only once the started process (or a descendant)
    listens on that port: another server already there must not pass for ours."""
    import httpx  # here, so `k3tui serve --dry-run` and the doctor stay quick
    import psutil

    t0 = time.monotonic()
    ps = None
    with contextlib.suppress(psutil.Error):
        ps = psutil.Process(backend.pid)
    last_report = -1.0
    with httpx.Client(timeout=2.0) as http:
        while True:
            failed = backend.failure()
            if failed is not None:
                why = backend.exit_reason()
                reason = log_reason(failed.log_tail)
                raise K3Error(f"{backend.kind} {why} while loading"
                              + (f": {reason}" if reason else "") + ".\n"
                              f"last log lines ({backend.log_path}):\n{failed.log_tail}",
                              hint_from_log(failed.log_tail))
            tail = backend.log_tail(200) if ready_line else ""
            ready = ready_line is None or ready_line in tail
            if ready and url_from_line and ready_line:
                backend.base_url = _url_after(tail, ready_line, backend.base_url)
            message = ""
            if ready:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    resp = http.get(backend.base_url + "/health")
                    if resp.status_code == 200:
                        if listen_port is None or listens(ps, listen_port):
                            return
                        message = (f"port {listen_port} answers, but not from the server k3tui "
                                   "started (waiting for it)")
                    else:
                        message = _load_phase(resp.json())
            elapsed = time.monotonic() - t0
            if elapsed > timeout_s:
                raise K3Error(f"{backend.kind} did not become ready in {timeout_s:.0f} s.",
                              f"read its log ({backend.log_path})")
            if on_progress is not None and elapsed - last_report >= 0.5:
                last_report = elapsed
                read = rss = None
                if ps is not None:
                    read, rss = _tree_io(ps)
                on_progress(LoadProgress(elapsed, read, rss, total_bytes, message))
            time.sleep(interval_s if elapsed > 2.0 else 0.05)  # tiny models: ready at once


def listens(ps: psutil.Process, port: int) -> bool:
    """Whether `ps` or one of its descendants holds a listening socket on `port`."""
    import psutil

    if ps is None:
        return False
    try:
        procs = [ps, *ps.children(recursive=True)]
    except psutil.Error:
        return False
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in p.net_connections(kind="inet")):
                return True
    return False


_REASON = re.compile(r"(?:^|\s)E\s|error|failed|couldn't|cannot|unable", re.IGNORECASE)
_LOG_PREFIX = re.compile(r"^[\d.]+\s+[EWIDT]\s+\S+\s+")  # "0.00.002.518 E srv  "


def log_reason(tail: str) -> str:
    """The first line of a server log that says what went wrong (its timestamp and level
    removed), e.g. "start: couldn't bind HTTP server socket, …, port: 8080"."""
    for line in tail.splitlines():
        if not line.startswith("#") and _REASON.search(line):
            return _LOG_PREFIX.sub("", line.strip()).strip()[:200]
    return ""


def _url_after(tail: str, marker: str, default: str) -> str:
    """The URL in the last line holding `marker` ("listening on http://127.0.0.1:40123");
    a wildcard bind host is reached through loopback."""
    line = next((ln for ln in reversed(tail.splitlines()) if marker in ln), "")
    url = line.split(marker, 1)[-1].strip().split()[0] if marker in line else ""
    if not url.startswith("http"):
        return default
    for wildcard in ("//0.0.0.0:", "//[::]:"):
        url = url.replace(wildcard, "//127.0.0.1:")
    return url


def _tree_io(ps: psutil.Process) -> tuple[int | None, int | None]:
    """Read bytes and RSS of the server and anything a wrapper forked for it."""
    import psutil

    read = rss = None
    try:
        procs = [ps, *ps.children(recursive=True)]
    except psutil.Error:
        return None, None
    for p in procs:
        with contextlib.suppress(psutil.Error, AttributeError):
            read = (read or 0) + p.io_counters().read_bytes
        with contextlib.suppress(psutil.Error):
            rss = (rss or 0) + p.memory_info().rss
    return read, rss


def hint_from_log(tail: str) -> str:
    """The next step for the failures a log shows most often."""
    low = tail.lower()
    if "bind" in low and ("socket" in low or "address already in use" in low):
        return "the port is taken: pass another --port (or 0 for a free one)"
    if "invalid argument" in low or "unknown argument" in low:
        return "a flag is not accepted by this llama-server: check `extra_args` in [llama_server]"
    if "failed to load model" in low or "error loading model" in low:
        return "the model file could not be loaded: `k3tui doctor` checks it; re-download if needed"
    if "out of memory" in low or "cannot allocate" in low or "failed to allocate" in low:
        return "not enough memory: lower `ctx_size` in [llama_server] or stop other programs"
    return "read the log above; fix the cause and start again"


def _load_phase(body: object) -> str:
    """The engine's /health 503 carries `progress` (phase, layers bound); llama-server not."""
    prog = body.get("progress") if isinstance(body, dict) else None
    if not isinstance(prog, dict):
        return ""
    text = f"now: {prog['phase']}" if prog.get("phase") else ""  # "model" alone reads oddly
    if prog.get("n_layers"):
        text += f" (layers {prog.get('layers_bound') or 0}/{prog['n_layers']})"
    return text


def exit_story(backend: RunningBackend) -> str:
    """One line for a server that ended (used by `k3tui serve`)."""
    return backend.exit_reason()
