"""The user's config (`config.toml`) and credentials (`credentials.toml`, 0600).

Read with stdlib `tomllib` (fast), written with `tomlkit` so comments and key order the user
wrote survive. Validation is strict: an unknown section or key, or a value of the wrong type,
is a K3Error naming the file and line, never silently ignored.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from k3tui.errors import K3Error
from k3tui.paths import get_paths, private_open
from k3tui.units import MiB
from k3vocab import (AUTO_PRESET, BACKEND_KINDS, CHECKPOINT_KINDS, CONFIG_PRESETS,
                     DEFAULT_CONTEXT, DEFAULT_EFFORT, EFFORTS)


@dataclass
class ModelSection:
    kind: str = CHECKPOINT_KINDS[0]
    repo: str = "moonshotai/Kimi-K3"
    revision: str = "main"
    dir: str = ""
    trunk_dir: str = ""
    include: list[str] = field(default_factory=list)


@dataclass
class BackendSection:
    kind: str = BACKEND_KINDS[0]
    host: str = "127.0.0.1"
    port: int = 0


@dataclass
class EngineSection:
    preset: str = AUTO_PRESET
    trunk_gb: float = 0.0
    cache_gb: float = 0.0
    threads: int = 0


@dataclass
class LlamaServerSection:
    binary: str = ""
    ctx_size: int = DEFAULT_CONTEXT
    reasoning_budget: int = 2048
    memory_limit_gb: float = 0.0
    n_gpu_layers: int = 99
    extra_args: list[str] = field(default_factory=list)
    rpc: list[str] = field(default_factory=list)  # the pool's workers, "host:port" each


@dataclass
class RemoteSection:
    url: str = ""
    model: str = ""
    api_key_env: str = ""
    verify_tls: bool = True


@dataclass
class ChatSection:
    thinking: bool = True
    thinking_effort: str = DEFAULT_EFFORT
    max_tokens: int = 4096
    temperature: float = 0.6
    system_prompt: str = ""
    seed: int = 0       # the sampling seed of every answer; 0: a new random one each
    on_done: str = ""   # a shell command run when an answer ends (k3tui/answers/runner.py)
    max_minutes: int = 0  # an answer's time budget from its start; 0: none (answers/runner.py)


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    backend: BackendSection = field(default_factory=BackendSection)
    engine: EngineSection = field(default_factory=EngineSection)
    llama_server: LlamaServerSection = field(default_factory=LlamaServerSection)
    remote: RemoteSection = field(default_factory=RemoteSection)
    chat: ChatSection = field(default_factory=ChatSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: {k.name: _copy(getattr(getattr(self, f.name), k.name))
                         for k in fields(getattr(self, f.name))}
                for f in fields(self)}


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]

# Allowed values for the keys that are enumerations.
CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("model", "kind"): CHECKPOINT_KINDS,
    ("backend", "kind"): BACKEND_KINDS,
    ("engine", "preset"): CONFIG_PRESETS,
    ("chat", "thinking_effort"): EFFORTS,
}
# Values an older k3tui accepted, and the allowed value nearest to each: `medium` was taken
# and then every bundled-engine turn was refused with a 400.
NEAREST: dict[tuple[str, str], dict[str, str]] = {
    ("chat", "thinking_effort"): {"medium": "high"},
}
# Inclusive bounds of the numeric keys that have them (negatives are refused for all others).
RANGES: dict[tuple[str, str], tuple[int, int]] = {
    ("backend", "port"): (0, 65535),
}

_HEADER = """\
# k3tui configuration. `k3tui setup` writes it; edit freely, comments are kept.
# `k3tui config show` prints the effective values; `k3tui doctor` checks them.
"""


def _cut(text: str, most: int = 80) -> str:
    """A name or value from outside as a message shows it: at most `most` characters."""
    return text if len(text) <= most else text[:most] + "…"


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def _example(section: str, key: str, tp: Any) -> str:
    """A value to show in `config set` advice: the key's own default where it has one (a
    generic "4" for chat.max_tokens would read as advice), else a placeholder of its type."""
    default = getattr(SECTIONS[section](), key)
    if default not in ("", 0, 0.0, [], False) and not isinstance(default, list):
        return str(default).lower() if isinstance(default, bool) else str(default)
    return {"str": "TEXT", "int": "N", "float": "N", "bool": "true",
            "list[str]": "'[\"a\", \"b\"]'"}[str(tp)]


def _type_name(tp: Any) -> str:
    return {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
            "list[str]": "a list of strings"}[str(tp)]


def _line_of(text: str, section: str, key: str | None) -> int | None:
    """Line (1-based) where `[section]` or `key` inside it is written; None if not found."""
    current = None
    header = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\"']+)\s*\]")
    for number, line in enumerate(text.splitlines(), 1):
        m = header.match(line)
        if m:
            current = m.group(1).strip("\"'")
            if key is None and current == section:
                return number
            continue
        if key is not None and current == section:
            if re.match(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=", line):
                return number
    return None


def _where(path: Path, text: str, section: str, key: str | None = None) -> str:
    """Where the value came from, as a message prefix ending in ": "; nothing for `k3tui
    config set` (the error already starts with "k3tui:" and the user just typed the command)."""
    if path == COMMAND_LINE:
        return ""
    line = _line_of(text, section, key) or _line_of(text, section, None)
    return f"{path}, line {line}: " if line else f"{path}: "


COMMAND_LINE = Path("<command line>")  # the "file" of `k3tui config set`


def is_http_url(url: str) -> bool:
    """What remote.url, `setup --remote-url` and `chat --url` accept (httpx speaks no other
    scheme): an http:// or https:// address."""
    return url.startswith(("http://", "https://"))


