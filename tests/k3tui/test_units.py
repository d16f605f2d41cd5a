"""One units module: every byte constant and formatter in k3tui comes from k3tui.units."""

from __future__ import annotations

import re
from pathlib import Path

from k3tui.units import (GB, GiB, MiB, disk_size, gb_amount, gib, memory_size, rate, transfer_size,
                         transfer_progress)

K3TUI = Path(__file__).resolve().parents[2] / "k3tui"
# a byte unit spelled out (1e9, 2**30, 1024 * 1024, 1 << 20 …) or a module-level GB/GiB constant
OWN_UNIT = re.compile(r"\b(1e6|1e9|1e12)\b|2 ?\*\* ?(20|30)\b|1024 ?(\*\*|\*) ?(1024|[23])\b|"
                      r"1000 ?\*\* ?[34]\b|1 ?<< ?(20|30)\b|^(KB|MB|GB|TB|KIB|MIB|GIB|KiB|MiB|GiB)"
                      r" ?=", re.MULTILINE)


def test_no_module_spells_out_its_own_byte_units():
    offenders = [f"{p.relative_to(K3TUI)}: {m.group(0)}" for p in sorted(K3TUI.rglob("*.py"))
                 if p.name != "units.py" for m in OWN_UNIT.finditer(p.read_text())]
    assert offenders == []


def test_each_kind_of_size_reads_the_same_everywhere():
    assert gib(21.2 * GiB) == "21.2 GiB" and gib(3 * GiB, 2) == "3.00 GiB"
    assert memory_size(545 * GiB) == "545.0 GiB" and memory_size(12 * MiB) == "12.0 MiB"
    assert memory_size(1.5 * GiB, 2, 0) == "1.50 GiB" and memory_size(300 * MiB, 2, 0) == "300 MiB"
    assert disk_size(1_560_936_091_448) == "1.56 TB" and disk_size(579.5 * GB) == "579.5 GB"
    assert transfer_size(1_234_567_890_123) == "1,234.57 GB"
    assert transfer_size(12_345_678) == "12.3 MB"
    assert transfer_size(None) == "?" and rate(123_456_789) == "123.5 MB/s"
    assert transfer_size(4_200) == "4.2 KB" and transfer_size(512) == "512 B"
    # a small file's progress in its own unit, not "0.0/0.0 GB"
    assert transfer_progress(400, 1_234) == "0.4 / 1.2 KB"
    assert transfer_progress(3_900_000_000, 16_300_000_000) == "3.90 / 16.30 GB"
    assert transfer_progress(0, 0) == "0 / 0 B"
    assert gb_amount(0.021) == "21 MB" and gb_amount(4.04) == "4.0 GB" and gb_amount(None) == "–"
