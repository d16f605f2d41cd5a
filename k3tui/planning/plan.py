"""MachineReport + checkpoint kind → what k3tui would run, and why. Pure functions only.

Sizes and preset numbers come from the model spec (§1.2, §2.4, §4): the preset table is the
peer engine's measured peak RSS per preset, so a preset is picked only when that peak fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from k3tui.probe.limits import ISOLATION_NEXT
from k3tui.probe.report import MachineReport
from k3tui.units import GB, GiB, disk_size, gib
from k3vocab import DEFAULT_CONTEXT
from k3vocab import PRESETS as VOCAB_PRESETS

SAFETENSORS_BYTES = 1_560_936_091_448  # 96 shards
# what `k3tui pack` writes: the 93 trunk runs (spec §2.2); embed/lm_head (4.70 GB) stay in
# their shard and are not copied
TRUNK_PACK_BYTES = 108_810_000_000
GGUF_BYTES = 579_500_000_000  # Kimi-K3 IQ1_S, 34 files

MODEL_LABELS = {
    "safetensors": "Kimi-K3 safetensors (1,560.9 GB in 96 files)",
    "gguf": "Kimi-K3 IQ1_S GGUF (579.5 GB in 34 files)",
    "remote": "a remote Kimi-K3 endpoint (nothing to download)",
}


@dataclass(frozen=True)
class Preset:
    name: str
    trunk_gb: float
    cache_gb: float
    peak_rss_gb: float  # measured by the peer engine at this preset
    s_per_token: str  # the peer's measured range (spec §4, v0.1 and v1.0 runs); README's table

    @property
    def speed(self) -> str:
        """The C engine's figure: "~27–33 s/token" (or "not faster than server")."""
        return f"{self.s_per_token} s/token" if self.s_per_token[0] == "~" else self.s_per_token


# The one table of expected speeds (wizard, plan and README) until issue 15's forecast
# replaces it with figures measured on this machine.
PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("laptop", *VOCAB_PRESETS["laptop"], 8.2, "~27–33"),
    Preset("desktop", *VOCAB_PRESETS["desktop"], 31.9, "~24–31"),
    Preset("workstation", *VOCAB_PRESETS["workstation"], 95.5, "~20–24"),
    Preset("server", *VOCAB_PRESETS["server"], 128.0, "~6–11"),
    Preset("max", *VOCAB_PRESETS["max"], 224.0, "not faster than server"),
]}
# Where those figures come from, said wherever one is shown without this machine's forecast.
PEER_SOURCE = ("measured by kimi-k3-in-c, a C engine for Kimi-K3, on a 124-core server with "
               "fast NVMe; this machine's own: `k3tui bench forecast`")
PRESET_HEADROOM = 1.05  # the peer's forecast missed peak RSS by up to 1.84 GB
MIN_USABLE_BYTES = 3 * GB  # the peer's `--preset auto` refuses below this
DRIVER_RESERVE_BYTES = 25 * GiB  # unified memory: left to the GPU driver and the system
LLAMA_MIN_BYTES = 4 * GiB  # below this even the mmap'd trunk thrashes
DEFAULT_REASONING_BUDGET = 2048
# blockers about where the checkpoint is downloaded: they do not stop serving a model that is here
DOWNLOAD_BLOCKERS = ("not_a_dir", "disk_space", "pseudo_fs")


@dataclass
class Finding:
    level: str  # "info" | "warn" | "blocker"
    code: str
    message: str  # one line: what and why
    next: str = ""  # the command or action that fixes it


@dataclass
class Plan:
    model_kind: str
    model_label: str
    backend: str  # "bundled" | "llama-server" | "remote"
    backend_reason: str
    preset: str = ""  # bundled only: a preset name or "custom"
    preset_reason: str = ""
    trunk_gb: float = 0.0
    cache_gb: float = 0.0
    threads: int = 0
    llama_server_args: list[str] = field(default_factory=list)  # flags after binary/model/host/port
    flag_reasons: list[list[str]] = field(default_factory=list)  # [flag, why]
    memory_limit_bytes: int | None = None
    memory_limit_reason: str = ""
    download_bytes: int = 0
    disk_needed_bytes: int = 0
    findings: list[Finding] = field(default_factory=list)
    rpc_workers: list[str] = field(default_factory=list)  # llama-server as a pool's head

    @property
    def blockers(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "blocker"]

    @property
    def launch_blockers(self) -> list[Finding]:
        """The blockers that stop `k3tui serve` (and the chat) from starting the backend."""
        return [f for f in self.blockers if f.code not in DOWNLOAD_BLOCKERS]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["blockers"] = len(self.blockers)
        return d


