"""`k3tui answers [show|stop] [ID] [--json]`: the turns queued, running and recently ended."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from k3tui.errors import K3Error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", default="list",
                        choices=["list", "show", "stop", "run"],
                        help="list (default), show ID (its reasoning and answer so far), "
                        "stop ID")
    parser.add_argument("id", nargs="?", help="the turn's id (from `k3tui ask` or the list)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    # the runner job's own arguments (`k3tui answers run` is started by `k3tui ask`)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--wait-backend", type=float, help=argparse.SUPPRESS)


def turn_json(turn: Any, *, full: bool = False) -> dict[str, Any]:
    out = {"id": turn.id, "conversation": turn.conversation_id, "state": turn.state,
           "tokens": turn.tokens, "s_per_token": turn.s_per_token,
           "elapsed_s": turn.elapsed_s(time.time()), "eta_s": turn.eta_s,
           "backend": turn.backend, "stop_reason": turn.stop_reason,
           "next_step": turn.next_step}
    if full:
        out.update(reasoning=turn.reasoning, content=turn.content,
                   token_ids=turn.token_ids)
    return out


def _turn_id(args: argparse.Namespace) -> int:
    if not args.id or not args.id.isdigit():
        raise K3Error(f"`k3tui answers {args.action}` needs a turn id.",
                      "list them with `k3tui answers`", 2)
    return int(args.id)


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 120:
        return f"{value:.1f}s"
    if value < 7200:
        return f"{value / 60:.0f}m"
    return f"{value / 3600:.1f}h"


def _resume_orphans(store: Any, turns: list[Any]) -> None:
    """A turn queued or running with no runner alive (killed, a reboot) gets one."""
    from k3tui import jobs
    from k3tui.answers.runner import ensure_runner

    for backend in store.backends_waiting():
        runners = {t.runner for t in turns if t.backend == backend and t.state == "running"}
        alive = False
        for rid in runners:
            try:
                alive = alive or (jobs.valid_id(rid)
                                  and jobs.read_state(rid)["status"] == "running")
            except K3Error:
                pass
        if not alive:
            ensure_runner(backend)


def run(args: argparse.Namespace) -> int:
    from k3tui.answers.store import TurnStore
    from k3tui.history import History

    if args.action == "run":
        from k3tui.answers.runner import WAIT_BACKEND_S, serve_queue

        if not args.backend:
            raise K3Error("`k3tui answers run` needs --backend URL.",
                          "it is started by `k3tui ask`; you need not run it", 2)
        return serve_queue(args.backend, wait_s=args.wait_backend or WAIT_BACKEND_S)
    store = TurnStore(History())
    if args.action == "show":
        turn = store.get(_turn_id(args))
        if args.json:
            print(json.dumps(turn_json(turn, full=True)))
            return 0
        from k3tui.textsafe import clean   # the store is a file: what it says goes on a terminal

        print(f"turn {turn.id} · conversation {turn.conversation_id} · {turn.state} · "
              f"{turn.tokens} tokens" + (f" · {clean(turn.stop_reason)}" if turn.stop_reason
                                         else ""))
        if turn.reasoning:
            print(f"\n[reasoning]\n{clean(turn.reasoning)}")
        print(f"\n{clean(turn.content)}")
        return 0
    if args.action == "stop":
        turn = store.request_stop(_turn_id(args))
        what = {"queued": "it will stop", "running": "it stops within a second"}
        print(f"turn {turn.id}: {turn.state}"
              + (f"; stop requested, {what.get(turn.state, '')}"
                 if turn.state == "running" else ""))
        return 0
    turns = store.list_turns()
    _resume_orphans(store, turns)
    if args.json:
        print(json.dumps([turn_json(t) for t in turns]))
        return 0
    if not turns:
        print("No answers yet. Queue one with `k3tui ask \"…\"`.")
        return 0
    now = time.time()
    print(f"{'ID':>5} {'CONV':>5} {'STATE':8} {'TOKENS':>7} {'S/TOK':>7} {'ELAPSED':>8} "
          f"{'ETA':>7}")
    for t in turns:
        pace = f"{t.s_per_token:.2f}" if t.s_per_token is not None else "-"
        print(f"{t.id:>5} {t.conversation_id:>5} {t.state:8} {t.tokens:>7} {pace:>7} "
              f"{_seconds(t.elapsed_s(now) if t.started else None):>8} {_seconds(t.eta_s):>7}")
    return 0
