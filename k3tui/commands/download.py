"""`k3tui download [REPO]`: resumable, verified, detached download of a checkpoint.

The pre-flight (file list, pinned commit, access, free space) runs here in the terminal
so refusals are immediate; the transfer itself runs as a detached job (`k3tui.jobs`) that
survives the terminal closing; this command then attaches to it (Ctrl-C detaches).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from k3tui.errors import K3Error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("It runs as a detached job: Ctrl-C, a closed terminal or a dropped SSH "
                     "session do not stop it (Ctrl-C only detaches). Rerun the same command to "
                     "resume or attach again; `k3tui jobs` lists jobs, `k3tui jobs cancel ID` "
                     "stops one. A gated repo needs a token: HF_TOKEN, `hf auth login`, or the "
                     "one `k3tui setup` stores.")
    parser.add_argument("repo", nargs="?", help="Hub repo id (default: the configured model)")
    parser.add_argument("--revision", help="branch, tag or commit (default: config, else main)")
    parser.add_argument("--dir", help="target folder (default: config, else "
                        "<k3tui home>/models/<name>)")
    parser.add_argument("--include", action="append", metavar="GLOB",
                        help="only files matching this glob (repeatable), e.g. '*Q4_K_M*'")
    parser.add_argument("--workers", type=int, default=8,
                        help="connections in parallel (default 8): a large file is fetched "
                        "over several at once, in 64 MiB ranges")
    parser.add_argument("--verify", action="store_true",
                        help="re-hash files changed since they were verified (size or mtime), "
                        "refetch bad ones")
    parser.add_argument("--rehash", action="store_true",
                        help="with --verify: re-hash every file, changed or not")
    parser.add_argument("--retry-corrupt", action="store_true",
                        help="fetch again files that arrived twice with the same wrong sha256 "
                        "(kept in DIR/.k3tui/corrupt/)")
    parser.add_argument("--timeout", type=float, help="seconds of silence before a retry "
                        "(default 30)")
    parser.add_argument("--detach", action="store_true",
                        help="start the job and return (attach later with `k3tui jobs attach`)")
    parser.add_argument("--foreground", action="store_true",
                        help="download in this process instead of a detached job")
    # the command the user typed, made explicit: a detached job names it in its advice
    parser.add_argument("--resume-as", help=argparse.SUPPRESS)


def resume_command(repo: str, revision: str, target: Path, include: list[str],
                   args: argparse.Namespace, *, foreground: bool = False) -> str:
    """The exact `k3tui download …` that continues this download: the same repo, folder,
    globs and revision whatever the config says by then (copy-pasteable, shell-quoted)."""
    import shlex

    words = ["k3tui", "download", repo, "--dir", str(target)]
    for g in include:
        words += ["--include", g]
    if revision != "main":
        words += ["--revision", revision]
    if args.workers != 8:
        words += ["--workers", str(args.workers)]
    if args.timeout:
        words += ["--timeout", f"{args.timeout:g}"]
    if args.verify:
        words.append("--verify")
    if args.rehash:
        words.append("--rehash")
    if args.retry_corrupt:
        words.append("--retry-corrupt")
    if foreground:
        words.append("--foreground")
    return shlex.join(words)


def _defaults(args: argparse.Namespace) -> tuple[str, str, Path, list[str]]:
    from k3tui.hub.metadata import check_repo_id
    from k3tui.paths import get_paths

    from k3tui.config import config_exists, load_config

    cfg = load_config() if config_exists() else None
    model = cfg.model if cfg is not None else None
    repo = args.repo or (model.repo if model is not None else None)
    if not repo:
        raise K3Error("Which repo? No model is configured.",
                      "run `k3tui setup`, or give one: `k3tui download OWNER/NAME --dir DIR`", 2)
    check_repo_id(repo)                       # before it names the default folder
    same = model is not None and model.repo == repo
    revision = args.revision or (model.revision if same and model.revision else "main")
    if args.dir:
        target = Path(args.dir)
    elif same and model.dir:
        target = Path(model.dir)
    else:
        target = get_paths().models_dir / repo.split("/")[-1]
    include = args.include or (list(model.include) if same and model.include else [])
    return repo, revision, target.expanduser().resolve(), include


def _check_mode(args: argparse.Namespace) -> str:
    if args.rehash and not args.verify:
        raise K3Error("--rehash only makes sense with --verify.",
                      "use `k3tui download --verify --rehash`", 2)
    return "hash" if args.rehash else "stat" if args.verify else "size"


def run(args: argparse.Namespace) -> int:
    from k3tui import jobs

    if args.workers < 1:
        raise K3Error("--workers must be at least 1.", "try --workers 8", 2)
    check = _check_mode(args)
    repo, revision, target, include = _defaults(args)
    reporter = jobs.JobReporter.from_env()
    if reporter is not None:
        return _run_in_job(reporter, repo, revision, target, include, args, check)

    running = [j for j in jobs.list_jobs() if j["status"] == "running"
               and j.get("kind") == "download" and j.get("target") == str(target)]
    if running and not args.foreground:       # "rerun to resume" while it still runs
        job_id = running[0]["id"]
        print(f"Job {job_id} is already downloading into {target}.")
        if args.detach:
            print(f"Watch it with `k3tui jobs attach {job_id}`.")
            return 0
        from k3tui.commands.jobs import attach

        return attach(job_id)

    from k3tui.hub import fetch_snapshot, plan_download
    from k3tui.hub.metadata import check_access
    from k3tui.hub.store import check_writable

    check_writable(target)  # before the Hub is asked: the folder is the user's to fix
    print(f"Checking {repo} ({revision}) on the Hub…", flush=True)
    snap = fetch_snapshot(repo, revision, include)
    plan = plan_download(snap, target, check=check)
    print(plan.describe())
    plan.refuse_if_short()
    if not plan.missing and not plan.to_check:
        if plan.update:             # the same files under a new commit: it holds that one now
            _claim(snap, target, resume_command(repo, revision, target, include, args))
        print(f"All {len(snap.files)} files are already here and verified.")
        return 0
    check_access(snap)
    # before the job, which asks for the commit by its hash: the folder records the revision
    # the user named, and another repo is refused here rather than in the job
    _claim(snap, target, resume_command(repo, revision, target, include, args))
    if args.foreground:
        return _run_here(snap, target, args, check,
                         resume_command(repo, revision, target, include, args, foreground=True))
    argv = jobs.k3tui_argv("download", repo, "--revision", snap.commit, "--dir", str(target),
                           "--workers", str(args.workers), "--foreground",
                           "--resume-as", resume_command(repo, revision, target, include, args))
    for g in include:
        argv += ["--include", g]
    if args.verify:
        argv.append("--verify")
    if args.rehash:
        argv.append("--rehash")
    if args.retry_corrupt:
        argv.append("--retry-corrupt")
    if args.timeout:
        argv += ["--timeout", str(args.timeout)]
    job_id = jobs.start_job("download", argv, str(target), lock_file=_lock_file(target),
                            command=resume_command(repo, revision, target, include, args))
    print(f"Started job {job_id}: it keeps going if this terminal closes.")
    if args.detach:
        print(f"Watch it with `k3tui jobs attach {job_id}`.")
        return 0
    from k3tui.commands.jobs import attach

    return attach(job_id)


def _claim(snap, target: Path, command: str) -> None:
    """Record the commit the folder holds, under the folder's lock (its one writer)."""
    import os

    from k3tui import jobs
    from k3tui.hub.store import LocalStore

    lock = jobs.lock_target(str(target), command, path=_lock_file(target))
    store = LocalStore(target)
    try:
        store.ensure()
        store.claim(snap)
    finally:
        store.close()
        os.close(lock)


