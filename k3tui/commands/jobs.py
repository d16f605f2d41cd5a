"""`k3tui jobs [attach|cancel|log] [ID]`: detached downloads and packing."""

from __future__ import annotations

import argparse
import sys
import time

from k3tui import units
from k3tui.hub.progress import file_counts
from k3tui.jobs import resume_hint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", default="list",
                        choices=["list", "attach", "cancel", "log", "clean"],
                        help="list (default), attach (live progress; Ctrl-C detaches), "
                        "cancel, log (print the job's log), or clean (forget finished jobs)")
    parser.add_argument("--json", action="store_true",
                        help="with list: print the jobs' states as JSON")
    parser.add_argument("id", nargs="?", help="job id, or a unique part of it "
                        "(default: the newest running job)")


def run(args: argparse.Namespace) -> int:
    from k3tui import jobs

    if args.action == "list":
        return _list(as_json=args.json)
    if args.action == "clean":
        gone, damaged = jobs.forget_finished()
        print(f"Forgot {len(gone)} finished job(s); files they downloaded or packed stay.")
        _print_damaged(damaged, sys.stdout)
        return 0
    job_id = jobs.resolve_id(args.id)
    if args.action == "attach":
        return attach(job_id)
    if args.action == "log":
        return _log(job_id)
    state, stopped = jobs.cancel_job(job_id)
    if stopped:
        print(f"Job {job_id}: {state['status']}. Its partial files are kept; "
              f"{resume_hint(state)}.")
    else:   # a job whose process is gone says so in its message, and nothing was signalled
        print(f"Job {job_id} is not running ({state['status']}): "
              f"{state['message'].rstrip('.')}.")
    return 0


def _log(job_id: str) -> int:
    from k3tui import jobs
    from k3tui.errors import K3Error

    state = jobs.read_state(job_id)
    path = jobs.log_path(job_id)       # named from the id, not from the state file
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            sys.stdout.write(fh.read())
    except OSError as exc:
        status = state["status"]
        step = f"`k3tui jobs attach {job_id}` shows its progress" if status == "running" \
            else "`k3tui jobs` still shows how it ended" + \
            ("" if status == "done" else f"; {resume_hint(state)}")
        raise K3Error(f"The log of job {job_id} cannot be read ({path}: "
                      f"{exc.strerror or exc}).", step, 1) from None
    return 0


def _print_damaged(damaged, out) -> None:
    from k3tui.jobs import jobs_folder

    for d in damaged:
        print(f"{d.id}  damaged, skipped: {d.reason}", file=out)
    if damaged:
        print(f"  (look at or remove those state files in {jobs_folder()})", file=out)


def _eta(s: float | None) -> str:
    if s is None:
        return "--"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def summary_line(state: dict) -> str:
    from k3tui.jobs import layer_progress

    if state.get("kind") == "rpc-worker":  # a service, not a transfer: nothing to count
        return "RPC worker" + (": serves a head until `k3tui worker stop`"
                               if state.get("status") == "running" else "")
    if state.get("kind") == "backend":
        return "backend service" + (f" at {state.get('url') or '(loading)'}: shared by every "
                                    "chat and `k3tui ask` until `k3tui serve stop`"
                                    if state.get("status") == "running" else "")
    if state.get("kind") == "answers":
        return "answer runner" + (": answers the queued turns (`k3tui answers`)"
                                  if state.get("status") == "running" else "")
    if state.get("kind") == "llama-build":  # done_bytes of 100 is the build's percent
        return "llama.cpp source build" + (f": {state.get('message')}"
                                           if state.get("status") == "running" else "")
    total, done = state.get("total_bytes") or 0, state.get("done_bytes") or 0
    pct = f"{100 * done / total:.1f}%" if total else "--"
    rate = state.get("rate_bps") or 0.0
    bits = [f"{pct}  {units.transfer_progress(done, total)}"]
    if state.get("status") == "running":
        bits.append(f"{units.rate(rate)}  ETA {_eta(state.get('eta_s'))}")
        if state.get("stalled"):
            bits.append("STALLED (retrying)")
    layer = layer_progress(state)
    if layer:
        bits.append(layer)
    return "  ".join(bits)


