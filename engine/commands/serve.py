"""`python -m engine serve CHECKPOINT`: an OpenAI-compatible HTTP server for the engine.

The flags become the service (engine/serve/routes.py) and the load's typed settings; the
socket is bound before the model loads, so a client sees 503 with progress, not a refused
connection. Binding anything but loopback requires `--api-key`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import uvicorn

from engine.decode.steer import DEMO_NOTICE
from engine.errors import EngineError
from engine.serve.limits import MAX_BODY_MB, MIN_BODY_RATE, READ_TIMEOUT, h11_with_head_deadline
from engine.serve.routes import PING_SECONDS, Service
from engine.serve.worker import LoadSettings, load_engine
from engine.weights.planner import add_memory_arguments
from k3vocab import DEFAULT_CONTEXT

STATE_GB = 16.0        # on disk: ~20 real-model conversations of a few thousand tokens
SNAPSHOT_GB = 2.0      # real model: ~3 kept states of ~0.63 GB (KDA state) + their latent cache


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint folder (config.json + safetensors shards)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="folder with tiktoken.model + tokenizer_config.json (default: the checkpoint)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8080, help="port (0 = any free port; default 8080)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("K3_API_KEY"),
        metavar="KEY",
        help="require this key (comma-separated for several; default $K3_API_KEY, "
        "which keeps it out of `ps`); needed off loopback",
    )
    parser.add_argument("--model-name", default=None, metavar="NAME", help="model id in responses")
    parser.add_argument(
        "--ctx-size",
        type=int,
        default=DEFAULT_CONTEXT,
        metavar="N",
        help=f"context tokens per conversation (default {DEFAULT_CONTEXT})",
    )
    parser.add_argument(
        "--reasoning-budget",
        type=int,
        default=-1,
        metavar="N",
        help="default max tokens of thinking before the answer is forced (-1 = no limit)",
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=MAX_BODY_MB,
        metavar="MB",
        help=f"largest request body in MiB; bigger ones get 413 (default {MAX_BODY_MB:g})",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=READ_TIMEOUT,
        metavar="S",
        help="seconds a client may take to send a request's headers, or stall in "
        f"its body, before the connection is closed (default {READ_TIMEOUT:g}); after "
        f"them a body must average {MIN_BODY_RATE // 1024} KiB/s",
    )
    parser.add_argument(
        "--steer-demo",
        action="store_true",
        help="demo for random-weight models: readable words in a scripted think/answer shape",
    )
    parser.add_argument(
        "--snapshot-gb",
        type=float,
        default=SNAPSHOT_GB,
        metavar="X",
        help="GB of conversation states kept between turns, so a follow-up prefills only "
        f"what is new (0 = off; default {SNAPSHOT_GB:g}; the memory plan counts it)",
    )
    parser.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="folder where conversation states are also kept on disk, so a restarted server "
        "resumes them (0700, files 0600; default: none, states end with the process)",
    )
    parser.add_argument(
        "--state-gb",
        type=float,
        default=STATE_GB,
        metavar="X",
        help=f"GB the state folder may hold, least recently used out (default {STATE_GB:g})",
    )
    parser.add_argument("--debug-load-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--debug-token-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    # tests: mid-answer checkpoints every N tokens, and a generation that stops after N tokens
    # (as if the server were killed there)
    parser.add_argument("--debug-checkpoint-every", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--debug-hang-after", type=int, default=0, help=argparse.SUPPRESS)
    # tests: pings often enough that a client's stall window is short
    parser.add_argument("--debug-ping-seconds", type=float, default=PING_SECONDS,
                        help=argparse.SUPPRESS)
    add_memory_arguments(parser)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _fail(message: str, code: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def main(args: argparse.Namespace) -> int:
    api_keys = [k.strip() for k in (args.api_key or "").split(",") if k.strip()]
    if not is_loopback(args.host) and not api_keys:
        return _fail(
            f"refusing to bind {args.host} without --api-key: anyone who can reach it could use "
            "the model; pass --api-key KEY, or bind 127.0.0.1 and tunnel (ssh -L)",
            2,
        )
    checkpoint = Path(args.checkpoint).expanduser()
    if not (checkpoint / "config.json").is_file():
        return _fail(
            f"{checkpoint} has no config.json; pass the checkpoint folder "
            "(with the safetensors shards)"
        )
    tok_dir = Path(args.tokenizer).expanduser() if args.tokenizer else checkpoint
    if not (tok_dir / "tiktoken.model").is_file():
        return _fail(
            f"{tok_dir} has no tiktoken.model; pass --tokenizer DIR with tiktoken.model and "
            "tokenizer_config.json (for a synthesised model: python -m engine synth writes them)"
        )
    if args.ctx_size < 16:
        return _fail("--ctx-size must be at least 16 tokens", 2)
    if not (0 < args.max_body_mb < 2**20 and 0 < args.read_timeout < 86400):
        return _fail("--max-body-mb and --read-timeout must be positive numbers", 2)
    if not 0 < args.debug_ping_seconds <= 3600:
        return _fail("--debug-ping-seconds must be from 0 to 3600 seconds", 2)
    try:
        sock = socket.create_server(
            (args.host.strip("[]"), args.port),
            family=socket.AF_INET6 if ":" in args.host else socket.AF_INET,
        )
    except OSError as exc:
        return _fail(
            f"cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); "
            "pick another --port or stop the program using it"
        )
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host

    name = args.model_name or (DEMO_NOTICE if args.steer_demo else checkpoint.resolve().name)
    service = Service(
        model_name=name,
        steer_demo=args.steer_demo,
        reasoning_budget=args.reasoning_budget,
        api_keys=api_keys,
        max_body_mb=args.max_body_mb,
        read_timeout=args.read_timeout,
        ping_seconds=args.debug_ping_seconds,
    )

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            print(f"listening on http://{url_host}:{port}", flush=True)

        async def shutdown(self, sockets=None) -> None:
            service.cancel_running()  # end a running stream now, not after the grace period
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(
        service.app(),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
        timeout_keep_alive=5,
        http=h11_with_head_deadline(args.read_timeout),
    )
    server = Server(config)
    failed: list[str] = []

    def load() -> None:
        try:
            if args.debug_load_delay:
                service.progress.phase = "debug-delay"
                time.sleep(args.debug_load_delay)
            settings = LoadSettings.from_args(args)
            loaded = load_engine(checkpoint, tok_dir, settings, service.progress, args.ctx_size)
            service.set_loaded(loaded)
            print(
                f"model ready in {service.metrics.values['load_seconds']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        except Exception as exc:  # noqa: BLE001 - any load failure ends the server with one sentence
            if not isinstance(exc, EngineError):
                traceback.print_exc(file=sys.stderr)
            failed.append(
                str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
            )
            service.progress.error = failed[-1]
            server.should_exit = True

    threading.Thread(target=load, name="k3-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        service.cancel_running()
    if failed:
        return _fail(f"the model failed to load: {failed[-1]}")
    return 0