def _lock_file(target: Path) -> Path:
    """In the folder itself, so two homes (two users, root and a user) see the same lock."""
    from k3tui.hub.store import LocalStore

    return LocalStore(target).lock_file


def _options(args: argparse.Namespace):
    from k3tui.hub import Options, hub_token

    kw = {"token": hub_token(), "retry_corrupt": args.retry_corrupt}
    if args.timeout:
        kw["timeout_s"] = args.timeout
    return Options.from_env(**kw)


def _run_here(snap, target: Path, args: argparse.Namespace, check: str, resume: str) -> int:
    """`--foreground` in a terminal: same loop, Rich progress here, the target lock held."""
    from rich.console import Console
    from rich.live import Live

    from k3tui import jobs
    from k3tui.commands.jobs import render_state
    from k3tui.hub import download

    lock = jobs.lock_target(str(target), resume, path=_lock_file(target))
    console = Console()
    state = {"id": "foreground", "kind": "download", "status": "running", "message": ""}
    try:
        with Live(render_state(state, console.width), console=console, refresh_per_second=4,
                  transient=False) as live:
            def on_progress(ev):
                state.update(_event_fields(ev))
                live.update(render_state(state, console.width))
            result = download(snap, target, workers=args.workers, opts=_options(args),
                              on_progress=on_progress, check=check,
                              log=lambda m: live.console.print(f"[dim]{m}[/]"),
                              resume=resume)
    finally:
        __import__("os").close(lock)
    return _conclude(result, target, print, resume)


