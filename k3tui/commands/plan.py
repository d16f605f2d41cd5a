"""`k3tui plan`: what k3tui would run on this machine, or on a built-in machine profile.

With `--users …` it sizes a cluster instead (k3tui/planning/capacity.py).
"""

from __future__ import annotations

import argparse
import json

from k3vocab import CHECKPOINT_KINDS, DEFAULT_CONTEXT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from k3tui.commands.completion import machine_completion
    from k3tui.probe.report import list_profiles

    machine = parser.add_argument(
        "--machine", metavar="FILE|NAME",
        help=f"a machine report JSON, or a profile: {', '.join(list_profiles())} "
             "(default: probe this machine)")
    machine.complete = machine_completion()  # type: ignore[attr-defined]  # for shtab
    from k3tui.commands import old_spelling

    kinds = CHECKPOINT_KINDS
    parser.add_argument("--checkpoint-kind", "--kind", dest="kind", choices=kinds,
                        help="checkpoint kind (default: the config's, else the recommended one)")
    old_spelling(parser, "--model", "--checkpoint-kind", dest="kind", choices=kinds)
    parser.add_argument("--dir", metavar="PATH",
                        help="where the checkpoint would go (default: the config's model dir)")
    parser.add_argument("--json", action="store_true", help="print JSON (machine + plan)")
    from k3tui.planning.capacity import add_capacity_arguments

    add_capacity_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "users", None) is not None or getattr(args, "recipe", None):
        from k3tui.planning.capacity import main as capacity_main

        return capacity_main(args)

    from k3tui.config import config_exists, load_config
    from k3tui.planning.plan import format_plan, make_plan, recommend_model_kind
    from k3tui.probe import load_report, probe_machine

    cfg = load_config() if config_exists() else None
    if args.machine:
        report = load_report(args.machine)
    else:
        from k3tui.paths import get_paths

        target = args.dir or (cfg.model.dir if cfg and cfg.model.dir else get_paths().models_dir)
        report = probe_machine(target)
        report.description = f"this machine ({report.hostname})"
    kind = args.kind or (cfg.model.kind if cfg else None) or recommend_model_kind(report)
    kwargs = {}
    if cfg is not None:
        kwargs = {"ctx_size": cfg.llama_server.ctx_size,
                  "reasoning_budget": cfg.llama_server.reasoning_budget,
                  "rpc": [] if args.machine else cfg.llama_server.rpc}
    plan = make_plan(report, kind, **kwargs)
    # a stored forecast measured this machine: not a profile's, and not llama-server's
    here = not args.machine and plan.backend == "bundled"
    if args.json:
        out = {"machine": report.to_dict(), "plan": plan.to_dict()}
        if here:
            from k3tui.planning.forecast import load_stored

            stored = load_stored()[0]
            out["forecast"] = stored.to_dict() if stored else None
        if plan.backend == "bundled":
            out["states"] = _states_facts()
        print(json.dumps(out, indent=2))
    else:
        import shutil
        import sys

        from k3tui.planning.plan import fit_to_width

        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
        lines = None
        if here:
            from k3tui.planning.forecast import plan_lines

            lines = plan_lines(plan.preset)
        text = format_plan(plan, report, forecast=lines)
        if plan.backend == "bundled":
            from k3tui.paths import get_paths
            from k3vocab import DEFAULT_CONTEXT as DEFAULT_CTX
            from k3tui.planning.states import plan_lines as state_lines

            text += "\n" + "\n".join(state_lines(get_paths().states_dir, DEFAULT_CTX))
        if plan.backend == "llama-server":
            text += "\n" + "\n".join(_pool_lines(cfg, report, probe=not args.machine))
        print(fit_to_width(text, width))
    return 0


def _states_facts() -> dict:
    """The state folder's budget and the real model's per-state figures, for --json."""
    from k3tui.paths import get_paths
    from k3tui.planning import states
    from k3vocab import DEFAULT_CONTEXT as DEFAULT_CTX

    return {"dir": str(get_paths().states_dir), "budget_gb": states.STATE_GB,
            "state_fixed_bytes": states.STATE_FIXED_BYTES,
            "state_bytes_per_token": states.STATE_BYTES_PER_TOKEN, "ctx": DEFAULT_CTX,
            "state_bytes_at_ctx": states.state_bytes(DEFAULT_CTX),
            "save_s": list(states.STATE_SAVE_S), "restore_s": states.STATE_RESTORE_S}


def _pool_lines(cfg, report, *, probe: bool) -> list[str]:
    """The pool section: the configured workers, asked at once (a few seconds at most,
    however many are down), or how many workers this model would need."""
    from k3tui.planning.plan import GGUF_BYTES
    from k3tui.planning.pool import Member, plan_lines

    endpoints = list(cfg.llama_server.rpc) if cfg is not None and probe else []
    workers = []
    if endpoints:
        from k3tui.backends.llama.rpc import probe_all

        workers = [Member(s.endpoint, s.free_bytes if s.ok else None, s.detail)
                   for s in probe_all(endpoints)]
    gpu = report.gpu
    head = None
    if gpu.present:
        free = report.memory.available_bytes if gpu.unified_memory else \
            gpu.discrete_memory_bytes
        head = Member("this machine's GPU", free)
    ctx = cfg.llama_server.ctx_size if cfg is not None else DEFAULT_CONTEXT
    return plan_lines(workers, model_bytes=GGUF_BYTES, ctx=ctx,
                      node_bytes=report.memory.effective_total_bytes, head=head)
