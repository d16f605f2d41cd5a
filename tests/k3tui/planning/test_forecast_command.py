"""`k3tui bench forecast`, the stored forecast in `k3tui plan` and `k3tui setup`: real runs of
the CLI, which runs the engine's real `bench parts` as a subprocess at its toy size (--quick:
a 32 MB scratch file and the tiny synth widths, a few seconds)."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output.plain_text import PlainTextOutput

from k3tui.commands.setup import run_interactive
from k3tui.config import Config, load_config
from k3tui.paths import get_paths
from k3tui.planning import forecast
from k3tui.planning.plan import PRESETS
from k3tui.probe import load_report

KEYS = {"name", "fits", "s_per_token", "bound", "first_token_s"}


def k3(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3tui", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env=dict(os.environ))


def test_bench_forecast_json_is_stored_and_plan_shows_it(tmp_path):
    before = k3("plan", "--model", "safetensors")
    assert before.returncode == 0, before.stderr
    assert "Forecast: none measured yet: `k3tui bench forecast`" in before.stdout

    res = k3("bench", "forecast", "--json", "--quick", "--dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    names = [p["name"] for p in out["presets"]]
    assert names[:4] == ["laptop", "desktop", "workstation", "server"]
    for p in out["presets"]:
        assert KEYS <= p.keys() and isinstance(p["fits"], bool)
        assert p["bound"] in ("disk", "compute") and p["s_per_token"] > 0
    assert "not a measurement of the real model" in out["note"]
    assert "disk under" in res.stderr  # the engine's progress, relayed
    assert list(tmp_path.iterdir()) == []  # its scratch file is gone

    path = get_paths().bench_dir / "forecast.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    stored = json.loads(path.read_text())
    assert stored["dir"] == str(tmp_path) and stored["date"] and stored["machine"]["cores"] >= 1

    plan = k3("plan", "--model", "safetensors")
    assert plan.returncode == 0, plan.stderr
    line = next(ln for ln in plan.stdout.splitlines() if ln.startswith("Forecast:"))
    preset = stored["presets"][0]  # this box plans laptop or bigger; find what it printed
    chosen = next(p for p in stored["presets"] if f"Forecast: {p['name']} " in line)
    assert f"~{forecast.per_token(chosen['s_per_token'])} s/token ({chosen['bound']}-bound)" in line
    assert "first token ~" in line and f"under {tmp_path}" in line and preset
    # one speed for the preset: this machine's forecast, not the C engine's figure beside it
    assert "Speed:" not in plan.stdout and "kimi-k3-in-c" not in plan.stdout
    assert "s/token" not in next(ln for ln in plan.stdout.splitlines() if ln.startswith("Preset"))
    assert json.loads(k3("plan", "--json", "--model", "safetensors").stdout)["forecast"][
        "dir"] == str(tmp_path)

    text = k3("bench", "forecast", "--quick", "--dir", str(tmp_path))
    assert text.returncode == 0, text.stderr
    assert "laptop" in text.stdout and "first token" in text.stdout
    assert "forecast from measured parts of this machine" in text.stdout


def test_a_missing_dir_is_one_clear_error_and_exit_2(tmp_path):
    res = k3("bench", "forecast", "--quick", "--dir", str(tmp_path / "nope"))
    assert res.returncode == 2
    assert res.stderr.startswith(f"k3tui: {tmp_path / 'nope'} is not a folder")
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert not (get_paths().bench_dir / "forecast.json").exists()


def test_a_failed_measurement_says_why_once():
    res = k3("bench", "forecast", "--quick", "--dir", "/proc")  # a folder no one can write in
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.count("cannot measure the disk under /proc") == 1
    assert "k3tui: the measurement under /proc failed" in res.stderr
    assert not (get_paths().bench_dir / "forecast.json").exists()


@pytest.mark.parametrize("body", [
    "not json", "[]", '{"date": "x", "dir": "d", "presets": []}',
    '{"date": "x", "dir": "d", "disk_gb_per_s": {"sequential": 1, "experts": 1}, "presets": '
    '[{"name": "laptop\\u001b[2J", "fits": true, "bound": "disk", "s_per_token": 1}]}',
    '{"date": "x", "dir": "d", "disk_gb_per_s": {"sequential": 1, "experts": 1}, "presets": '
    '[{"name": "laptop", "fits": true, "bound": "disk", "s_per_token": "NaN"}]}',
])
def test_a_damaged_stored_forecast_is_named_not_shown(body):
    path = get_paths().bench_dir / "forecast.json"
    path.parent.mkdir(parents=True)
    path.write_text(body)
    res = k3("plan", "--model", "safetensors")
    assert res.returncode == 0 and "Traceback" not in res.stderr
    assert f"the stored forecast {path} cannot be read" in res.stdout
    assert "\x1b" not in res.stdout
    assert path.read_text() == body  # the user's file is left as it was


def test_a_slow_forecast_reads_in_seconds_not_in_exponents():
    """A disk-bound preset on a slow disk takes thousands of seconds a token: `k3tui plan`
    writes "~3,480 s/token", never "~3.48e+03"."""
    slow = forecast.PresetForecast("laptop", True, 3480.4, "disk", 7.9, 9e4, 9e5, 858, 1445)
    forecast.store(forecast.Forecast("2026-12-01 23:50", "/models", {}, [1.0],
                                     {"sequential": 0.05, "experts": 0.04}, [slow]))
    res = k3("plan", "--model", "safetensors")
    assert res.returncode == 0, res.stderr
    assert "Forecast: laptop ~3,480 s/token (disk-bound)" in res.stdout, res.stdout
    assert "e+0" not in res.stdout
    assert slow.brief().startswith("~3,480 s/token, first token")


def test_the_wizard_measures_and_shows_the_forecast_beside_each_preset(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no Hugging Face login
    monkeypatch.setenv("COLUMNS", "200")  # room for the whole line (80: see the tmux test)
    report = load_report("laptop-8g")
    calls = []

    def measure(folder):
        calls.append(folder)
        return forecast.measure(folder, quick=True)

    screen, out = io.StringIO(), io.StringIO()
    # checkpoint, folder, "measure?" yes, no token, the recommended preset, write it
    with create_pipe_input() as inp:
        inp.send_text("\r" + "\r" + "y\r" + "\r" + "\r" + "y\r")  # y/n wait for Enter
        rc = run_interactive(report, Config(), input=inp, output=PlainTextOutput(screen),
                             out=out, forecaster=measure,
                             storage_probe=lambda d: report.storage, llama_binary=lambda c: None)
    assert rc == 0, out.getvalue()
    assert len(calls) == 1  # the default folder does not exist yet: its nearest parent is measured
    assert os.path.isdir(calls[0]) and str(get_paths().models_dir / "Kimi-K3").startswith(calls[0])
    text = " ".join(out.getvalue().split())
    assert "not a measurement of the real model" in text and "first token" in text
    stored = forecast.load_stored()[0]
    laptop = stored.preset("laptop")
    shown = "".join(screen.getvalue().split())  # the choice, wrapped at 80 columns
    beside = f"laptop trunk 3 + cache 1 GB, peak ~8.2 GB | {laptop.brief()} — measured here"
    assert "".join(beside.split()) in shown
    # one figure per preset, said whose: the forecast's, never the C engine's beside it
    assert "this machine's forecast" in text and PRESETS["laptop"].speed not in text
    assert "".join(PRESETS["laptop"].speed.split()) not in shown
    assert load_config().engine.preset == "laptop"


def test_setup_yes_shows_a_stored_forecast(tmp_path):
    res = k3("setup", "--yes", "--model-dir", str(tmp_path), "--preset", "laptop", "--force")
    assert res.returncode == 0, res.stderr
    assert "forecast: none measured yet" in res.stdout and "--forecast" in res.stdout
    assert k3("bench", "forecast", "--quick", "--dir", str(tmp_path)).returncode == 0
    res = k3("setup", "--yes", "--model-dir", str(tmp_path), "--preset", "laptop", "--force")
    assert res.returncode == 0, res.stderr
    laptop = forecast.load_stored()[0].preset("laptop")
    assert f"forecast: laptop {laptop.brief()} — measured here" in res.stdout
    # a --quick forecast's toy figures were shown as this machine's, with nothing to say not
    line = next(ln for ln in res.stdout.splitlines() if "forecast: laptop" in ln)
    assert line.endswith("(--quick: toy sizes for tests; these are not this machine's figures)")


def test_setup_yes_forecast_measures_through_the_real_cli(tmp_path):
    """The full path of `setup --yes --forecast`: the engine's own `bench parts` (no
    --quick flag: K3_BENCH_PARTS_QUICK scales the measurement down so it runs here in
    seconds), stored 0600, the forecast printed beside each preset and the chosen one."""
    models = tmp_path / "models" / "Kimi-K3"  # not there yet: its nearest folder is measured
    res = subprocess.run(
        [sys.executable, "-m", "k3tui", "setup", "--yes", "--forecast", "--model-dir",
         str(models), "--preset", "desktop", "--force"], capture_output=True, text=True,
        timeout=300, stdin=subprocess.DEVNULL, env={**os.environ, "K3_BENCH_PARTS_QUICK": "1"})
    assert res.returncode == 0, res.stderr
    assert "disk under" in res.stderr  # the engine's progress, relayed: it really measured
    path = get_paths().bench_dir / "forecast.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    stored = json.loads(path.read_text())
    assert stored["dir"] == str(tmp_path) and stored["quick"] is True
    assert not any(p.name.startswith(".k3-bench-parts-") for p in tmp_path.rglob("*"))
    fc = forecast.load_stored()[0]
    lines = res.stdout.splitlines()
    for p in fc.presets:  # the table: each preset beside its forecast
        assert any(ln.split()[:4] == [p.name, "yes" if p.fits else "no",
                                      f"{p.s_per_token:.1f}", p.bound] for ln in lines), p.name
    assert "toy sizes for tests" in res.stdout  # a scaled-down measurement says so
    desktop = fc.preset("desktop")
    assert f"forecast: desktop {desktop.brief()} — measured here {fc.date}" in res.stdout
    assert load_config().engine.preset == "desktop"


def test_an_engine_refusal_is_passed_on_with_its_own_next_step(tmp_path, monkeypatch):
    # the engine refuses (exit 2) when the measurement would not fit in free memory; its
    # sentence says what to do, so no generic "writable with 1 GB free" advice follows it
    from k3tui.errors import K3Error
    from k3tui.planning import forecast

    said = ("error: measuring needs 3.7 GB of free memory and 1.2 GB is available; close "
            "some programs and run it again.")
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho '{said}' >&2\nexit 2\n")
    fake.chmod(0o755)
    monkeypatch.setattr(forecast.sys, "executable", str(fake))
    with pytest.raises(K3Error) as exc:
        forecast.measure(tmp_path, progress=io.StringIO())
    assert exc.value.exit_code == 2
    assert "measuring needs 3.7 GB of free memory" in exc.value.message
    assert "writable" not in str(exc.value)


def stored_forecast(s_per_token: float = 43.4) -> forecast.Forecast:
    """A forecast as `k3tui bench forecast` stores it, without measuring (`--quick` would
    take seconds and give toy figures)."""
    presets = [forecast.PresetForecast(name, name == "laptop", s_per_token, "disk", 5.3, 540.0,
                                       2880.0, 858.0, 1445.0) for name in PRESETS]
    fc = forecast.Forecast(date="2026-12-01 14:42", dir="/data", machine={}, load_average=[],
                           disk_gb_per_s={"sequential": 3.48, "experts": 3.0}, presets=presets)
    forecast.store(fc)
    return fc


def test_a_wide_terminal_shows_the_whole_forecast_and_one_speed(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    from k3tui.wizard import preset_title

    fc = stored_forecast()
    title = preset_title(PRESETS["laptop"], fc.preset("laptop"))
    assert title.endswith(f"GB | {fc.preset('laptop').brief()} — measured here")
    assert title.count("s/token") == 1
    for p in PRESETS.values():  # 80 columns: the select's "» " and every title on one line
        assert len(preset_title(p, fc.preset(p.name), width=80)) <= 76
        assert preset_title(p, fc.preset(p.name), width=80).endswith("~43.4 s/token here")
        assert len(preset_title(p, None, width=80)) <= 76
    assert preset_title(PRESETS["laptop"], None, width=80).endswith(" | ~27–33 s/token")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
@pytest.mark.parametrize("seconds", [43.4, 3476.5])
def test_at_80_columns_each_preset_shows_its_measured_speed_and_ctrl_c_writes_nothing(
        tmp_path, seconds):
    """In a real 80x24 terminal the select cut each preset at `…, the floor, ~27–33 s/toke`:
    the forecast `k3tui setup` promises beside each preset was past the edge. Ctrl-C at that
    question then leaves no config and no traceback."""
    from tui_helpers import Tmux

    stored_forecast(seconds)
    home = get_paths().root
    tmux = Tmux(f"k3wiz{os.getpid()}{int(seconds)}",
                {"K3TUI_HOME": str(home), "HOME": str(tmp_path / "home"),
                 "HF_HOME": str(tmp_path / "hf"), "TERM": "xterm-256color"})
    try:
        tmux.start(f"{sys.executable} -m k3tui setup; echo EXIT=$?")
        tmux.wait_for(lambda s: "Which checkpoint?" in s)
        tmux.keys("Enter")                                  # safetensors (no GPU here)
        tmux.wait_for(lambda s: "Where should the checkpoint go?" in s)
        tmux.keys("Enter")
        screen = tmux.wait_for(lambda s: "Choose another folder?" in s or "again" in s)
        if "Choose another folder?" in screen:              # this disk is far below 1.56 TB
            tmux.keys("n", "Enter")
        tmux.wait_for(lambda s: "Measure this machine again" in s)
        tmux.keys("n", "Enter")
        tmux.wait_for(lambda s: "Hugging Face token" in s)
        tmux.keys("Enter")
        screen = tmux.wait_for(lambda s: "custom" in s and "Engine memory preset" in s)
        shown = f"~{seconds:,.0f}" if seconds >= 100 else f"~{seconds:g}"
        named = ("laptop", "desktop", "workstation", "server", "max")
        rows = {ln.lstrip(" »").split()[0]: ln for ln in screen.splitlines()
                if ln.lstrip(" »").startswith(named) and "trunk" in ln}
        assert set(rows) == set(named), screen
        for row in rows.values():
            assert row.rstrip().endswith(f"{shown} s/token here"), screen
            assert row.count("s/token") == 1, screen   # one speed a preset
        # the recommendation above says no other speed, and whose the figures are is said
        assert "27–33" not in screen and "C peer" not in screen and "the floor" not in screen
        assert "s/token below: this machine's forecast" in " ".join(screen.split()), screen
        assert not (home / "config.toml").exists()
        tmux.keys("C-c")
        screen = tmux.wait_for(lambda s: "EXIT=" in s)
        assert "no changes were made" in screen and "EXIT=130" in screen
        assert "Traceback" not in screen
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (home / "config.toml").exists():
            time.sleep(0.1)  # a late write would show up here; none may
        assert not (home / "config.toml").exists()
        assert not list(home.glob("*.tmp"))
    finally:
        tmux.close()


def test_without_a_forecast_plan_shows_one_speed_and_says_whose(tmp_path):
    """"the floor, ~27–33 s/token (the C peer's figure, on its machine)": neither the floor
    nor the C peer was explained anywhere a new user looks."""
    res = k3("plan", "--machine", "laptop-8g", "--checkpoint-kind", "safetensors")
    assert res.returncode == 0, res.stderr
    speeds = [ln for ln in res.stdout.splitlines() if "s/token" in ln]
    assert len(speeds) == 1, speeds
    assert speeds[0].startswith("Speed:   ~27–33 s/token (measured by kimi-k3-in-c, a C engine")
    assert "C peer" not in res.stdout and "the floor" not in res.stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_the_forecast_table_fits_an_80_column_terminal(tmp_path):
    """`k3tui bench forecast` in a real 80x24 window: the header ran to 130 columns, so the
    terminal cut it mid-word ("first token: 50-token / prompt / 500-token prompt")."""
    from tui_helpers import Tmux

    tmux = Tmux(f"k3fc{os.getpid()}", {"K3TUI_HOME": str(get_paths().root),
                                       "HOME": str(tmp_path / "home"), "TERM": "xterm"})
    try:
        tmux.start(f"{sys.executable} -m k3tui bench forecast --quick --dir {tmp_path} "
                   "2>/dev/null; echo EXIT=$?")
        screen = tmux.wait_for(lambda s: "EXIT=" in s, timeout=120)
        assert "EXIT=0" in screen, screen
        lines = screen.splitlines()
        # a line the terminal had to break reaches the last column; none may
        assert all(len(ln) < 80 for ln in lines), [ln for ln in lines if len(ln) >= 80]
        header = next(ln for ln in lines if ln.lstrip().startswith("preset"))
        assert header.split() == ["preset", "fits", "s/token", "bound", "peak", "RSS",
                                  "first", "token*", "experts", "read*"]
        rows = [ln.split() for ln in lines if ln.lstrip().startswith(("laptop", "server"))]
        assert len(rows) == 2 and all(r[1] in ("yes", "no") and r[3] in ("disk", "compute")
                                      for r in rows), rows
        assert "* for a 50-token / a 500-token prompt" in screen
    finally:
        tmux.close()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_the_wizard_at_80_columns_cuts_nothing_it_prints(tmp_path):
    """Walking setup at 80x24: the measurement's table (indented two more by the wizard),
    its progress lines and the chosen preset's echo ("? Engine memory preset: laptop …
    | ~1" / "00 s/token here") ran past the edge and were cut mid-word."""
    from tui_helpers import Tmux

    home = get_paths().root
    tmux = Tmux(f"k3wiz80{os.getpid()}",
                {"K3TUI_HOME": str(home), "HOME": str(tmp_path / "home"),
                 "HF_HOME": str(tmp_path / "hf"), "K3_BENCH_PARTS_QUICK": "1",
                 "TERM": "xterm"})
    try:
        tmux.start(f"{sys.executable} -m k3tui setup; echo EXIT=$?")
        tmux.wait_for(lambda s: "Which checkpoint?" in s)
        tmux.keys("Enter")
        tmux.wait_for(lambda s: "Where should the checkpoint go?" in s)
        tmux.keys("Enter")
        screen = tmux.wait_for(lambda s: "Choose another folder?" in s or "Measure what" in s)
        if "Choose another folder?" in screen:
            tmux.keys("n", "Enter")
        tmux.wait_for(lambda s: "Measure what" in s)
        tmux.keys("y", "Enter")
        tmux.wait_for(lambda s: "Hugging Face token" in s, timeout=120)
        tmux.keys("Enter")
        tmux.wait_for(lambda s: "Engine memory preset" in s and "custom" in s)
        tmux.keys("Enter")
        tmux.wait_for(lambda s: "Write this to" in s)
        text = subprocess.run([*tmux.base, "capture-pane", "-p", "-S", "-200", "-t",
                               tmux.name], capture_output=True, text=True).stdout
        tmux.keys("C-c")
    finally:
        tmux.close()
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Measuring"))
    cut = [ln for ln in lines[start:] if len(ln) >= 80]   # the terminal broke these
    assert cut == [], text
    echo = next(i for i, ln in enumerate(lines) if ln.startswith("? Engine memory preset:"))
    assert lines[echo].split()[4] == "laptop" and "s/token here" in " ".join(
        lines[echo:echo + 2]), text
