"""After a download or a pack: the config pointed at what was just made, and the next command.

A download or pack into a folder the config does not name left `k3tui chat` on the old one:
two `k3tui config set` were needed before the new files were used, and nothing said what to
run next. Now a folder is recorded when no config exists yet, offered (y/N waits for Enter)
when the config names another one, and spelled out as commands when nobody can be asked.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path

Ask = Callable[[str], str]
BACKEND_FOR = {"safetensors": "bundled", "gguf": "llama-server"}


def checkpoint_kind(folder: Path) -> str | None:
    """"gguf" or "safetensors" by the files in `folder`; None when it holds no checkpoint."""
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError:
        return None
    if any(n.endswith(".gguf") for n in names):
        return "gguf"
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        return "safetensors"
    return None


def _say(line: str) -> None:
    """Print; in a terminal wrapped at words (a path cut mid-word at 80 columns is unreadable)."""
    if sys.stdout.isatty():
        from k3tui.wizard import wrapped

        line = wrapped(line)
    print(line, flush=True)


def _next(steps: list[tuple[str, str]], say: Callable[[str], None]) -> None:
    """"Next:" and each command with what it does, the descriptions in one column."""
    say("Next:")
    width = max(len(cmd) for cmd, _ in steps)
    for cmd, what in steps:
        say(f"  {cmd:<{width}}  {what}")


def _asker() -> Ask | None:
    """input() where a person is at the terminal, else None (a pipe, a job, a script)."""
    return input if sys.stdin.isatty() and sys.stdout.isatty() else None


def _same(a: str, b: Path) -> bool:
    return bool(a) and Path(a).expanduser().resolve() == b.resolve()


def _record(changes: dict[str, str], why: str, ask: Ask | None, say: Callable[[str], None]
            ) -> bool:
    """Write `changes` (dotted key -> value) into the config: at once when there is none,
    after a yes when it names something else, else print the commands that would."""
    from k3tui.config import config_exists, load_config, save_config

    cfg = load_config()
    exists = config_exists()
    changes = {k: v for k, v in changes.items()  # only what differs is said or asked
               if getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) != v}
    if not changes:
        return True
    if exists:
        if ask is None:
            say(f"The config still names {why}; to use the new files:")
            for key, value in changes.items():
                say(f"  k3tui config set {key} {shlex.quote(value)}")
            return False
        try:
            answer = ask(f"The config names {why}. Use the new files from now on? [Y/n] ")
        except EOFError:
            answer = "n"
        if answer.strip().lower() not in ("", "y", "yes"):
            say("The config is unchanged.")
            return False
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    path = save_config(cfg)
    said = ", ".join(f"{k} = {v or '(none)'}" for k, v in changes.items())
    say(f"Saved {said} in {'the config' if exists else 'a new config'} ({path}).")
    return True


def after_download(target: Path, repo: str, *, ask: Ask | None = None,
                   say: Callable[[str], None] = _say) -> int:
    """A finished download into `target`: the config names it (or says how), then Next."""
    from k3tui.config import config_exists, load_config

    kind = checkpoint_kind(target)
    if kind is None:  # e.g. `--include config.json`: nothing to chat with yet
        return 0
    cfg = load_config() if config_exists() else None
    ask = ask if ask is not None else _asker()
    configured = cfg is not None and _same(cfg.model.dir, target) and cfg.model.kind == kind
    if not configured:
        changes = {"model.dir": str(target), "model.repo": repo, "model.kind": kind,
                   "backend.kind": BACKEND_FOR[kind]}
        if cfg is not None and cfg.model.trunk_dir:
            changes["model.trunk_dir"] = ""  # the old checkpoint's trunk: refused for this one
        old = f"{cfg.model.dir or 'no folder'} ({cfg.model.kind})" if cfg else ""
        configured = _record(changes, old, ask, say)
    there = "" if configured else f" {shlex.quote(str(target))}"
    steps = [(f"k3tui pack{there}", "pack the trunk for streaming (a detached job too)")
             if kind == "safetensors" else
             ("k3tui doctor", "check the llama-server and the memory limit")]
    if configured:
        steps.append(("k3tui chat", "talk to the model"))
    _next(steps, say)
    return 0


def after_download_job(code: int, job_id: str, target: Path, repo: str) -> int:
    """After attaching to a download job: the next step only when the job finished."""
    from k3tui import jobs

    if code == 0 and jobs.read_state(job_id).get("status") == "done":
        after_download(target, repo)
    return code


def after_pack(ckpt: Path, out: Path, *, ask: Ask | None = None,
               say: Callable[[str], None] = _say) -> int:
    """A finished pack of `ckpt` into `out`: the config names both (or says how), then Next."""
    from k3tui.config import config_exists, load_config

    cfg = load_config() if config_exists() else None
    changes: dict[str, str] = {}
    if cfg is None or not _same(cfg.model.dir, ckpt) or cfg.model.kind != "safetensors":
        changes = {"model.dir": str(ckpt), "model.kind": "safetensors",
                   "backend.kind": "bundled"}
    if cfg is None or not _same(cfg.model.trunk_dir, out):
        changes["model.trunk_dir"] = str(out)
    configured = True
    if changes:
        old = f"{cfg.model.dir or 'no checkpoint'} and trunk {cfg.model.trunk_dir or '(none)'}" \
            if cfg else ""
        configured = _record(changes, old, ask if ask is not None else _asker(), say)
    _next([("k3tui chat", "talk to the model" if configured else
            "once the config names these folders (the commands above)")], say)
    return 0


def after_pack_job(code: int, job_id: str, ckpt: Path, out: Path) -> int:
    from k3tui import jobs

    if code == 0 and jobs.read_state(job_id).get("status") == "done":
        after_pack(ckpt, out)
    return code
