"""`k3tui chat`'s sessions: the demo asks with the same [chat] settings as every chat."""

from __future__ import annotations

import argparse

from k3tui.commands import chat
from k3tui.config import Config, save_config


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    chat.add_arguments(parser)
    return parser.parse_args(list(argv))


def _config() -> Config:
    cfg = Config()
    cfg.chat.max_tokens, cfg.chat.temperature = 77, 0.25
    cfg.chat.thinking_effort, cfg.chat.system_prompt = "low", "Be brief."
    save_config(cfg)
    return cfg


def test_the_demo_sends_the_chat_settings_with_its_seed_and_cap():
    _config()
    s = chat.build_session(_args("--demo", "--smoke"))
    assert s.info.label and s.starter is not None
    assert s.system_prompt == "Be brief."
    assert s.chat_kwargs == {"max_tokens": 77, "temperature": 0.25,
                             "extra": {"chat_template_kwargs": {"thinking": True,
                                                                "thinking_effort": "low"},
                                       "seed": 0}}
    cfg = _config()
    cfg.chat.max_tokens = 100_000
    save_config(cfg)
    assert chat.build_session(_args("--demo")).chat_kwargs["max_tokens"] == 200


def test_switching_to_the_demo_from_the_startup_screen_keeps_the_chat_settings(tmp_path):
    cfg = _config()
    cfg.backend.kind, cfg.model.dir = "bundled", str(tmp_path / "absent")
    save_config(cfg)
    s = chat.build_session(_args())
    configured = dict(s.chat_kwargs)
    s.use_demo()
    assert s.info.label and s.system_prompt == "Be brief."
    assert s.chat_kwargs == {**configured, "extra": {**configured["extra"], "seed": 0}}
