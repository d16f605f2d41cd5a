"""An answer outlives the terminal and the backend: real `k3tui ask` processes, a real
`python -m engine serve` on loopback (a synthesised checkpoint, no demo steering), the
real runner job and the real history file; processes killed with SIGKILL.

The answer is sampled (temperature 1, a fixed seed) so that it is long enough to cut: the
engine's draw for each position depends only on the seed and the position, so a continued
answer equals the uninterrupted one id for id."""

from __future__ import annotations

import json
import shutil
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from engine.checkpoint.synth import synthesize
from k3tui.answers.store import TurnStore
from k3tui.history import History

PROMPT = "Hello there"
ASK = ["--temperature", "1", "--seed", "0", "--max-tokens", "600"]
DEADLINE_S = 180.0   # a safety net for a hung run, never a measure


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("answers_small"), "small", seed=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """`python -m engine serve` on a fixed port, so that it can be brought back there."""

    def __init__(self, ckpt, port: int):
        self.ckpt, self.port, self.proc = ckpt, port, None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> Engine:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", str(self.ckpt), "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + DEADLINE_S
        while True:
            assert self.proc.poll() is None, "the engine server exited while it loaded"
            assert time.monotonic() < deadline, "the engine server never became ready"
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def engine(ckpt):
    e = Engine(ckpt, free_port())
    yield e.start()
    e.kill()


@pytest.fixture(autouse=True)
def _no_runner_left():
    yield
    from k3tui import jobs

    for state in jobs.list_jobs():
        if state["status"] == "running":
            jobs.cancel_job(state["id"], wait_s=5)


def k3(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3tui", *args], capture_output=True,
                          text=True, timeout=DEADLINE_S, **kw)


