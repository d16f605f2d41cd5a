"""`k3tui chat`: the chat TUI on the configured backend, any OpenAI-compatible URL, or the demo."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from k3tui.errors import K3Error
from k3tui.units import GB

SMOKE_PROMPT = "Say hello in one short sentence."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="base URL of a running OpenAI-compatible server "
                        "(with or without a trailing /v1)")
    parser.add_argument("--api-key-env", metavar="VAR",
                        help="environment variable holding the API key for --url")
    parser.add_argument("--model", help="model name to request (default: the server's first)")
    parser.add_argument("--demo", action="store_true",
                        help="synthesise a small demo model (random weights, not Kimi-K3) "
                        "and chat with it on the bundled engine")
    parser.add_argument("--smoke", action="store_true",
                        help="no terminal needed: send one scripted prompt headless in a new "
                        "conversation, print the answer, exit 0 only if an answer streamed")
    parser.add_argument("--prompt", default=SMOKE_PROMPT, help="the prompt --smoke sends")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--conversation", type=int, metavar="ID",
                       help="open this conversation (default: the most recent)")
    which.add_argument("--new", action="store_true",
                       help="start a new conversation instead of opening the most recent")
    parser.add_argument("--ascii", action="store_true",
                        help="ASCII sparklines, for terminals without block characters")
    parser.add_argument("--light", action="store_true", help="light theme")


def _require_terminal(args: argparse.Namespace) -> None:
    if args.smoke:
        return
    if not sys.stdin.isatty() or not sys.stdout.isatty():
        raise K3Error("`k3tui chat` needs a terminal, and stdin or stdout is not one.",
                      "run it in a terminal (over SSH: `ssh -t host k3tui chat`), or use "
                      "`k3tui chat --smoke` for a non-interactive check", 2)


class Session:
    """What the app talks to: a stream function, header info, and how to (re)start it."""

    def __init__(self) -> None:
        from k3tui.tui.app import BackendInfo

        self.info = BackendInfo()
        self.running: Any = None                  # a RunningBackend we started (or None)
        self.starter: Callable[[Callable[[Any], None]], Any] | None = None
        self.chat_kwargs: dict[str, Any] = {}
        self.system_prompt = ""
        self.url = ""
        self.api_key: str | None = None
        self.verify: Any = True                   # TLS policy for a remote URL

    def stream(self, messages: list[dict[str, Any]]):
        if self.running is not None:
            return self.running.chat(messages, **self.chat_kwargs)
        from k3tui.backends.openai_stream import stream_chat

        return stream_chat(self.url, messages, api_key=self.api_key, verify=self.verify,
                           model=self.info.model or None, **self.chat_kwargs)

    def attach(self, running: Any) -> None:
        """Called once a started backend answers: point the stream and header at it."""
        self.running = running
        self.info.kind = running.kind
        self.info.model = self.info.model or running.model
        self.info.url = running.base_url
        self.info.pid = running.pid
        self.info.log_path = str(running.log_path or "")
        self.info.pool = list(getattr(running, "rpc_workers", []))
        limit = getattr(running, "memory_limit_bytes", None)
        if limit and not self.info.budget_gb:
            self.info.budget_gb = limit / GB  # llama-server's enforced memory limit

    def use_demo(self) -> Callable[[Callable[[Any], None]], Any]:
        """Become the demo session in place (the app holds this session's info and stream);
        returns its starter."""
        d = _demo_session()
        self.info.__dict__.update(d.info.__dict__)
        d.info = self.info  # the demo's starter records its budget on the info shown
        self.starter, self.chat_kwargs, self.system_prompt = (d.starter, d.chat_kwargs,
                                                              d.system_prompt)
        return d.starter

    def alive(self) -> bool:
        return self.running is None or self.running.alive()

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop()


def _url_session(url: str, api_key_env: str | None, model: str | None) -> Session:
    from k3tui.config import is_http_url, load_config

    if not is_http_url(url):
        raise K3Error(f"--url {url} is not an http:// or https:// address.",
                      "e.g. `k3tui chat --url http://127.0.0.1:8080/v1`", 2)
    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise K3Error(f"The environment variable {api_key_env} is empty or not set.",
                          f"export {api_key_env}=<your key>, then run this again", 2)
    return _point_at(_chat_settings(Session(), load_config().chat), url, api_key, model)


def _demo_session() -> Session:
    """The demo model with the [chat] settings every chat sends (defaults without a config)."""
    from k3tui import demo
    from k3tui.config import load_config

    return demo.demo_session(_chat_settings(Session(), load_config().chat))


def _chat_settings(s: Session, chat: Any) -> Session:
    """The [chat] section (defaults without a config) for whichever backend answers."""
    from k3tui.backends.openai_stream import chat_settings

    s.chat_kwargs = chat_settings(chat)
    s.system_prompt = chat.system_prompt
    return s


def _point_at(s: Session, url: str, api_key: str | None, model: str | None,
              verify: Any = True) -> Session:
    """Aim a session at a running server: URL, key, TLS policy, and the model to ask for."""
    s.url, s.api_key, s.verify = url, api_key, verify
    s.info.kind = "remote"
    s.info.url = url
    s.info.model = model or _first_model(url, api_key) or urlsplit(url).netloc or "?"
    return s


def _first_model(url: str, api_key: str | None) -> str | None:
    """The server's first model id; None when it cannot say (the chat still opens)."""
    import asyncio

    try:
        from k3tui.backends.openai_stream import list_models

        models = asyncio.run(asyncio.wait_for(list_models(url, api_key=api_key), 10))
    except Exception:
        return None
    if not models:
        return None
    return str(models[0].get("id") or "") or None


def _remote_session(cfg: Any, base: Session) -> Session:
    """The configured endpoint: its key from the named variable or the one `k3tui setup`
    stored, and its TLS policy."""
    from k3tui.backends.endpoint import resolve_api_key, tls_verify

    api_key, _ = resolve_api_key(cfg.remote.api_key_env)
    return _point_at(base, cfg.remote.url, api_key, cfg.remote.model or None,
                     tls_verify(cfg.remote.verify_tls))


def _config_session(cfg: Any) -> Session:
    s = _chat_settings(Session(), cfg.chat)
    if cfg.backend.kind == "remote":
        url = cfg.remote.url
        if not url:
            raise K3Error("The config names a remote backend but no URL.",
                          "run `k3tui setup`, or `k3tui config set remote.url URL`")
        return _remote_session(cfg, s)
    s.info.kind = cfg.backend.kind
    s.info.model = os.path.basename(str(cfg.model.dir).rstrip("/")) or cfg.model.repo
    if cfg.backend.kind == "bundled":
        s.info.preset = cfg.engine.preset
    from k3tui.backends import launch as launch_mod

    s.starter = lambda on_progress: launch_mod.launch(cfg, on_progress=on_progress)
    return s


def _offer_demo() -> bool:
    print("k3tui has no configuration yet (run `k3tui setup` to make one).")
    if not sys.stdin.isatty():
        return False
    try:
        answer = input("Try the demo model now (random weights, a few MB, not Kimi-K3)? [Y/n] ")
    except EOFError:
        return False
    return answer.strip().lower() in ("", "y", "yes")


def build_session(args: argparse.Namespace) -> Session:
    if args.demo:
        return _demo_session()
    if args.url:
        return _url_session(args.url, args.api_key_env, args.model)
    from k3tui.config import config_exists, load_config

    if not config_exists():
        if not args.smoke and _offer_demo():
            return _demo_session()
        raise K3Error("There is no configuration yet.",
                      "run `k3tui setup`, or try `k3tui chat --demo`", 2)
    return _config_session(load_config())


def make_app(session: Session, args: argparse.Namespace, **overrides: Any):
    from k3tui.history import History
    from k3tui.monitor import Monitor
    from k3tui.tui.app import ChatApp

    kwargs: dict[str, Any] = dict(
        stream=session.stream, history=History(), backend=session.info,
        monitor=Monitor(session.info.pid), ascii=True if args.ascii else None,
        conversation_id=args.conversation, new_conversation=args.new or args.smoke,
        system_prompt=session.system_prompt,
        theme="textual-light" if args.light else None, starter=session.starter,
        on_started=session.attach, backend_alive=session.alive,
        demo=session.use_demo if session.starter is not None and not session.info.label
        else None)
    kwargs.update(overrides)
    return ChatApp(**kwargs)


def run(args: argparse.Namespace) -> int:
    _require_terminal(args)
    session = build_session(args)
    try:
        if args.smoke:
            return smoke(session, args)
        app = make_app(session, args)
        app.run()
        return int(app.return_code or 0)
    finally:
        session.stop()


def smoke(session: Session, args: argparse.Namespace) -> int:
    """One scripted turn in the real app, headless; 0 only if tokens streamed."""
    from k3tui.tui.widgets.prompt import Prompt

    result: dict[str, Any] = {}
    t0 = time.monotonic()

    def ready(app) -> None:
        def check() -> None:
            chat = app.chat
            failed = getattr(app.screen, "failure", None)  # the start-up screen's refusal
            if failed is not None:
                result["failed"] = failed
                app.exit(1)
                return
            if app.screen is not chat:
                return  # still starting the backend
            if not result.get("sent"):
                result["sent"] = time.monotonic()
                chat.query_one(Prompt).post_message(Prompt.Submitted(args.prompt))
                return
            if chat.turns_finished < 1:
                return
            snap = chat.stats.snapshot()
            result.update(tokens=snap.tokens, ttft_ms=snap.ttft_ms, status=chat.current.status,
                          content=chat.current.content, reasoning=chat.current.reasoning,
                          note=chat.current.note, last_error=chat.last_error)
            app.exit(0 if snap.tokens > 0 and chat.current.status == "done" else 1)

        app.set_interval(0.1, check)

    app = make_app(session, args, on_ready=ready, sample_hz=2.0)
    app.run(headless=True, size=(100, 30))
    if "failed" in result:
        failed = result["failed"]
        print(f"smoke: the backend did not start: {failed.message.splitlines()[0]}\n"
              f"next: {failed.next_step}", file=sys.stderr)
        return 1
    if "tokens" not in result:
        print("smoke: the chat never finished a turn (see the backend log above).",
              file=sys.stderr)
        return 1
    wall = time.monotonic() - t0
    if result["tokens"] == 0 and result["last_error"] is not None:  # the backend said why
        message, step = result["last_error"]
        print(f"smoke: no answer ({result['status']} after {wall:.1f} s): {message}"
              + (f"\nnext: {step}" if step else ""), file=sys.stderr)
        return 1
    print(f"smoke: {result['tokens']} tokens streamed, status {result['status']}, "
          f"first token {(result['ttft_ms'] or 0) / 1000:.1f} s after sending, "
          f"{wall:.1f} s in all")
    if result["reasoning"]:
        print(f"reasoning: {result['reasoning'][:200]}")
    print(f"answer: {result['content'][:400]}")
    if result["note"]:
        print(f"note: {result['note']}")
    if result["tokens"] > 0 and not result["content"].strip():
        print("smoke: tokens streamed but no answer text"
              + (f": {result['note']}" if result["note"] else "."), file=sys.stderr)
        return 1
    return int(app.return_code or 0) if result["tokens"] > 0 else 1
