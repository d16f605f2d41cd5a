"""Storage behind a target directory: mount, filesystem class, disk kind, free space, O_DIRECT.

The filesystem class decides by fstype (an O_DIRECT failure cannot detect tmpfs any more:
tmpfs accepts it since Linux 6.6). `rotational` alone cannot tell an HDD from a virtio disk,
so the sysfs device path is checked too. `--measure` reads 1 GiB with O_DIRECT and checks the
disk counters moved by as much, so a page-cache hit cannot pose as disk speed.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.weights.sysmem import Mount, read_mounts
from k3tui.probe.env import ProbeEnv
from k3tui.units import MB, GiB, MiB

NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "virtiofs", "ceph", "glusterfs",
              "lustre", "gpfs", "beegfs", "afs", "sshfs"}
RAM_FS = {"tmpfs", "ramfs"}
PSEUDO_FS = {"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
             "securityfs", "configfs", "pstore", "bpf", "mqueue", "hugetlbfs", "autofs",
             "efivarfs", "fusectl"}


@dataclass
class StorageInfo:
    path: str = ""
    probed_path: str = ""  # nearest existing ancestor actually examined
    mount_point: str = ""
    fstype: str = ""
    source: str = ""
    fs_class: str = "unknown"  # local | network | fuse | tmpfs | overlay | pseudo | unknown
    device: str = ""  # whole-disk name, e.g. nvme0n1, vda
    disk_kind: str = "unknown"  # nvme | ssd | hdd | virtual | unknown
    rotational: bool | None = None
    free_bytes: int = 0
    total_bytes: int = 0
    o_direct: bool | None = None  # None = could not test (not writable)
    read_mb_s_qd1: float | None = None
    read_mb_s_qd8: float | None = None
    measure_note: str = ""
    not_a_dir: bool = False  # the path (or one of its parents) is a file


def fs_class(fstype: str) -> str:
    if fstype in NETWORK_FS:
        return "network"
    if fstype.startswith("fuse"):
        return "fuse"
    if fstype in RAM_FS:
        return "tmpfs"
    if fstype in PSEUDO_FS:
        return "pseudo"
    if fstype == "overlay":
        return "overlay"
    return "local" if fstype else "unknown"


def mount_for(path: str, mounts: list[Mount]) -> Mount | None:
    """Longest matching mount point; of equal ones the last mounted wins (it shadows)."""
    best = None
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        if path == mp or path.startswith(mp.rstrip("/") + "/") or mp == "/":
            if best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/"):
                best = m
    return best


def _existing(path: Path) -> Path:
    """Nearest ancestor that exists and can be looked at (EACCES counts as not there)."""
    p = path
    while p != p.parent:
        try:
            if p.exists():
                return p
        except OSError:
            pass
        p = p.parent
    return p


def _resolve(path: Path) -> str:
    """Symlinks resolved where allowed; the plain absolute path where not (EACCES)."""
    try:
        return str(path.resolve())
    except OSError:
        return os.path.abspath(path)


def _disk_dir(env: ProbeEnv, mount: Mount) -> Path | None:
    """sysfs directory of the whole disk behind a mount, following partitions and dm/md."""
    cand = env.sys / "dev" / "block" / mount.major_minor
    if not cand.exists() and mount.source.startswith("/dev/"):
        # btrfs shows an anonymous 0:N device; fall back to the mount source's name.
        cand = env.sys / "class" / "block" / os.path.basename(mount.source)
    if not cand.exists():
        return None
    d = cand.resolve()
    for _ in range(4):
        slaves = sorted((d / "slaves").glob("*")) if (d / "slaves").is_dir() else []
        if slaves:  # dm-* / md*: look at the first underlying device
            d = slaves[0].resolve()
            continue
        break
    if (d / "partition").exists():
        d = d.parent
    return d


def _classify_disk(d: Path, env: ProbeEnv) -> tuple[str, bool | None]:
    name = d.name
    rot = env.read(d / "queue" / "rotational")
    rotational = None if rot is None else rot.strip() == "1"
    path = str(d)
    if name.startswith("nvme"):
        return "nvme", rotational
    if "/virtio" in path or name.startswith(("vd", "xvd")) or "/devices/virtual/" in path:
        return "virtual", rotational
    if rotational is False:
        return "ssd", rotational
    if rotational is True:
        return "hdd", rotational
    return "unknown", rotational


def check_o_direct(directory: Path) -> bool | None:
    """Aligned O_DIRECT read of a fresh small file; None when we cannot write there."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd, name = tempfile.mkstemp(prefix=".k3tui-odirect-", dir=directory)
    except OSError:
        return None
    try:
        os.write(fd, b"\0" * 4096)
        os.fsync(fd)
        os.close(fd)
        try:
            dfd = os.open(name, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return False
        try:
            buf = mmap.mmap(-1, 4096)
            return os.preadv(dfd, [buf], 0) == 4096
        except OSError:
            return False
        finally:
            os.close(dfd)
    finally:
        try:
            os.unlink(name)
        except OSError:
            pass


def probe_storage(env: ProbeEnv, target: str | Path, mounts: list[Mount] | None = None,
                  test_o_direct: bool = True) -> StorageInfo:
    target = Path(target).expanduser()
    target = target if target.is_absolute() else Path.cwd() / target
    existing = _existing(target)
    real = _resolve(existing)
    info = StorageInfo(path=str(target), probed_path=real, not_a_dir=not existing.is_dir())
    mounts = read_mounts(env) if mounts is None else mounts
    # the mount the target will live on (its missing tail is created on that filesystem)
    m = mount_for(_resolve(target), mounts)
    if m is not None:
        info.mount_point, info.fstype, info.source = m.mount_point, m.fstype, m.source
        info.fs_class = fs_class(m.fstype)
        if info.fs_class in ("local", "overlay", "unknown"):
            d = _disk_dir(env, m)
            if d is not None:
                info.device = d.name
                info.disk_kind, info.rotational = _classify_disk(d, env)
    try:
        st = env.statvfs(real)
        info.free_bytes = st.f_bavail * st.f_frsize
        info.total_bytes = st.f_blocks * st.f_frsize
    except OSError:
        pass
    if test_o_direct and os.access(existing, os.X_OK) and existing.is_dir():
        info.o_direct = check_o_direct(existing)
    return info


# --- measuring (only with --measure) ---------------------------------------------------------

BLOCK = 4 * MiB


def _disk_read_bytes(env: ProbeEnv, device: str) -> int | None:
    for line in (env.read(env.proc / "diskstats") or "").splitlines():
        f = line.split()
        if len(f) > 5 and f[2] == device:
            return int(f[5]) * 512
    return None


def _write_test_file(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        chunk = os.urandom(MiB) * 4  # incompressible enough, cheap
        done = 0
        while done < size:
            done += os.write(fd, chunk[: min(BLOCK, size - done)])
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_direct(path: Path, size: int, depth: int) -> float:
    """Seconds to read `size` bytes with O_DIRECT, `depth` readers taking 4 MiB blocks."""
    offsets = list(range(0, size - BLOCK + 1, BLOCK))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, BLOCK)
        try:
            while True:
                with lock:
                    if not offsets:
                        return
                    off = offsets.pop()
                os.preadv(fd, [buf], off)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
        finally:
            os.close(fd)

    threads = [threading.Thread(target=worker) for _ in range(depth)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def measure_storage(env: ProbeEnv, info: StorageInfo, size: int = GiB,
                    say: Callable[[str], None] | None = None) -> StorageInfo:
    """O_DIRECT read throughput at QD1 and QD8, confirmed against the disk's counters.
    `say` hears each step as it starts."""
    say = say or (lambda _line: None)
    directory = Path(info.probed_path)
    if not info.o_direct:
        info.measure_note = "not measured: O_DIRECT is not available here"
        return info
    if info.free_bytes < 2 * size:
        info.measure_note = "not measured: not enough free space for the test file"
        return info
    path = directory / f".k3tui-measure-{os.getpid()}"
    try:
        say(f"measuring: writing a {size / GiB:g} GiB test file in {directory}")
        _write_test_file(path, size)
        notes = []
        for depth in (1, 8):
            say(f"measuring: reading it with O_DIRECT at queue depth {depth}")
            before = _disk_read_bytes(env, info.device) if info.device else None
            secs = _read_direct(path, size, depth)
            after = _disk_read_bytes(env, info.device) if info.device else None
            rate = size / secs / MB
            if depth == 1:
                info.read_mb_s_qd1 = round(rate, 1)
            else:
                info.read_mb_s_qd8 = round(rate, 1)
            if before is not None and after is not None:
                moved = after - before
                notes.append(f"QD{depth}: disk counters moved {moved / MiB:.0f} MiB "
                             f"of {size / MiB:.0f} MiB read")
                if moved < 0.9 * size:
                    notes.append(f"QD{depth} may have been served from a cache")
        info.measure_note = "; ".join(notes) or "disk counters not available for this device"
    except OSError as exc:
        info.measure_note = f"not measured: {exc.strerror or exc}"
    finally:
        try:
            path.unlink()
        except OSError:
            pass
    return info