def usable_bytes(report: MachineReport) -> int:
    """RAM the bundled engine may plan with: available (cgroup-clamped) minus a reserve."""
    avail = report.memory.effective_available_bytes
    reserve = 2 * GiB + int(0.02 * avail)
    return max(0, avail - reserve)


def pick_preset(usable: int) -> Preset:
    """The biggest named preset whose measured peak fits; `max` is never worth it."""
    for name in ("server", "workstation", "desktop"):
        p = PRESETS[name]
        if usable >= p.peak_rss_gb * PRESET_HEADROOM * GB:
            return p
    return PRESETS["laptop"]


def recommend_model_kind(report: MachineReport) -> str:
    """GGUF + llama-server where a GPU (or unified memory) can take the trunk, else the
    bundled engine on the original safetensors."""
    gpu = report.gpu
    if gpu.present and (gpu.unified_memory or gpu.discrete_memory_bytes >= 16 * GiB):
        return "gguf"
    return "safetensors"


def _storage_findings(report: MachineReport, need: int, extra: int, have: int,
                      model_kind: str) -> list[Finding]:
    s = report.storage
    out: list[Finding] = []
    where = s.path or "the model directory"
    missing = max(0, need - have)
    if s.not_a_dir:
        return [Finding("blocker", "not_a_dir", f"{s.probed_path or where} is a file, not a folder",
                        "choose a folder for the checkpoint (`k3tui setup`)")]
    if s.free_bytes and s.free_bytes < missing:
        out.append(Finding(
            "blocker", "disk_space",
            f"not enough disk: {where} has {disk_size(s.free_bytes)} free, the checkpoint "
            f"still needs {disk_size(missing)}"
            + (f" and its packed trunk {disk_size(extra)}" if extra else "")
            + f" ({disk_size(missing + extra - s.free_bytes)} short)",
            "pick a bigger disk with `k3tui setup` (or `k3tui doctor --dir PATH` to check one)"))
    elif extra and s.free_bytes and s.free_bytes < missing + extra:
        out.append(Finding(
            "warn", "disk_space_trunk",
            f"room for the checkpoint but not for the packed trunk "
            f"({extra / GB:.0f} GB more) on {where}",
            "put the trunk on another disk: `k3tui config set model.trunk_dir PATH`"))
    if s.fs_class == "network":
        out.append(Finding(
            "warn", "network_fs",
            f"{where} is on a network volume ({s.fstype}): expect streaming several times "
            f"slower than a local NVMe", "choose a local disk in `k3tui setup` if you have one"))
    elif s.fs_class == "fuse":
        out.append(Finding("warn", "fuse_fs",
                           f"{where} is on a FUSE filesystem ({s.fstype}): reads are slow "
                           f"and O_DIRECT may not bypass caching", "choose a local disk"))
    elif s.fs_class == "tmpfs":
        out.append(Finding("warn", "tmpfs",
                           f"{where} is RAM-backed ({s.fstype}): it competes with the model for "
                           f"memory and is lost at reboot", "choose a disk-backed directory"))
    elif s.fs_class == "pseudo":
        out.append(Finding("blocker", "pseudo_fs",
                           f"{where} is on a kernel pseudo filesystem ({s.fstype}), not a disk",
                           "choose a directory on a real disk"))
    elif s.fs_class == "overlay":
        out.append(Finding("warn", "overlay_fs",
                           f"{where} is inside a container layer (overlay): mount a host volume "
                           f"for the checkpoint", "run the container with -v HOSTDIR:DIR"))
    if s.o_direct is False and model_kind == "safetensors":
        out.append(Finding("warn", "no_o_direct",
                           f"{where} refuses O_DIRECT: the engine falls back to buffered reads "
                           f"and the page cache decides what stays in memory",
                           "choose a local ext4/xfs disk"))
    elif s.o_direct is None and s.path:
        out.append(Finding("warn", "not_writable",
                           f"could not write a test file in {where}",
                           f"create it and make it yours: mkdir -p {where}"))
    if s.disk_kind == "hdd":
        out.append(Finding("warn", "rotational",
                           f"{where} is on a rotational disk: expert reads are random, "
                           f"expect minutes per token", "use an SSD/NVMe"))
    elif s.disk_kind == "virtual" and s.read_mb_s_qd1 is None:
        out.append(Finding("info", "virtual_disk",
                           f"{where} is on a virtual disk: its speed is unknown",
                           "measure it: `k3tui doctor --measure`"))
    if s.read_mb_s_qd8 is not None and s.read_mb_s_qd8 < 1000:
        out.append(Finding("warn", "slow_disk",
                           f"measured {s.read_mb_s_qd8:.0f} MB/s at QD8: ~26 GB of experts per "
                           f"token take {26e3 / max(s.read_mb_s_qd8, 1):.0f} s",
                           "use a faster NVMe if you have one"))
    return out


