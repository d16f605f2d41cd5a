"""MachineReport: every probe's facts in one object, serialisable to JSON and back."""

from __future__ import annotations

import dataclasses
import json
import platform
import socket
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3tui.errors import K3Error
from k3tui.probe.cpu import CpuInfo
from k3tui.probe.gpu import Gpu, GpuApp, GpuInfo
from k3tui.probe.isolation import IsolationInfo
from k3tui.probe.memory import MemoryInfo
from k3tui.probe.storage import StorageInfo

SCHEMA = 1
PROFILES_DIR = Path(__file__).with_name("profiles")


@dataclass
class MachineReport:
    schema: int = SCHEMA
    source: str = "probe"  # "probe" or "profile:<name>"
    description: str = ""
    hostname: str = ""
    kernel: str = ""
    probed_at: float = 0.0
    probe_seconds: float = 0.0
    cpu: CpuInfo = field(default_factory=CpuInfo)
    memory: MemoryInfo = field(default_factory=MemoryInfo)
    gpu: GpuInfo = field(default_factory=GpuInfo)
    storage: StorageInfo = field(default_factory=StorageInfo)
    isolation: IsolationInfo = field(default_factory=IsolationInfo)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MachineReport":
        return _build(cls, data)

    @classmethod
    def from_json(cls, text: str) -> "MachineReport":
        return cls.from_dict(json.loads(text))


def _build(cls: type, data: Any) -> Any:
    """Rebuild nested dataclasses from plain dicts; unknown keys are refused."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} expects an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {sorted(unknown)}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        kwargs[name] = _convert(tp, value)
    return cls(**kwargs)


def _convert(tp: Any, value: Any) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value)
    origin = typing.get_origin(tp)
    if origin is list:
        (inner,) = typing.get_args(tp)
        return [_convert(inner, v) for v in value]
    return value


_TYPES = {"Gpu": Gpu, "GpuApp": GpuApp}  # keep imports used for get_type_hints


def load_report(name_or_path: str) -> MachineReport:
    """A built-in profile by name (`dgx-spark`) or a report JSON file written by `--json`."""
    p = Path(name_or_path).expanduser()
    source = f"file:{p}"
    if not p.is_file():
        p = PROFILES_DIR / f"{name_or_path}.json"
        source = f"profile:{name_or_path}"
        if not p.is_file():
            raise K3Error(f"no machine profile or file named {name_or_path!r}.",
                          f"use one of: {', '.join(list_profiles())}, or a JSON file from "
                          f"`k3tui doctor --json`", 2)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"it holds a JSON {type(data).__name__}, not an object")
        data = data.get("machine", data)  # accept the whole doctor --json output too
        missing = [k for k in ("cpu", "memory") if k not in data]
        if missing:  # e.g. `{}`: an empty machine would plan with 0 GB and 1 core
            raise ValueError(f"it has no {' or '.join(missing)} section")
        report = MachineReport.from_dict(data)
    except (OSError, ValueError, TypeError) as exc:
        raise K3Error(f"{p} is not a machine report: {exc}.",
                      "write one with `k3tui doctor --json > FILE`", 2) from None
    if report.source == "probe":
        report.source = source
    return report


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def host_facts() -> tuple[str, str]:
    return socket.gethostname(), platform.release()


def now() -> float:
    return time.time()
