"""Can k3tui put a hard memory limit on a backend process?

Two ways: a transient systemd user scope (only trusted when the limit reads back from inside
the scope: user units silently ignore limits without memory delegation), or a writable
cgroup v2 directory with the memory controller.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engine.weights.sysmem import CgroupInfo
from k3tui.probe.env import ProbeEnv

TEST_LIMIT = 256 * 1024 * 1024
READ_BACK = 'cat /sys/fs/cgroup$(sed -n "s/^0:://p" /proc/self/cgroup)/memory.max'


@dataclass
class IsolationInfo:
    method: str = "none"  # "systemd-run" | "cgroup" | "none"
    systemd_run_scope: bool = False
    cgroup_v2_writable: bool = False
    detail: str = ""


def check_systemd_scope(env: ProbeEnv) -> tuple[bool, str]:
    res = env.run([*env.systemd_run, "--user", "--scope", "--quiet",
                   "-p", f"MemoryMax={TEST_LIMIT}", "-p", "MemorySwapMax=0", "--",
                   "sh", "-c", READ_BACK], timeout=min(env.timeout_s, 3.0))
    if res is None:
        return False, "systemd-run is not available"
    if res.returncode != 0:
        msg = (res.stderr or res.stdout).strip().splitlines()
        return False, f"systemd-run --user --scope failed: {msg[-1] if msg else res.returncode}"
    if res.stdout.strip() != str(TEST_LIMIT):
        return False, (f"systemd-run ran, but the scope's memory.max read "
                       f"{res.stdout.strip() or 'nothing'} (limits are silently ignored)")
    return True, "systemd-run --user --scope applies MemoryMax (read back from the scope)"


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