def _gpu_findings(report: MachineReport, backend: str) -> list[Finding]:
    apps = report.gpu.apps
    if not apps:
        return []
    if backend == "llama-server":
        from k3tui.backends.llama.server import gpu_refusal

        refusal = gpu_refusal(report)
        if refusal is not None:  # what the launch itself decides, word for word
            return [Finding("blocker", "gpu_busy",
                            f"`k3tui serve` will refuse to start llama-server: {refusal[0]}",
                            refusal[1])]
    held = report.gpu.held_by_apps_bytes
    who = ", ".join(f"{a.name or '?'} (pid {a.pid}, {gib(a.used_bytes or 0)})" for a in apps)
    return [Finding("warn", "gpu_busy", f"GPU memory held by other processes: {who}",
                    f"stop them before starting the model (they hold {gib(held)})")]


def _memory_findings(report: MachineReport) -> list[Finding]:
    m = report.memory
    out = []
    if m.psi_some_avg10 is not None and m.psi_some_avg10 >= 10:
        out.append(Finding("warn", "memory_pressure",
                           f"memory pressure right now: PSI some avg10 = {m.psi_some_avg10:.1f}%",
                           "close memory-hungry programs"))
    if m.cgroup_limit_bytes is not None and m.cgroup_limit_bytes < m.total_bytes:
        out.append(Finding("info", "cgroup_limit",
                           f"a cgroup limit of {gib(m.cgroup_limit_bytes)} caps k3tui "
                           f"(the machine has {gib(m.total_bytes)})"))
    return out


def _plan_bundled(report: MachineReport, plan: Plan) -> None:
    usable = usable_bytes(report)
    preset = pick_preset(usable)
    plan.preset, plan.trunk_gb, plan.cache_gb = preset.name, preset.trunk_gb, preset.cache_gb
    plan.threads = report.cpu.usable
    plan.preset_reason = (f"{preset.name} (trunk {preset.trunk_gb:g} GB, cache "
                          f"{preset.cache_gb:g} GB, peak ~{preset.peak_rss_gb:g} GB): "
                          f"{usable / GB:.1f} GB usable of {report.memory.total_bytes / GB:.1f} GB "
                          "RAM")
    if usable < MIN_USABLE_BYTES:
        plan.findings.append(Finding(
            "blocker", "memory_floor",
            f"only {usable / GB:.1f} GB of RAM usable; the engine needs at least "
            f"{MIN_USABLE_BYTES / GB:.0f} GB", "close programs or use a remote endpoint"))
    elif usable < preset.peak_rss_gb * GB:
        plan.findings.append(Finding(
            "warn", "below_laptop_floor",
            f"{usable / GB:.1f} GB usable is below the laptop preset's measured peak "
            f"({preset.peak_rss_gb:g} GB): expect swapping or set a smaller trunk",
            "close other programs, or `k3tui config set engine.trunk_gb 2.0` "
            "(that switches engine.preset to custom)"))
    if report.gpu.unified_memory:
        plan.findings.append(Finding(
            "info", "unified_memory",
            "unified memory: the bundled engine reads with O_DIRECT, so it does not grow "
            "the page cache that the GPU shares"))


