"""`k3tui serve`: run the configured backend in the foreground until Ctrl-C.

Shows what it starts and why (each critical llama-server flag with a one-line reason, the
memory limit or the risk of running without one), reports load progress, prints the
OpenAI-compatible URL, and stops the server cleanly (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from k3tui.errors import K3Error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["bundled", "llama-server"],
                        help="which backend to start (default: [backend] kind of the config)")
    from k3tui.commands import old_spelling

    parser.add_argument("--model-path", dest="model_path", metavar="PATH",
                        help="checkpoint folder (bundled) or .gguf file / folder (llama-server)")
    old_spelling(parser, "--model", "--model-path", dest="model_path", metavar="PATH")
    parser.add_argument("--port", type=int, help="port to listen on (default: a free one)")
    parser.add_argument("--rpc", metavar="HOST:PORT,…",
                        help="pool these llama.cpp RPC workers (`k3tui worker` on each) for "
                             "llama-server (default: [llama_server] rpc; '' for none)")
    parser.add_argument("--force", action="store_true",
                        help="start despite a refusal: other processes holding GPU memory "
                             "on a unified-memory machine, a memory limit that leaves too "
                             "little or cannot be applied (risks freezing the machine)")
    parser.add_argument("--dry-run", action="store_true",
                        help="show the command and the memory limit, start nothing")
    parser.add_argument("--machine", metavar="NAME|FILE",
                        help="with --dry-run: show what would run on a machine profile "
                             "(dgx-spark, laptop-8g, workstation-128g, server-228g) or a "
                             "`k3tui doctor --json` file")


def _config():
    from k3tui.config import Config, config_exists, load_config

    return load_config() if config_exists() else Config()


def run(args: argparse.Namespace) -> int:
    from k3tui.backends.launch import prepare_launch
    from k3tui.backends.llama.server import exit_story
    from k3tui.config import parse_rpc

    cfg = _config()
    kind = args.backend or _kind_of(args.model_path) or cfg.backend.kind
    if kind == "remote":
        raise K3Error("The configured backend is a remote endpoint; there is nothing to serve "
                      "here.", "use `k3tui chat`, or pass --backend bundled|llama-server", 2)
    if args.rpc and kind != "llama-server":
        raise K3Error(f"--rpc pools workers for llama-server, and the backend here is {kind}.",
                      "serve a GGUF (`--backend llama-server --model-path FILE.gguf`)", 2)
    if args.machine and not args.dry_run:
        raise K3Error("--machine only describes another machine; it cannot start a server "
                      "here.", "add --dry-run", 2)
    model = args.model_path or cfg.model.dir
    if args.dry_run and args.machine and not (model and Path(model).expanduser().exists()):
        from k3tui.config import config_exists

        chosen = args.backend or _kind_of(args.model_path) \
            or (cfg.backend.kind if config_exists() else None)
        return _plan_without_model(args, chosen, configured=cfg.model.dir)
    workers = None if args.rpc is None else parse_rpc(args.rpc)
    ready = prepare_launch(cfg, kind=kind, model=args.model_path, port=args.port,
                           force=args.force, machine=args.machine, rpc=workers)
    shown = ready.describe()
    print(shown, flush=True)
    if args.dry_run:
        return 0
    tty = sys.stderr.isatty()

    def progress(p) -> None:
        end = "\r" if tty else "\n"
        print(f"  {p.line()}".ljust(78), end=end, file=sys.stderr, flush=True)

    # SIGTERM (e.g. from a service manager) stops the server like Ctrl-C does; SIGINT is
    # re-armed because a shell may have started us with it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    backend = ready.start(progress)
    try:
        if tty:
            print(file=sys.stderr)
        for note in backend.notes:
            if note not in shown:  # the memory-limit warning was already in the description
                print(note, file=sys.stderr)
        key = " (API key: see credentials.toml, `server_api_key`)" if backend.api_key else ""
        print(f"{backend.kind} ready: {backend.base_url}/v1 (model {backend.model}){key}\n"
              f"log: {backend.log_path}", flush=True)
        if backend.rpc_workers:
            print(_pool_loaded(backend), flush=True)
        print("Ctrl-C stops it.", flush=True)
        backend.wait()
        raise K3Error(f"The {backend.kind} backend {exit_story(backend)}.\n"
                      f"last log lines ({backend.log_path}):\n{backend.log_tail(15)}",
                      "read the log, fix the cause, and run `k3tui serve` again")
    except KeyboardInterrupt:
        print("\nstopping…", file=sys.stderr, flush=True)
        return 0
    finally:
        backend.stop()
        if backend.process is not None and backend.process.returncode is not None:
            print(f"{backend.kind} stopped.", file=sys.stderr)


def _pool_loaded(backend) -> str:
    """What each worker holds now that the head has loaded (from the head's log)."""
    from k3tui.backends.llama.rpc import placement_in_log
    from k3tui.units import memory_size

    held = placement_in_log(backend.log_path)
    return "pool: " + ", ".join(
        f"{w} holds {memory_size(held[w])}" if w in held else f"{w} (its share is not in "
        "the log)" for w in backend.rpc_workers)


def _kind_of(model: str | None) -> str | None:
    """The backend a `--model-path` needs: a .gguf (or a folder of them) runs only in
    llama-server, a safetensors checkpoint folder only in the bundled engine."""
    if not model:
        return None
    path = Path(model).expanduser()
    if path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf"))
                                  and not (path / "config.json").is_file()):
        return "llama-server"
    if path.is_dir() and (path / "config.json").is_file():
        return "bundled"
    return None


def _plan_without_model(args: argparse.Namespace, kind: str | None,
                        configured: str = "") -> int:
    """`serve --dry-run --machine NAME` for a machine you don't have, so without its model
    files: the plan for that machine from the model's published size and shard count."""
    from k3tui.planning.plan import MODEL_LABELS, format_plan, make_plan, recommend_model_kind
    from k3tui.probe import load_report

    report = load_report(args.machine)
    checkpoint = {"bundled": "safetensors", "llama-server": "gguf"}.get(kind or "") \
        or recommend_model_kind(report)
    given = args.model_path
    what = f"{given} is not here" if given else \
        f"The configured checkpoint {configured} is not here" if configured else \
        "No model is configured here"
    print(f"{what}; this is what k3tui would run on {args.machine}, from the published "
          f"size of {MODEL_LABELS[checkpoint].removeprefix('Kimi-K3 ')}"
          + ("" if given else " (the model path is a placeholder)") + ".")
    print(format_plan(make_plan(report, checkpoint), report, model_path=given))
    return 0
