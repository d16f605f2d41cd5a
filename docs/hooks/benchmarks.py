"""MkDocs hook: the benchmark results are data (docs/benchmarks/results.yaml, one record per
run) and become tables when the site is built, where a page holds the marker line
`<!-- results: NAME -->` (NAME: a `benchmark` of the records, `all`, or `machines` for
the list of machines the records name).

A record that lacks a field, or whose date does not start with YYYY-MM-DD, stops the build
with one sentence naming the record, so a result cannot be filed without its date, load and
machine.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from mkdocs.exceptions import PluginError

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results.yaml"
MARKER = re.compile(r"^<!-- results: ([\w-]+) -->$", re.MULTILINE)
FIELDS = ("benchmark", "what", "command", "date", "load", "machine", "k3tui")
OPTIONAL = ("reference", "shared")  # shared: other work loaded the machine during the run
DATE = re.compile(r"\d{4}-\d{2}-\d{2}\b")


def load(path: Path = RESULTS) -> tuple[dict, list[dict]]:
    """The machines and the runs of a results file, each run checked."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise PluginError(f"{path} cannot be read as YAML ({exc}).") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise PluginError(f"{path} must hold `machines` and a list of `runs`.")
    machines = data.get("machines") or {}
    for i, run in enumerate(data["runs"], 1):
        check(run, machines, f"{path.name} run {i}")
    return machines, data["runs"]


def check(run: object, machines: dict, where: str) -> None:
    if not isinstance(run, dict):
        raise PluginError(f"{where} is not a record of {', '.join(FIELDS)}.")
    missing = [f for f in FIELDS if not str(run.get(f) or "").strip()]
    if missing:
        raise PluginError(f"{where} ({run.get('what', '?')}) has no {', '.join(missing)}.")
    unknown = sorted(set(run) - set(FIELDS) - set(OPTIONAL))
    if unknown:
        raise PluginError(f"{where} ({run['what']}): unknown field {', '.join(unknown)}.")
    if not DATE.match(str(run["date"])):
        raise PluginError(f"{where} ({run['what']}): date {run['date']!r} must start YYYY-MM-DD.")
    if run["machine"] not in machines:
        raise PluginError(f"{where} ({run['what']}): machine {run['machine']!r} is not one of "
                          f"`machines` ({', '.join(machines) or 'none'}).")


def _cell(value: object) -> str:
    return " ".join(str(value).split()).replace("|", "\\|")


def table(runs: list[dict]) -> str:
    rows = ["| date | run | machine, load | k3tui | reference in the same run / the C peer |",
            "|---|---|---|---|---|"]
    for run in runs:
        what = f"{_cell(run['what'])} (`{_cell(run['command'])}`)"
        shared = ", shared" if run.get("shared") else ""
        where = f"{run['machine']}, {_cell(run['load'])}{shared}"
        rows.append(f"| {_cell(run['date'])} | {what} | {where} | {_cell(run['k3tui'])} | "
                    f"{_cell(run.get('reference') or '')} |")
    return "\n".join(rows) + "\n"


def machine_list(machines: dict) -> str:
    return "".join(f"* `{name}`: {_cell(text)}\n" for name, text in machines.items())


def render(markdown: str, machines: dict, runs: list[dict]) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1)
        if name == "machines":
            return machine_list(machines)
        chosen = sorted((r for r in runs if name in ("all", r["benchmark"])),
                        key=lambda r: str(r["date"]), reverse=True)  # newest first
        if not chosen:
            raise PluginError(f"the marker `results: {name}` names no benchmark in "
                              f"{RESULTS.name}.")
        return table(chosen)

    return MARKER.sub(one, markdown)


def on_page_markdown(markdown, page, config, files):
    if not MARKER.search(markdown):
        return markdown
    machines, runs = load()
    return render(markdown, machines, runs)
