"""Config: strict TOML with file:line errors, comments kept on save, 0600 credentials."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from k3tui.config import (Config, config_exists, load_config, load_credentials, save_config,
                          save_credential, set_in_file, set_value)
from k3tui.errors import K3Error
from k3tui.paths import get_paths


def test_defaults_when_absent_and_roundtrip():
    assert not config_exists()
    cfg = load_config()
    assert cfg == Config()
    assert (cfg.model.repo, cfg.backend.host, cfg.llama_server.ctx_size) == \
        ("moonshotai/Kimi-K3", "127.0.0.1", 8192)
    cfg.backend.kind = "llama-server"
    cfg.llama_server.extra_args = ["--no-warmup"]
    cfg.engine.trunk_gb = 12.5
    path = save_config(cfg)
    assert path == get_paths().config_file and config_exists()
    again = load_config()
    assert again == cfg


def test_every_documented_key_exists():
    d = Config().to_dict()
    documented = {
        "model": {"kind", "repo", "revision", "dir", "trunk_dir", "include"},
        "backend": {"kind", "host", "port"},
        "engine": {"preset", "trunk_gb", "cache_gb", "threads"},
        "llama_server": {"binary", "ctx_size", "reasoning_budget", "memory_limit_gb",
                         "n_gpu_layers", "extra_args", "rpc"},
        "remote": {"url", "model", "api_key_env", "verify_tls"},
        "chat": {"thinking", "thinking_effort", "max_tokens", "temperature", "system_prompt",
                 "seed", "on_done", "max_minutes"},
    }
    assert {k: set(v) for k, v in d.items()} == documented


@pytest.mark.parametrize("text, line, words", [
    ("[model]\nkind = \"gguf\"\n\n[backend]\nprot = 1\n", 5, "unknown key `prot`"),
    ("[model]\nkind = \"gguf\"\n[engines]\npreset = \"laptop\"\n", 3, "unknown section [engines]"),
    ("[backend]\nkind = \"bundled\"\nport = \"8080\"\n", 3, "port must be an integer"),
    ("[chat]\nthinking = 1\n", 2, "must be true or false"),
    ("[engine]\npreset = \"huge\"\n", 2, "not one of"),
    ("[llama_server]\nextra_args = [1, 2]\n", 2, "a list of strings"),
    ("[engine]\ntrunk_gb = -3\n", 2, "must not be negative"),
    ("[llama_server]\nrpc = [\"10.0.0.2\"]\n", 2, "'10.0.0.2' is not host:port"),
    ("[llama_server]\nrpc = [\"[::1]:50052\"]\n", 2, "cannot take an IPv6 address"),
    ("[llama_server]\nrpc = [\"a:1\", \"b:70000\"]\n", 2, "'b:70000' is not host:port"),
    ("[llama_server]\nrpc = [\"a:1\", \"a:1\"]\n", 2, "a:1 is listed twice"),
    ("[llama_server]\nrpc = [" + ", ".join(f'\"h{i}:1\"' for i in range(17)) + "]\n", 2,
     "at most 16 RPC workers"),
])
def test_bad_input_names_file_and_line(text, line, words):
    path = get_paths().config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    with pytest.raises(K3Error) as exc:
        load_config()
    assert f"{path}, line {line}" in exc.value.message
    assert words in exc.value.message
    assert exc.value.exit_code == 2


def test_toml_syntax_error_reports_line():
    path = get_paths().config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[model]\nkind = \n")
    with pytest.raises(K3Error) as exc:
        load_config()
    assert "line 2" in exc.value.message and str(path) in exc.value.message


def test_ints_accepted_for_floats():
    path = get_paths().config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[engine]\ntrunk_gb = 16\n")
    assert load_config().engine.trunk_gb == 16.0


def test_save_keeps_user_comments_and_order():
    path = get_paths().config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# my notes about this box\n[backend]\n# fixed port for the firewall\n"
                    "port = 8080  # keep\nkind = \"bundled\"\n")
    cfg = load_config()
    cfg.engine.preset = "server"
    save_config(cfg)
    text = path.read_text()
    assert "# my notes about this box" in text
    assert "# fixed port for the firewall" in text
    assert "port = 8080  # keep" in text
    assert text.index("port = 8080") < text.index('kind = "bundled"')
    assert load_config().engine.preset == "server"


def test_set_value_validates():
    cfg = set_value(Config(), "backend.port", "8080")
    assert cfg.backend.port == 8080
    cfg = set_value(cfg, "model.dir", "/srv/models")  # unquoted string accepted
    assert cfg.model.dir == "/srv/models"
    with pytest.raises(K3Error):
        set_value(cfg, "backend.nope", "1")
    with pytest.raises(K3Error):
        set_value(cfg, "backend.port", "abc")


def test_credentials_are_0600_and_merge():
    save_credential("hf_token", "hf_abc")
    save_credential("remote_api_key", "sk-1")
    path = get_paths().credentials_file
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_credentials() == {"hf_token": "hf_abc", "remote_api_key": "sk-1"}


def _cli(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "k3tui", "config", *args], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("key, value, step", [
    ("engine.preset", "turbo", "`k3tui config set engine.preset auto`"),
    ("chat.max_tokens", "-5", "`k3tui config set chat.max_tokens 4096`"),
    ("backend.port", "99999", "`k3tui config set backend.port N`"),
    ("remote.url", "ftp://x", "`k3tui config set remote.url https://HOST:PORT/v1`"),
])
def test_config_set_refusals_name_a_command_that_works(key, value, step):
    """`next: fix the value` told nobody what a good value looks like; an ftp:// endpoint
    was saved and only failed later, inside the chat."""
    res = _cli("set", key, value)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.count("\n") == 2 and f"next: e.g. {step}" in res.stderr, res.stderr
    assert not config_exists()


def test_config_set_repairs_the_value_that_stops_the_file_loading():
    """The error for a bad value in the file said to fix it, but `config set` loaded the file
    first and refused with that very error: the one command that could fix it could not."""
    path = get_paths().config_file
    path.write_text('# mine\n[engine]\npreset = "turbo"  # typo\nthreads = 2\n')
    res = _cli("show")
    assert res.returncode == 2
    assert f"{path}, line 3: [engine] preset = 'turbo'" in res.stderr
    assert "next: fix it with `k3tui config set engine.preset auto`, or edit that line" \
        in res.stderr
    res = _cli("set", "engine.threads", "3")      # another key: the file stays refused
    assert res.returncode == 2 and "line 3" in res.stderr
    res = _cli("set", "engine.preset", "laptop")
    assert res.returncode == 0, res.stderr
    cfg = load_config()
    assert (cfg.engine.preset, cfg.engine.threads) == ("laptop", 2)
    assert "# mine" in path.read_text()           # the user's comments survive the repair
    path.write_text('[engine]\npreset = "turbo"\nnokey = 1\n')
    res = _cli("set", "engine.preset", "laptop")  # a second fault is still reported by line
    assert res.returncode == 2 and "line 3: unknown key `nokey`" in res.stderr, res.stderr


def test_rpc_workers_are_a_checked_list_of_host_port():
    cfg = set_value(Config(), "llama_server.rpc", '["192.168.1.20:50052", "node-2.lan:50053"]')
    assert cfg.llama_server.rpc == ["192.168.1.20:50052", "node-2.lan:50053"]
    assert set_value(Config(), "llama_server.rpc", "10.0.0.2:50052").llama_server.rpc == \
        ["10.0.0.2:50052"]  # one worker, as a plain word
    res = _cli("set", "llama_server.rpc", "10.0.0.2")
    assert res.returncode == 2 and "'10.0.0.2' is not host:port" in res.stderr
    assert "next: e.g. `k3tui config set llama_server.rpc '[\"192.168.1.20:50052\"]'`" \
        in res.stderr


# -- hostile files: bounded before they are parsed ----------------------------------------------

DEEP = "[model]\ninclude = " + "[" * 100_000 + "]" * 100_000 + "\n"
DOTTED = "[model]\n" + ".".join(["a"] * 50_000) + " = 1\n"          # 100 KB of key


@pytest.mark.parametrize("text, words", [
    (DEEP, "line 2: arrays or tables are nested more than 32 deep"),
    ("[chat]\nx = " + "{a = " * 100_000 + "1" + "}" * 100_000 + "\n",
     "line 2: arrays or tables are nested more than 32 deep"),
    (DOTTED, "line 2: a key (or a bare value) is longer than 256 characters"),
    ("[model]\n" + " . ".join(["a"] * 50_000) + " = 1\n", "line 2: a key (or a bare value)"),
    ("[" + ".".join(["a"] * 50_000) + "]\n", "line 1: a key (or a bare value)"),
    ("# k3tui\n[model]\nrepo = \"" + "x" * 2_000_000 + "\"\n", "is larger than 1,024 KiB"),
])
def test_config_a_hostile_file_is_one_sentence(text, words):
    """Nested 100k deep was a RecursionError; a 100 KB dotted key cost ~10 GB of memory
    before it was refused."""
    path = get_paths().config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    for load in (load_config, lambda: set_in_file("chat.max_tokens", "10")):
        with pytest.raises(K3Error) as info:
            load()
        message = info.value.message
        assert words in message and message.startswith(str(path)), message[:300]
        assert len(message) < 300 and "\n" not in message


def test_config_bounds_leave_real_files_alone():
    """Strings (any length, any brackets or dots inside), comments and multi-line strings are
    skipped by the bound; only what is outside quotes counts."""
    text = ('# a comment with [[[[ and a.b.c.d ' + "x" * 500 + '\n'
            '[model]\nrepo = "moonshotai/Kimi-K3"\ninclude = ["*IQ1_S*", "[[[{{{"]\n'
            '[chat]\nsystem_prompt = """' + "Be brief. [{" * 400 + '\n"quoted" ""x\\""""\n'
            "[llama_server]\nextra_args = ['--x', '" + "a." * 300 + "']\n"
            '"ctx_size" = 4096\n')
    path = get_paths().config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    cfg = load_config()
    assert cfg.chat.system_prompt.startswith("Be brief. [{") and cfg.llama_server.ctx_size == 4096
    assert cfg.model.include == ["*IQ1_S*", "[[[{{{"]


def test_config_set_takes_a_long_sentence_as_text():
    """`config set` parses its value as TOML when it is one: a long sentence with dots is
    text, and a value nested 100k deep never reaches the parser."""
    sentence = "Answer briefly. Cite sources. " * 40
    assert set_value(Config(), "chat.system_prompt", sentence).chat.system_prompt == sentence
    with pytest.raises(K3Error, match="must be a list of strings|must be an integer"):
        set_value(Config(), "chat.max_tokens", "[" * 100_000)


def test_config_a_100kb_dotted_key_is_refused_without_allocating(tmp_path):
    """Peak memory of a process that loads the file: well under 200 MB (it was ~10 GB; the
    address-space limit turns that into a MemoryError instead of swapping the machine)."""
    path = tmp_path / "config.toml"
    path.write_text(DOTTED)
    code = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        from k3tui.config import load_config
        from k3tui.errors import K3Error
        try:
            load_config({str(path)!r})
        except K3Error as exc:
            print(exc.message)
        # VmHWM, not ru_maxrss: Linux carries the spawning process's peak (pytest's, late
        # in a run ~700 MB) into a child's ru_maxrss across exec
        print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ))
    assert p.returncode == 0, p.stderr[-2000:]
    said, peak_kib = p.stdout.splitlines()[-2], int(p.stdout.splitlines()[-1])
    assert "a key (or a bare value) is longer than 256 characters" in said
    assert peak_kib < 200 * 1024, peak_kib