MAX_RPC_WORKERS = 16  # llama.cpp's GGML_RPC_MAX_SERVERS
_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def split_endpoint(text: str) -> tuple[str, int] | None:
    """`host:port` → (host, port): an IPv4 address or a host name, and a port 1..65535;
    None when it is not one. (llama.cpp's RPC client reads the host up to the first colon,
    so an IPv6 address cannot name a worker.)"""
    host, sep, port = text.partition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return (host, int(port)) if _HOST_NAME.fullmatch(host) else None


def rpc_problem(endpoints: list[str]) -> str | None:
    """Why a list of RPC workers cannot be used (one sentence), or None."""
    if len(endpoints) > MAX_RPC_WORKERS:
        return f"llama.cpp takes at most {MAX_RPC_WORKERS} RPC workers, not {len(endpoints)}"
    for endpoint in endpoints:
        if split_endpoint(endpoint) is None:
            return (f"{endpoint!r} is not host:port (an IPv4 address or a host name, a port "
                    "1..65535; llama.cpp's RPC client cannot take an IPv6 address)")
    twice = sorted({e for e in endpoints if endpoints.count(e) > 1})
    if twice:
        return f"{', '.join(twice)} is listed twice"
    return None


def parse_rpc(given: str, flag: str = "--rpc") -> list[str]:
    """A command line's `HOST:PORT,HOST:PORT` (empty: no workers), checked like the
    config's list."""
    workers = [w.strip() for w in given.split(",") if w.strip()]
    why = rpc_problem(workers)
    if why:
        raise K3Error(f"{flag}: {why}.", f"e.g. {flag} 192.168.1.20:50052,192.168.1.21:50052",
                      2)
    return workers


def _fix(cli: bool, section: str, key: str, example: Any) -> str:
    """The next step for a refused value: the command that sets it (`config set` also
    repairs a file that does not load because of that value), or for a file that line."""
    command = f"`k3tui config set {section}.{key} {example}`"
    return f"e.g. {command}" if cli else f"fix it with {command}, or edit that line"


def _check_value(section: str, key: str, expected: Any, value: Any) -> Any | None:
    """The value converted to the field's type, or None when the type is wrong."""
    tp = str(expected)
    if tp == "bool":
        return value if isinstance(value, bool) else None
    if tp == "int":
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if tp == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return None
    if tp == "str":
        return value if isinstance(value, str) else None
    if tp == "list[str]":
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        return None
    raise AssertionError(f"unhandled config type {tp} for {section}.{key}")


