"""The bundled engine's state folder ($K3TUI_HOME/states, its `--state-dir`): the budget
k3tui gives it, how big one conversation's state is, what the folder holds, and clearing it.

The folder and its files are the engine's (engine/serve/durable.py): `<owner>/<hex>.k3s`,
least recently used out by mtime. k3tui only looks at names of that shape, with lstat and
through folder descriptors opened with O_NOFOLLOW, so a symlink is never followed and
nothing outside the folder is read or removed. Clearing is safe while an engine runs: the
engine reads and checks a state file whole each time it uses one, and a file that is gone
only means that turn is prefilled as on a cold server.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from k3tui.units import GB, KB, MB

STATE_GB = 16.0  # the folder's budget, passed as `--state-gb` (k3tui/backends/bundled.py)

# One conversation's state on the real model (69 KDA layers' recurrent state and the logits,
# plus 24 MLA layers' latent cache per token), and its save and restore on this machine's
# virtual disk: measured with real-shape arrays, docs/engine/server-api.md "Prompt reuse".
STATE_FIXED_BYTES = 465_300_000
STATE_BYTES_PER_TOKEN = 55_300
STATE_SAVE_S = (0.66, 1.95)
STATE_RESTORE_S = 0.75

# The names engine/serve/durable.py makes (_OWNER, _NAME there; a test keeps them equal).
OWNER_NAME = re.compile(r"^([0-9a-f]{64}|local)$")
STATE_NAME = re.compile(r"^[0-9a-f]{32}\.k3s$")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def state_bytes(n_tokens: int) -> int:
    """The size of one real-model state covering `n_tokens` tokens of context."""
    return STATE_FIXED_BYTES + STATE_BYTES_PER_TOKEN * n_tokens


@dataclass
class Usage:
    files: int = 0
    bytes: int = 0
    oldest_mtime: float | None = None


class NotAFolder(OSError):
    """The state folder is a symlink or a file: k3tui neither reads nor clears it."""


def _visit(root: Path, remove: bool) -> Usage:
    """The state files under `root` (stat only), removed first with `remove`; a folder that
    does not exist holds nothing. Raises NotAFolder, or OSError when it cannot be read."""
    out = Usage()
    try:
        top = os.open(root, _DIR_FLAGS)
    except FileNotFoundError:
        return out
    except OSError as exc:
        if stat.S_ISDIR(os.lstat(root).st_mode):
            raise
        raise NotAFolder(exc.errno, f"{root} is not a folder (a symlink?)") from None
    try:
        with os.scandir(top) as owners:
            names = [e.name for e in owners
                     if OWNER_NAME.match(e.name) and e.is_dir(follow_symlinks=False)]
        for name in names:
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=top)
            except OSError:
                continue  # swapped for a symlink, or gone, since it was listed
            try:
                with os.scandir(fd) as entries:
                    for e in entries:
                        if not STATE_NAME.match(e.name):
                            continue
                        info = e.stat(follow_symlinks=False)
                        if not stat.S_ISREG(info.st_mode):
                            continue
                        if remove:
                            try:
                                os.unlink(e.name, dir_fd=fd)
                            except FileNotFoundError:
                                continue  # the engine made room first
                        out.files += 1
                        out.bytes += info.st_size
                        if out.oldest_mtime is None or info.st_mtime < out.oldest_mtime:
                            out.oldest_mtime = info.st_mtime
            finally:
                os.close(fd)
    finally:
        os.close(top)
    return out


def usage(root: Path) -> Usage:
    """What the state folder holds (stat only)."""
    return _visit(root, remove=False)


def clear(root: Path) -> Usage:
    """Remove every state file (nothing else) from the folder; what was removed."""
    return _visit(root, remove=True)


def age(seconds: float) -> str:
    """How old an entry is, in the largest whole unit: "40 s", "5 min", "3 h", "2 days"."""
    for size, unit in ((86400, "days"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{int(seconds // size)} {unit}"
    return f"{max(0, int(seconds))} s"


def plan_lines(root: Path, n_ctx: int) -> list[str]:
    """The plan's lines about kept conversation states (the bundled engine)."""
    full = state_bytes(n_ctx)
    return [f"States:  up to {STATE_GB:g} GB in {root}, least recently used out (about "
            f"{int(STATE_GB * GB // full)} conversations at the full context)",
            f"         one real-model state: {STATE_FIXED_BYTES / MB:.0f} MB + "
            f"{STATE_BYTES_PER_TOKEN / KB:.1f} KB a token of context, {full / GB:.2f} GB at "
            f"{n_ctx:,} tokens; saved in {STATE_SAVE_S[0]:g}-{STATE_SAVE_S[1]:g} s, "
            f"restored in {STATE_RESTORE_S:g} s (measured on a virtual disk)"]