def _plan_llama(report: MachineReport, plan: Plan, ctx: int, budget: int,
                pooled: bool = False) -> None:
    gpu, mem = report.gpu, report.memory
    threads = report.cpu.usable
    plan.threads = threads
    args: list[str] = []
    why: list[list[str]] = []

    def add(flag: list[str], reason: str) -> None:
        args.extend(flag)
        why.append([" ".join(flag), reason])

    if pooled:
        add(["--n-gpu-layers", "99"], "every layer on a device: the pool's workers (and this "
                                      "machine's GPU, if any) hold them all")
        add(["--verbosity", "4"], "the log names what the head puts on each worker (the "
                                  "chat's I/O pane shows it)")
        if gpu.unified_memory:
            add(["--no-host"], "unified memory: no separate pinned host copy of the weights")
    elif gpu.present:
        add(["--n-gpu-layers", "99"], "attention and the dense trunk on the GPU")
        add(["--cpu-moe"], f"the {GGUF_BYTES / GB:.0f} GB of experts stay in host memory, "
                           "paged from the SSD through mmap")
        if gpu.unified_memory:
            add(["--no-host"], "unified memory: no separate pinned host copy of the weights")
    else:
        add(["--n-gpu-layers", "0"], "no GPU: everything on the CPU")
    add(["--load-mode", "mmap"], "map the GGUF instead of reading it into RAM: the model is "
                                 "far larger than memory (--mmap/--no-mmap are deprecated for it)")
    add(["--parallel", "1"], "one slot: a single user gets the whole context and KV cache")
    add(["--ctx-size", str(ctx)], "explicit, so --fit does not shrink it")
    add(["--reasoning-budget", str(budget)], "cap thinking tokens so an answer arrives")
    add(["--threads", str(threads)], f"{threads} usable cores")
    plan.llama_server_args, plan.flag_reasons = args, why

    if gpu.unified_memory:
        held = gpu.held_by_apps_bytes
        limit = mem.total_bytes - DRIVER_RESERVE_BYTES - held
        reason = (f"{gib(mem.total_bytes)} unified memory minus "
                  f"{gib(DRIVER_RESERVE_BYTES)} for the driver and the system")
        if held:
            reason += f" minus {gib(held)} held by other GPU processes"
        risk = ("unified memory is shared by the GPU and the page cache: an uncapped mmap of "
                "the GGUF can starve CUDA and lock the machine up (the DGX Spark lockup)")
        if report.isolation.method != "none":  # handled: said, not a warning with no action
            plan.findings.append(Finding("info", "unified_memory", f"{risk}; k3tui starts "
                                         "llama-server under the memory limit above"))
        else:
            plan.findings.append(Finding(
                "warn", "unified_memory", risk, "`k3tui serve` refuses to start llama-server "
                "here until the limit can be enforced (see no_isolation)"))
    else:
        reserve = max(2 * GiB, int(0.1 * mem.effective_total_bytes))
        limit = mem.effective_total_bytes - reserve
        reason = f"{gib(mem.effective_total_bytes)} RAM minus {gib(reserve)} for the system"
        if not gpu.present and not pooled:
            plan.findings.append(Finding(
                "warn", "no_gpu",
                "no GPU: llama-server runs the GGUF on the CPU through mmap (expect well under "
                "1 token/s); the bundled engine is built for this case",
                "`k3tui setup` and choose the safetensors checkpoint"))
    if mem.cgroup_limit_bytes is not None and mem.cgroup_limit_bytes - GiB < limit:
        limit = mem.cgroup_limit_bytes - GiB
        reason += f", capped by the cgroup limit {gib(mem.cgroup_limit_bytes)} minus 1 GiB"
    if limit < LLAMA_MIN_BYTES:
        plan.findings.append(Finding(
            "blocker", "memory_limit_too_small",
            f"only {gib(max(limit, 0))} would be left for llama-server ({reason}; it "
            f"needs at least {gib(LLAMA_MIN_BYTES)}), so no memory limit could confine it",
            "free memory (stop other GPU processes), set `memory_limit_gb` in [llama_server], "
            "or use the bundled engine"))
    plan.memory_limit_bytes = max(0, int(limit))
    plan.memory_limit_reason = reason
    if report.isolation.method == "none":
        # on unified memory an unconfined server is the lockup itself: serve refuses it
        plan.findings.append(Finding(
            "blocker" if gpu.unified_memory else "warn", "no_isolation",
            "no way to enforce the memory limit here (no systemd user scope with MemoryMax, no "
            "writable cgroup v2): "
            + ("on unified memory k3tui refuses to start llama-server unconfined (--force "
               "overrides)" if gpu.unified_memory else "k3tui can only watch llama-server's "
                                                       "memory"),
            ISOLATION_NEXT))


