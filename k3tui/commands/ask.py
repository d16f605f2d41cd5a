"""`k3tui ask [PROMPT | -]`: queue a turn from a shell; it is answered by a detached runner."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from typing import Any

from k3tui.errors import K3Error

MAX_PROMPT_CHARS = 1_000_000
FOLLOW_POLL_S = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default="-",
                        help="the prompt, or - (default) to read it from stdin")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--conversation", type=int, metavar="ID",
                       help="continue this conversation (default: the most recent)")
    which.add_argument("--new", action="store_true", help="start a new conversation")
    parser.add_argument("--wait", action="store_true",
                        help="follow the answer to its end and print it (Ctrl-C detaches; "
                        "the answer goes on)")
    parser.add_argument("--json", action="store_true",
                        help='print {"id": …} (with --wait: the finished turn)')
    parser.add_argument("--url", help="an OpenAI-compatible server to ask (default: the "
                        "configured remote endpoint)")
    parser.add_argument("--api-key-env", metavar="VAR",
                        help="environment variable holding the API key for --url")
    parser.add_argument("--model", help="model name to request")
    parser.add_argument("--max-tokens", type=int, help="default: chat.max_tokens")
    parser.add_argument("--temperature", type=float, help="default: chat.temperature")
    parser.add_argument("--seed", type=int, help="sampling seed (default: chat.seed, else a "
                        "random one; kept with the turn, so a continued answer is the same "
                        "answer)")
    parser.add_argument("--wait-backend", type=float, metavar="S", help=argparse.SUPPRESS)


def _prompt(text: str) -> str:
    if text == "-":
        if sys.stdin.isatty():
            print("Type the prompt, then Ctrl-D:", file=sys.stderr)
        text = sys.stdin.read(MAX_PROMPT_CHARS + 1)
    if len(text) > MAX_PROMPT_CHARS:
        raise K3Error(f"The prompt is longer than {MAX_PROMPT_CHARS:,} characters.",
                      "shorten it", 2)
    if not text.strip():
        raise K3Error("The prompt is empty.", 'e.g. `k3tui ask "Why is the sky blue?"`', 2)
    return text.strip("\n")


def backend_and_settings(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """Where the turn is asked (its queue's key: the API base URL) and how."""
    from k3tui.backends.openai_stream import api_base, chat_settings
    from k3tui.config import config_exists, is_http_url, load_config

    cfg = load_config() if config_exists() else None
    chat = cfg.chat if cfg is not None else load_config().chat
    settings: dict[str, Any] = chat_settings(chat)
    settings["system_prompt"] = chat.system_prompt
    if args.url:
        if not is_http_url(args.url):
            raise K3Error(f"--url {args.url} is not an http:// or https:// address.",
                          "e.g. `k3tui ask --url http://127.0.0.1:8080/v1 …`", 2)
        url, settings["api_key_env"], settings["model"] = args.url, args.api_key_env, args.model
        if args.api_key_env and not os.environ.get(args.api_key_env):
            raise K3Error(f"The environment variable {args.api_key_env} is empty or not set.",
                          f"export {args.api_key_env}=<your key>, then run this again", 2)
    elif cfg is not None and cfg.backend.kind == "remote" and cfg.remote.url:
        url = cfg.remote.url
        settings.update(api_key_env=cfg.remote.api_key_env or None, configured_key=True,
                        model=args.model or cfg.remote.model or None,
                        verify_tls=cfg.remote.verify_tls)
    elif cfg is not None and cfg.backend.kind in ("bundled", "llama-server"):
        url = _shared_backend(cfg)
        settings["model"] = args.model or None
        if (cfg.backend.host or "127.0.0.1") not in ("127.0.0.1", "localhost", "::1"):
            settings["api_key_credential"] = "server_api_key"   # launch.API_KEY_CREDENTIAL
    else:
        raise K3Error("There is no backend to ask: no configuration, and no --url.",
                      "run `k3tui setup`, or pass a server: `k3tui ask --url "
                      "http://127.0.0.1:PORT …`", 2)
    if args.max_tokens is not None:
        settings["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        settings["temperature"] = args.temperature
    seed = args.seed if args.seed is not None else chat.seed or secrets.randbelow(2**31)
    settings["seed"] = seed
    return api_base(url), settings


def _shared_backend(cfg: Any) -> str:
    """The URL of the configured backend's shared service, started (detached) if none runs."""
    from k3tui.backends import service

    def progress(p) -> None:
        print(f"  {p.line()}", file=sys.stderr, flush=True)

    found, already = service.attach_or_start(cfg, on_progress=progress)
    if not already:
        print(f"Started the backend as a shared service (job {found.job_id}); "
              "`k3tui serve stop` stops it.", file=sys.stderr, flush=True)
    return found.url


def _conversation(history: Any, args: argparse.Namespace, prompt: str) -> int:
    if args.conversation is not None:
        if history.get_conversation(args.conversation) is None:
            raise K3Error(f"There is no conversation {args.conversation}.",
                          "leave out --conversation, or use --new", 2)
        return args.conversation
    convs = [] if args.new else history.list_conversations()
    if convs:
        return convs[0].id
    return history.new_conversation(" ".join(prompt.split())[:60] or "New chat")


def run(args: argparse.Namespace) -> int:
    from k3tui.answers.runner import ensure_runner
    from k3tui.answers.store import TurnStore
    from k3tui.history import History

    prompt = _prompt(args.prompt)
    backend, settings = backend_and_settings(args)
    history = History()
    store = TurnStore(history)
    turn = store.enqueue(_conversation(history, args, prompt), prompt, backend, settings)
    ensure_runner(backend, args.wait_backend)
    if not args.wait:
        print(json.dumps({"id": turn.id, "conversation": turn.conversation_id})
              if args.json else turn.id, flush=True)
        return 0
    if not args.json:
        print(f"turn {turn.id} (conversation {turn.conversation_id}); Ctrl-C detaches",
              file=sys.stderr, flush=True)
    return follow(store, turn.id, as_json=args.json)


def follow(store: Any, turn_id: int, *, as_json: bool = False) -> int:
    """Print the answer as it comes until the turn ends; Ctrl-C detaches."""
    from k3tui.commands.answers import turn_json
    from k3tui.textsafe import clean   # the store is a file: what it says goes on a terminal

    shown = thought = 0
    try:
        while True:
            turn = store.get(turn_id)
            if not as_json and len(turn.reasoning) > thought:   # the thinking, apart
                sys.stderr.write(("[reasoning] " if not thought else "")
                                 + clean(turn.reasoning[thought:]))
                sys.stderr.flush()
                thought = len(turn.reasoning)
            if not as_json and len(turn.content) > shown:
                if thought and not shown:
                    sys.stderr.write("\n")
                sys.stdout.write(clean(turn.content[shown:]))
                sys.stdout.flush()
                shown = len(turn.content)
            if turn.state not in ("queued", "running"):
                break
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        print(f"\nDetached; the answer goes on: `k3tui answers show {turn_id}`.",
              file=sys.stderr)
        return 130
    if as_json:
        print(json.dumps(turn_json(turn, full=True)))
    else:
        print()
        if turn.state != "done":
            print(f"turn {turn_id}: {turn.state}: {turn.stop_reason}", file=sys.stderr)
    return 0 if turn.state == "done" else 1
