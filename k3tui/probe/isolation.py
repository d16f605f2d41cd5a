"""Can k3tui put a hard memory limit on a backend process?

Two ways: a transient systemd user scope (checked by `k3tui.probe.limits`, the same check the
launcher makes), or a writable cgroup v2 directory with the memory controller.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engine.weights.sysmem import CgroupInfo
from k3tui.probe import limits
from k3tui.probe.env import ProbeEnv
from k3tui.units import MiB

TEST_LIMIT = 256 * MiB


@dataclass
class IsolationInfo:
    method: str = "none"  # "systemd-run" | "cgroup" | "none"
    systemd_run_scope: bool = False
    cgroup_v2_writable: bool = False
    detail: str = ""


def check_systemd_scope(env: ProbeEnv) -> tuple[bool, str]:
    return limits.check_systemd_scope(lambda argv: env.run(argv, timeout=min(env.timeout_s, 3.0)),
                                      TEST_LIMIT, env.systemd_run)


def check_cgroup_writable(env: ProbeEnv, cg: CgroupInfo) -> tuple[bool, str]:
    if cg.version != "v2" or not cg.memory_dir:
        return False, "no cgroup v2 memory controller for this process"
    d = Path(cg.memory_dir)
    if "memory" not in (env.read(d / "cgroup.controllers") or "").split():
        return False, f"{d} has no memory controller"
    if not os.access(d, os.W_OK):
        return False, f"{d} is not writable"
    return True, f"{d} is writable with the memory controller"


def probe_isolation(env: ProbeEnv, cg: CgroupInfo) -> IsolationInfo:
    info = IsolationInfo()
    info.systemd_run_scope, sd_detail = check_systemd_scope(env)
    info.cgroup_v2_writable, cg_detail = check_cgroup_writable(env, cg)
    if info.systemd_run_scope:
        info.method, info.detail = "systemd-run", sd_detail
    elif info.cgroup_v2_writable:
        info.method, info.detail = "cgroup", cg_detail
    else:
        info.detail = f"{sd_detail}; {cg_detail}"
    return info
