"""The runner's time budget (chat.max_minutes) against a real HTTP stream on loopback.

The stream is the remote area's OpenAI-compatible endpoint, streaming far longer than the
test lasts; the store's clock is the test's, so the budget runs out when the test says.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from k3tui.answers.follow import follow_turn
from k3tui.answers.runner import TurnAnswerer
from k3tui.answers.store import TurnStore
from k3tui.backends.events import Finished
from k3tui.history import History

ENDPOINT = Path(__file__).resolve().parents[1] / "backends" / "fake_endpoint.py"


@contextlib.contextmanager
def endless_endpoint(tmp_path: Path, api_key: str) -> Iterator[int]:
    """The endpoint streaming a word every 10 ms for hours: its port."""
    log = tmp_path / "endpoint.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, str(ENDPOINT), "--port", "0", "--api-key",
                                 api_key, "--chunks", "1000000", "--interval", "0.01"],
                                stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(rb"listening (\d+)", log.read_bytes())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield int(m.group(1))
    finally:
        proc.terminate()
        proc.wait(10)


def test_max_minutes_ends_an_answer_cleanly_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("K3T_TEST_KEY", "k")
    now = [1000.0]
    history = History(tmp_path / "history.sqlite3")
    store = TurnStore(history, clock=lambda: now[0])
    conv = history.new_conversation("t", backend="remote", model="fake-k3")
    with endless_endpoint(tmp_path, "k") as port:
        url = f"http://127.0.0.1:{port}/v1"
        store.enqueue(conv, "go on forever", url, {"api_key_env": "K3T_TEST_KEY"})
        turn = store.claim(url, "test")
        assert turn is not None and turn.started == 1000.0

        async def main() -> str:
            answer = asyncio.ensure_future(
                TurnAnswerer(store, turn, poll_s=0.05, max_minutes=2).run())
            while store.get(turn.id).tokens == 0:      # it streams and saves
                assert not answer.done()
                await asyncio.sleep(0.05)
            now[0] = 1000.0 + 119
            await asyncio.sleep(0.3)                   # a few polls under the budget
            assert not answer.done()
            now[0] = 1000.0 + 120                      # the budget is spent
            return await asyncio.wait_for(answer, 30)

        assert asyncio.run(main()) == "done"
    ended = store.get(turn.id)
    assert ended.state == "done" and ended.tokens > 0 and ended.content.startswith("word0")
    assert ended.stop_reason == \
        "max_minutes: (stopped at the time budget, chat.max_minutes = 2)"
    message = [m for m in history.messages(conv) if m.role == "assistant"][0]
    assert message.status == "done" and message.content == ended.content

    async def last_event():
        events = [ev async for ev in follow_turn(store, turn.id)]
        return events[-1]
    assert asyncio.run(last_event()) == Finished(
        "max_minutes", note="(stopped at the time budget, chat.max_minutes = 2)")
