"""`k3tui bench tui`: stream 2,000 tokens at 200 tok/s from a loopback server into the real app.

The server is a separate process (so its CPU is not the app's) speaking the OpenAI SSE
dialect over real HTTP on 127.0.0.1; the app runs headless with the real stream client,
history and I/O sampler. Printed, all measured in this one run:

* lag_fraction: how long after the server sent the last token it was on screen, over the
  stream's duration (target < 0.10);
* cpu_s_per_1000_tokens: the app process's CPU seconds per 1,000 streamed tokens;
* idle_cpu_fraction: the CPU share of the panes' sampling while idle (target < 0.02):
  the idle app with sampling on minus off, in alternating windows of the same run; the
  whole idle app's share is printed too (idle_app_cpu_fraction).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MARKER = "ZZENDMARKERZZ"
WORDS = ("the model streams experts from disk under a memory budget while the trunk stays "
         "pinned and every token reads a few gigabytes").split()


def script_tokens(n: int) -> list[str]:
    """Realistic Markdown deltas: paragraphs, a list, a code fence now and then; MARKER last."""
    out: list[str] = []
    i = 0
    while len(out) < n - 1:
        block = i % 4
        if block == 3:
            out += ["\n\n```python\n", "for", " layer", " in", " range", "(93):\n", "    step",
                    "(layer)\n", "```\n\n"]
        elif block == 2:
            out += [f"\n- item {j} " + WORDS[j % len(WORDS)] for j in range(6)] + ["\n\n"]
        else:
            out += [(" " if k else "") + WORDS[(i + k) % len(WORDS)] for k in range(60)]
            out.append(".\n\n")
        i += 1
    return out[: n - 1] + [" " + MARKER]


# --- the loopback server (runs in its own process) ------------------------------------
async def _serve(tokens: int, rate: float) -> None:
    pieces = script_tokens(tokens)
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line = head.split(b"\r\n", 1)[0].decode()
        length = 0
        for line in head.decode("latin-1").split("\r\n"):
            if line.lower().startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        if length:
            await reader.readexactly(length)
        if "/models" in request_line:
            body = json.dumps({"object": "list", "data": [{"id": "bench-model"}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
            await writer.drain()
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Cache-Control: no-cache\r\nConnection: close\r\n\r\n")
        t0 = time.monotonic()
        first = last = None
        for i, piece in enumerate(pieces):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            chunk = {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            writer.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await writer.drain()
            last = time.monotonic()
            first = first or last
        end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 8, "completion_tokens": len(pieces)}}
        writer.write(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n")
        await writer.drain()
        writer.close()
        # CLOCK_MONOTONIC is system-wide on Linux, so the app can compare it with its own.
        print(json.dumps({"first_sent": first, "last_sent": last, "tokens": len(pieces)}),
              flush=True)
        done.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    async with server:
        await done.wait()


# --- the measurement ---------------------------------------------------------------------
def _cpu() -> float:
    t = os.times()
    return t.user + t.system


async def _measure(url: str, server: subprocess.Popen, idle_s: float) -> dict[str, Any]:
    from k3tui.backends.openai_stream import stream_chat
    from k3tui.history import History
    from k3tui.monitor import Monitor
    from k3tui.tui.app import ChatApp
    from k3tui.tui.widgets.prompt import Prompt

    home = Path(tempfile.mkdtemp(prefix="k3bench-"))
    app = ChatApp(stream=lambda messages: stream_chat(url, messages),
                  history=History(home / "history.sqlite3"), monitor=Monitor(server.pid),
                  sample_hz=2.0)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.5)
        # Idle: nothing streams, the I/O pane samples at 2 Hz and the panes tick at 4 Hz.
        # Windows with sampling on and off alternate, so the machine's noise hits both.
        chat = app.chat
        spent = {True: [0.0, 0.0], False: [0.0, 0.0]}
        windows = max(2, int(idle_s / 1.0))
        for i in range(windows * 2):
            chat.sampling = on = i % 2 == 0
            c0, w0 = _cpu(), time.monotonic()
            await asyncio.sleep(idle_s / windows / 2)
            spent[on][0] += _cpu() - c0
            spent[on][1] += time.monotonic() - w0
        chat.sampling = True
        idle_cpu = spent[True][0] / spent[True][1]
        sampling_cpu = max(0.0, idle_cpu - spent[False][0] / spent[False][1])

        c0 = _cpu()
        chat.query_one(Prompt).post_message(Prompt.Submitted("stream, please"))
        while chat.current is None or MARKER not in chat.current.content:
            await asyncio.sleep(0.01)
            if server.poll() is not None and (chat.current is None or not chat.generating):
                break
        t_received = time.monotonic()
        from k3tui.tui.widgets.markdown import StreamedMarkdown
        md = chat.current.query_one(".answer-md", StreamedMarkdown)
        while MARKER not in md.source:
            await asyncio.sleep(0.01)
        t_source = time.monotonic()
        # On screen = the composed frame contains the marker (the chat follows the stream).
        while True:
            strips = app.screen._compositor.render_strips()
            if any(MARKER in strip.text for strip in strips):
                break
            await asyncio.sleep(0.02)  # composing a frame to look costs CPU too
            if time.monotonic() - t_received > 30:
                raise RuntimeError("the last token never reached the screen")
        t_screen = time.monotonic()
        stream_cpu = _cpu() - c0
        await app.workers.wait_for_complete()
    line = server.stdout.readline() if server.stdout else ""
    sent = json.loads(line)
    duration = sent["last_sent"] - sent["first_sent"]
    lag = t_screen - sent["last_sent"]
    return {
        "tokens": sent["tokens"],
        "stream_s": round(duration, 3),
        "lag_s": round(lag, 4),
        "receive_lag_s": round(t_received - sent["last_sent"], 4),
        "source_lag_s": round(t_source - sent["last_sent"], 4),
        "lag_fraction": round(lag / duration, 4),
        "cpu_s_per_1000_tokens": round(stream_cpu / sent["tokens"] * 1000, 3),
        "idle_cpu_fraction": round(sampling_cpu, 4),
        "idle_app_cpu_fraction": round(idle_cpu, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3tui bench tui", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=200.0, help="tokens per second")
    parser.add_argument("--idle-s", type=float, default=6.0)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv or [])
    if args.serve:
        asyncio.run(_serve(args.tokens, args.rate))
        return 0
    server = subprocess.Popen([sys.executable, "-m", "k3tui.tui.bench", "--serve",
                               "--tokens", str(args.tokens), "--rate", str(args.rate)],
                              stdout=subprocess.PIPE, text=True)
    try:
        first = server.stdout.readline() if server.stdout else ""
        if not first.startswith("listening on "):
            print("k3tui: the loopback server did not start.", file=sys.stderr)
            return 1
        url = first.split()[-1]
        result = asyncio.run(_measure(url, server, args.idle_s))
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(5)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"streamed {result['tokens']} tokens at {args.rate:.0f} tok/s over "
          f"{result['stream_s']:.2f} s from a loopback server into the headless app")
    print(f"last token on screen {result['lag_s'] * 1000:.0f} ms after the server sent it "
          f"(received after {result['receive_lag_s'] * 1000:.0f} ms): "
          f"lag_fraction {result['lag_fraction']:.4f} (target < 0.10)")
    print(f"app CPU: {result['cpu_s_per_1000_tokens']:.3f} s per 1,000 tokens")
    print(f"idle: the panes' sampling costs idle_cpu_fraction {result['idle_cpu_fraction']:.4f} "
          f"of a core (target < 0.02); the whole idle app "
          f"{result['idle_app_cpu_fraction']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
