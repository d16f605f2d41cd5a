"""The real model's s/token on this machine, forecast from its measured parts.

`python -m engine bench parts --json` measures the disk under the model folder with the
engine's read pattern and the compute of real-width layers, and forecasts each preset (see
engine/bench/parts.py). k3tui runs it as a subprocess (its kernels never load in-process),
checks its JSON like any outside input, and keeps the result in
$K3TUI_HOME/bench/forecast.json (0600) for `k3tui plan` and `k3tui setup`.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from k3tui.errors import K3Error
from k3tui.paths import get_paths, private_dir
from k3tui.units import GB

SAYS = ("a forecast from measured parts of this machine (its disk, its cores, real-width layers "
        "with random weights), not a measurement of the real model")
HOW = "`k3tui bench forecast` measures this machine in under a minute, without downloading anything"
BOUNDS = ("disk", "compute")


@dataclass(frozen=True)
class PresetForecast:
    name: str
    fits: bool
    s_per_token: float
    bound: str
    peak_rss_gb: float
    first_token_s: float  # 50-token prompt
    first_token_500_s: float
    prefill_gb: float  # expert GB the 50-token prefill reads
    prefill_500_gb: float

    def brief(self) -> str:
        """`~50 s/token, first token ~16 min`."""
        return f"~{per_token(self.s_per_token)} s/token, first token {duration(self.first_token_s)}"


@dataclass(frozen=True)
class Forecast:
    date: str
    dir: str
    machine: dict[str, Any]
    load_average: list[float]
    disk_gb_per_s: dict[str, float]  # sequential, experts
    presets: list[PresetForecast] = field(default_factory=list)
    quick: bool = False  # the engine's --quick: toy sizes for tests, not this machine
    load_average_after: list[float] = field(default_factory=list)

    def preset(self, name: str) -> PresetForecast | None:
        return next((p for p in self.presets if p.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


TOY = "--quick: toy sizes for tests; these are not this machine's figures"


def per_token(s: float) -> str:
    """Seconds per token: three figures ("43.4", "0.372"), whole seconds with thousands
    separators from 100 up ("3,480", never "3.48e+03")."""
    return f"{s:,.0f}" if s >= 100 else f"{s:.3g}"


def duration(s: float) -> str:
    """A forecast time, rounded as it deserves: `~48 s`, `~16 min`, `~2.1 h`."""
    if s < 90:
        return f"~{s:.0f} s"
    if s < 7200:
        return f"~{s / 60:.0f} min"
    return f"~{s / 3600:.1f} h"


# ---- checking what the engine printed (or what a file holds) --------------------------------
def _num(d: Any, *keys: str) -> float:
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or d < 0:
        raise ValueError(f"{'.'.join(keys)} is not a finite number >= 0")
    return float(d)


def _loads(x: Any) -> list[float]:
    """The 1/5/15-minute load averages, or nothing when they are not three numbers."""
    try:
        return [_num({"v": v}, "v") for v in x][:3] if isinstance(x, list) else []
    except ValueError:
        return []


def _preset(d: Any) -> PresetForecast:
    if not isinstance(d, dict):
        raise ValueError("a preset is not a JSON object")
    name, fits, bound = d.get("name"), d.get("fits"), d.get("bound")
    if not (isinstance(name, str) and name.isalnum() and len(name) <= 20):
        raise ValueError("a preset name is not a short word")
    if not isinstance(fits, bool) or bound not in BOUNDS:
        raise ValueError(f"preset {name}: fits is not true/false or bound not disk/compute")
    return PresetForecast(name, fits, _num(d, "s_per_token"), bound, _num(d, "peak_rss_gb"),
                          _num(d, "first_token_s_by_prompt", "50"),
                          _num(d, "first_token_s_by_prompt", "500"),
                          _num(d, "prefill_expert_gb_by_prompt", "50"),
                          _num(d, "prefill_expert_gb_by_prompt", "500"))


def from_parts(parts: Any, directory: str) -> Forecast:
    """A Forecast from `engine bench parts --json` output; ValueError names what is wrong."""
    if not isinstance(parts, dict) or parts.get("schema") != 1:
        raise ValueError("not a schema-1 bench parts object")
    presets = parts.get("presets")
    if not isinstance(presets, list) or not presets:
        raise ValueError("no presets")
    return Forecast(
        date=time.strftime("%Y-%m-%d %H:%M"), dir=directory, machine=machine_summary(),
        load_average=_loads(parts.get("load_average")),
        disk_gb_per_s={"sequential": _num(parts, "disk", "sequential_gb_per_s"),
                       "experts": _num(parts, "disk", "expert_gb_per_s")},
        presets=[_preset(p) for p in presets], quick=parts.get("quick") is True,
        load_average_after=_loads(parts.get("load_average_after")))


def from_stored(d: Any) -> Forecast:
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    text = {k: d.get(k) for k in ("date", "dir")}
    if not all(isinstance(v, str) and v.isprintable() for v in text.values()):
        raise ValueError("date or dir is not a line of text")
    machine, disk, presets = d.get("machine"), d.get("disk_gb_per_s"), d.get("presets")
    if not isinstance(presets, list) or not presets:
        raise ValueError("no presets")
    return Forecast(
        **text, machine=_machine(machine),
        load_average=_loads(d.get("load_average")),
        disk_gb_per_s={k: _num(disk, k) for k in ("sequential", "experts")},
        presets=[_preset_from_stored(p) for p in presets],
        quick=d.get("quick") is True, load_average_after=_loads(d.get("load_average_after")))


def _preset_from_stored(p: Any) -> PresetForecast:
    if not isinstance(p, dict):
        raise ValueError("a preset is not a JSON object")
    return _preset({"name": p.get("name"), "fits": p.get("fits"), "bound": p.get("bound"),
                    "s_per_token": p.get("s_per_token"), "peak_rss_gb": p.get("peak_rss_gb"),
                    "first_token_s_by_prompt": {"50": p.get("first_token_s"),
                                                "500": p.get("first_token_500_s")},
                    "prefill_expert_gb_by_prompt": {"50": p.get("prefill_gb"),
                                                    "500": p.get("prefill_500_gb")}})


def _machine(m: Any) -> dict[str, Any]:
    """The stored machine summary, keeping only what is what it claims to be."""
    m = m if isinstance(m, dict) else {}
    host = m.get("hostname")
    out: dict[str, Any] = {"hostname": host if isinstance(host, str) and host.isprintable()
                           and len(host) < 256 else "?"}
    for key in ("cores", "ram_gb"):
        try:
            out[key] = _num(m, key)
        except ValueError:
            out[key] = "?"
    if isinstance(out["cores"], float):
        out["cores"] = int(out["cores"])
    return out


def machine_summary() -> dict[str, Any]:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 0
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"hostname": socket.gethostname(), "cores": cores, "ram_gb": round(ram / GB, 1)}


# ---- measuring and storing -----------------------------------------------------------------
def forecast_file() -> Path:
    return get_paths().bench_dir / "forecast.json"


def measure(directory: str | Path, *, quick: bool = False,
            progress: TextIO | None = None) -> Forecast:
    """Run the engine's parts bench on the disk holding `directory`; K3Error on failure."""
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        raise K3Error(f"{folder} is not a folder, so its disk cannot be measured.",
                      "give --dir a folder on the disk where the model would live", 2)
    progress = progress or sys.stderr
    argv = [sys.executable, "-m", "engine", "bench", "parts", "--dir", str(folder), "--json"]
    scratch = "a small scratch file" if quick else "a 1 GB scratch file"

    def say(line: str) -> None:  # a terminal's lines wrapped at words (80-column SSH)
        if getattr(progress, "isatty", lambda: False)():
            import shutil
            import textwrap

            width = shutil.get_terminal_size().columns - 1
            line = "\n".join(textwrap.wrap(line, width, subsequent_indent="    ",
                                            break_on_hyphens=False)) or line
        print(line, file=progress, flush=True)

    say(f"Measuring this machine's parts under {folder} (under a minute; {scratch} there "
        "is written, read and removed) …")
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv + (["--quick"] if quick else []), stdout=out,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        said = []
        assert proc.stderr is not None
        for line in proc.stderr:  # the engine's progress lines: not its error, no traceback
            said.append(line.rstrip())
            if line.strip() and not line.startswith("error:") and \
                    not any(s.startswith("Traceback") for s in said):
                say(f"  {line.strip()}")
        rc = proc.wait()
        out.seek(0)
        text = out.read()
    if rc != 0:
        last = next((s.strip() for s in reversed(said) if s.strip()), f"exit {rc}")
        last = last.removeprefix("error: ")
        if rc == 2:  # the engine refused before measuring; its sentence names the next step
            raise K3Error(f"the measurement was not started: {last}", "", 2)
        raise K3Error(f"the measurement under {folder} failed: {last}",
                      "check the folder is writable with 1 GB free, then run "
                      "`k3tui bench forecast` again", 1)
    try:
        return from_parts(json.loads(text), str(folder.absolute()))
    except ValueError as exc:  # json.JSONDecodeError is one
        raise K3Error(f"the measurement printed something k3tui cannot read ({exc}).",
                      "run `python -m engine bench parts` to see its output", 1) from None