def config_from_dict(data: dict[str, Any], *, path: Path | None = None,
                     text: str = "") -> Config:
    """Validate a parsed TOML mapping strictly and build a Config."""
    where_path = path or Path("<config>")
    cli = where_path == COMMAND_LINE
    cfg = Config()
    for section, values in data.items():
        if section not in SECTIONS:
            raise K3Error(
                f"{_where(where_path, text, section)}unknown section [{_cut(section)}] "
                f"(known: {', '.join(SECTIONS)}).",
                "use one of those sections" if cli else
                "fix or remove it, then run `k3tui config show`", 2)
        if not isinstance(values, dict):
            raise K3Error(f"{_where(where_path, text, section)}`{section}` must be a table "
                          f"([{section}] with keys under it).",
                          "fix the file, or run `k3tui setup`", 2)
        target = getattr(cfg, section)
        known = {f.name: f.type for f in fields(target)}
        for key, value in values.items():
            if key not in known:
                raise K3Error(
                    f"{_where(where_path, text, section, key)}unknown key `{_cut(key)}` in "
                    f"[{section}] (known: {', '.join(known)}).",
                    "use one of those keys" if cli else "fix the spelling or remove the line", 2)
            converted = _check_value(section, key, known[key], value)
            if converted is None:
                raise K3Error(
                    f"{_where(where_path, text, section, key)}[{section}] {key} must be "
                    f"{_type_name(known[key])}, not {_cut(repr(value))}.",
                    _fix(cli, section, key, _example(section, key, known[key])), 2)
            where = _where(where_path, text, section, key)
            fix = _fix(cli, section, key, _example(section, key, known[key]))
            allowed = CHOICES.get((section, key))
            if allowed and converted not in allowed:
                nearest = NEAREST.get((section, key), {}).get(str(converted))
                fix = _fix(cli, section, key, nearest or getattr(SECTIONS[section](), key))
                raise K3Error(f"{where}[{section}] {key} = {_cut(repr(converted))} is not one of "
                              f"{', '.join(allowed)}.", fix, 2)
            if isinstance(converted, (int, float)) and not isinstance(converted, bool) \
                    and converted < 0 and key != "reasoning_budget":
                raise K3Error(f"{where}[{section}] {key} must not be negative.", fix, 2)
            low, high = RANGES.get((section, key), (None, None))
            if high is not None and not low <= converted <= high:
                raise K3Error(f"{where}[{section}] {key} = {converted!r} is outside "
                              f"{low}..{high}.", fix, 2)
            if (section, key) == ("remote", "url") and converted and \
                    not is_http_url(converted):
                raise K3Error(f"{where}[remote] url = {_cut(repr(converted))} is not an http:// or "
                              "https:// address.",
                              _fix(cli, section, key, "https://HOST:PORT/v1"), 2)
            if (section, key) == ("llama_server", "rpc") and rpc_problem(converted):
                raise K3Error(f"{where}[llama_server] rpc: {rpc_problem(converted)}.",
                              _fix(cli, section, key, '\'["192.168.1.20:50052"]\''), 2)
            setattr(target, key, converted)
    return cfg


MAX_FILE_BYTES = MiB   # a config is a few KB; its longest value a system prompt
MAX_KEY = 256              # characters of a key (or a bare value) outside quotes
MAX_NESTING = 32           # arrays and inline tables inside each other

# Outside strings: a run of key or bare-value characters, blanks, the start of a string or a
# comment, or one separator. Then where each kind of string, or a comment, ends.
_TOKEN = re.compile(r"""[^\s"'#=,{}\[\]]+|[ \t\r\f\v]+|"{3}|'{3}|.""", re.S)
_ENDS = {
    '"': re.compile(r'(?:[^"\\\n]|\\[^\n])*(?:"|(?=\n)|\Z)'),
    "'": re.compile(r"[^'\n]*(?:'|(?=\n)|\Z)"),
    '"""': re.compile(r'(?:[^"\\]|\\.|"(?!""))*(?:"{3,5}|\Z)', re.S),
    "'''": re.compile(r"(?:[^']|'(?!''))*(?:'{3,5}|\Z)", re.S),
    "#": re.compile(r"[^\n]*"),
}


def toml_problem(text: str) -> str | None:
    """Why `text` must not reach a TOML parser, or None: a key or bare value longer than
    MAX_KEY characters outside quotes (tomllib spends memory quadratic in the parts of a
    dotted key: ~10 GB for 100 KB of them), or arrays and tables nested deeper than
    MAX_NESTING (a RecursionError). One linear pass that skips strings and comments;
    everything else is the parser's to judge."""
    depth = run = pos = 0
    while pos < len(text):
        token = _TOKEN.match(text, pos).group()
        end = pos + len(token)
        if token in _ENDS:
            end = _ENDS[token].match(text, end).end()
        elif token in ("[", "{"):
            depth += 1
            if depth > MAX_NESTING:
                return (f"line {text.count(chr(10), 0, pos) + 1}: arrays or tables are "
                        f"nested more than {MAX_NESTING} deep")
        elif token in ("]", "}"):
            depth = max(0, depth - 1)
        if token in ("\n", "=", ",", "[", "]", "{", "}"):
            run = 0
        elif token not in _ENDS and not token.isspace():
            run += len(token)
            if run > MAX_KEY:
                return (f"line {text.count(chr(10), 0, pos) + 1}: a key (or a bare value) is "
                        f"longer than {MAX_KEY} characters, as no setting is")
        pos = end
    return None


def read_toml(path: Path, what: str) -> tuple[str, dict[str, Any]]:
    """(text, parsed) of a TOML file k3tui reads, its size and shape bounded before it is
    parsed; every refusal is one K3Error sentence naming the file. `what`: "a config"…"""
    fix = "fix the file in a text editor, or delete it and run `k3tui setup`"
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise K3Error(f"cannot read {path}: {exc.strerror or exc}.",
                      "check the file's permissions", 1) from None
    if len(raw) > MAX_FILE_BYTES:
        raise K3Error(f"{path} is larger than {MAX_FILE_BYTES >> 10:,} KiB, which {what} "
                      "never is.", fix, 2)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise K3Error(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}).",
                      fix, 2) from None
    if problem := toml_problem(text):
        raise K3Error(f"{path}, {problem}.", fix, 2)
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise K3Error(f"{path}: not valid TOML: {exc}.",
                      "fix the line named above, or delete the file and run `k3tui setup`",
                      2) from None


