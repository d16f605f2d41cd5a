"""NVIDIA GPUs through nvidia-smi (with a timeout; NVML when nvidia-ml-py is installed).

No driver, no binary, a hung or failing nvidia-smi: all mean "no GPU", never an exception.
A GPU whose memory reads [N/A] / Not Supported is unified memory (GB10 / DGX Spark): it is
sized from /proc/meminfo and shares it with the page cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3tui.probe.env import ProbeEnv
from k3tui.units import MiB

GPU_FIELDS = ["index", "name", "uuid", "pci.bus_id", "memory.total", "memory.used",
              "memory.free", "driver_version", "compute_cap"]
UNKNOWN = {"[n/a]", "n/a", "[not supported]", "not supported", "[insufficient permissions]",
           "[unknown error]", ""}


@dataclass
class Gpu:
    index: int = 0
    name: str = ""
    uuid: str = ""
    bus_id: str = ""
    memory_total_bytes: int | None = None  # None = not reported (unified memory)
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    compute_cap: str = ""
    addressing_mode: str = ""  # "ATS" | "HMM" | "None" | "" (unknown)
    unified: bool = False


@dataclass
class GpuApp:
    pid: int
    name: str
    used_bytes: int | None
    gpu_uuid: str = ""


@dataclass
class GpuInfo:
    present: bool = False
    source: str = ""  # "nvidia-smi" | "nvml" | ""
    driver_version: str = ""
    gpus: list[Gpu] = field(default_factory=list)
    apps: list[GpuApp] = field(default_factory=list)
    note: str = ""  # why there is no GPU / what failed

    @property
    def unified_memory(self) -> bool:
        return any(g.unified for g in self.gpus)

    @property
    def discrete_memory_bytes(self) -> int:
        return sum(g.memory_total_bytes or 0 for g in self.gpus if not g.unified)

    @property
    def held_by_apps_bytes(self) -> int:
        return sum(a.used_bytes or 0 for a in self.apps)


def _value(text: str) -> str | None:
    text = text.strip()
    return None if text.lower() in UNKNOWN else text


def _mib(text: str) -> int | None:
    v = _value(text)
    try:
        return int(float(v) * MiB) if v is not None else None
    except ValueError:
        return None


def parse_gpu_csv(text: str) -> list[Gpu]:
    gpus = []
    for line in text.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < len(GPU_FIELDS):
            continue
        idx = _value(cols[0])
        g = Gpu(index=int(idx) if idx and idx.isdigit() else len(gpus),
                name=_value(cols[1]) or "", uuid=_value(cols[2]) or "",
                bus_id=_value(cols[3]) or "", memory_total_bytes=_mib(cols[4]),
                memory_used_bytes=_mib(cols[5]), memory_free_bytes=_mib(cols[6]),
                compute_cap=_value(cols[8]) or "")
        g.unified = g.memory_total_bytes is None
        gpus.append(g)
    return gpus


def parse_apps_csv(text: str) -> list[GpuApp]:
    apps = []
    for line in text.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 3 or not cols[0].isdigit():
            continue
        apps.append(GpuApp(pid=int(cols[0]), name=cols[1], used_bytes=_mib(cols[2]),
                           gpu_uuid=cols[3] if len(cols) > 3 else ""))
    return apps


def _query(env: ProbeEnv, what: str, fields: str):
    return env.run([*env.nvidia_smi, f"--query-{what}={fields}",
                    "--format=csv,noheader,nounits"])


def probe_gpu(env: ProbeEnv) -> GpuInfo:
    info = GpuInfo()
    res = _query(env, "gpu", ",".join(GPU_FIELDS))
    if res is None:
        if env.use_nvml:
            nv = _probe_nvml()
            if nv is not None:
                return nv
        info.note = "no NVIDIA driver (nvidia-smi not found or not answering)"
        return info
    if res.returncode != 0:
        info.note = f"nvidia-smi failed: {(res.stdout + res.stderr).strip()[:200]}"
        return info
    info.gpus = parse_gpu_csv(res.stdout)
    if not info.gpus:
        info.note = "nvidia-smi lists no GPU"
        return info
    info.present = True
    info.source = "nvidia-smi"
    drv = res.stdout.splitlines()[0].split(",")
    info.driver_version = _value(drv[7]) or "" if len(drv) > 7 else ""
    # A separate query: on older drivers an unknown field fails the whole command.
    mode = _query(env, "gpu", "addressing_mode")
    if mode is not None and mode.returncode == 0:
        for g, line in zip(info.gpus, mode.stdout.splitlines()):
            g.addressing_mode = _value(line) or ""
    apps = _query(env, "compute-apps", "pid,process_name,used_memory,gpu_uuid")
    if apps is not None and apps.returncode == 0:
        info.apps = parse_apps_csv(apps.stdout)
    return info


def _probe_nvml() -> GpuInfo | None:
    """NVML path for machines without nvidia-smi on PATH; None when NVML is not usable."""
    try:
        import pynvml  # nvidia-ml-py, optional
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    info = GpuInfo(present=True, source="nvml")
    try:
        drv = pynvml.nvmlSystemGetDriverVersion()
        info.driver_version = drv.decode() if isinstance(drv, bytes) else str(drv)
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            g = Gpu(index=i, name=name.decode() if isinstance(name, bytes) else str(name))
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                g.memory_total_bytes, g.memory_used_bytes = int(mem.total), int(mem.used)
                g.memory_free_bytes = int(mem.free)
            except pynvml.NVMLError:
                g.unified = True  # NOT_SUPPORTED on GB10
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                g.compute_cap = f"{major}.{minor}"
            except pynvml.NVMLError:
                pass
            try:
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                    used = getattr(p, "usedGpuMemory", None)
                    info.apps.append(GpuApp(pid=int(p.pid), name="", used_bytes=used))
            except pynvml.NVMLError:
                pass
            info.gpus.append(g)
    except Exception as exc:  # a half-working driver must not crash the probe
        info.note = f"NVML error: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    info.present = bool(info.gpus)
    return info