def _event_fields(ev) -> dict:
    return {"total_bytes": ev.total_bytes, "done_bytes": ev.done_bytes,
            "rate_bps": ev.rate_bps, "eta_s": ev.eta_s, "stalled": ev.stalled,
            "files": ev.files, "file_counts": ev.counts, "retries": ev.retries,
            "errors": ev.errors}


def _conclude(result, target: Path, say, resume: str = "") -> int:
    if result.verified_now:
        say(f"Verified {len(result.verified_now)} files already on disk.")
    if result.replaced:
        n = len(result.replaced)
        say(f"Refetched {n} files that did not match: " + ", ".join(result.replaced[:10])
            + (f" and {n - 10} more" if n > 10 else ""))
    if result.ok:
        say(f"Done: every file in {target} is verified (size and sha256).")
        return 0
    if result.cancelled:
        again = f"`{resume}`" if resume else "the same command"
        say(f"Cancelled; partial files are kept. Rerun {again} to resume.")
        return 1
    raise result.error


def _run_in_job(reporter, repo, revision, target, include, args, check) -> int:
    """Inside the detached job: state file instead of a screen, log lines to the log."""
    from k3tui.hub import download, fetch_snapshot

    stop = reporter.install_signals()

    def log(msg: str) -> None:
        print(time.strftime("%H:%M:%S"), msg, flush=True)

    try:
        log(f"download {repo} @ {revision} into {target} (check={check})")
        snap = fetch_snapshot(repo, revision, include)
        reporter.update(message=f"{repo} @ {snap.commit[:12]}",
                        total_bytes=snap.total_bytes)
        resume = args.resume_as or resume_command(repo, revision, target, include, args)
        result = download(snap, target, workers=args.workers, opts=_options(args), stop=stop,
                          check=check, log=log, max_hz=4, resume=resume,  # TUI polls at 2 Hz
                          on_progress=lambda ev: reporter.update(**_event_fields(ev)))
        lines: list[str] = []
        code = _conclude(result, target, lines.append, resume)
        for line in lines:
            log(line)
        # every line: a --verify run must say which files it refetched, not only "Done"
        reporter.finish("done" if code == 0 else "cancelled", " ".join(lines) or "done")
        return code
    except K3Error as exc:
        log(f"failed: {exc}")
        reporter.finish("failed", str(exc))
        return exc.exit_code
    except BaseException as exc:
        import traceback

        traceback.print_exc()
        reporter.finish("failed", f"unexpected {type(exc).__name__}: {exc} (see the log)")
        return 1
