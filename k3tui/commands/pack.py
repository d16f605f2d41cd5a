"""`k3tui pack [CHECKPOINT] [OUT]`: pack the trunk for streaming, as a detached job.

Runs `engine.checkpoint.trunk.pack` (resumable) in a job process; the state file carries the same
keys as a download plus `layer`. Defaults: the configured checkpoint (`model.dir`) and
`model.trunk_dir`, else `<checkpoint>-trunk` beside it (then saved as `model.trunk_dir`).
A finished trunk is checked again (each layer against its digest and its shard) and what
changed is re-packed; `--verify` only checks, in this process, and changes nothing.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from k3tui.errors import K3Error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", help="checkpoint folder (default: model.dir)")
    parser.add_argument("out", nargs="?", help="trunk folder (default: model.trunk_dir, else "
                        "<checkpoint>-trunk)")
    parser.add_argument("--detach", action="store_true", help="start the job and return")
    parser.add_argument("--foreground", action="store_true",
                        help="pack in this process instead of a detached job")
    parser.add_argument("--compact", action="store_true",
                        help="lossless compact trunk (~12 bits/weight, fewer bytes per token; "
                        "this engine only, not the C peer)")
    parser.add_argument("--verify", action="store_true",
                        help="check every layer of the packed trunk against its digest and the "
                        "checkpoint, in this process; change nothing")


def _config():
    from k3tui.config import config_exists, load_config

    return load_config() if config_exists() else None


def _defaults(args: argparse.Namespace) -> tuple[Path, Path, bool]:
    cfg = _config()
    ckpt = args.checkpoint or (cfg.model.dir if cfg is not None else "")
    if not ckpt:
        raise K3Error("Which checkpoint? No model folder is configured.",
                      "run `k3tui setup`, or give one: `k3tui pack CHECKPOINT [OUT]`", 2)
    ckpt_path = Path(ckpt).expanduser().resolve()
    if not (ckpt_path / "config.json").is_file():
        raise K3Error(f"{ckpt_path} is not a checkpoint folder (no config.json).",
                      "download it first with `k3tui download`, or pass the right folder", 2)
    out = args.out or (cfg.model.trunk_dir if cfg is not None else "")
    remember = not out and cfg is not None
    out_path = Path(out).expanduser().resolve() if out else default_trunk_dir(ckpt_path)
    return ckpt_path, out_path, remember


def default_trunk_dir(checkpoint: Path) -> Path:
    """Where `k3tui pack` puts a trunk when neither OUT nor model.trunk_dir says."""
    return checkpoint.with_name(checkpoint.name + "-trunk")


def run(args: argparse.Namespace) -> int:
    from k3tui import jobs

    ckpt, out, remember = _defaults(args)
    if args.verify:
        return _verify(ckpt, out)
    reporter = jobs.JobReporter.from_env()
    if reporter is not None:
        return _run_in_job(reporter, ckpt, out, remember, args.compact)
    if args.foreground:
        lock = jobs.lock_target(str(out), f"k3tui pack {ckpt} {out}")
        try:
            summary = _pack(ckpt, out, _printer(_layer_count(ckpt)), args.compact)
        finally:
            os.close(lock)
        print()
        return _conclude(summary, out, remember, print)
    argv = jobs.k3tui_argv("pack", str(ckpt), *([] if remember else [str(out)]), "--foreground",
                           *(["--compact"] if args.compact else []))
    job_id = jobs.start_job("pack", argv, str(out))
    print(f"Started job {job_id}: packing {ckpt} into {out}; it keeps going if this "
          "terminal closes.")
    if args.detach:
        print(f"Watch it with `k3tui jobs attach {job_id}`.")
        return 0
    from k3tui.commands.jobs import attach

    return attach(job_id)


def _engine_trunk():
    """The engine's trunk module and its error type."""
    try:
        from engine.checkpoint import trunk
        from engine.errors import EngineError
    except ImportError as exc:
        raise K3Error(f"The bundled engine cannot pack here ({exc}).",
                      "reinstall k3tui (`pip install -e .`) and rerun") from None
    return trunk, EngineError


