"""`bench compact` on a small real-format checkpoint: at a budget where the trunk streams,
the compact trunk reads fewer bytes per token for the same ids, and each run reports the
disk's speed and the I/O bound it implies beside s/token."""

from __future__ import annotations

from engine.bench.compact import decode_section
from engine.checkpoint.synth import synthesize


def test_compact_bench_streams_fewer_bytes_for_the_same_ids(tmp_path):
    ck = synthesize(tmp_path / "ck", "small", seed=5)
    (row,) = decode_section(ck, tmp_path / "work", [0.1], tokens=3)
    assert row["ids_equal"] is True
    b, c = row["bf16"], row["c12"]
    assert b["trunk_gb_per_token"] > 0 and row["bytes_ratio"] < 0.9
    for run in (b, c):
        assert run["disk_gb_s"] > 0 and run["io_bound_s"] > 0 and run["wait_trunk_s"] >= 0


def test_compact_bench_refuses_bad_budgets_before_touching_the_disk(tmp_path, capsys):
    from engine.cli import main

    for bad in ("0.53,abc", "-1", ",", "nan"):
        assert main(["bench", "compact", "--size", "bench", "--workdir", str(tmp_path),
                     "--budgets-gb", bad]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: --budgets-gb takes positive numbers") and "Traceback" \
            not in err
    assert list(tmp_path.iterdir()) == []  # nothing synthesised or packed
