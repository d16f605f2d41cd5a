"""Every file k3tui keeps derives from one root, so `K3TUI_HOME` relocates all of it.

Default root: the platform's user data folder (``~/.local/share/k3tui`` on Linux).
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from pathlib import Path

from k3tui.errors import K3Error


@dataclass(frozen=True)
class Paths:
    root: Path

    @property
    def config_file(self) -> Path:
        return self.root / "config.toml"

    @property
    def credentials_file(self) -> Path:
        """API keys and tokens, written 0600, never logged."""
        return self.root / "credentials.toml"

    @property
    def jobs_dir(self) -> Path:
        return self.root / "jobs"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def history_db(self) -> Path:
        return self.root / "history.sqlite3"

    @property
    def demo_dir(self) -> Path:
        return self.root / "demo"

    @property
    def models_dir(self) -> Path:
        """Default download target when the config names none."""
        return self.root / "models"

    @property
    def bench_dir(self) -> Path:
        return self.root / "bench"

    @property
    def states_dir(self) -> Path:
        """The bundled engine's kept conversation states (its --state-dir)."""
        return self.root / "states"

    def as_dict(self) -> dict[str, str]:
        names = ["root", "config_file", "credentials_file", "jobs_dir", "logs_dir",
                 "history_db", "demo_dir", "models_dir", "bench_dir", "states_dir"]
        return {name: str(getattr(self, name)) for name in names}


def log_stamps() -> dict[Path, int]:
    """Each backend log's modification time (ns); a log removed meanwhile is left out."""
    stamps = {}
    for p in get_paths().logs_dir.glob("*.log"):
        try:
            stamps[p] = p.stat().st_mtime_ns
        except OSError:
            continue
    return stamps


def newest_log_since(before: dict[Path, int]) -> Path | None:
    """The newest log written since `before` was taken: new, or changed. Compared by the
    stamps themselves, not with a clock: a kernel that stamps files with a coarse clock
    can date a log written just after `time.time()` before it."""
    changed = {p: t for p, t in log_stamps().items() if before.get(p) != t}
    return max(changed, key=changed.__getitem__) if changed else None


def get_paths() -> Paths:
    """Resolve the root now (not at import), so tests and users can set K3TUI_HOME late."""
    home = os.environ.get("K3TUI_HOME")
    if home:
        return Paths(Path(home).expanduser().resolve())
    from platformdirs import user_data_path

    return Paths(user_data_path("k3tui", appauthor=False))


# --- privacy: chats, logs and keys are the user's alone -------------------------------------
# The home is 0700 and what k3tui writes in it 0600. Something found looser (made by an
# older k3tui, or a umask) is tightened, and the user told once per process on stderr.
PRIVATE_DIRS = ("jobs", "jobs/locks", "logs", "exports")  # under the root; models/ is not
_told = False


def _tell(path: Path, was: int, now: int) -> None:
    global _told
    if not _told:
        _told = True
        import sys

        print(f"k3tui: {path} was readable by other users (mode {was:04o}); k3tui's files "
              f"are now private to you ({now:04o}).", file=sys.stderr)


def _tighten(path: Path, mode: int) -> None:
    try:
        was = path.stat().st_mode & 0o777
        if was & 0o077:
            os.chmod(path, was & ~0o077 | (mode & 0o700))
            _tell(path, was, was & ~0o077 | (mode & 0o700))
    except FileNotFoundError:
        pass
    except OSError as exc:   # a read-only home, or another user's file: nothing k3tui can do
        if exc.errno not in _NOT_WRITABLE:
            raise


_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class HomeNotWritable(K3Error, OSError):
    """k3tui's own folder cannot be written: one sentence naming it for the user, and still
    the OSError it was for code that handles one (an export shows strerror and filename)."""

    def __init__(self, exc: OSError, root: Path):
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        K3Error.__init__(self, f"Cannot write in k3tui's folder {root} "
                         f"({exc.strerror or exc}).",
                         ("free some space there" if full else "make it writable")
                         + ", or point K3TUI_HOME at another folder "
                         "(`export K3TUI_HOME=/path/to/folder`)")
        self.errno, self.strerror, self.filename = exc.errno, exc.strerror, exc.filename


@contextlib.contextmanager
def _writing(path: Path):
    """A home k3tui cannot write (a read-only mount, another user's folder, /proc, a full
    disk) is one sentence naming it, not an OSError from whichever file came first."""
    try:
        yield
    except FileExistsError:
        raise
    except OSError as exc:
        root = get_paths().root
        if not (path == root or root in path.parents or path in root.parents):
            raise
        raise HomeNotWritable(exc, root) from None


def private_dir(path: Path | str) -> Path:
    """`path` and its missing parents created 0700; if it is k3tui's root or inside it,
    it and the folders up to the root are tightened to 0700."""
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        try:
            with _writing(p):
                p.mkdir(mode=0o700)
        except FileExistsError:
            pass  # made meanwhile by another process
    root = get_paths().root
    if path == root or root in path.parents:
        for p in (path, *path.parents):
            _tighten(p, 0o700)
            if p == root:
                break
    return path


def private_file(path: Path | str, *, create: bool = True) -> Path:
    """`path` exists (when `create`) as 0600, without ever being readable by others."""
    path = Path(path)
    if create:
        with _writing(path):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    _tighten(path, 0o600)
    return path


def private_open(path: Path | str, mode: str = "ab", **kwargs):
    """`open(path, mode)` for a file k3tui writes (a log, a state file): its folder
    private, the file created 0600 or tightened to it."""
    path = Path(path)
    private_dir(path.parent)
    private_file(path)
    with _writing(path):
        return open(path, mode, **kwargs)


def secure_home() -> None:
    """Tighten the root, its private folders and the files in them (one notice at most)."""
    root = get_paths().root
    if not root.is_dir():
        return
    private_dir(root)
    for entry in root.iterdir():
        if entry.is_file() and not entry.is_symlink():
            _tighten(entry, 0o600)
    for name in PRIVATE_DIRS:
        folder = root / name
        if folder.is_dir() and not folder.is_symlink():
            _tighten(folder, 0o700)
            for entry in folder.iterdir():
                if entry.is_file() and not entry.is_symlink():
                    _tighten(entry, 0o600)
