"""Byte units and the one way each kind of size is written.

Decimal units (GB, TB) for disks, downloads and checkpoints, as they are sold and listed;
binary units (GiB, MiB) for memory and limits, as the kernel and llama-server count them.
Every byte formatter in k3tui is here; the constants are k3vocab's, shared with the engine.
"""

from __future__ import annotations

from k3vocab import GB, KB, MB, TB, GiB, KiB, MiB

__all__ = ["GB", "KB", "MB", "TB", "GiB", "KiB", "MiB"]  # re-exported for k3tui's modules


def gib(n: float, digits: int = 1) -> str:
    """Memory in GiB: "21.2 GiB"."""
    return f"{n / GiB:.{digits}f} GiB"


def memory_size(n: float, gib_digits: int = 1, mib_digits: int = 1) -> str:
    """Memory in GiB from 1 GiB up, in MiB below it."""
    return gib(n, gib_digits) if n >= GiB else f"{n / MiB:.{mib_digits}f} MiB"


def disk_size(n: float) -> str:
    """Disk sizes in TB from 1 TB up, else GB."""
    return f"{n / TB:.2f} TB" if n >= TB else f"{n / GB:.1f} GB"


def _transfer_unit(n: float) -> tuple[float, str, int]:
    """(divisor, unit, decimals) for `n` bytes moved: GB from 1 GB, then MB, KB, bytes."""
    for size, unit, digits in ((GB, "GB", 2), (MB, "MB", 1), (KB, "KB", 1)):
        if n >= size:
            return size, unit, digits
    return 1, "B", 0


def transfer_size(n: float | None) -> str:
    """Bytes moved or to move: "1,234.57 GB", "12.3 MB" below 1 GB, "4.2 KB", "512 B";
    "?" when unknown."""
    if n is None:
        return "?"
    size, unit, digits = _transfer_unit(n)
    return f"{n / size:,.{digits}f} {unit}"


def transfer_progress(done: float, total: float) -> str:
    """Done of total in the total's unit: "3.90 / 16.30 GB", "0.4 / 1.2 KB" (a 1 KB file is
    not "0.0 / 0.0 GB")."""
    size, unit, digits = _transfer_unit(max(total, done))
    return f"{done / size:,.{digits}f} / {total / size:,.{digits}f} {unit}"


def rate(bytes_per_s: float) -> str:
    """A transfer rate: "123.4 MB/s"."""
    return f"{bytes_per_s / MB:,.1f} MB/s"


def gb_amount(gb: float | None) -> str:
    """A value already in GB, with one decimal, or MB below 1 GB (a demo budget of 0.021 GB
    reads as 21 MB); "–" when unknown."""
    if gb is None:
        return "–"
    if abs(gb) < 1:
        return f"{gb * 1000:.0f} MB"
    return f"{gb:.1f} GB"