def store(fc: Forecast) -> Path:
    path = forecast_file()
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(fc.to_dict(), f, indent=2)
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def load_stored() -> tuple[Forecast | None, str]:
    """The stored forecast, or None and why not ("" when there is none)."""
    path = forecast_file()
    try:
        return from_stored(json.loads(path.read_text())), ""
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError, TypeError) as exc:
        return None, (f"the stored forecast {path} cannot be read ({exc}); "
                      "run `k3tui bench forecast` again")


# ---- what a user reads ---------------------------------------------------------------------
def format_forecast(fc: Forecast) -> list[str]:
    m, d = fc.machine, fc.disk_gb_per_s
    out = [f"Real 93-layer Kimi-K3 on {m.get('hostname', '?')} ({m.get('cores', '?')} cores, "
           f"{m.get('ram_gb', '?')} GB RAM), measured {fc.date} under {fc.dir}: disk "
           f"{d['sequential']:.2f} GB/s sequential, {d['experts']:.2f} GB/s expert reads"
           + (f"; load {fc.load_average[0]:.2f}" if fc.load_average else "")
           + (f" → {fc.load_average_after[0]:.2f}" if fc.load_average_after else "")]
    if fc.quick:
        out.append(f"  ({TOY})")
    # Every row within 80 columns (an SSH window): the two prompts' figures share a column
    # and the footnote says which is which.
    # (77 columns at most: the wizard indents them by two more)
    out.append(f"  {'preset':<11} {'fits':<4} {'s/token':>7}  {'bound':<7} {'peak RSS':>8}  "
               f"{'first token*':<17} experts read*")
    for p in fc.presets:
        first = f"{duration(p.first_token_s)} / {duration(p.first_token_500_s)}"
        out.append(f"  {p.name:<11} {'yes' if p.fits else 'no':<4} {p.s_per_token:>7.1f}  "
                   f"{p.bound:<7} {p.peak_rss_gb:>5.1f} GB  {first:<17} "
                   f"{p.prefill_gb:,.0f}/{p.prefill_500_gb:,.0f} GB")
    out.append("  * for a 50-token / a 500-token prompt (experts: what its prefill reads)")
    out.append(f"This is {SAYS}.")
    return out


def plan_lines(preset: str) -> list[str]:
    """For `k3tui plan`: the stored forecast for `preset`, else the C engine's figure (one
    speed per preset, never both) and how to get this machine's."""
    from k3tui.planning.plan import peer_speed_lines

    fc, why = load_stored()
    if fc is None:
        return peer_speed_lines(preset) + [f"Forecast: {why or 'none measured yet: ' + HOW}"]
    p = fc.preset(preset)
    if p is None:
        return peer_speed_lines(preset) + [
            f"Forecast: none for the {preset} preset in the measurement of {fc.date}"]
    return [f"Forecast: {preset} ~{per_token(p.s_per_token)} s/token ({p.bound}-bound), "
            f"first token {duration(p.first_token_s)} for a 50-token prompt, peak RSS "
            f"~{p.peak_rss_gb:.1f} GB; measured here {fc.date} under {fc.dir}"
            + (" (--quick: toy sizes)" if fc.quick else ""),
            f"          {SAYS}; `k3tui bench forecast` shows every preset"]