def ask(url: str, *extra: str) -> int:
    out = k3("ask", "--url", url, "--json", *ASK, *extra, PROMPT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["id"]


def store() -> TurnStore:
    return TurnStore(History())


def wait_for(turn_id: int, until, what: str):
    s, deadline = store(), time.monotonic() + DEADLINE_S
    while not until(turn := s.get(turn_id)):
        assert time.monotonic() < deadline, f"turn {turn_id} never {what}: {turn}"
        time.sleep(0.05)
    s.history.close()
    return turn


def ended(turn_id: int):
    return wait_for(turn_id, lambda t: t.state not in ("queued", "running"), "ended")


def reference(url: str) -> list[int]:
    t = ended(ask(url, "--new"))
    assert t.state == "done" and t.tokens > 100, t   # long enough to cut
    return t.token_ids


def test_a_turn_survives_the_killed_shell_that_queued_it(engine):
    want = reference(engine.url)
    # `ask --wait` in its own session, killed with its whole group: a dropped SSH session
    shell = subprocess.Popen([sys.executable, "-m", "k3tui", "ask", "--url", engine.url, "--new",
                              "--wait", *ASK, PROMPT], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    s = store()
    deadline = time.monotonic() + DEADLINE_S
    while not (turns := [t for t in s.list_turns() if t.tokens > 0 and t.state == "running"]):
        assert time.monotonic() < deadline, s.list_turns()
        time.sleep(0.02)
    os.killpg(shell.pid, signal.SIGKILL)
    shell.wait()
    turn = ended(turns[0].id)
    assert turns[0].tokens < len(want)           # it was cut while the shell was alive
    assert turn.state == "done"
    assert turn.token_ids == want
    listed = json.loads(k3("answers", "--json").stdout)
    row = next(r for r in listed if r["id"] == turn.id)
    assert (row["state"], row["tokens"]) == ("done", len(want))
    shown = json.loads(k3("answers", "show", str(turn.id), "--json").stdout)
    assert shown["content"] == turn.content and shown["reasoning"] == turn.reasoning


def test_the_backend_killed_mid_answer_and_brought_back_completes_the_same_answer(engine):
    want = reference(engine.url)
    turn_id = ask(engine.url, "--new", "--wait-backend", "120")
    cut = wait_for(turn_id, lambda t: t.tokens > 0, "streamed")
    os.kill(engine.proc.pid, signal.SIGSTOP)     # freeze it, so it cannot finish first
    assert store().get(turn_id).state == "running"
    engine.kill()
    engine.start()
    turn = ended(turn_id)
    assert cut.tokens < len(want)
    assert turn.state == "done", turn.stop_reason
    assert turn.token_ids == want
    assert turn.tokens == len(want)


def test_a_turn_whose_runner_was_sigkilled_is_continued_by_the_next_one(engine):
    from k3tui import jobs

    want = reference(engine.url)
    turn_id = ask(engine.url, "--new")
    cut = wait_for(turn_id, lambda t: t.tokens > 0, "streamed")
    (runner,) = [j for j in jobs.list_jobs() if j["kind"] == "answers" and
                 j["status"] == "running"]
    os.kill(runner["pid"], signal.SIGKILL)
    wait_for(turn_id, lambda t: jobs.read_state(runner["id"])["status"] == "failed",
             "lost its runner")
    assert store().get(turn_id).state == "running"      # left for the next runner
    listed = k3("answers", "--json")                    # sees no runner alive: starts one
    assert listed.returncode == 0, listed.stderr
    turn = ended(turn_id)
    assert cut.tokens < len(want)
    assert turn.state == "done" and turn.token_ids == want
    assert turn.runner != runner["id"]


def test_a_backend_that_never_comes_back_fails_the_turn_with_why(engine):
    turn_id = ask(engine.url, "--new", "--wait-backend", "2")
    wait_for(turn_id, lambda t: t.tokens > 0, "streamed")
    engine.kill()
    turn = ended(turn_id)
    assert turn.state == "failed"
    assert "did not come back within 2 s" in turn.stop_reason
    assert turn.tokens > 0 and turn.content + turn.reasoning    # what came is kept


def test_a_queue_of_prompts_runs_in_order_one_at_a_time(engine):
    ids = [ask(engine.url, "--max-tokens", "20") for _ in range(4)]
    turns = [ended(i) for i in ids]
    assert [t.state for t in turns] == ["done"] * 4
    for before, after in zip(turns, turns[1:], strict=False):
        assert before.ended <= after.started
    # one conversation: each later prompt was asked with the replies before it, by ids
    sent = store().request_messages(turns[-1])
    assert [m["role"] for m in sent] == ["user", "assistant"] * 3 + ["user"]
    assert all(m["k3_token_ids"] for m in sent if m["role"] == "assistant")


def test_stop_from_the_shell_ends_a_running_answer(engine):
    turn_id = ask(engine.url, "--new")
    wait_for(turn_id, lambda t: t.tokens > 0, "streamed")
    out = k3("answers", "stop", str(turn_id))
    assert out.returncode == 0, out.stderr
    turn = ended(turn_id)
    assert turn.state == "stopped" and turn.tokens < 600


def configure(ckpt) -> None:
    for key, value in (("backend.kind", "bundled"), ("model.dir", str(ckpt)),
                       ("engine.preset", "custom"), ("engine.trunk_gb", "0.5"),
                       ("engine.cache_gb", "0.25")):
        assert k3("config", "set", key, value).returncode == 0


def engines_of(ckpt) -> list:
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "engine" in cmd and "serve" in cmd and str(ckpt) in cmd:
            out.append(p)
    return out


def test_the_configured_backend_is_one_shared_service_until_serve_stop(ckpt):
    configure(ckpt)
    assert engines_of(ckpt) == []
    started = k3("serve", "--detach")
    assert started.returncode == 0, started.stderr
    (job,) = [j for j in json.loads(k3("jobs", "--json").stdout) if j["kind"] == "backend"]
    assert job["status"] == "running" and job["url"].startswith("http://127.0.0.1:")
    again = k3("serve")                                 # attaches: no second engine
    assert again.returncode == 0 and "already runs as a shared service" in again.stdout
    out = k3("ask", "--json", "--wait", "--temperature", "0", "--max-tokens", "8", "hi")
    assert out.returncode == 0, out.stderr
    turn = json.loads(out.stdout)
    assert turn["state"] == "done" and turn["backend"] == job["url"] + "/v1"
    (engine,) = engines_of(ckpt)
    assert k3("serve", "stop").returncode == 0
    engine.wait(30)                                     # stopped with its service
    states = {j["id"]: j["status"] for j in json.loads(k3("jobs", "--json").stdout)}
    assert states[job["id"]] == "cancelled"


def test_ask_starts_the_shared_service_when_none_runs(ckpt):
    configure(ckpt)
    out = k3("ask", "--json", "--wait", "--temperature", "0", "--max-tokens", "8", "hi")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["state"] == "done"
    running = [j for j in json.loads(k3("jobs", "--json").stdout)
               if j["kind"] == "backend" and j["status"] == "running"]
    assert len(running) == 1 and len(engines_of(ckpt)) == 1   # it outlives the ask
    assert k3("serve", "stop").returncode == 0


def test_a_chat_attaches_to_the_shared_service_and_leaves_it_running(ckpt):
    configure(ckpt)
    assert k3("serve", "--detach").returncode == 0
    (engine,) = engines_of(ckpt)
    for _ in range(2):
        chat = k3("chat", "--smoke", "--prompt", "hi")
        assert "tokens streamed" in chat.stdout, chat.stdout + chat.stderr
    assert engines_of(ckpt) == [engine] and engine.is_running()   # the same one, kept
    assert k3("serve", "stop").returncode == 0


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_a_turn_sent_from_the_chat_survives_its_killed_tmux_session(engine):
    """What a dropped SSH session does: the chat and everything in its session get SIGHUP.
    The answer goes on in its runner, ends as the uninterrupted run does, and a chat
    opened afterwards shows it."""
    from tui_helpers import REPO_ROOT, Tmux

    for key, value in (("chat.temperature", "1"), ("chat.max_tokens", "600"),
                       ("chat.seed", "1")):
        assert k3("config", "set", key, value).returncode == 0
    env = {"K3TUI_HOME": os.environ["K3TUI_HOME"], "TERM": "xterm-256color",
           "PYTHONPATH": str(REPO_ROOT)}
    tmux = Tmux(f"k3tui-answers-{os.getpid()}", env)
    command = f"{sys.executable} -m k3tui chat --url {engine.url}/v1"
    try:
        tmux.start(command)
        tmux.wait_for(lambda s: "Stop" in s)
        tmux.keys(PROMPT, literal=True)
        tmux.keys("Enter")
        s = store()
        deadline = time.monotonic() + DEADLINE_S
        while not (turns := [t for t in s.list_turns() if t.tokens > 0]):
            assert time.monotonic() < deadline, "the chat's answer never streamed"
            time.sleep(0.02)
        tmux.kill()
        (cut,) = turns
        assert cut.state == "running"
        turn = ended(cut.id)
        seed = turn.settings["seed"]
        want = reference_with_seed(engine.url, seed)
        assert cut.tokens < len(want)
        assert turn.state == "done" and turn.token_ids == want
        tmux.start(command)                               # reopened: the answer is there
        # the answer's last words, or (all reasoning: shown folded) its reasoning's fold
        shown = " ".join(turn.content.split())[-12:] if turn.content.strip() else \
            "reasoning ("
        tmux.wait_for(lambda scr: PROMPT in scr and shown in " ".join(scr.split()), timeout=60)
    finally:
        tmux.close()


def reference_with_seed(url: str, seed: int) -> list[int]:
    out = k3("ask", "--url", url, "--json", "--new", "--wait", "--temperature", "1",
             "--max-tokens", "600", "--seed", str(seed), PROMPT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["token_ids"]


def test_on_done_runs_with_the_turn_in_its_environment_not_its_text(engine, tmp_path):
    out = tmp_path / "done.txt"
    command = f'echo "$K3TUI_TURN_ID $K3TUI_CONVERSATION $K3TUI_TURN_STATE" >> {out}'
    assert k3("config", "set", "chat.on_done", command).returncode == 0
    turn_id = ask(engine.url, "--new", "--max-tokens", "8")
    turn = ended(turn_id)
    deadline = time.monotonic() + DEADLINE_S
    while not out.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert out.read_text().split() == [str(turn.id), str(turn.conversation_id), "done"]
