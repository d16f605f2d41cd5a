"""Byte units and the one way each kind of size is written.

Decimal units (GB, TB) for disks, downloads and checkpoints, as they are sold and listed;
binary units (GiB, MiB) for memory and limits, as the kernel and llama-server count them.
Every byte formatter and GB/GiB constant in k3tui comes from here.
"""

from __future__ import annotations

KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
KiB, MiB, GiB = 2**10, 2**20, 2**30


def gib(n: float, digits: int = 1) -> str:
    """Memory in GiB: "21.2 GiB"."""
    return f"{n / GiB:.{digits}f} GiB"


def memory_size(n: float, gib_digits: int = 1, mib_digits: int = 1) -> str:
    """Memory in GiB from 1 GiB up, in MiB below it."""
    return gib(n, gib_digits) if n >= GiB else f"{n / MiB:.{mib_digits}f} MiB"


def disk_size(n: float) -> str:
    """Disk sizes in TB from 1 TB up, else GB."""
    return f"{n / TB:.2f} TB" if n >= TB else f"{n / GB:.1f} GB"


def transfer_size(n: float | None) -> str:
    """Bytes moved or to move: "1,234.57 GB", "12.3 MB" below 1 GB, "?" when unknown."""
    if n is None:
        return "?"
    return f"{n / GB:,.2f} GB" if n >= GB else f"{n / MB:,.1f} MB"


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
