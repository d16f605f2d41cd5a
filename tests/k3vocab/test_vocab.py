"""Every reader of the shared vocabulary agrees with k3vocab: the config's allowed values, the
argparse choices of both command lines, the plan and wizard's preset table, the engine's
planner and chat template, and the default context everywhere. A reader that grows its own
copy (`medium` in the config but not in the template was a 400 on every turn) fails here."""

from __future__ import annotations

import argparse

import pytest

import k3vocab
from engine.commands import plan as engine_plan_command
from engine.commands import serve as engine_serve
from engine.serve.protocol import _thinking
from engine.text import chat_template
from engine.weights import planner
from k3tui import config
from k3tui.backends.openai_stream import chat_settings
from k3tui.cli import build_parser
from k3tui.errors import K3Error
from k3tui.paths import get_paths
from k3tui.planning import plan


def choices(parser: argparse.ArgumentParser, dest: str, command: str | None = None):
    """The choices (or default) of `dest`, in `command`'s subparser when given."""
    if command is not None:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[command]
    return next(a for a in parser._actions if a.dest == dest)


def engine_parser(add) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add(p)
    return p


def test_presets_agree():
    names = tuple(k3vocab.PRESETS)
    assert tuple(choices(build_parser("setup"), "preset", "setup").choices) == (*names, "auto")
    assert config.CHOICES[("engine", "preset")] == (*names, "auto", "custom")
    assert tuple(choices(engine_parser(planner.add_memory_arguments), "preset").choices) \
        == (*names, "auto")
    assert tuple(choices(engine_parser(engine_plan_command.add_arguments), "preset").choices) \
        == (*names, "auto")
    # the wizard offers plan.PRESETS; the engine plans with planner.PRESETS
    assert {n: (p.trunk_gb, p.cache_gb) for n, p in plan.PRESETS.items()} == k3vocab.PRESETS
    assert planner.PRESETS == k3vocab.PRESETS


def test_kinds_agree():
    setup = build_parser("setup")
    assert config.CHOICES[("model", "kind")] == k3vocab.CHECKPOINT_KINDS
    assert config.CHOICES[("backend", "kind")] == k3vocab.BACKEND_KINDS
    assert tuple(choices(setup, "kind", "setup").choices) == k3vocab.CHECKPOINT_KINDS
    assert tuple(choices(setup, "backend", "setup").choices) == k3vocab.BACKEND_KINDS
    assert tuple(choices(build_parser("plan"), "kind", "plan").choices) \
        == k3vocab.CHECKPOINT_KINDS
    assert set(plan.MODEL_LABELS) == set(k3vocab.CHECKPOINT_KINDS)


def test_default_context_agrees():
    assert config.Config().llama_server.ctx_size == k3vocab.DEFAULT_CONTEXT
    assert choices(engine_parser(engine_serve.add_arguments), "ctx_size").default \
        == k3vocab.DEFAULT_CONTEXT
    assert choices(engine_parser(engine_plan_command.add_arguments), "context").default \
        == k3vocab.DEFAULT_CONTEXT
    assert plan.make_plan.__kwdefaults__["ctx_size"] == k3vocab.DEFAULT_CONTEXT


def test_every_effort_the_config_takes_is_one_the_engine_serves():
    assert config.CHOICES[("chat", "thinking_effort")] == k3vocab.EFFORTS
    assert chat_template.EFFORTS == k3vocab.EFFORTS
    assert config.Config().chat.thinking_effort in k3vocab.EFFORTS
    for effort in config.CHOICES[("chat", "thinking_effort")]:
        chat = config.Config().chat
        chat.thinking_effort = effort
        body = chat_settings(chat)["extra"]  # what k3tui sends the bundled engine
        assert _thinking(body) == (True, effort)


def test_units_are_one_set():
    from k3tui import units

    assert (units.GB, units.GiB, planner.GB) == (k3vocab.GB, k3vocab.GiB, k3vocab.GB)


def test_a_config_holding_medium_is_refused_naming_the_command_that_fixes_it():
    path = get_paths().config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('[chat]\nthinking_effort = "medium"\n')
    with pytest.raises(K3Error) as exc:
        config.load_config()
    assert f"{path}, line 2" in exc.value.message and "not one of low, high, max" in \
        exc.value.message
    assert "`k3tui config set chat.thinking_effort high`" in exc.value.next_step


def test_k3vocab_imports_nothing():
    """Both packages read it, so it may depend on neither, nor on a third-party library."""
    import ast
    from pathlib import Path

    for path in Path(k3vocab.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert False, f"{path.name} imports {[a.name for a in node.names]}"
            if isinstance(node, ast.ImportFrom):
                assert node.module == "__future__", f"{path.name} imports {node.module}"
