"""`k3tui doctor`: check this machine, the config and the model files; say what to do next.

Each check is ok / warn / fail with the next command. Exit 1 only when something blocks
(a fail); warnings never change the exit code. Without `--measure` it stays under 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from k3tui.errors import K3Error

MARK = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}
FINDING_STATUS = {"info": "ok", "warn": "warn", "blocker": "fail"}
REMOTE_TIMEOUT_S = 15.0  # the doctor answers in seconds; setup waits longer for a busy cluster


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str
    next: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", metavar="PATH",
                        help="check this directory for the checkpoint (default: the config's)")
    parser.add_argument("--measure", action="store_true",
                        help="also measure disk read speed with O_DIRECT (writes and reads 1 GiB)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _model_bytes_present(directory: Path, kind: str) -> int:
    """Bytes of checkpoint files already in `directory` (to discount from the disk check)."""
    suffix = ".gguf" if kind == "gguf" else ".safetensors"
    total = 0
    try:
        for root, _dirs, files in os.walk(directory):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files
                         if f.endswith(suffix))
    except OSError:
        pass
    return total


def run_checks(target: str | None, measure: bool,
               say: Callable[[str], None] | None = None) -> tuple[list[Check], dict]:
    from k3tui.config import Config, config_exists, load_config
    from k3tui.paths import get_paths
    from k3tui.planning.plan import DOWNLOAD_BLOCKERS, describe_machine, make_plan
    from k3tui.probe.limits import ISOLATION_NEXT
    from k3tui.units import gib
    from k3tui.probe import probe_machine

    checks: list[Check] = []
    paths = get_paths()
    cfg: Config = Config()
    checks.append(Check("python", "ok", f"Python {sys.version.split()[0]} ({sys.executable})"))
    if not config_exists():
        checks.append(Check("config", "warn", f"no config yet ({paths.config_file})",
                            "k3tui setup"))
    else:
        try:
            cfg = load_config()
            checks.append(Check("config", "ok", f"{paths.config_file}: backend {cfg.backend.kind}"
                                f", model {cfg.model.kind}"))
        except K3Error as exc:
            checks.append(Check("config", "fail", exc.message, exc.next_step or "k3tui setup"))

    model_dir = Path(target or cfg.model.dir or paths.models_dir).expanduser()
    report = probe_machine(model_dir, measure=measure, say=say)
    report.description = f"this machine ({report.hostname})"
    have = _model_bytes_present(model_dir, cfg.model.kind) if model_dir.is_dir() else 0
    plan = make_plan(report, cfg.model.kind, ctx_size=cfg.llama_server.ctx_size,
                     reasoning_budget=cfg.llama_server.reasoning_budget, have_bytes=have,
                     rpc=cfg.llama_server.rpc)

    lines = {line.split()[0].lower(): line.split(None, 1)[1]
             for line in describe_machine(report, binary=cfg.model.kind == "gguf")}
    checks.append(Check("cpu", "ok", lines["cpu"]))
    m = report.memory
    mem = lines["ram"]
    mem += f"; cgroup {m.cgroup_version}"  # its limit, if any, is in the RAM line
    mem += ("; PSI unavailable" if m.psi_some_avg10 is None
            else f"; pressure {m.psi_some_avg10:.1f}%")
    checks.append(Check("memory", "ok", mem))
    g = report.gpu
    if not g.present:
        gpu_detail = "no GPU" + (" (the bundled engine needs none)"
                                 if cfg.model.kind != "gguf" else "")
    else:
        gpu_detail = "; ".join(
            f"{x.name} ({'unified memory' if x.unified else gib(x.memory_total_bytes or 0)})"
            for x in g.gpus)
        gpu_detail += f"; driver {g.driver_version}" if g.driver_version else ""
    checks.append(Check("gpu", "ok", gpu_detail))
    checks.append(_disk_check(report.storage, model_dir, explicit_dir=bool(target)))
    s = report.storage
    if measure and s.measure_note:
        checks.append(Check("measure", "ok" if s.read_mb_s_qd1 else "warn", s.measure_note))
    iso = report.isolation
    if iso.method != "none":
        checks.append(Check("isolation", "ok", f"memory limits via {iso.method}: {iso.detail}"))
    elif cfg.backend.kind == "llama-server":
        checks.append(Check("isolation", "warn", f"no enforceable memory limit: {iso.detail}",
                            ISOLATION_NEXT))
    else:  # not needed: the OS's own words (`--json` keeps them) would read as a fault
        checks.append(Check("isolation", "ok", "no memory limit can be enforced here (no "
                            "systemd user scope, no writable cgroup v2); only llama-server "
                            "needs one, the bundled engine keeps to its budget"))

    # Before `k3tui setup` nobody chose a folder: the default one being small is not a blocker.
    chosen = bool(target) or bool(cfg.model.dir)
    for f in plan.findings:
        if f.code == "no_isolation":
            continue  # the isolation line above says it
        status, step = FINDING_STATUS[f.level], f.next
        if status == "fail" and not chosen and f.code in DOWNLOAD_BLOCKERS:
            status, step = "warn", ("no folder is chosen yet: `k3tui setup` asks where the "
                                    "checkpoint goes (`k3tui doctor --dir PATH` checks one)")
        checks.append(Check(f.code, status, f.message, step))

    checks += _model_checks(cfg, model_dir, have, explicit_dir=bool(target),
                            configured=config_exists())
    checks.append(_states_check(paths.states_dir))
    return checks, {"machine": report.to_dict(), "plan": plan.to_dict(),
                    "model_dir": str(model_dir), "model_bytes_present": have}


def _disk_check(s, model_dir: Path, explicit_dir: bool) -> Check:
    """Free space and O_DIRECT of the folder; a folder that does not exist yet is measured on
    its nearest existing parent, and the line says so."""
    from k3tui.units import disk_size

    where = str(model_dir)
    missing = not model_dir.exists()
    if missing:
        where += f" (does not exist; checked on {s.probed_path})"
    disk = f"{where}: {disk_size(s.free_bytes)} free on {s.fstype or '?'} ({s.fs_class}), " \
           f"{s.disk_kind} {s.device}".rstrip()
    disk += "; O_DIRECT " + {True: "works", False: "refused", None: "not tested"}[s.o_direct]
    if s.read_mb_s_qd1 is not None:
        disk += f"; read {s.read_mb_s_qd1:.0f} MB/s at QD1, {s.read_mb_s_qd8:.0f} MB/s at QD8"
    if missing and explicit_dir:
        return Check("disk", "warn", disk, f"create it (`mkdir -p {model_dir}`) or give an "
                     "existing folder to --dir")
    return Check("disk", "ok", disk)


def _remote_check(cfg) -> list[Check]:
    """The endpoint tested as `k3tui setup` tests it (health, models, one token), briefly."""
    if not cfg.remote.url:
        return [Check("remote", "fail", "the config chooses a remote endpoint but gives no URL",
                      "k3tui setup")]
    from k3tui.backends.endpoint import check_endpoint, resolve_api_key

    key, _ = resolve_api_key(cfg.remote.api_key_env)
    check = check_endpoint(cfg.remote.url, key, cfg.remote.verify_tls,
                           model=cfg.remote.model or None, timeout=REMOTE_TIMEOUT_S)
    out = [Check("remote", "ok" if check.ok else "fail",
                 f"{cfg.remote.url}: {check.message}", check.next_step)]
    out += [Check("remote_tls", "warn", w) for w in check.warnings]
    return out


def _model_checks(cfg, model_dir: Path, have: int, explicit_dir: bool = False,
                  configured: bool = True) -> list[Check]:
    from k3tui.planning.plan import GGUF_BYTES, SAFETENSORS_BYTES
    from k3tui.units import disk_size

    out: list[Check] = []
    kind = cfg.model.kind
    if kind == "remote":
        return _remote_check(cfg)
    need = GGUF_BYTES if kind == "gguf" else SAFETENSORS_BYTES
    if have >= need * 0.999:
        out.append(Check("model", "ok", f"{kind} checkpoint present in {model_dir} "
                         f"({disk_size(have)})"))
    else:
        detail = (f"{kind} checkpoint not downloaded yet ({disk_size(have)} of "
                  f"{disk_size(need)} in {model_dir})")
        # `doctor --dir X` checked X, so the download it suggests goes there too; without a
        # config `k3tui download` does not know which repo, so setup comes first
        step = f"k3tui download --dir {model_dir}" if explicit_dir else "k3tui download"
        if not configured:
            step = f"`k3tui setup` (it chooses the checkpoint), then `{step}`"
        out.append(Check("model", "warn", detail, step))
    if kind == "safetensors" and cfg.backend.kind == "bundled":
        out += _trunk_check(cfg, model_dir, have >= need * 0.999)
    if cfg.backend.kind == "llama-server":
        out.append(_llama_check(cfg.llama_server.binary))
        if cfg.llama_server.rpc:
            out += _pool_checks(cfg, have if have >= need * 0.999 else need)
    return out


def _llama_check(configured: str) -> Check:
    """The llama-server k3tui would start, and whether it knows the kimi-k3 architecture
    (read from the names compiled into it: a version string says nothing for a fork)."""
    from k3tui.backends.llama.binary import (K3_BUILD_ADVICE, find_binary, inspect_binary,
                                             kimi_k3_verdict)

    try:
        binary = find_binary(configured)
        version = inspect_binary(binary).version
    except K3Error as exc:
        return Check("llama-server", "fail", exc.message, exc.next_step or "k3tui setup")
    verdict, line = kimi_k3_verdict(binary, version)
    status = {"ok": "ok", "no": "fail", "unknown": "warn"}[verdict]
    return Check("llama-server", status, line, "" if verdict == "ok" else K3_BUILD_ADVICE)


def _pool_checks(cfg, model_bytes: int) -> list[Check]:
    """One line for each worker of the pool (asked all at once, so the doctor answers
    within one timeout however many are down), then whether they hold the model."""
    from k3tui.backends.llama import rpc
    from k3tui.planning.pool import Member, need_text, shortfall

    try:
        head = rpc.server_protocol(rpc.find_rpc_server(cfg.llama_server.binary))
    except K3Error:
        head = None
    out = []
    statuses = rpc.probe_all(cfg.llama_server.rpc)
    for s in statuses:
        version = f"RPC protocol {rpc.version_text(s.version)}"
        if not s.ok:
            status, detail = ("warn" if s.state == "busy" else "fail"), s.detail
            step = "" if s.state == "busy" else \
                "start it on that machine: `k3tui worker --host {} --port {}`".format(
                    *s.endpoint.split(":"))
        elif s.mismatch(head):
            status, detail = "fail", s.mismatch(head)
            step = "install the same llama.cpp build on the head and the worker"
        else:
            same = "the head's" if head else "the head's is unknown"
            status, detail, step = "ok", f"{version} ({same}), {s.memory()}", ""
        out.append(Check("worker", status, f"{s.endpoint}: {detail}", step))
    answered = [Member(s.endpoint, s.free_bytes) for s in statuses if s.ok]
    short = shortfall(answered, model_bytes, cfg.llama_server.ctx_size)
    if len(answered) < len(statuses):
        out.append(Check("pool", "warn", f"{len(answered)} of {len(statuses)} workers answered; "
                         "the head refuses to start without all of them"))
    elif short:
        out.append(Check("pool", "fail", short, "start more workers and add them to "
                         "[llama_server] rpc"))
    else:
        out.append(Check("pool", "ok", f"{len(statuses)} workers hold the model's "
                         f"{need_text(model_bytes, cfg.llama_server.ctx_size)}"))
    return out


def _trunk_check(cfg, model_dir: Path, downloaded: bool) -> list[Check]:
    """The packed trunk checked against the checkpoint as the engine checks it before use
    (its layout, and each shard still the file it was packed from); its bytes are checked
    on first read, or all at once by `k3tui pack --verify`."""
    from k3tui.commands.pack import default_trunk_dir

    trunk = Path(cfg.model.trunk_dir).expanduser() if cfg.model.trunk_dir else \
        default_trunk_dir(model_dir)
    if not (trunk / "trunk.json").is_file():
        if (trunk / "trunk.progress.json").is_file():
            return [Check("trunk", "warn", f"packing into {trunk} is not finished",
                          "k3tui pack (it resumes)")]
        return [Check("trunk", "warn", "the trunk is not packed yet (streaming needs it)",
                      "k3tui pack")] if downloaded else []
    if not (model_dir / "config.json").is_file():
        return [Check("trunk", "warn", f"packed trunk in {trunk}, but no checkpoint in "
                      f"{model_dir} to check it against", "k3tui download")]
    try:
        from engine.checkpoint.trunk import check
        from engine.errors import EngineError
    except ImportError as exc:
        return [Check("trunk", "warn", f"the bundled engine cannot check the trunk ({exc})",
                      "reinstall k3tui (`pip install -e .`)")]
    try:
        packed = check(model_dir, trunk)
    except (EngineError, OSError) as exc:
        return [Check("trunk", "fail", str(exc), "k3tui pack")]
    if not packed.digests:
        return [Check("trunk", "warn", f"packed trunk in {trunk} has no per-layer digests "
                      "(packed by the C peer): its bytes are not checked",
                      "k3tui pack (re-packs it with digests)")]
    return [Check("trunk", "ok", f"packed trunk in {trunk} matches the checkpoint; each layer "
                  "is checked on its first read (`k3tui pack --verify` checks every byte now)")]


def _states_check(root: Path) -> Check:
    """The bundled engine's kept conversation states: how many, how big, the oldest (stat
    only, no symlink followed)."""
    import time

    from k3tui.planning.states import STATE_GB, NotAFolder, age, usage
    from k3tui.units import GB, transfer_size

    clear = "k3tui config clear-states"
    try:
        used = usage(root)
    except NotAFolder as exc:
        return Check("states", "warn", f"{exc.strerror}: the bundled engine keeps no "
                     "conversation states on disk", f"remove it, or move it aside: {root}")
    except OSError as exc:
        return Check("states", "warn", f"{root} cannot be read ({exc.strerror or exc})",
                     f"check its owner and mode (0700): {root}")
    if not used.files:
        return Check("states", "ok", f"no kept conversation states yet in {root} (up to "
                     f"{STATE_GB:g} GB)")
    oldest = age(time.time() - used.oldest_mtime) if used.oldest_mtime is not None else "?"
    detail = (f"{used.files} kept conversation state(s), {transfer_size(used.bytes)} of "
              f"{STATE_GB:g} GB, the oldest used {oldest} ago, in {root}")
    if used.bytes > STATE_GB * GB:
        return Check("states", "warn", detail + "; over its budget (the engine makes room "
                     "at its next save)", clear)
    return Check("states", "ok", detail)


def format_checks(checks: list[Check], title: str) -> str:
    out = [f"k3tui doctor: {title}"]
    for c in checks:
        out.append(f"  {MARK[c.status]}  {c.name:<13} {c.detail}")
        if c.next:
            out.append(f"  {'':4}  {'':<13} next: {c.next}")
    fails = sum(c.status == "fail" for c in checks)
    warns = sum(c.status == "warn" for c in checks)
    if fails:
        out.append(f"{fails} blocker(s), {warns} warning(s): fix the FAIL lines first.")
    elif warns:
        out.append(f"no blockers, {warns} warning(s).")
    else:
        out.append("all good: `k3tui chat` when the model is in place.")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    def say(line: str) -> None:  # --measure takes seconds: show each step as it starts
        print(f"k3tui doctor: {line}…", file=sys.stderr, flush=True)

    checks, data = run_checks(args.dir, args.measure, say=say)
    failed = any(c.status == "fail" for c in checks)
    if args.json:
        data["checks"] = [asdict(c) for c in checks]
        data["ok"] = not failed
        print(json.dumps(data, indent=2))
    else:
        from k3tui.planning.plan import fit_to_width

        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
        text = fit_to_width(format_checks(checks, data["machine"]["description"]), width)
        print(colour_marks(text) if _wants_colour() else text)
    return 1 if failed else 0


COLOURS = {"ok": "32", "warn": "33", "FAIL": "1;31"}  # green, yellow, bold red


def _wants_colour() -> bool:
    """A terminal that shows colour, unless NO_COLOR (no-color.org) says otherwise."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR") and \
        os.environ.get("TERM", "dumb") != "dumb"


def colour_marks(text: str) -> str:
    """Each check's ok / warn / FAIL mark in its colour (after wrapping: codes have no
    width)."""
    out = []
    for line in text.splitlines():
        mark = line[2:6].strip()
        if line.startswith("  ") and mark in COLOURS and line[6:8] == "  ":
            line = f"  \x1b[{COLOURS[mark]}m{line[2:6]}\x1b[0m{line[6:]}"
        out.append(line)
    return "\n".join(out)