def _verify(ckpt: Path, out: Path) -> int:
    from k3tui.units import transfer_size

    trunk, EngineError = _engine_trunk()
    try:
        summary = trunk.verify(ckpt, out, progress=_printer(_layer_count(ckpt)))
    except EngineError as exc:
        raise K3Error(str(exc), f"k3tui pack {ckpt} {out}") from None
    print()
    if summary["bad"]:
        layer, why = summary["bad"][0]
        more = f" (and {len(summary['bad']) - 1} more layers)" if len(summary["bad"]) > 1 else ""
        raise K3Error(f"Layer {layer} of the trunk in {out} does not match: {why}{more}.",
                      f"`k3tui pack {ckpt} {out}` re-packs what changed")
    print(f"Every layer of the trunk in {out} matches its digest and the checkpoint "
          f"({transfer_size(summary['bytes'])} read).")
    return 0


def _pack(ckpt: Path, out: Path, on_progress, compact: bool = False) -> dict:
    trunk, EngineError = _engine_trunk()
    try:
        return trunk.pack(ckpt, out, progress=on_progress, compact=compact)
    except EngineError as exc:
        raise K3Error(str(exc), "fix the cause above and rerun `k3tui pack` (it resumes)") \
            from None


class _Meter:
    """Turns pack's (done, total, layer) callbacks into rate/ETA fields, <= 4 updates/s."""

    def __init__(self, sink, layers: int | None = None):
        from k3tui.hub.progress import Progress

        self.sink, self._progress_cls, self.layers = sink, Progress, layers
        self.progress = None
        self.last_done = 0
        self.last_emit = 0.0

    def __call__(self, done: int, total: int, layer: int) -> None:
        if self.progress is None:
            self.progress = self._progress_cls([("trunk.bin", total)])
            self.progress.initial_bytes("trunk.bin", done)   # resumed layers: no fake burst
        else:
            self.progress.add("trunk.bin", done - self.last_done)
        self.last_done = done
        now = time.monotonic()
        if now - self.last_emit >= 0.25 or done >= total:
            self.last_emit = now
            ev = self.progress.snapshot()
            self.sink({"total_bytes": total, "done_bytes": done, "rate_bps": ev.rate_bps,
                       "eta_s": ev.eta_s, "stalled": False, "layer": layer,
                       "layers": self.layers})


def _layer_count(ckpt: Path) -> int | None:
    """How many layers the checkpoint has ("layer 6 of 12"); pack itself reports a bad
    config, so None here."""
    try:
        from engine.errors import EngineError
        from engine.core.config import ModelConfig

        return ModelConfig.from_dir(ckpt).num_hidden_layers
    except (ImportError, EngineError, OSError, ValueError):
        return None


def _printer(layers: int | None):
    def show(fields: dict) -> None:
        from k3tui.commands.jobs import summary_line

        print("\r" + summary_line(dict(fields, status="running")), end="", flush=True)
    return _Meter(show, layers)


def _conclude(summary: dict, out: Path, remember: bool, say) -> int:
    if summary.get("already_packed"):
        say(f"{out} already holds this checkpoint's trunk (every layer checked); nothing to do.")
    else:
        from k3tui.units import transfer_size

        say(f"Packed {transfer_size(summary['total_bytes'])} of trunk into {out} "
            f"({summary['mb_per_s']:.0f} MB/s).")
    if remember:
        from k3tui.config import load_config, save_config

        cfg = load_config()
        if not cfg.model.trunk_dir:
            cfg.model.trunk_dir = str(out)
            save_config(cfg)
            say(f"Saved model.trunk_dir = {out} in the config.")
    return 0


def _run_in_job(reporter, ckpt: Path, out: Path, remember: bool, compact: bool = False) -> int:
    import signal

    signal.signal(signal.SIGHUP, signal.SIG_IGN)   # SIGTERM (cancel) just ends us: pack
                                                   # resumes per layer
    reporter.update(message=f"packing {ckpt} into {out}")
    print(time.strftime("%H:%M:%S"), f"pack {ckpt} -> {out}", flush=True)
    try:
        meter = _Meter(lambda fields: reporter.update(**fields), _layer_count(ckpt))
        summary = _pack(ckpt, out, meter, compact)
        lines: list[str] = []
        _conclude(summary, out, remember, lines.append)
        for line in lines:
            print(time.strftime("%H:%M:%S"), line, flush=True)
        reporter.finish("done", lines[0])
        return 0
    except K3Error as exc:
        print(time.strftime("%H:%M:%S"), f"failed: {exc}", flush=True)
        reporter.finish("failed", str(exc))
        return exc.exit_code
