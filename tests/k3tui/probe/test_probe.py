"""Probe parsers against captured /proc and /sys trees and recorded nvidia-smi output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from probe_helpers import env_for
from k3tui.probe import MachineReport, probe_machine
from engine.weights.sysmem import limit_or_none, parse_mountinfo, read_cgroup as probe_cgroup
from k3tui.probe.cpu import parse_cpu_list
from k3tui.probe.env import ProbeEnv
from k3tui.probe.gpu import probe_gpu
from k3tui.probe.memory import parse_psi
from k3tui.probe.storage import check_o_direct, fs_class, measure_storage, probe_storage

GiB = 1024**3


def test_cgroup_hybrid_captured_from_this_vm():
    env = env_for("hybrid")
    cg = probe_cgroup(env)
    assert cg.version == "hybrid"
    assert cg.memory_limit_bytes is None  # 9223372036854771712 = PAGE_COUNTER_MAX = none
    assert cg.memory_current_bytes and cg.memory_current_bytes > 0
    assert cg.memory_dir.endswith("/process_api/f1aaf799aac24e82fe36e512f646d9b2")
    assert cg.v2_controllers == ["hugetlb"]
    assert cg.cpu_quota_cores is None  # cfs_quota_us = -1


def test_cgroup_v2_limit_is_min_over_ancestors_and_quota():
    cg = probe_cgroup(env_for("v2"))
    assert cg.version == "v2"
    assert cg.memory_limit_bytes == 16 * GiB  # set on user@1000.service, not on the scope
    assert cg.swap_limit_bytes == 0
    assert cg.memory_current_bytes == 1 * GiB
    assert cg.cpu_quota_cores == 4.0


def test_cgroup_v1_container_namespace_root():
    cg = probe_cgroup(env_for("v1"))
    assert cg.version == "v1"
    assert cg.memory_limit_bytes == 8 * GiB
    assert cg.swap_limit_bytes is None  # memsw unlimited
    assert cg.cpu_quota_cores == 1.5


def test_cpu_usable_cores_follow_affinity_and_quota():
    r = probe_machine("/", env=env_for("v1"), check_isolation=False)
    assert (r.cpu.online, r.cpu.allowed, r.cpu.usable) == (8, 8, 2)  # 1.5 CPUs -> 2 threads
    assert not r.cpu.avx2 and not r.cpu.neon
    r = probe_machine("/", env=env_for("v2"), check_isolation=False)
    assert (r.cpu.online, r.cpu.usable, r.cpu.avx2, r.cpu.avx512) == (16, 4, True, False)
    r = probe_machine("/", env=env_for("spark"), check_isolation=False)
    assert (r.cpu.arch, r.cpu.usable, r.cpu.neon) == ("aarch64", 20, True)
    assert r.cpu.model == "Cortex-X925 + Cortex-A725"
    r = probe_machine("/", env=env_for("hybrid"), check_isolation=False)
    assert (r.cpu.usable, r.cpu.avx2, r.cpu.avx512) == (2, True, True)


def test_memory_psi_present_and_absent():
    r = probe_machine("/", env=env_for("v2"), check_isolation=False)
    assert r.memory.total_bytes == 32_614_000 * 1024
    assert r.memory.psi_some_avg10 == 12.5 and r.memory.psi_full_avg10 == 3.25
    # the 16 GiB cgroup limit clamps what is available (psutil would report host numbers)
    assert r.memory.effective_available_bytes == 15 * GiB
    r = probe_machine("/", env=env_for("v1"), check_isolation=False)
    assert r.memory.psi_some_avg10 is None and r.memory.psi_full_avg10 is None
    assert r.memory.cgroup_limit_bytes == 8 * GiB
    assert r.memory.effective_total_bytes == 8 * GiB


def test_psi_unreadable_is_unknown(tmp_path):
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure" / "memory").mkdir()  # reading a directory fails like EOPNOTSUPP
    env = ProbeEnv(proc=tmp_path, sys=tmp_path)
    assert env.read(tmp_path / "pressure" / "memory") is None
    assert parse_psi(None) == (None, None)
    assert parse_psi("some avg10=1.50 avg60=0 avg300=0 total=1\n") == (1.5, None)


def test_limit_values():
    assert limit_or_none("max\n") is None
    assert limit_or_none("9223372036854771712") is None
    assert limit_or_none(str(2**62)) is None
    assert limit_or_none(str(2**62 - 1)) == 2**62 - 1
    assert limit_or_none("17179869184\n") == 16 * GiB
    assert parse_cpu_list("0-3,8,10-11") == 7


def test_gpu_gb10_is_unified_memory():
    g = probe_gpu(env_for("spark", "gb10"))
    assert g.present and g.unified_memory
    (gpu,) = g.gpus
    assert gpu.name == "NVIDIA GB10" and gpu.memory_total_bytes is None
    assert (gpu.compute_cap, gpu.addressing_mode, g.driver_version) == ("12.1", "ATS", "580.95.05")
    assert g.apps == []


def test_gpu_busy_shows_ollama_holding_36_gib():
    g = probe_gpu(env_for("spark", "busy"))
    (app,) = g.apps
    assert (app.pid, app.name, app.used_bytes) == (48211, "/usr/local/bin/ollama", 36 * GiB)
    assert g.held_by_apps_bytes == 36 * GiB


def test_gpu_h100_discrete_and_old_driver_without_addressing_mode():
    g = probe_gpu(env_for("v2", "h100"))
    assert g.present and not g.unified_memory
    assert g.discrete_memory_bytes == 81559 * 1024**2
    assert g.gpus[0].addressing_mode == ""  # the separate query failed; the rest survived


@pytest.mark.parametrize("recording", ["nodriver", None])
def test_no_gpu_is_never_an_exception(recording):
    g = probe_gpu(env_for("hybrid", recording))
    assert not g.present and g.gpus == [] and g.note


def test_hung_nvidia_smi_times_out(tmp_path):
    env = ProbeEnv(nvidia_smi=[sys.executable, "-c", "import time; time.sleep(30)"],
                   use_nvml=False, timeout_s=0.5)
    g = probe_gpu(env)
    assert not g.present and "not answering" in g.note


def test_storage_classes_from_mountinfo():
    env = env_for("v2")
    s = probe_storage(env, "/home/user/models/Kimi-K3", test_o_direct=False)
    assert (s.mount_point, s.fstype, s.fs_class) == ("/", "ext4", "local")
    assert (s.device, s.disk_kind, s.rotational) == ("nvme0n1", "nvme", False)
    s = probe_storage(env, "/mnt/models/k3", test_o_direct=False)
    assert (s.fs_class, s.fstype, s.device) == ("network", "nfs4", "")
    s = probe_storage(env, "/home/user/gdrive/x", test_o_direct=False)
    assert s.fs_class == "fuse"
    s = probe_storage(env, "/dev/shm/k3", test_o_direct=False)
    assert s.fs_class == "tmpfs"
    s = probe_storage(env, "/mnt/My Disk/models", test_o_direct=False)  # \040 in mountinfo
    assert (s.mount_point, s.device, s.disk_kind) == ("/mnt/My Disk", "sda", "hdd")
    s = probe_storage(env_for("v1"), "/workspace", test_o_direct=False)
    assert s.fs_class == "overlay"
    s = probe_storage(env_for("v1"), "/models/k3", test_o_direct=False)
    assert (s.fstype, s.device, s.disk_kind) == ("xfs", "sda", "hdd")
    s = probe_storage(env_for("hybrid"), "/work", test_o_direct=False)
    assert (s.device, s.disk_kind, s.rotational) == ("vda", "virtual", True)  # virtio says 1
    assert fs_class("fuse.sshfs") == "fuse" and fs_class("virtiofs") == "network"


def test_mountinfo_last_of_equal_mount_points_wins():
    text = ("1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
            "2 1 8:2 / /data rw - ext4 /dev/sda2 rw\n"
            "3 1 0:50 / /data rw - nfs4 nas:/x rw\n")
    from k3tui.probe.storage import mount_for

    assert mount_for("/data/models", parse_mountinfo(text)).fstype == "nfs4"
    assert mount_for("/datax", parse_mountinfo(text)).fstype == "ext4"


def test_o_direct_real_file(tmp_path):
    # this VM's ext4 (and tmpfs since 6.6) accept aligned O_DIRECT reads
    assert check_o_direct(tmp_path) is True
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.geteuid() != 0:
            assert check_o_direct(ro) is None
    finally:
        ro.chmod(0o700)


def test_free_space_and_nearest_existing_parent(tmp_path):
    s = probe_storage(ProbeEnv(), tmp_path / "not" / "yet")
    assert s.probed_path == str(tmp_path.resolve())
    st = os.statvfs(tmp_path)
    assert abs(s.free_bytes - st.f_bavail * st.f_frsize) < 64 * 1024**2
    assert s.o_direct is True


def test_measure_reads_with_o_direct_and_checks_counters(tmp_path):
    s = probe_storage(ProbeEnv(), tmp_path)
    s = measure_storage(ProbeEnv(), s, size=64 * 1024**2)
    assert s.read_mb_s_qd1 and s.read_mb_s_qd1 > 0 and s.read_mb_s_qd8 > 0
    if s.device:  # a real block device: the disk counters must have moved
        assert "disk counters moved" in s.measure_note
    assert not list(tmp_path.glob(".k3tui-measure-*"))  # test file removed


def test_report_json_roundtrip_and_strictness():
    r = probe_machine("/tmp", env=env_for("spark", "busy"), check_isolation=False)
    again = MachineReport.from_json(r.to_json())
    assert again == r
    assert again.gpu.apps[0].used_bytes == 36 * GiB
    bad = r.to_dict()
    bad["memory"]["bogus"] = 1
    with pytest.raises(ValueError):
        MachineReport.from_dict(bad)


def test_isolation_absent_here_is_reported_not_raised():
    r = probe_machine("/tmp", env=env_for("hybrid"))
    assert r.isolation.method == "none" and not r.isolation.systemd_run_scope
    assert "systemd-run is not available" in r.isolation.detail


def test_real_machine_probe_matches_the_kernel():
    r = probe_machine("/tmp")
    assert r.cpu.usable == len(os.sched_getaffinity(0))
    meminfo = Path("/proc/meminfo").read_text()
    total_kb = int(next(ln for ln in meminfo.splitlines() if ln.startswith("MemTotal")).split()[1])
    assert r.memory.total_bytes == total_kb * 1024
    has_smi = subprocess.run(["sh", "-c", "command -v nvidia-smi"],
                             capture_output=True).returncode == 0
    if not has_smi:
        assert not r.gpu.present and r.gpu.gpus == []


def _fake_systemd_run(tmp_path, body: str) -> list[str]:
    """A stand-in systemd-run (no user systemd here) that checks it was asked for a scope
    with MemoryMax and MemorySwapMax=0, then answers like the real one would."""
    script = tmp_path / "systemd-run"
    script.write_text(
        "#!/bin/sh\n"
        'case "$*" in *"--user --scope"*"MemoryMax=268435456"*"MemorySwapMax=0"*) ;; '
        '*) echo "unexpected args: $*" >&2; exit 64;; esac\n' + body)
    script.chmod(0o755)
    return [str(script)]


@pytest.mark.parametrize("body, works, words", [
    ("echo 268435456\n", True, "applies MemoryMax"),
    ("echo max\n", False, "silently ignored"),  # user unit without memory delegation
    ("echo 'Failed to connect to bus: No medium found' >&2; exit 1\n", False,
     "Failed to connect to bus"),
])
def test_isolation_trusts_only_a_limit_read_back(tmp_path, body, works, words):
    from k3tui.probe.isolation import probe_isolation

    env = env_for("spark")
    env.systemd_run = _fake_systemd_run(tmp_path, body)
    info = probe_isolation(env, probe_cgroup(env))
    assert info.systemd_run_scope is works
    assert info.method == ("systemd-run" if works else "none")
    assert words in info.detail


def test_isolation_falls_back_to_a_writable_v2_cgroup(tmp_path):
    from k3tui.probe.isolation import probe_isolation

    env = env_for("v2")  # its scope lists the memory controller; the tree is writable
    env.systemd_run = _fake_systemd_run(tmp_path, "exit 1\n")
    info = probe_isolation(env, probe_cgroup(env))
    assert (info.method, info.cgroup_v2_writable) == ("cgroup", True)
    hybrid = env_for("hybrid")
    assert probe_isolation(hybrid, probe_cgroup(hybrid)).cgroup_v2_writable is False
