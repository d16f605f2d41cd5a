"""The one reader of memory facts: /proc/meminfo and the cgroup (v1 / v2 / hybrid) limits.

The engine's planner, k3tui's probe and its llama-server limit all read through here, so they
agree. Dependency-free (the engine may not import k3tui). The cgroup version comes from
/proc/self/mountinfo, not from file names under /sys/fs/cgroup; limits are the minimum over
the cgroup and its ancestors up to the mount root (a limit set on a parent binds too).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from collections.abc import Iterable, Iterator
from pathlib import Path


@dataclass
class Roots:
    """Where /proc and /sys are: the real ones, or captured trees in tests."""
    proc: Path = Path("/proc")
    sys: Path = Path("/sys")

    def host(self, path: str) -> Path:
        """Map an absolute host path (as written in mountinfo) into these trees."""
        for prefix, root in (("/proc", self.proc), ("/sys", self.sys)):
            if path == prefix or path.startswith(prefix + "/"):
                return root / path[len(prefix):].lstrip("/")
        return Path(path)

    def read(self, path: Path) -> str | None:
        """Text of a pseudo file, or None when it is missing or unreadable (EOPNOTSUPP etc.)."""
        try:
            return path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None


def parse_int(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


NO_LIMIT = 2**62  # cgroup values at or above this mean "unlimited" (v1 PAGE_COUNTER_MAX etc.)


def limit_or_none(text: str | None) -> int | None:
    """A cgroup limit file ("max", bytes, or a huge v1 number) as bytes, None = no limit."""
    if text is None or text.strip() in ("", "max", "-1"):
        return None
    value = parse_int(text)
    if value is None or value >= NO_LIMIT or value < 0:
        return None
    return value


def parse_meminfo(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            mult = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
            out[key.strip()] = int(parts[0]) * mult
    return out


@dataclass
class Mount:
    mount_id: int
    major_minor: str
    root: str
    mount_point: str
    options: list[str]
    fstype: str
    source: str
    super_options: list[str]


def _unescape(s: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal.
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n") \
        .replace("\\134", "\\")


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        a = left.split()
        b = right.split()
        if len(a) < 6 or len(b) < 2:
            continue
        mounts.append(Mount(mount_id=int(a[0]), major_minor=a[2], root=_unescape(a[3]),
                            mount_point=_unescape(a[4]), options=a[5].split(","),
                            fstype=b[0], source=_unescape(b[1]),
                            super_options=b[2].split(",") if len(b) > 2 else []))
    return mounts


def read_mounts(env: Roots) -> list[Mount]:
    return parse_mountinfo(env.read(env.proc / "self" / "mountinfo") or "")


@dataclass
class CgroupInfo:
    version: str = "none"  # "v1" | "v2" | "hybrid" | "none"
    memory_dir: str = ""  # host path of this process's memory cgroup
    memory_limit_bytes: int | None = None
    memory_high_bytes: int | None = None
    memory_current_bytes: int | None = None
    swap_limit_bytes: int | None = None
    cpu_quota_cores: float | None = None
    v2_controllers: list[str] = field(default_factory=list)


def _own_paths(env: Roots) -> dict[str, str]:
    """controller -> path from /proc/self/cgroup; "" key is the v2 unified path."""
    out: dict[str, str] = {}
    for line in (env.read(env.proc / "self" / "cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        if ctrls == "":
            out[""] = path
        for c in ctrls.split(","):
            if c:
                out[c] = path
    return out


def _cgroup_dir(env: Roots, mount: Mount, path: str) -> Path:
    """The directory of `path` under `mount`; the mount root when the path is not visible
    (inside a cgroup namespace it may not be)."""
    rel = path
    if mount.root not in ("/", "") and rel.startswith(mount.root):
        rel = rel[len(mount.root):]
    base = env.host(mount.mount_point)
    candidate = base / rel.lstrip("/")
    return candidate if candidate.is_dir() else base


def _walk_up(start: Path, stop: Path) -> Iterator[Path]:
    cur = start
    while True:
        yield cur
        if cur == stop or stop not in cur.parents:
            return
        cur = cur.parent


def _min_limit(dirs: Iterable[Path], name: str, env: Roots) -> int | None:
    best = None
    for d in dirs:
        value = limit_or_none(env.read(d / name))
        if value is not None:
            best = value if best is None else min(best, value)
    return best


def read_cgroup(env: Roots, mounts: list[Mount] | None = None) -> CgroupInfo:
    mounts = read_mounts(env) if mounts is None else mounts
    own = _own_paths(env)
    v2 = next((m for m in mounts if m.fstype == "cgroup2"), None)
    v1 = {opt: m for m in mounts if m.fstype == "cgroup" for opt in m.super_options + m.options}
    info = CgroupInfo()
    if v2 and v1:
        info.version = "hybrid"
    elif v2:
        info.version = "v2"
    elif v1:
        info.version = "v1"
    else:
        return info

    v2_dir = None
    if v2 is not None:
        v2_dir = _cgroup_dir(env, v2, own.get("", "/"))
        info.v2_controllers = (env.read(env.host(v2.mount_point) / "cgroup.controllers")
                               or "").split()

    if "memory" in v1:
        m = v1["memory"]
        d = _cgroup_dir(env, m, own.get("memory", "/"))
        chain = list(_walk_up(d, env.host(m.mount_point)))
        info.memory_dir = str(d)
        info.memory_limit_bytes = _min_limit(chain, "memory.limit_in_bytes", env)
        info.memory_current_bytes = parse_int(env.read(d / "memory.usage_in_bytes"))
        memsw = _min_limit(chain, "memory.memsw.limit_in_bytes", env)
        if memsw is not None and info.memory_limit_bytes is not None:
            info.swap_limit_bytes = max(0, memsw - info.memory_limit_bytes)
    elif v2 is not None and v2_dir is not None and "memory" in info.v2_controllers:
        chain = list(_walk_up(v2_dir, env.host(v2.mount_point)))
        info.memory_dir = str(v2_dir)
        info.memory_limit_bytes = _min_limit(chain, "memory.max", env)
        info.memory_high_bytes = _min_limit(chain, "memory.high", env)
        info.memory_current_bytes = parse_int(env.read(v2_dir / "memory.current"))
        info.swap_limit_bytes = _min_limit(chain, "memory.swap.max", env)

    if "cpu" in v1:
        m = v1["cpu"]
        d = _cgroup_dir(env, m, own.get("cpu", "/"))
        quotas = []
        for cur in _walk_up(d, env.host(m.mount_point)):
            q = parse_int(env.read(cur / "cpu.cfs_quota_us"))
            p = parse_int(env.read(cur / "cpu.cfs_period_us"))
            if q and q > 0 and p:
                quotas.append(q / p)
        info.cpu_quota_cores = min(quotas) if quotas else None
    elif v2 is not None and v2_dir is not None:
        quotas = []
        for cur in _walk_up(v2_dir, env.host(v2.mount_point)):
            text = env.read(cur / "cpu.max")
            if text:
                quota, _, period = text.strip().partition(" ")
                if quota != "max" and parse_int(quota) and parse_int(period):
                    quotas.append(int(quota) / int(period))
        info.cpu_quota_cores = min(quotas) if quotas else None
    return info


def memory_pressure_file(env: Roots, info: CgroupInfo) -> Path | None:
    """The cgroup's own memory.pressure (v2 only)."""
    if info.version == "v2" and info.memory_dir:
        p = Path(info.memory_dir) / "memory.pressure"
        return p if p.exists() else None
    return None


