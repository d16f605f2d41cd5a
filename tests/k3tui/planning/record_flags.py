"""Record the command-line flags a released SGLang or vLLM wheel accepts (run by hand).

The recipes in `k3tui/planning/recipes.py` name versions; `test_recipes.py` checks every flag
they print against the lists this script wrote from those very wheels. Neither package
can be imported here (they need torch and CUDA), so the flags are read from the source
files in the wheel: argparse `add_argument("--x", …)` literals, and for config dataclasses
each field name as `--field-name` (how both projects derive their CLI) plus its aliases.

    pip download --no-deps --only-binary :all: -d /tmp/w sglang==0.5.23 vllm==0.33.0
    python tests/k3tui/planning/record_flags.py /tmp/w/sglang-0.5.23-*.whl
    python tests/k3tui/planning/record_flags.py /tmp/w/vllm-0.33.0-*.whl
"""

from __future__ import annotations

import ast
import hashlib
import re
import sys
import zipfile
from pathlib import Path

# Source files that define the server CLI of each project (inside the wheel).
SOURCES = {
    "sglang": re.compile(
        r"^sglang/(srt/server_args\.py|srt/arg_groups/fields/[^/]+\.py|cli/[^/]+\.py)$"
    ),
    "vllm": re.compile(
        r"^vllm/(engine/arg_utils\.py|entrypoints/(common/cli_args|cli/serve|cli/main)\.py)$"
    ),
}
FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")
# Files whose string lists / dict keys are the accepted parser names: recorded as
# `--reasoning-parser=NAME` / `--tool-call-parser=NAME` lines.
PARSERS = {
    "sglang": {
        "--reasoning-parser": "sglang/srt/parser/reasoning_parser_names.py",
        "--tool-call-parser": "sglang/srt/function_call/parser_names.py",
    },
    "vllm": {
        "--reasoning-parser": "vllm/reasoning/__init__.py",
        "--tool-call-parser": "vllm/tool_parsers/__init__.py",
    },
}
ARCH = "KimiK3ForConditionalGeneration"
# The `serve` subcommand, and each project's own environment variables.
SERVE = {
    "sglang": ("sglang/cli/main.py", '"serve"'),
    "vllm": ("vllm/entrypoints/cli/serve.py", 'name = "serve"'),
}
ENVIRON = {"sglang": ("sglang/srt/environ.py", "SGLANG_"), "vllm": ("vllm/envs.py", "VLLM_")}


def _flags_from_source(text: str, dataclass_fields: bool) -> set[str]:
    flags: set[str] = set()
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and FLAG.match(node.value)
        ):
            flags.add(node.value)  # add_argument literals, aliases=[...], cli_name=...
        if dataclass_fields and isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    name = item.target.id
                    if not name.startswith("_"):
                        flags.add("--" + name.replace("_", "-"))
    return flags


def _names(text: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        items = (
            node.keys
            if isinstance(node, ast.Dict)
            else (node.elts if isinstance(node, (ast.List, ast.Tuple, ast.Set)) else [])
        )
        for item in items:
            if isinstance(item, ast.Constant) and isinstance(item.value, str):
                names.add(item.value)
    return names


def record(wheel: Path) -> Path:
    project, version = wheel.name.split("-")[:2]
    pattern = SOURCES[project]
    flags: set[str] = set()
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if pattern.match(name):
                text = zf.read(name).decode("utf-8")
                # SGLang's config structs and vLLM's FrontendArgs become flags by field name.
                fields = "/fields/" in name or name.endswith("cli_args.py")
                flags |= _flags_from_source(text, fields)
        for flag, name in PARSERS[project].items():
            flags |= {f"{flag}={n}" for n in _names(zf.read(name).decode("utf-8"))}
        path, needle = SERVE[project]
        if needle in zf.read(path).decode("utf-8"):
            flags.add("subcommand=serve")
        path, prefix = ENVIRON[project]
        text = zf.read(path).decode("utf-8")
        flags |= {
            f"env={m}"
            for m in re.findall(rf'^\s+"?({prefix}[A-Z0-9_]+)"?\s*[:=]', text, re.MULTILINE)
        }
        if any(
            ARCH in zf.read(n).decode("utf-8", "replace")
            for n in zf.namelist()
            if n.endswith(".py") and "models" in n
        ):
            flags.add(f"architecture={ARCH}")
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    out = Path(__file__).parent / "data" / f"{project}-{version}-flags.txt"
    header = (
        f"# flags accepted by `{project}` {version}, read from {wheel.name}\n"
        f"# sha256 {sha}\n"
        "# written by tests/k3tui/planning/record_flags.py;"
        " one flag (or flag=accepted value) a line\n"
    )
    out.write_text(header + "\n".join(sorted(flags)) + "\n", encoding="utf-8")
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(record(Path(arg)))
