"""Machine probe: what this box has (CPU, memory, cgroups, GPU, storage, isolation).

No UI imports. Every probe reads through a `ProbeEnv` (root of /proc and /sys, the
nvidia-smi command), so tests run the same code against captured trees.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from k3tui.probe.env import ProbeEnv
from k3tui.probe.report import MachineReport, list_profiles, load_report

__all__ = ["MachineReport", "ProbeEnv", "list_profiles", "load_report", "probe_machine"]


def probe_machine(target_dir: str | Path | None = None, measure: bool = False,
                  env: ProbeEnv | None = None, check_isolation: bool = True,
                  say: Callable[[str], None] | None = None) -> MachineReport:
    """Probe this machine (or the trees `env` points at) for the model's target directory.
    `say` hears each step of `measure` (it takes seconds)."""
    from engine.weights.sysmem import read_cgroup, read_mounts
    from k3tui.probe.cpu import probe_cpu
    from k3tui.probe.gpu import probe_gpu
    from k3tui.probe.isolation import IsolationInfo, probe_isolation
    from k3tui.probe.memory import probe_memory
    from k3tui.probe.report import host_facts, now
    from k3tui.probe.storage import measure_storage, probe_storage

    from concurrent.futures import ThreadPoolExecutor

    env = env or ProbeEnv()
    t0 = time.perf_counter()
    mounts = read_mounts(env)
    cg = read_cgroup(env, mounts)
    hostname, kernel = host_facts()
    report = MachineReport(hostname=hostname, kernel=kernel, probed_at=now())
    # nvidia-smi (slow without persistence mode) and systemd-run are separate processes:
    # wait for them side by side, not one after the other.
    with ThreadPoolExecutor(max_workers=2) as pool:
        gpu = pool.submit(probe_gpu, env)
        isolation = pool.submit(probe_isolation, env, cg) if check_isolation else None
        report.cpu = probe_cpu(env, cg.cpu_quota_cores)
        report.memory = probe_memory(env, cg)
        if target_dir is None:
            from k3tui.paths import get_paths

            target_dir = get_paths().models_dir
        report.storage = probe_storage(env, target_dir, mounts)
        report.gpu = gpu.result()
        report.isolation = isolation.result() if isolation else IsolationInfo(
            detail="not checked")
    if measure:
        measure_storage(env, report.storage, say=say)
    report.probe_seconds = round(time.perf_counter() - t0, 3)
    return report
