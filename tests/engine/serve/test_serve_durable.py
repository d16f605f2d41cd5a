"""Kept states on disk (--state-dir): a real server killed with SIGKILL or stopped cleanly,
started again (also under another memory budget), resumes the conversation with cache_n
covering what it kept and gives the ids a cold server gives; state files that are
corrupt, truncated, foreign or hostile are refused with a sentence on stderr, and the
answer is still the cold one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import struct
from pathlib import Path

import httpx
import pytest

from engine.bench.chat import cut_after_text
from engine.decode.generate import checkpoint_interval
from engine.serve.durable import MAGIC, PREFIX
from engine.text.tokenizer import Tokenizer
from tests.engine.serve.test_serve_determinism import parsed
from tests.engine.serve.test_serve_process import CHAT, ServeProcess, small_ckpt  # noqa: F401

FIRST = [{"role": "user", "content": "Hello there"}]
SAMPLING = {"temperature": 0.9, "seed": 5}  # sampled: the ids depend on every logit


def ask(srv, messages, key=None, max_tokens=8):
    headers = {"Authorization": f"Bearer {key}"} if key else None
    resp = httpx.post(srv.url + CHAT, json={"messages": messages, "max_tokens": max_tokens,
                                            **SAMPLING}, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def follow_up(first) -> list[dict]:
    reply = {**first["choices"][0]["message"], "k3_token_ids": first["k3"]["token_ids"]}
    return FIRST + [reply, {"role": "user", "content": "And then?"}]


@pytest.fixture(scope="module")
def cold(small_ckpt):  # noqa: F811
    srv = ServeProcess(str(small_ckpt), "--port", "0", "--snapshot-gb", "0")
    yield srv
    srv.stop()


def stop(srv, how: str) -> str:
    if how == "kill":
        srv.proc.kill()
        srv.proc.wait()
    else:
        assert srv.stop() in (0, -signal.SIGTERM)
    return srv.proc.stderr.read()


@pytest.mark.parametrize("how, flags", [("kill", ()), ("stop", ()),
                                        ("kill", ("--budget-gb", "0.000668"))])
def test_srv_restart_resumes_from_the_state_folder(small_ckpt, cold, tmp_path, how,  # noqa: F811
                                                   flags):
    """The third case is the portable one: saved by a resident server, resumed by one
    streaming its experts under a budget that holds a few of them (the ids never depend
    on the budget), which reads weights for the new ids only."""
    states = tmp_path / "states"
    srv = ServeProcess(str(small_ckpt), "--port", "0", "--state-dir", str(states))
    first = ask(srv, FIRST)
    stop(srv, how)
    assert stat.S_IMODE(states.stat().st_mode) == 0o700
    files = list(states.glob("*/*.k3s"))
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)

    again = ServeProcess(str(small_ckpt), "--port", "0", "--state-dir", str(states), *flags)
    try:
        second = follow_up(first)
        w, c = ask(again, second), ask(cold, second)
    finally:
        stop(again, "stop")
    assert w["k3"]["token_ids"] == c["k3"]["token_ids"]
    assert w["choices"][0]["message"] == c["choices"][0]["message"]
    t1 = first["timings"]
    # the prompt and the reply (but its last id, never fed) come from disk
    assert w["timings"]["cache_n"] == t1["prompt_n"] + len(first["k3"]["token_ids"]) - 1
    assert w["timings"]["prompt_n"] == c["timings"]["prompt_n"] - w["timings"]["cache_n"]
    assert c["timings"]["cache_n"] == 0 and "gb_read_prefill" in w["k3"]
    if flags:
        assert 0 < w["k3"]["gb_read_prefill"]


# --- hostile files: one API key (one owner folder) per kind ----------------------------------

def _header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    _, n, _ = PREFIX.unpack_from(data)
    return json.loads(data[PREFIX.size:PREFIX.size + n]), data[PREFIX.size + n:]


def _rewrite(path: Path, header: dict, body: bytes) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(PREFIX.pack(MAGIC, len(raw), b"\0" * 32) + raw + body)


def corrupt(path, outside):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # a bit of the body (the header still parses)
    path.write_bytes(bytes(data))


def truncated(path, outside):
    os.truncate(path, path.stat().st_size - 100)


def foreign_checkpoint(path, outside):
    header, body = _header(path)
    _rewrite(path, {**header, "fingerprint": "sha256:" + "0" * 64}, body)


def foreign_format(path, outside):
    header, body = _header(path)
    _rewrite(path, {**header, "format": "k3-state-0"}, body)


def huge_header(path, outside):
    with open(path, "r+b") as f:
        f.write(struct.pack("<8sI", MAGIC, 2**31))
        f.truncate(50 * 2**30)  # sparse: 50 GB that must never be read


def huge_shapes(path, outside):
    header, body = _header(path)
    header["arrays"][0][1] = [2**40, 2**20]
    _rewrite(path, header, body)


def wrong_dtype(path, outside):
    header, body = _header(path)
    header["arrays"][0][0] = "<f8"
    _rewrite(path, header, body)


def symlink_out(path, outside):
    """The state, moved outside the folder, and a symlink to it where it was."""
    target = outside / path.name
    shutil.move(path, target)
    os.symlink(target, path)


def symlinked_folder(path, outside):
    """The owner's whole folder, moved outside, and a symlink to it where it was."""
    folder = path.parent
    if not folder.is_symlink():
        shutil.move(folder, outside / "folder")
        os.symlink(outside / "folder", folder)