def _list(as_json: bool = False) -> int:
    import json
    import textwrap

    from k3tui import jobs

    rows, damaged = jobs.scan()
    if as_json:
        print(json.dumps(rows, indent=2))
        _print_damaged(damaged, sys.stderr)
        return 0
    if not rows and not damaged:
        print("No jobs. Start one with `k3tui download` or `k3tui pack`.")
        return 0
    for s in rows:  # three short lines a job: an 80-column SSH window does not wrap them
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(s["started"]))
        print(f"{s['id']}  {s['status']:<9}  {started}")
        print(f"  {summary_line(s)}")
        print(f"  {s['target']}")
        if s["message"]:  # wrapped at word boundaries, at most three lines
            print(textwrap.fill(s["message"], 80, initial_indent="  ", subsequent_indent="  ",
                                max_lines=3, placeholder=f" … (`k3tui jobs log {s['id']}`)"))
    _print_damaged(damaged, sys.stdout)
    return 0


def render_state(state: dict, width: int = 80):
    """A Rich renderable for one job's state (also used by `download --foreground`),
    fitted to `width` columns."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    total, done = state.get("total_bytes") or 0, state.get("done_bytes") or 0
    head = Text.assemble((f"{state.get('kind', 'job')} {state.get('id', '')}", "bold"),
                         f"  {state.get('status', '')}  ", (state.get("message") or "", "dim"))
    bar = Table.grid()  # a grid row ends the line; a bare ProgressBar would not
    bar.add_row(ProgressBar(total=max(total, 1), completed=done,
                            width=max(10, min(60, width - 1))))
    parts = [head, bar, Text(summary_line(state),
                             style="bold red" if state.get("stalled") else "")]
    files = state.get("files") or []
    busy = [f for f in files if f["status"] not in ("done", "pending")]
    if busy:
        table = Table.grid(padding=(0, 2))
        for f in busy[:8]:
            pct = 100 * f["done"] / f["size"] if f["size"] else 100.0
            done_of = units.transfer_progress(f["done"], f["size"])
            table.add_row(f["name"], f"{pct:5.1f}%", done_of, f["status"])
        parts.append(table)
    counts = file_counts(state)
    if counts:
        parts.append(Text(f"{counts.get('done', 0)}/{sum(counts.values())} files verified"
                          + (f", {state['retries']} retries" if state.get("retries") else ""),
                          style="dim"))
    for err in (state.get("errors") or [])[-2:]:
        parts.append(Text(f"last error: {err}", style="yellow"))
    return Group(*parts)


def attach(job_id: str) -> int:
    """Follow a job until it ends; Ctrl-C detaches and leaves it running."""
    from rich.console import Console
    from rich.live import Live

    from k3tui import jobs

    console = Console()
    state = jobs.read_state(job_id)
    try:
        if console.is_terminal:
            with Live(render_state(state, console.width), console=console,
                      refresh_per_second=4) as live:
                while state["status"] == "running":
                    time.sleep(0.25)
                    state = jobs.read_state(job_id)
                    live.update(render_state(state, console.width))
        else:                     # piped / logged: one plain line every few seconds
            last = 0.0
            while state["status"] == "running":
                if time.monotonic() - last >= 5 and state.get("total_bytes"):
                    print(f"{job_id} {summary_line(state)}", flush=True)
                    last = time.monotonic()
                time.sleep(0.25)
                state = jobs.read_state(job_id)
    except KeyboardInterrupt:
        console.print(f"\nDetached; job {job_id} keeps running. "
                      f"Reattach with `k3tui jobs attach {job_id}`.")
        return 0
    message = state.get("message") or ""
    print(f"{job_id}: {message}" if message.lower().startswith(state["status"])
          else f"{job_id}: {state['status']}: {message}")
    if state["status"] != "done":
        print(f"  log: `k3tui jobs log {job_id}`", file=sys.stderr)
    return 0 if state["status"] == "done" else 1