def config_exists(path: Path | None = None) -> bool:
    return (path or get_paths().config_file).is_file()


def load_config(path: Path | None = None) -> Config:
    """The config at `path` (default: the paths root), defaults when the file is absent."""
    path = Path(path) if path else get_paths().config_file
    if not path.is_file():
        return Config()
    text, data = read_toml(path, "a config")
    return config_from_dict(data, path=path, text=text)


def save_config(cfg: Config, path: Path | None = None) -> Path:
    """Write `cfg`; an existing file keeps its comments, order and unknown-free layout."""
    import tomlkit

    path = Path(path) if path else get_paths().config_file
    config_from_dict(cfg.to_dict())  # never write what we would refuse to read
    if path.is_file():
        doc = tomlkit.parse(read_toml(path, "a config")[0])
    else:
        doc = tomlkit.document()
        for line in _HEADER.splitlines():
            doc.add(tomlkit.comment(line.lstrip("# ")))
    for section, values in cfg.to_dict().items():
        if section not in doc:
            doc.add(tomlkit.nl())
            doc.add(section, tomlkit.table())
        table = doc[section]
        for key, value in values.items():
            if key in table and table[key] == value:
                continue  # untouched: keep the user's formatting
            table[key] = value
    tmp = path.with_suffix(".toml.tmp")
    with private_open(tmp, "w", encoding="utf-8") as fh:
        fh.write(tomlkit.dumps(doc))
    os.replace(tmp, path)
    return path


def set_in_file(dotted: str, raw: str, path: Path | None = None) -> Config:
    """`k3tui config set` on a file that does not load: the value set replaces the refused
    one (`config set` is how the error says to fix it), and the rest is checked as usual."""
    path = Path(path) if path else get_paths().config_file
    try:
        return set_value(load_config(path), dotted, raw)
    except K3Error as refused:
        if not path.is_file():
            raise
        fresh = set_value(Config(), dotted, raw)  # the new value alone: its own errors first
        try:
            text, data = read_toml(path, "a config")
        except K3Error:
            raise refused from None
        section, _, key = dotted.partition(".")
        if not isinstance(data.get(section, {}), dict):
            raise refused from None
        data.setdefault(section, {})[key] = getattr(getattr(fresh, section), key)
        return config_from_dict(data, path=path, text=text)


def set_value(cfg: Config, dotted: str, raw: str) -> Config:
    """`section.key` = raw (parsed as a TOML value, or taken as a string), validated."""
    section, _, key = dotted.partition(".")
    if not key:
        raise K3Error(f"`{_cut(dotted)}` is not section.key.",
                      "e.g. `k3tui config set backend.port 8080`", 2)
    try:   # what no TOML value is (a long sentence, or deep nesting) is taken as text
        value = raw if toml_problem(raw) else tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    if section in SECTIONS and isinstance(value, str):
        kinds = {f.name: str(f.type) for f in fields(SECTIONS[section])}
        if kinds.get(key) == "list[str]":
            value = [value]  # `config set model.include '*IQ1_S*'`: one glob is a list of one
    data = cfg.to_dict()
    data.setdefault(section, {})
    data[section] = dict(data[section]) if section in SECTIONS else {}
    data[section][key] = value
    return config_from_dict(data, path=COMMAND_LINE, text="")


# --- credentials -----------------------------------------------------------------------------

def load_credentials(path: Path | None = None) -> dict[str, str]:
    path = Path(path) if path else get_paths().credentials_file
    if not path.is_file():
        return {}
    return {k: v for k, v in read_toml(path, "a credentials file")[1].items()
            if isinstance(v, str)}


def save_credential(key: str, value: str, path: Path | None = None) -> Path:
    """Store one secret; the file is created 0600 (never world-readable, even briefly)."""
    import tomlkit

    path = Path(path) if path else get_paths().credentials_file
    creds = load_credentials(path)
    creds[key] = value
    doc = tomlkit.document()
    doc.add(tomlkit.comment("k3tui secrets: mode 0600, never logged."))
    for k, v in sorted(creds.items()):
        doc[k] = v
    tmp = path.with_suffix(".toml.tmp")
    with private_open(tmp, "w", encoding="utf-8") as fh:
        fh.write(tomlkit.dumps(doc))
    os.replace(tmp, path)
    return path
