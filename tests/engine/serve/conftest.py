"""Fixtures for the server tests: an in-process server with a small
numpy generator (same contract as engine.generate), and a real `python -m engine serve`."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from engine.decode.stats import TokenStats


class FakeToken:
    def __init__(self, id, seconds, index, prefill_seconds, stats):
        self.id, self.seconds, self.index = id, seconds, index
        self.prefill_seconds, self.stats = prefill_seconds, stats


class FakeParams:
    def __init__(self, max_tokens=256, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_ids=()):
        self.max_tokens, self.seed, self.stop_ids = max_tokens, seed, stop_ids


def fake_generate(
    vocab: int,
    delay: float = 0.0,
    counter: list | None = None,
    fail_at: int | None = None,
    gate: threading.Event | None = None,
):
    """Random logits per step (seeded), the hook, then argmax: generate()'s contract.
    The random logits never pick an end id by themselves (only a hook ends a reply), so
    a test that cancels a long reply never races a reply that happened to stop early.
    With `gate`, every token after the first waits until the test sets it (or the
    generation is cancelled): a test holds the slot for as long as it needs, whatever
    the machine's speed, instead of racing a reply of a fixed length."""

    def gen(prompt_ids, params, cancel=None, logits_hook=None, owner="", keep_at=()):
        rng = np.random.default_rng(params.seed)
        generated: list[int] = []
        for index in range(params.max_tokens):
            if cancel is not None and cancel.is_set():
                return
            if fail_at is not None and index == fail_at:
                raise RuntimeError("simulated engine failure")
            if gate is not None and index >= 1:
                while not gate.wait(0.02):
                    if cancel is not None and cancel.is_set():
                        return
            time.sleep(delay)
            if counter is not None:
                counter.append(index)
            logits = rng.standard_normal(vocab).astype(np.float32)
            logits[list(params.stop_ids)] = -np.inf
            if logits_hook is not None:
                logits = logits_hook(list(generated), logits)
            tok = int(np.argmax(logits))
            generated.append(tok)
            yield FakeToken(
                tok,
                delay + 0.001,
                index,
                0.002 if index == 0 else None,
                TokenStats(
                    s_per_token=delay + 0.001,
                    gb_read_trunk=0.001,
                    gb_read_experts=0.0,
                    compute_s=delay,
                ),
            )
            if tok in params.stop_ids:
                return

    return gen


def scripted_generate(script: list[int]):
    """A generator that writes `script` (whatever the prompt), up to max_tokens, ending
    early at a stop id as generate() does; a test picks exactly where a reply is cut."""

    def gen(prompt_ids, params, cancel=None, logits_hook=None, owner="", keep_at=()):
        for index, tok in enumerate(script[: params.max_tokens]):
            if cancel is not None and cancel.is_set():
                return
            stats = TokenStats(s_per_token=0.001, gb_read_trunk=0.0, gb_read_experts=0.0)
            yield FakeToken(tok, 0.001, index, 0.002 if index == 0 else None, stats)
            if tok in params.stop_ids:
                return

    return gen


class InProcServer:
    def __init__(self, service, loaded=None):
        import uvicorn

        self.service = service
        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        if loaded is not None:
            service.set_loaded(loaded)
        cfg = uvicorn.Config(service.app(), log_level="warning", lifespan="off", http="h11")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started, "the in-process server did not start in 30 s"

    def stop(self):
        self.service.cancel_running()
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def make_loaded(test_tok):
    """Factory: a `Loaded` over the fake generator (for set_loaded after a delay)."""
    from engine.serve.worker import Loaded

    def make(n_ctx=64, delay=0.0):
        return Loaded(
            tok=test_tok,
            generate=fake_generate(test_tok.vocab_size, delay),
            make_params=FakeParams,
            n_ctx=n_ctx,
        )

    return make


@pytest.fixture
def inproc(test_tok):
    """Factory: inproc(delay=..., steer_demo=..., gate=..., tok=..., script=[ids],
    **service kwargs) -> InProcServer."""
    from engine.serve.routes import Service
    from engine.serve.worker import Loaded

    servers = []

    def make(
        delay=0.0,
        steer_demo=False,
        loaded=True,
        api_keys=(),
        reasoning_budget=-1,
        n_ctx=4096,
        counter=None,
        fail_at=None,
        gate=None,
        tok=None,
        script=None,
    ):
        service = Service(
            model_name="fake-k3",
            steer_demo=steer_demo,
            reasoning_budget=reasoning_budget,
            api_keys=list(api_keys),
        )
        ld = None
        if loaded:
            ld = Loaded(
                tok=tok or test_tok,
                generate=scripted_generate(script) if script is not None
                else fake_generate(test_tok.vocab_size, delay, counter, fail_at, gate),
                make_params=FakeParams,
                n_ctx=n_ctx,
                info={"memory_plan": {"mode": "resident"}},
            )
        srv = InProcServer(service, ld)
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.stop()
