"""Monitor, clipboard and latency maths: core modules, no Textual (history: test_history)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from k3tui.backends.events import Finished, TokenStats
from k3tui.clipboard import copy_beyond_terminal
from k3tui.monitor import Monitor
from k3tui.tui.stats import LatencyStats, format_rate, percentile
from k3tui.tui.widgets.sparkline import bucket_max, render_sparkline


# --- monitor -------------------------------------------------------------------------
def _fake_tree(tmp_path, v1: bool):
    proc, sys_ = tmp_path / "proc", tmp_path / "sys"
    (proc / "pressure").mkdir(parents=True)
    (proc / "self").mkdir()
    (proc / "pressure" / "memory").write_text(
        "some avg10=12.50 avg60=3.00 avg300=1.00 total=100\n"
        "full avg10=4.25 avg60=1.00 avg300=0.50 total=50\n")
    (proc / "meminfo").write_text("MemTotal: 100 kB\nCached:  2048000 kB\n")
    if v1:
        (proc / "self" / "cgroup").write_text("4:memory:/job/x\n0::/\n")
        cg = sys_ / "fs" / "cgroup" / "memory" / "job" / "x"
        cg.mkdir(parents=True)
        (cg / "memory.usage_in_bytes").write_text("3000000000\n")
        (cg / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    else:
        (proc / "self" / "cgroup").write_text("0::/user.slice/k3\n")
        cg = sys_ / "fs" / "cgroup" / "user.slice" / "k3"
        cg.mkdir(parents=True)
        (cg / "memory.current").write_text("5000000000\n")
        (cg / "memory.max").write_text("8000000000\n")
    return proc, sys_


@pytest.mark.parametrize("v1", [False, True])
def test_tui_monitor_reads_proc_and_computes_rates(tmp_path, v1):
    proc, sys_ = _fake_tree(tmp_path, v1)
    now = [0.0]
    disk = [1_000_000_000]
    stats = {"value": (6_000_000_000, 500_000_000)}
    m = Monitor(42, clock=lambda: now[0], proc_root=proc, sys_root=sys_,
                disk_read_bytes=lambda: disk[0], process_stats=lambda pid: stats["value"])
    first = m.sample()
    assert first.disk_read_mb_s is None  # no delta yet
    assert first.psi_some_avg10 == 12.5 and first.psi_full_avg10 == 4.25
    assert first.page_cache_gb == pytest.approx(2048000 * 1024 / 1e9)
    now[0] = 0.5
    disk[0] += 400_000_000
    stats["value"] = (6_100_000_000, 700_000_000)
    s = m.sample()
    assert s.disk_read_mb_s == pytest.approx(800.0)
    assert s.proc_read_mb_s == pytest.approx(400.0)
    assert s.proc_rss_gb == pytest.approx(6.1)
    if v1:
        assert s.cgroup_current_gb == pytest.approx(3.0) and s.cgroup_max_gb is None
    else:
        assert s.cgroup_current_gb == pytest.approx(5.0) and s.cgroup_max_gb == pytest.approx(8.0)
    stats["value"] = None  # the backend died
    now[0] = 1.0
    gone = m.sample()
    assert gone.proc_rss_gb is None and gone.proc_read_mb_s is None


def test_tui_monitor_missing_files_are_none(tmp_path):
    m = Monitor(None, proc_root=tmp_path, sys_root=tmp_path, disk_read_bytes=lambda: None)
    s = m.sample()
    assert (s.psi_some_avg10, s.page_cache_gb, s.cgroup_current_gb) == (None, None, None)


def test_tui_monitor_follows_a_pool_heads_connections_and_log(tmp_path):
    """Which workers the head (here: this process) holds a connection to, and what its
    log says the load put on each."""
    import os
    import socket

    up, down = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    workers = [f"127.0.0.1:{s.getsockname()[1]}" for s in (up, down)]
    log = tmp_path / "head.log"
    log.write_text(f"0.00.129.084 I load_tensors: RPC0[{workers[0]}] model buffer size =  "
                   "  75.00 MiB\n")
    m = Monitor(os.getpid(), proc_root=tmp_path, sys_root=tmp_path, disk_read_bytes=lambda: None)
    assert m.sample().pool == ()  # not a pool head
    m.set_pool(workers, str(log))
    with up, down, socket.create_connection(up.getsockname()):
        pool = m.sample().pool
    assert pool == ((workers[0], True, 75 * 2**20), (workers[1], False, None))


def test_tui_core_modules_do_not_import_ui():
    code = ("import sys, k3tui.history, k3tui.monitor, k3tui.clipboard; "
            "bad = [m for m in ('textual', 'rich', 'questionary', 'prompt_toolkit', 'engine') "
            "if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- clipboard -----------------------------------------------------------------------
def test_tui_clipboard_beyond_terminal_only_inside_tmux(tmp_path):
    """Outside tmux and with no display nothing is run, though `tmux` is on PATH."""
    tmux = tmp_path / "tmux"
    tmux.write_text("#!/bin/sh\n: > \"$0.ran\"\n")  # builtins only: PATH is just here
    tmux.chmod(0o755)
    assert copy_beyond_terminal("x", env={"PATH": str(tmp_path)}) == []
    assert not (tmp_path / "tmux.ran").exists()
    env = {"PATH": str(tmp_path), "TMUX": "/tmp/tmux-0/default,1,0"}
    assert copy_beyond_terminal("x", env=env) == ["tmux"]  # and inside, tmux is asked
    assert (tmp_path / "tmux.ran").exists()


# --- latency maths -------------------------------------------------------------------
def test_tui_stats_client_inter_arrival_and_rates():
    st = LatencyStats()
    st.start(100.0)
    for i, t in enumerate([100.8, 100.85, 100.9, 101.4, 101.45]):
        st.on_token(TokenStats(arrival_s=t, tokens=1, prompt_tokens=40 if i == 0 else None))
    snap = st.snapshot()
    assert snap.source == "client"
    assert snap.ttft_ms == pytest.approx(800)
    assert snap.prefill_tok_s == pytest.approx(50)  # 40 prompt tokens in the 0.8 s TTFT
    assert snap.series == pytest.approx([50, 50, 500, 50])
    assert snap.p95_ms == pytest.approx(500)  # the spike survives
    assert snap.tokens == 5


def test_tui_stats_prefers_backend_timings():
    st = LatencyStats()
    st.start(0.0)
    st.on_token(TokenStats(arrival_s=5.0, tokens=1, backend_ms=None))
    st.on_token(TokenStats(arrival_s=9.0, tokens=2, backend_ms=1800.0))
    st.on_finished(Finished("stop", timings={"prompt_ms": 2000.0, "prompt_n": 100}))
    snap = st.snapshot()
    assert snap.source == "backend" and snap.gen_ms_per_token == pytest.approx(1800)
    assert snap.prefill_tok_s == pytest.approx(50)
    assert format_rate(snap.gen_ms_per_token) == "1.8 s/token"
    assert format_rate(25.0) == "40.0 tok/s"


def test_tui_sparkline_keeps_spikes_and_ascii():
    values = [1.0] * 100
    values[37] = 50.0
    cols = bucket_max(values, 10)
    assert max(cols) == 50.0 and len(cols) == 10
    line = render_sparkline(values, 10)
    assert "█" in line and len(line) == 10
    ascii_line = render_sparkline(values, 10, ascii=True)
    assert ascii_line.isascii() and "#" in ascii_line
    assert render_sparkline([], 5) == "     "
    assert percentile([3, 1, 2], 50) == 2


def test_tui_monitor_diskstats_counts_whole_disks_only(tmp_path):
    from k3tui.monitor import diskstats_reader

    (tmp_path / "proc").mkdir()
    (tmp_path / "sys" / "block" / "nvme0n1").mkdir(parents=True)
    (tmp_path / "proc" / "diskstats").write_text(
        " 259 0 nvme0n1 100 0 2000 0 0 0 0 0 0 0 0\n"
        " 259 1 nvme0n1p1 90 0 1800 0 0 0 0 0 0 0 0\n")
    read = diskstats_reader(tmp_path / "proc", tmp_path / "sys")
    assert read() == 2000 * 512  # the partition's sectors are not counted twice
