"""Issue 18, serve/plan/doctor/setup and the CLI as a new user meets them: each test runs
the real `k3tui` in a subprocess (the user guide's commands as written where it shows them)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from k3tui.planning.plan import PRESETS, TRUNK_PACK_BYTES
from k3tui.units import GB

REPO = Path(__file__).resolve().parents[3]
GUIDE = REPO / "docs" / "guide"
SETUP, BACKENDS, PACK, PRESETS_PAGE = (
    (GUIDE / f"{name}.md").read_text(encoding="utf-8")
    for name in ("setup", "backends", "pack", "presets"))
# The README and every page: where a user copies commands from.
DOCS = "\n".join(p.read_text(encoding="utf-8")
                 for p in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))])
PROFILES = REPO / "k3tui" / "probe" / "profiles"


def k3(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3tui", *args], capture_output=True,
                          text=True, timeout=120, env=env or dict(os.environ),
                          stdin=subprocess.DEVNULL, check=False)


def test_dash_v_prints_the_version():
    p = k3("-V")
    assert p.returncode == 0 and re.fullmatch(r"k3tui \d+\.\d+\.\d+\n", p.stdout)


def test_bash_completion_is_generated_from_the_parser(tmp_path):
    p = k3("completion", "bash")
    assert p.returncode == 0, p.stderr
    script = tmp_path / "k3tui.bash"
    script.write_text(p.stdout)
    # bash itself completes with the script: a flag of one subcommand, a subcommand name
    probe = (f'source {script}; COMP_WORDS=(k3tui serve --dr); COMP_CWORD=2; _shtab_k3tui; '
             'echo "${COMPREPLY[@]}"; COMP_WORDS=(k3tui compl); COMP_CWORD=1; _shtab_k3tui; '
             'echo "${COMPREPLY[@]}"')
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[:2] == ["--dry-run", "completion"], done.stderr
    for shell in ("zsh", "fish"):
        out = k3("completion", shell)
        assert out.returncode == 0 and "--checkpoint-kind" in out.stdout and "k3tui" in out.stdout


def _job(job_id: str, message: str) -> None:
    from k3tui import jobs

    jobs._write_state({"id": job_id, "kind": "download", "pid": None, "status": "failed",
                       "started": 1_780_000_000, "updated": 1_780_000_100, "message": message,
                       "log": str(jobs.jobs_dir() / f"{job_id}.log"), "total_bytes": 10,
                       "done_bytes": 5, "target": "/srv/models/Kimi-K3"})


def test_jobs_wraps_a_long_error_at_words_and_lists_as_json():
    words = [f"word{i:03d}" for i in range(45)]
    message = "failed: " + " ".join(words)
    _job("dl-20260101-aaaa", message)
    p = k3("jobs")
    assert p.returncode == 0, p.stderr
    shown = p.stdout.split("/srv/models/Kimi-K3\n", 1)[1]
    assert all(len(line) <= 80 for line in shown.splitlines())
    assert set(shown.split()) <= set(message.split()) | {"…", "(`k3tui", "jobs", "log",
                                                          "dl-20260101-aaaa`)"}
    listed = json.loads(k3("jobs", "--json").stdout)
    assert [j["id"] for j in listed] == ["dl-20260101-aaaa"] and listed[0]["message"] == message


def test_config_set_errors_have_one_prefix_and_a_sensible_example():
    p = k3("config", "set", "chat.max_tokens", "lots")
    assert p.returncode == 2
    assert p.stderr.startswith("k3tui: [chat] max_tokens must be an integer")
    assert "k3tui config set chat.max_tokens 4096`" in p.stderr  # its default, not "4"


def test_doctor_names_a_missing_dir_instead_of_vouching_for_it(tmp_path):
    missing = tmp_path / "no" / "such" / "folder"
    data = json.loads(k3("doctor", "--json", "--dir", str(missing)).stdout)
    disk = next(c for c in data["checks"] if c["name"] == "disk")
    assert disk["status"] == "warn" and f"{missing} (does not exist; checked on " \
        f"{tmp_path})" in disk["detail"]
    assert "mkdir -p" in disk["next"]


def test_doctor_tests_a_remote_endpoint_that_does_not_answer(tmp_path):
    from llama_helpers import refused_port

    home = Path(os.environ["K3TUI_HOME"])
    with refused_port() as port:  # held while doctor runs: nobody can start listening there
        (home / "config.toml").write_text('[model]\nkind = "remote"\n[backend]\nkind = "remote"\n'
                                          f'[remote]\nurl = "http://127.0.0.1:{port}/v1"\n')
        p = k3("doctor", "--dir", str(tmp_path))
    assert p.returncode == 1
    assert re.search(rf"FAIL +remote +http://127.0.0.1:{port}/v1: Nothing answers", p.stdout)
    assert "all good" not in p.stdout


def test_setup_yes_disk_refusal_and_the_guide_show_the_override(tmp_path):
    p = k3("setup", "--yes", "--model-dir", str(tmp_path))
    if "not enough disk" not in p.stderr:
        pytest.skip("this disk holds the 1.67 TB the checkpoint needs")
    assert p.returncode == 1 and "add --force to save the config anyway" in p.stderr
    setup = SETUP[SETUP.index("k3tui setup --yes"):][:900]
    assert "--force" in setup and "not enough disk" in setup


def test_guide_serve_dry_run_for_another_machine_needs_no_file():
    line = next(ln for ln in BACKENDS.splitlines() if ln.startswith("k3tui serve --dry-run "
                                                                    "--machine"))
    argv = line.split("#")[0].split()[1:]
    p = k3(*argv)
    assert p.returncode == 0, p.stderr
    assert "is not here" in p.stdout and "published size of IQ1_S GGUF (579.5 GB in 34 " \
        "files)" in p.stdout
    assert " -m X.gguf " in p.stdout


def test_model_flags_say_what_they_take_and_the_old_spelling_still_works():
    # the README and the docs use the new names for plan, setup and serve
    for ln in DOCS.splitlines():
        if re.match(r"k3tui (plan|setup|serve)\b", ln.strip()):
            assert not re.search(r"--model(?![-\w])", ln), ln
    old = k3("plan", "--machine", "dgx-spark", "--model", "gguf")
    assert old.returncode == 0 and "--model is now --checkpoint-kind" in old.stderr
    assert "IQ1_S GGUF" in old.stdout
    new = k3("plan", "--machine", "dgx-spark", "--checkpoint-kind", "gguf")
    assert new.stdout == old.stdout and new.stderr == ""


def test_one_trunk_size_and_one_speed_table_in_plan_and_the_guide():
    trunk = f"{TRUNK_PACK_BYTES / GB:.1f} GB"
    assert trunk == "108.8 GB"  # the 93 trunk runs the spec says `pack` writes (§2.2)
    out = k3("plan", "--machine", "server-228g", "--checkpoint-kind", "safetensors").stdout
    assert f"{trunk} for the packed trunk" in out
    assert f"writes the {trunk} of non-expert weights" in PACK
    for name, preset in PRESETS.items():
        row = next(ln for ln in PRESETS_PAGE.splitlines() if ln.startswith(f"| {name} |"))
        assert row.split("|")[5].strip() == preset.s_per_token, row
    assert f"{PRESETS['server'].s_per_token} s/token" in out


def _profile(tmp_path: Path, *, isolation: str, apps: list[dict]) -> str:
    data = json.loads((PROFILES / "dgx-spark.json").read_text())
    data["gpu"]["apps"] = apps
    data["isolation"]["method"] = isolation
    path = tmp_path / "spark.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_plan_on_unified_memory_with_a_gpu_holder_says_serve_refuses(tmp_path):
    ollama = [{"pid": 4242, "name": "ollama", "used_bytes": 36 * 2**30}]
    out = k3("plan", "--machine", _profile(tmp_path, isolation="systemd-run", apps=ollama),
             "--checkpoint-kind", "gguf").stdout
    assert re.search(r"blocker +`k3tui serve` will refuse to start llama-server: other "
                     r"processes hold GPU memory .*pid 4242 ollama 36.0 GiB", out), out
    assert "k3tui serve --force" in out


def test_plan_without_isolation_on_unified_memory_does_not_say_nothing_to_do(tmp_path):
    out = k3("plan", "--machine", _profile(tmp_path, isolation="none", apps=[]),
             "--checkpoint-kind", "gguf").stdout
    assert "nothing to do" not in out
    assert "`k3tui serve` refuses to start llama-server here until the limit can be " \
           "enforced" in out


def test_dry_run_shows_the_model_name_the_launch_adds(tiny_a):
    p = k3("serve", "--dry-run", "--backend", "bundled", "--model-path", str(tiny_a))
    assert p.returncode == 0, p.stderr
    assert f"engine serve {tiny_a} --host 127.0.0.1 --port <free port> --model-name " \
           "kimi-k3 " in p.stdout


def test_dry_run_keeps_conversation_states_in_the_home(tiny_a):
    """The bundled engine keeps its states under $K3TUI_HOME/states: a restart resumes."""
    p = k3("serve", "--dry-run", "--backend", "bundled", "--model-path", str(tiny_a))
    home = Path(os.environ["K3TUI_HOME"]).resolve()
    assert f"--state-dir {home / 'states'} --state-gb 16" in p.stdout, p.stdout


def test_load_mode_reason_matches_what_the_binary_lists():
    from k3tui.backends.llama.binary import binary_env, find_binary

    binary = find_binary("")
    help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True,
                               timeout=60, env=binary_env(binary)).stdout
    assert re.search(r"--mmap, --no-mmap +DEPRECATED", help_text)
    out = k3("plan", "--machine", "dgx-spark", "--checkpoint-kind", "gguf").stdout
    assert "(--mmap/--no-mmap are deprecated for it)" in out and "no longer exist" not in out


def test_bench_without_a_name_says_which_there_are():
    """`k3tui bench` alone said "the following arguments are required: what, rest"."""
    p = k3("bench")
    assert p.returncode == 2 and "rest" not in p.stderr and "Traceback" not in p.stderr
    assert p.stderr.splitlines() == [
        "k3tui: Which benchmark? Name one of download, tui, forecast or engine.",
        "  next: before a download, `k3tui bench forecast` gives the real model's s/token on "
        "this machine (under a minute)"]
    assert k3("bench", "forecast", "--help").returncode == 0