def not_json(path, outside):
    raw = b"{" * 100000
    path.write_bytes(PREFIX.pack(MAGIC, len(raw), b"\0" * 32) + raw)


KINDS = [corrupt, truncated, foreign_checkpoint, foreign_format, huge_header, huge_shapes,
         wrong_dtype, symlink_out, symlinked_folder, not_json]
SAID = {corrupt: "checksum", truncated: "truncated or padded",
        foreign_checkpoint: "another checkpoint", foreign_format: "another checkpoint",
        huge_header: "header declares", huge_shapes: "not this model's",
        wrong_dtype: "not this model's", symlink_out: "not a regular file",
        symlinked_folder: "not a folder",
        not_json: "not JSON"}


def test_srv_hostile_state_files_are_refused(small_ckpt, cold, tmp_path):  # noqa: F811
    keys = [f"key-{k.__name__}" for k in KINDS]
    states, outside = tmp_path / "states", tmp_path / "outside"
    outside.mkdir()
    args = [str(small_ckpt), "--port", "0", "--state-dir", str(states), "--api-key",
            ",".join(keys)]
    srv = ServeProcess(*args)
    for key in keys:
        ask(srv, FIRST, key=key)
    stop(srv, "stop")
    folders = sorted(p for p in states.iterdir())
    assert len(folders) == len(keys)  # one owner folder per key, named by its digest
    from engine.serve.snapshots import owner_of
    for kind, key in zip(KINDS, keys):
        for path in sorted((states / owner_of(key)).glob("*.k3s")):
            kind(path, outside)
    before = {p: p.stat().st_mtime_ns for p in outside.iterdir()}

    srv = ServeProcess(*args)
    try:
        answers = {key: ask(srv, FIRST, key=key) for key in keys}
        want = ask(cold, FIRST)
    finally:
        log = stop(srv, "stop")
    for kind, key in zip(KINDS, keys):
        got = answers[key]
        assert got["k3"]["token_ids"] == want["k3"]["token_ids"], kind.__name__
        assert got["timings"]["cache_n"] == 0, kind.__name__
        assert SAID[kind] in log, (kind.__name__, log)
    assert "Traceback" not in log
    # nothing outside the folder was written (or replaced)
    assert {p: p.stat().st_mtime_ns for p in outside.iterdir()} == before


# --- mid-answer checkpoints ------------------------------------------------------------------

def stream_until(srv, body, n: int, then=lambda: None) -> list[int]:
    """The ids of a streamed answer until `n` have come; `then()` runs before the stream
    is closed."""
    got: list[int] = []
    with httpx.stream("POST", srv.url + CHAT, json={**body, "stream": True},
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                got += json.loads(line[6:])["k3"]["token_ids"]
                if len(got) >= n:
                    break
        then()
    return got


@pytest.mark.parametrize("demo", [(), ("--steer-demo",)], ids=["model", "steer-demo"])
def test_srv_killed_mid_answer_continues_from_its_checkpoint(small_ckpt, tmp_path, demo):  # noqa: F811
    """SIGKILL after k >= 10 tokens, checkpoints every 4: the restarted server continues
    the partial answer from the last checkpoint (only the ids after it prefilled), and the
    answer is the uninterrupted run's."""
    n, every = 24, 4
    body = {"messages": FIRST, "max_tokens": n, "ignore_eos": True, "reasoning_budget_tokens": 12,
            **SAMPLING}
    states = tmp_path / "states"
    flags = ["--port", "0", "--state-dir", str(states), *demo]
    ref = ServeProcess(str(small_ckpt), "--port", "0", "--snapshot-gb", "0", *demo)
    try:
        whole = stream_until(ref, body, n + 1)
    finally:
        stop(ref, "stop")
    assert len(whole) == n
    tok = Tokenizer.from_dir(small_ckpt)
    k = cut_after_text(tok, whole, 10)
    srv = ServeProcess(str(small_ckpt), *flags, "--debug-checkpoint-every", str(every),
                       "--debug-hang-after", str(k))
    got = stream_until(srv, body, k, then=lambda: stop(srv, "kill"))
    assert got == whole[:k]

    again = ServeProcess(str(small_ckpt), *flags)
    try:
        reasoning, content = parsed(tok, got)
        turn = {"role": "assistant", "reasoning_content": reasoning, "content": content,
                "partial": True, "k3_token_ids": got}
        resp = httpx.post(again.url + CHAT, json={**body, "messages": FIRST + [turn],
                                                   "max_tokens": n - k}, timeout=120)
        assert resp.status_code == 200, resp.text
        rest = resp.json()
    finally:
        stop(again, "stop")
    assert got + rest["k3"]["token_ids"] == whole
    t = rest["timings"]
    covered = (k - 1) // every * every  # the last checkpoint: after that many ids
    assert t["prompt_n"] == k - covered < k
    assert t["cache_n"] == rest["usage"]["prompt_tokens"] - t["prompt_n"]


def test_checkpoint_interval_keeps_saves_under_two_percent():
    assert checkpoint_interval(0.5, 60.0) == 1          # the real model: every token
    assert checkpoint_interval(0.004, 0.005) == 40      # a tiny model: 4 ms save, 5 ms token
    assert checkpoint_interval(0.001, 0.0) > 10**6      # no measured token: never
    for save, token in ((0.3, 2.0), (0.02, 0.01), (1e-5, 1.0)):
        n = checkpoint_interval(save, token)
        assert save / n <= 0.02 * token < save / max(1, n - 1) or n == 1