def make_plan(report: MachineReport, model_kind: str, *, ctx_size: int = DEFAULT_CONTEXT,
              reasoning_budget: int = DEFAULT_REASONING_BUDGET, have_bytes: int = 0,
              trunk_on_same_disk: bool = True, rpc: Sequence[str] = ()) -> Plan:
    """What k3tui would do with `model_kind` on the machine `report` describes; `rpc`:
    as the head of a pool of these RPC workers (llama-server only)."""
    if model_kind not in MODEL_LABELS:
        raise ValueError(f"unknown model kind {model_kind!r}")
    if model_kind == "remote":
        return Plan(model_kind, MODEL_LABELS[model_kind], "remote",
                    "the model runs elsewhere; k3tui only connects over HTTP",
                    findings=[Finding("info", "remote", "nothing is downloaded or started here",
                                      "`k3tui setup` asks for the URL and tests it")])
    if model_kind == "gguf":
        plan = Plan(model_kind, MODEL_LABELS[model_kind], "llama-server",
                    "a GGUF runs in llama.cpp's llama-server"
                    + (" with the GPU taking the trunk" if report.gpu.present else ""))
        need, extra = GGUF_BYTES, 0
        plan.rpc_workers = list(rpc)
        _plan_llama(report, plan, ctx_size, reasoning_budget, pooled=bool(rpc))
    else:
        plan = Plan(model_kind, MODEL_LABELS[model_kind], "bundled",
                    "the bundled engine streams the safetensors from disk under a memory "
                    "budget; no GPU needed")
        need, extra = SAFETENSORS_BYTES, (TRUNK_PACK_BYTES if trunk_on_same_disk else 0)
        _plan_bundled(report, plan)
    plan.download_bytes = max(0, need - have_bytes)
    plan.disk_needed_bytes = need + extra
    plan.findings[:0] = _storage_findings(report, need, extra, have_bytes, model_kind)
    plan.findings += _gpu_findings(report, plan.backend) + _memory_findings(report)
    return plan


def peer_speed_lines(preset: str) -> list[str]:
    """The one speed shown for `preset` where this machine has no forecast: the C engine's,
    saying whose it is (nothing for custom and auto, which have no figure)."""
    p = PRESETS.get(preset)
    return [f"Speed:   {p.speed} ({PEER_SOURCE})"] if p else []


def describe_machine(report: MachineReport, binary: bool = False) -> list[str]:
    """Short human lines about the machine (used by plan, doctor and the wizard). RAM in GB
    like the presets it is compared with; `binary`: in GiB, like llama-server's limit."""
    c, m, g, s = report.cpu, report.memory, report.gpu, report.storage
    simd = ", ".join(n for n, ok in (("AVX2", c.avx2), ("AVX-512", c.avx512),
                                     ("NEON", c.neon)) if ok) or "no SIMD"
    lines = [f"CPU     {c.usable} usable cores, {c.arch} ({simd})"]

    def mem(n: int) -> str:
        return gib(n) if binary else f"{n / GB:.1f} GB"

    ram = f"RAM     {mem(m.total_bytes)} total, {mem(m.available_bytes)} available"
    if m.cgroup_limit_bytes is not None:
        ram += f", cgroup limit {mem(m.cgroup_limit_bytes)}"
    lines.append(ram)
    if not g.present:
        lines.append("GPU     no GPU")
    for gpu in g.gpus:
        mem = "unified memory" if gpu.unified else gib(gpu.memory_total_bytes or 0)
        lines.append(f"GPU     {gpu.name} ({mem})")
    if s.path:
        disk = s.disk_kind if s.disk_kind != "unknown" else "disk"
        lines.append(f"Disk    {s.path}: {s.fs_class} {s.fstype} on {disk}"
                     f"{' ' + s.device if s.device else ''}, {disk_size(s.free_bytes)} free")
    return lines


