"""Helpers for the TUI tests: a deterministic app around a scripted stream.

A module of its own (not conftest) so each test file imports it by name and runs alone.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

from k3tui.history import History
from k3tui.monitor import Sample
from k3tui.tui.app import BackendInfo, ChatApp
from scripted import FakeClock, FixedMonitor, ScriptedStream

REPO_ROOT = Path(__file__).resolve().parents[3]

SAMPLES = [Sample(t=float(i), disk_read_mb_s=v, proc_read_mb_s=v * 0.9, proc_rss_gb=6.2,
                  psi_some_avg10=1.5, psi_full_avg10=0.2, cgroup_current_gb=7.1,
                  cgroup_max_gb=12.0, page_cache_gb=3.4)
           for i, v in enumerate([120, 480, 950, 300, 1800, 640, 710, 90, 1200, 880, 400, 1500])]
K3 = {"s_per_token": 1.8, "gb_read": 2.41, "mb_per_s": 1340.0, "true_hit_rate": 0.62,
      "rss_gb": 6.2, "budget_gb": 8.0}


def build_app(tmp_path, stream=None, *, history=None, clock=None, **kwargs) -> ChatApp:
    clock = clock or getattr(stream, "clock", None) or FakeClock()
    stream = stream or ScriptedStream("Hello.", clock=clock)
    kwargs.setdefault("backend", BackendInfo("bundled", "kimi-k3", "laptop", 8.0))
    kwargs.setdefault("monitor", FixedMonitor(SAMPLES))
    kwargs.setdefault("sample_hz", 0)
    kwargs.setdefault("ascii", False)
    return ChatApp(stream=stream, history=history or History(tmp_path / "history.sqlite3"),
                   clock=clock, **kwargs)


async def wait_until(pilot, predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.02)


async def settle(app, pilot) -> None:
    await app.workers.wait_for_complete()
    await pilot.pause()
    await asyncio.sleep(0)
    await pilot.pause()


def screen_text(app) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


class Tmux:
    """tmux on a private socket: other tests' tmux servers come and go meanwhile."""

    def __init__(self, name: str, env: dict[str, str]):
        self.name = name
        self.env = env
        self.base = ["tmux", "-L", name]

    def start(self, command: str) -> None:
        # A keeper session keeps the private server up while the app's session restarts
        # (a server exiting after its last session races with the next new-session).
        if subprocess.run([*self.base, "has-session", "-t", "keeper"],
                          capture_output=True).returncode != 0:
            subprocess.run([*self.base, "new-session", "-d", "-s", "keeper", "sleep 900"],
                           check=True)
        exports = " ".join(f"{k}={v}" for k, v in self.env.items())
        subprocess.run([*self.base, "new-session", "-d", "-s", self.name, "-x", "80", "-y", "24",
                        f"cd {REPO_ROOT} && env {exports} {command}; sleep 60"], check=True)

    def keys(self, *keys: str, literal: bool = False) -> None:
        subprocess.run([*self.base, "send-keys", "-t", self.name, *(["-l"] if literal else []),
                        *keys], check=True)

    def screen(self) -> str:
        return subprocess.run([*self.base, "capture-pane", "-p", "-t", self.name], check=True,
                              capture_output=True, text=True).stdout

    def wait_for(self, predicate, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.screen()
            if predicate(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"screen never matched:\n{self.screen()}")

    def kill(self) -> None:
        """Kill the session (SIGHUP to the app), keeping the private server for a restart."""
        subprocess.run([*self.base, "kill-session", "-t", self.name], capture_output=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and subprocess.run(
                [*self.base, "has-session", "-t", self.name], capture_output=True).returncode == 0:
            time.sleep(0.1)

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True)