@dataclass(frozen=True)
class MemoryFacts:
    mem_total: int
    mem_available: int
    cgroup_limit: int | None
    cgroup_usage: int | None

    @property
    def available(self) -> int:
        """MemAvailable, or what the cgroup still allows if that is less."""
        avail = self.mem_available
        if self.cgroup_limit is not None:
            avail = min(avail, self.cgroup_limit - (self.cgroup_usage or 0))
        return max(0, avail)


def read_memory_facts(env: Roots | None = None) -> MemoryFacts:
    env = env or Roots()
    mi = parse_meminfo(env.read(env.proc / "meminfo") or "")
    total = mi.get("MemTotal", 0)
    cg = read_cgroup(env)
    return MemoryFacts(total, mi.get("MemAvailable", mi.get("MemFree", total)),
                       cg.memory_limit_bytes, cg.memory_current_bytes)


def current_rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def peak_rss() -> int:
    """The kernel's high-water mark of this process's own memory (VmHWM), never below the
    current RSS (the two counters are synchronised lazily, so the mark can trail the current
    figure by a few pages). Not ru_maxrss: Linux carries the peak of the process that spawned
    this one into it across exec, so an engine started by a 700 MB parent read 700 MB."""
    try:
        with open("/proc/self/status") as f:
            hwm = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")),
                       0)
    except OSError:
        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(hwm, current_rss())