def format_plan(plan: Plan, report: MachineReport, model_path: str | None = None,
                forecast: list[str] | None = None) -> str:
    """The plan as `k3tui plan` prints it; `model_path` names the model in the command
    (default: a placeholder for the first of the published shards); `forecast`: the lines of
    this machine's measured forecast (k3tui/planning/forecast.py), shown under the preset."""
    out = []
    title = report.description or report.source
    out.append(f"Machine: {title}")
    out += [f"  {line}" for line in describe_machine(report, plan.backend == "llama-server")]
    out.append(f"Model:   {plan.model_label}")
    out.append(f"Backend: {plan.backend}: {plan.backend_reason}")
    if plan.backend == "bundled":
        out.append(f"Preset:  {plan.preset_reason}")
        out += forecast or peer_speed_lines(plan.preset)
        out.append(f"Threads: {plan.threads}")
    if plan.backend == "llama-server":
        from k3tui.backends.llama.command import planned_command

        iso = getattr(report, "isolation", None)
        method = getattr(iso, "method", "none") or "none"
        limit = plan.memory_limit_bytes
        shown = {"model": model_path} if model_path else {}
        cmd = planned_command(plan.llama_server_args, limit_bytes=limit, method=method,
                              rpc=plan.rpc_workers, **shown)
        out.append("Command: " + " ".join(cmd))
        if limit is not None:
            out.append(f"Memory limit: {gib(limit)} ({limit} bytes) = "
                       f"{plan.memory_limit_reason}")
            assumed = "assumed for this profile" in (getattr(iso, "detail", "") or "")
            check = "; checked again at launch" if assumed else ""
            if method == "systemd-run":
                how = ("applied by the systemd-run wrapper in the command (a user scope with "
                       f"MemoryMax and no swap{check})")
            elif method == "cgroup":
                how = ("applied by starting llama-server inside a cgroup v2 subtree with "
                       f"memory.max and no swap{check}")
            else:
                how = ("NOT applied: no systemd user scope or writable cgroup v2 here "
                       f"({getattr(iso, 'detail', '') or 'none found'}); k3tui "
                       + ("refuses to start llama-server without it (--force overrides)"
                          if report.gpu.unified_memory else
                          "warns and starts llama-server without it"))
            out.append(f"              {how}")
        out.append("Why these flags:")
        out += [f"  {flag:<24} {why}" for flag, why in plan.flag_reasons]
    if plan.download_bytes:
        trunk = plan.disk_needed_bytes - (SAFETENSORS_BYTES if plan.model_kind == "safetensors"
                                          else GGUF_BYTES)
        out.append(f"Disk:    {plan.disk_needed_bytes / GB:,.1f} GB needed "
                   f"({plan.download_bytes / GB:,.1f} GB to download"
                   + (f", {trunk / GB:,.1f} GB for the packed trunk)" if trunk > 0 else ")"))
    if plan.findings:
        out.append("Findings:")
        for f in plan.findings:
            line = f"  {f.level:<7} {f.message}"
            if f.next:
                line += f"\n          next: {f.next}"
            out.append(line)
    return "\n".join(out)


def fit_to_width(text: str, width: int | None) -> str:
    """Wrap long lines for a terminal `width` columns wide, each continuation indented under
    its line's text column (after the label), so an 80-column SSH window stays readable."""
    import re
    import textwrap

    if not width:
        return text
    out: list[str] = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        gaps = [m.end() for m in re.finditer(r" {2,}", line[:26]) if m.end() < len(line)]
        hang = " " * min(gaps[-1] if gaps else 0, width // 2)
        out += textwrap.wrap(line, width, subsequent_indent=hang, break_on_hyphens=False,
                             drop_whitespace=True) or [line]
    return "\n".join(out)
