"""What a packed trunk is bound to, so that nothing about it is trusted that can lie.

* Each layer's bytes: trunk.json's `sha256` is the digest of the bytes its tensors cover in
  trunk.bin (from `file_off` to the end of its last tensor; the zero padding after it is
  never read), `source_sha256` the digest of the run in its shard it was packed from (the
  same value for the BF16 trunk, whose bytes are the run's). Both are computed while
  packing, from bytes the pack holds in memory anyway; the engine checks `sha256` on a
  layer's first read, `pack` and `pack --verify` check every layer.
* The shards: `sources` holds, per shard a layer comes from, its size, mtime and inode
  taken before the pack read it. A shard replaced since (a re-download renames a new file
  into place) or rewritten in place has another inode or mtime: the trunk is refused until
  `pack` has hashed that shard's runs again and found them unchanged.
* An unfinished pack's progress file names the trunk.bin it describes (device and inode)
  and the digests of its finished layers; a resumed pack re-reads each of them and keeps
  only those whose bytes still match (trunk.bin deleted, truncated or rewritten after a
  kill re-packs what it lost).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from engine.errors import ReadError
from engine.core.directio import ALIGN, DirectFile, align_down, align_up, aligned_buffer

DIGEST_CHUNK = 16 << 20  # bytes read (O_DIRECT) while the previous chunk is hashed
HEX = frozenset("0123456789abcdef")


def new_digest() -> Any:
    return hashlib.sha256()


def is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= HEX


def digest_of_range(path: Path, offset: int, n: int,
                    on_bytes: Callable[[int], None] | None = None) -> str | None:
    """sha256 of bytes [offset, offset + n) of `path`, or None when the file is missing,
    shorter or unreadable. Reads with O_DIRECT (the page cache does not grow), the next
    chunk in flight while one is hashed (hashlib releases the GIL)."""
    try:
        f = DirectFile(path)
    except ReadError:
        return None
    h = new_digest()
    try:
        if f.size < offset + n:
            return None
        spans = [(p, min(offset + n, p + DIGEST_CHUNK)) for p in range(offset, offset + n,
                                                                         DIGEST_CHUNK)]
        bufs = [aligned_buffer(DIGEST_CHUNK + 2 * ALIGN) for _ in range(2)]

        def read(k: int):
            lo, hi = spans[k]
            win, buf = align_down(lo), bufs[k % 2]
            f.read_into(buf[:align_up(hi) - win], win, hi - win)
            return buf[lo - win:hi - win]

        with ThreadPoolExecutor(1, thread_name_prefix="k3-digest") as ex:
            ahead = ex.submit(read, 0) if spans else None
            for k in range(len(spans)):
                data = ahead.result()
                ahead = ex.submit(read, k + 1) if k + 1 < len(spans) else None
                h.update(data)
                if on_bytes:
                    on_bytes(data.nbytes)
    except ReadError:
        return None
    finally:
        f.close()
    return h.hexdigest()


def shard_stats(shards: Iterable[Path]) -> dict[str, dict[str, int]]:
    """Per shard (by name): size, mtime and inode, what a replaced or rewritten file changes."""
    out: dict[str, dict[str, int]] = {}
    for path in shards:
        if path.name not in out:
            st = os.stat(path)
            out[path.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
    return out


def changed_shards(recorded: Any, now: dict[str, dict[str, int]]) -> set[str]:
    """The shards in `now` whose recorded stats differ (all of them when none are recorded)."""
    if not isinstance(recorded, dict):
        return set(now)
    return {name for name, st in now.items() if recorded.get(name) != st}


def file_identity(path: Path) -> dict[str, int] | None:
    """The file itself (device, inode), None when it does not exist: a trunk.bin deleted and
    made again is another file, whatever its bytes."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return {"dev": st.st_dev, "ino": st.st_ino}
