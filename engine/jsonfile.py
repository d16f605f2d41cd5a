"""JSON from files the engine did not write: size and nesting bounded, one-sentence errors.

Every JSON file a checkpoint or trunk brings (config.json, the safetensors index and
headers, trunk.json, tokenizer_config.json) is read through here, so a file of gigabytes
or a `[[[[…` nested 100 000 deep is refused with its name instead of filling memory or
ending in a RecursionError traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError, EngineError

MAX_DEPTH = 64  # the deepest real file (config.json's quantization_config) nests 6 levels


def parse_json(raw: bytes | str, where: str, advice: str,
               error: type[EngineError] = CheckpointError) -> dict[str, Any]:
    """`raw` as a JSON object nested at most MAX_DEPTH deep, else `error` naming `where`."""
    try:
        data = json.loads(raw)
    except RecursionError:
        data = None  # deeper than the parser's stack: over MAX_DEPTH by far
    except (UnicodeDecodeError, ValueError) as exc:
        raise error(f"{where} is not valid JSON ({_reason(exc)}); {advice}") from None
    if data is None or _too_deep(data):
        raise error(f"{where} nests deeper than {MAX_DEPTH} levels, which no real file does; "
                    f"{advice}")
    if not isinstance(data, dict):
        raise error(f"{where} is not a JSON object; {advice}")
    return data


def load_json(path: Path, limit: int, advice: str,
              error: type[EngineError] = CheckpointError) -> dict[str, Any]:
    """The JSON object in `path`, refused unread when the file is over `limit` bytes."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise error(f"cannot read {path} ({exc.strerror}); {advice}") from None
    if len(raw) > limit:
        raise error(f"{path} is over {limit / 1e6:g} MB, far more than a real one; {advice}")
    return parse_json(raw, str(path), advice, error)


def _reason(exc: Exception) -> str:
    return exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__


def _too_deep(data: Any) -> bool:
    """Iterative, so checking a deep value cannot itself overflow the stack."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, (dict, list)))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, (dict, list)))
    return False
