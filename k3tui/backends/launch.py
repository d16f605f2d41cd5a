"""Start whichever backend the config names and hand back a `RunningBackend`.

`prepare_launch` decides everything first (binary, flags, memory limit, guard) so a
command can show it before anything runs; `launch` does both steps for the TUI.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3tui.backends import bundled
from k3tui.backends.llama import command, server
from k3tui.backends.running import LoadProgress, ProgressCallback, RunningBackend
from k3tui.errors import K3Error
from k3tui.units import GiB

if TYPE_CHECKING:  # types only: the config and the plan are read where they are used
    from k3tui.config import Config
    from k3tui.planning.plan import Finding
    from k3tui.probe.report import MachineReport

API_KEY_CREDENTIAL = "server_api_key"
MODEL_NAME = "kimi-k3"  # the name the started server reports


@dataclass
class Launchable:
    """A decided launch: `describe()` says what will run and why; `start()` runs it."""

    kind: str
    summary: str
    run: Callable[[ProgressCallback | None], RunningBackend] = field(repr=False)
    command: list[str] = field(default_factory=list)  # full argv incl. any limit wrapper
    prepared: server.Prepared | None = None  # llama-server launches
    details: str = ""     # the summary without the warnings (shown beside them)
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return self.summary

    def start(self, on_progress: ProgressCallback | None = None) -> RunningBackend:
        return self.run(on_progress)


def _api_key(host: str) -> str | None:
    """Loopback needs no key; anything wider gets a stored (or new) one."""
    if host in command.LOOPBACK:
        return None
    from k3tui.config import load_credentials, save_credential

    key = load_credentials().get(API_KEY_CREDENTIAL)
    if not key:
        key = secrets.token_urlsafe(24)
        save_credential(API_KEY_CREDENTIAL, key)
    return key


def _model_path(cfg: Config, model: str | Path | None) -> Path:
    path = model or cfg.model.dir
    if not path:
        raise K3Error("No model is configured.",
                      "run `k3tui setup`, or `k3tui config set model.dir FOLDER`")
    return Path(path).expanduser()


def prepare_launch(cfg: Config, *, kind: str | None = None, model: str | Path | None = None,
                   port: int | None = None, force: bool = False,
                   report: MachineReport | None = None, machine: str | None = None,
                   rpc: list[str] | None = None,
                   **seams: Any) -> Launchable:
    """Decide the launch for `cfg` (overridden by the arguments). `machine` names a machine
    profile (e.g. "dgx-spark") to show what would run there; `rpc`: the pool's workers
    (default: [llama_server] rpc). Raises K3Error."""
    kind = kind or cfg.backend.kind
    if machine:
        from k3tui.probe import load_report

        report = load_report(machine)
        seams["profile"] = True
    host = cfg.backend.host or "127.0.0.1"
    port = cfg.backend.port if port is None else port
    if kind == "remote":
        return _prepare_remote(cfg)
    if kind == "llama-server":
        workers = list(cfg.llama_server.rpc if rpc is None else rpc)
        return _prepare_llama(cfg, _model_path(cfg, model), host, port, force, report, seams,
                              workers)
    if kind == "bundled":
        return _prepare_bundled(cfg, _model_path(cfg, model), host, port)
    raise K3Error(f"Unknown backend kind {kind!r}.",
                  "use bundled, llama-server or remote ([backend] kind in the config)", 2)


def _prepare_remote(cfg: Config) -> Launchable:
    url = cfg.remote.url
    if not url:
        raise K3Error("The remote backend has no URL.", "set `url` in [remote], or run "
                      "`k3tui setup`")
    from k3tui.backends.endpoint import resolve_api_key

    key, _ = resolve_api_key(cfg.remote.api_key_env)  # the variable, else the stored key

    def run(_: ProgressCallback | None) -> RunningBackend:
        return RunningBackend(kind="remote", base_url=url.rstrip("/").removesuffix("/v1"),
                              api_key=key, model=cfg.remote.model or "kimi-k3")

    return Launchable("remote", f"remote endpoint {url} (nothing to start)", run)


def _prepare_llama(cfg: Config, model: Path, host: str, port: int, force: bool,
                   report: MachineReport | None,
                   seams: dict[str, Any], rpc: list[str]) -> Launchable:
    from k3tui.planning.plan import make_plan

    ls = cfg.llama_server
    if report is None:
        from k3tui.probe import probe_machine

        report = probe_machine(target_dir=model if model.is_dir() else model.parent,
                               check_isolation=False)  # the launch checks isolation itself
    plan = make_plan(report, "gguf", ctx_size=ls.ctx_size, reasoning_budget=ls.reasoning_budget,
                     rpc=rpc)
    own_limit = ls.memory_limit_gb > 0
    limit = int(ls.memory_limit_gb * GiB) if own_limit else plan.memory_limit_bytes
    # plan's blockers, less what the launch decides itself: the user's own limit replaces
    # the computed one, whether a limit applies is checked by really applying it, and the
    # busy-GPU refusal is server.gpu_guard itself
    skip = {"no_isolation", "gpu_busy"} | ({"memory_limit_too_small"} if own_limit else set())
    notes = refuse_or_warn([f for f in plan.launch_blockers if f.code not in skip], force)
    profile = seams.pop("profile", False)
    if profile:
        seams["limit"] = server.assumed_limit(report, limit)
    gpu_present = bool(getattr(getattr(report, "gpu", None), "present", False))
    prepared = server.prepare(
        model, binary=ls.binary, plan_args=plan.llama_server_args, memory_limit_bytes=limit,
        ctx_size=ls.ctx_size, reasoning_budget=ls.reasoning_budget,
        n_gpu_layers=ls.n_gpu_layers if gpu_present or rpc else None, rpc=rpc,
        probe_pool=not profile,
        threads=cfg.engine.threads or None, extra_args=ls.extra_args, host=host, port=port,
        alias="kimi-k3", api_key=_api_key(host), report=report, force=force, notes=notes,
        plan_reasons={fr[0].split()[0]: fr[1] for fr in plan.flag_reasons if fr}, **seams)
    reason = f"\n  (limit = {plan.memory_limit_reason})" \
        if limit and plan.memory_limit_reason and ls.memory_limit_gb <= 0 else ""
    summary = prepared.describe() + reason

    def run(on_progress: ProgressCallback | None) -> RunningBackend:
        return server.start(prepared, on_progress=on_progress)

    return Launchable("llama-server", summary, run,
                      prepared.limit.wrap(prepared.command.argv), prepared,
                      details=prepared.describe(warnings=False) + reason,
                      warnings=prepared.warnings())


def refuse_or_warn(blockers: Sequence[Finding], force: bool) -> list[str]:
    """The plan's blockers as a refusal (the numbers and the next step), or with --force as
    warnings that say what is risked."""
    if not blockers:
        return []
    if not force:
        raise K3Error("k3tui will not start llama-server: "
                      + "; ".join(f.message for f in blockers) + ".",
                      "; ".join(f.next for f in blockers if f.next)
                      + "; or start anyway with `k3tui serve --force` (risk: memory runs out: "
                        "the server is killed, or on unified memory the machine freezes)",
                      exit_code=2)
    return [f"--force: starting although {f.message} (risk: memory runs out: the server is "
            "killed, or on unified memory the machine freezes)" for f in blockers]


def _prepare_bundled(cfg: Config, checkpoint: Path, host: str, port: int) -> Launchable:
    if not checkpoint.exists():
        raise K3Error(f"The checkpoint folder {checkpoint} does not exist.",
                      "run `k3tui download`, or point the config at the folder it filled "
                      "(`k3tui config set model.dir FOLDER`); `k3tui chat --demo` works "
                      "meanwhile")
    args = bundled.memory_flags(cfg.engine) + bundled.state_flags()
    if cfg.model.trunk_dir:
        args += ["--trunk", cfg.model.trunk_dir]
    key = _api_key(host)
    summary = (f"bundled engine: python -m engine serve {checkpoint} --host {host} "
               f"--port {port or '<free port>'} --model-name {MODEL_NAME} "
               f"{' '.join(args)}".rstrip())  # the argv start_engine builds

    def run(on_progress: ProgressCallback | None) -> RunningBackend:
        return bundled.start_engine(checkpoint, args=args, host=host, port=port, api_key=key,
                                    model_name=MODEL_NAME, on_progress=on_progress)

    return Launchable("bundled", summary, run)


def launch(cfg: Config, *, on_progress: ProgressCallback | None = None, **options: Any
           ) -> RunningBackend:
    """Start the configured backend ("bundled", "llama-server" or "remote"); the first
    progress report carries the description of what is started. Raises K3Error."""
    ready = prepare_launch(cfg, **options)
    if on_progress is not None:   # the warnings travel apart, so a screen shows them once
        on_progress(LoadProgress(0.0, message=ready.details or ready.describe(),
                                 warnings=tuple(ready.warnings)))
    return ready.start(on_progress)


def launch_engine(checkpoint: str | Path, *, budget_gb: float | None = None,
                  extra_args: Sequence[str] = (), steer_demo: bool = False,
                  on_progress: ProgressCallback | None = None) -> RunningBackend:
    """The bundled engine on loopback for `checkpoint` (the demo uses this)."""
    args: list[str] = []
    if budget_gb:
        args += ["--budget-gb", f"{budget_gb:g}"]
    if steer_demo:
        args.append("--steer-demo")
    args += list(extra_args)
    if "--state-dir" not in args:
        args += bundled.state_flags()
    return bundled.start_engine(checkpoint, args=args, on_progress=on_progress)
