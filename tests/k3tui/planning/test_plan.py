"""Plan decisions, table-tested over built-in profiles and probes of captured trees."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from probe_helpers import env_for
from k3tui.planning.plan import (DRIVER_RESERVE_BYTES, PRESETS, SAFETENSORS_BYTES, make_plan,
                                 pick_preset, recommend_model_kind)
from k3tui.probe import list_profiles, load_report, probe_machine

GB, GiB = 1000**3, 1024**3


def codes(plan, level=None):
    return {f.code for f in plan.findings if level is None or f.level == level}


def test_profiles_exist_and_load():
    assert {"dgx-spark", "laptop-8g", "workstation-128g", "server-228g"} <= set(list_profiles())
    for name in list_profiles():
        r = load_report(name)
        assert r.source == f"profile:{name}" and r.description


@pytest.mark.parametrize("machine, kind, backend, preset", [
    ("laptop-8g", "safetensors", "bundled", "laptop"),
    ("server-228g", "safetensors", "bundled", "server"),
    ("workstation-128g", "safetensors", "bundled", "workstation"),
    ("dgx-spark", "safetensors", "bundled", "workstation"),
    ("dgx-spark", "gguf", "llama-server", ""),
    ("workstation-128g", "gguf", "llama-server", ""),
    ("laptop-8g", "remote", "remote", ""),
])
def test_backend_and_preset_table(machine, kind, backend, preset):
    plan = make_plan(load_report(machine), kind)
    assert (plan.backend, plan.preset) == (backend, preset)
    assert plan.backend_reason
    if preset:
        p = PRESETS[preset]
        assert (plan.trunk_gb, plan.cache_gb) == (p.trunk_gb, p.cache_gb)
        assert preset in plan.preset_reason
    assert not plan.blockers


def test_dgx_spark_gguf_flags_and_limit():
    report = load_report("dgx-spark")
    plan = make_plan(report, "gguf", reasoning_budget=1024)
    args = plan.llama_server_args
    for flag in ["--cpu-moe", "--no-host"]:
        assert flag in args
    assert args[args.index("--load-mode") + 1] == "mmap"
    assert args[args.index("--parallel") + 1] == "1"
    assert args[args.index("--reasoning-budget") + 1] == "1024"
    assert "--no-mmap" not in args and "--mmap" not in args  # removed from llama.cpp
    assert plan.memory_limit_bytes is not None
    assert report.memory.total_bytes - plan.memory_limit_bytes >= 25 * GiB
    assert plan.memory_limit_bytes > 80 * GiB  # and not absurdly small
    assert "unified_memory" in codes(plan, "info")  # the limit handles it: nothing to do
    assert all(reason for _, reason in plan.flag_reasons)


def test_busy_gb10_lowers_the_limit_and_warns():
    # a probe of the captured DGX Spark tree with ollama holding 36 GiB on the GPU
    idle = probe_machine("/", env=env_for("spark", "gb10"), check_isolation=False)
    busy = probe_machine("/", env=env_for("spark", "busy"), check_isolation=False)
    p_idle, p_busy = make_plan(idle, "gguf"), make_plan(busy, "gguf")
    assert idle.memory.total_bytes - p_idle.memory_limit_bytes == DRIVER_RESERVE_BYTES
    assert p_idle.memory_limit_bytes - p_busy.memory_limit_bytes == 36 * GiB
    busy_finding = next(f for f in p_busy.findings if f.code == "gpu_busy")
    assert "ollama" in busy_finding.message and "48211" in busy_finding.message
    assert "gpu_busy" not in codes(p_idle)


def test_discrete_gpu_has_no_no_host_and_cpu_only_has_no_cpu_moe():
    ws = make_plan(load_report("workstation-128g"), "gguf")
    assert "--cpu-moe" in ws.llama_server_args and "--no-host" not in ws.llama_server_args
    server = make_plan(load_report("server-228g"), "gguf")
    assert "--cpu-moe" not in server.llama_server_args
    assert server.llama_server_args[server.llama_server_args.index("--n-gpu-layers") + 1] == "0"
    assert "no_gpu" in codes(server, "warn")


def test_not_enough_disk_is_a_blocker():
    r = load_report("server-228g")
    r.storage.free_bytes = int(1.2e12)  # 1.2 TB free for the 1.56 TB checkpoint
    plan = make_plan(r, "safetensors")
    assert [f.code for f in plan.blockers] == ["disk_space"]
    assert "1.20 TB free" in plan.blockers[0].message
    # what is already downloaded counts
    plan = make_plan(r, "safetensors", have_bytes=SAFETENSORS_BYTES - int(1.0e12))
    assert not plan.blockers
    # room for the checkpoint but not the packed trunk: a warning, not a blocker
    r.storage.free_bytes = SAFETENSORS_BYTES + 10 * GB
    plan = make_plan(r, "safetensors")
    assert not plan.blockers and "disk_space_trunk" in codes(plan, "warn")


@pytest.mark.parametrize("change, code, level", [
    ({"fs_class": "network", "fstype": "nfs4"}, "network_fs", "warn"),
    ({"fs_class": "fuse", "fstype": "fuse.rclone"}, "fuse_fs", "warn"),
    ({"fs_class": "tmpfs", "fstype": "tmpfs"}, "tmpfs", "warn"),
    ({"fs_class": "overlay", "fstype": "overlay"}, "overlay_fs", "warn"),
    ({"o_direct": False}, "no_o_direct", "warn"),
    ({"disk_kind": "hdd"}, "rotational", "warn"),
    ({"fs_class": "pseudo", "fstype": "proc"}, "pseudo_fs", "blocker"),
])
def test_storage_findings(change, code, level):
    r = load_report("server-228g")
    r.storage = dataclasses.replace(r.storage, **change)
    plan = make_plan(r, "safetensors")
    f = next(f for f in plan.findings if f.code == code)
    assert f.level == level and f.message and f.next


def test_missing_isolation_is_reported_for_llama_server():
    r = load_report("dgx-spark")
    r.isolation.method = "none"
    # unified memory: an unconfined llama-server is the lockup, so serve refuses it
    assert "no_isolation" in codes(make_plan(r, "gguf"), "blocker")
    r = load_report("workstation-128g")
    r.isolation.method = "none"
    assert "no_isolation" in codes(make_plan(r, "gguf"), "warn")
    assert "no_isolation" not in codes(make_plan(load_report("dgx-spark"), "gguf"))


def test_cgroup_limit_caps_llama_server_and_preset():
    r = probe_machine("/", env=env_for("v2", "h100"), check_isolation=False)
    plan = make_plan(r, "gguf")
    assert plan.memory_limit_bytes <= 16 * GiB - GiB
    plan = make_plan(r, "safetensors")
    assert plan.preset == "laptop"  # 15 GiB left in the 16 GiB cgroup: below desktop's 31.9 GB
    assert "memory_pressure" in codes(plan, "warn")  # PSI some avg10 = 12.5


def test_pick_preset_thresholds_and_never_max():
    assert pick_preset(2 * GB).name == "laptop"
    assert pick_preset(40 * GB).name == "desktop"
    assert pick_preset(110 * GB).name == "workstation"
    assert pick_preset(500 * GB).name == "server"
    assert all(pick_preset(n * GB).name != "max" for n in range(1, 1000, 7))


def test_tiny_memory_blocks_the_bundled_engine():
    r = load_report("laptop-8g")
    r.memory.available_bytes = 4 * GiB
    plan = make_plan(r, "safetensors")
    assert "memory_floor" in codes(plan, "blocker")


def test_recommendation():
    assert recommend_model_kind(load_report("dgx-spark")) == "gguf"
    assert recommend_model_kind(load_report("laptop-8g")) == "safetensors"
    assert recommend_model_kind(load_report("server-228g")) == "safetensors"


def run_k3(*args):
    return subprocess.run([sys.executable, "-m", "k3tui", *args], capture_output=True, text=True)


def test_plan_command_dgx_spark_gguf_text_and_json():
    res = run_k3("plan", "--machine", "dgx-spark", "--model", "gguf")
    assert res.returncode == 0, res.stderr
    for text in ["llama-server", "--cpu-moe", "--no-host", "--load-mode mmap", "--parallel 1",
                 "--reasoning-budget 2048", "Memory limit:", "the driver and the system",
                 "DGX Spark lockup"]:
        assert text in res.stdout, text
    res = run_k3("plan", "--machine", "dgx-spark", "--model", "gguf", "--json")
    data = json.loads(res.stdout)
    assert isinstance(data["plan"]["llama_server_args"], list)
    assert "--cpu-moe" in data["plan"]["llama_server_args"]
    total = data["machine"]["memory"]["total_bytes"]
    assert total - data["plan"]["memory_limit_bytes"] >= 25 * GiB


def test_plan_command_accepts_a_report_file_and_refuses_unknown(tmp_path):
    r = load_report("laptop-8g")
    f = tmp_path / "box.json"
    f.write_text(r.to_json())
    res = run_k3("plan", "--machine", str(f), "--model", "safetensors")
    assert res.returncode == 0 and "laptop (trunk 3 GB" in res.stdout
    res = run_k3("plan", "--machine", "nosuchbox")
    assert res.returncode == 2 and "dgx-spark" in res.stderr and "Traceback" not in res.stderr
    f.write_text("{not json")
    res = run_k3("plan", "--machine", str(f))
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_plan_users_delegates_to_capacity():
    res = run_k3("plan", "--users", "50", "--requests-per-user-day", "20",
                 "--tokens-per-answer", "500", "--tok-per-s", "0.37")
    try:
        import k3tui.planning.capacity  # noqa: F401
    except ImportError:
        assert res.returncode == 2 and "not built yet" in res.stderr
    else:
        assert res.returncode == 0, res.stderr
        assert "68" in res.stdout  # the study's moderate row
