"""The wire protocol of `python -m engine serve`: llama-server's shapes.

* Requests: strict JSON (`parse_json`) and a chat request checked field by field into a
  typed `ChatRequest` (`parse_chat_request`); anything wrong is a `BadRequest` naming the
  field.
* Errors: `{"error": {"code", "message", "type"}}` (`error_body`).
* Answers: the worker emits typed events (`Token`, `End`, `Failed`, `Stopped`); each
  serialises itself as SSE chunks (`sse`) or into a non-streamed JSON body (`collect`).
  Every chunk carries a `k3` object: the worker's `TokenStats` record (`k3_record`,
  `Job.final_record`) written by `k3_object`.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, overload

from engine.decode.stats import K3_FINAL, TokenStats
from k3vocab import EFFORTS

FINGERPRINT = "k3-engine-0.1.0"
MAX_JSON_DEPTH = 64    # a chat request nests 4 levels deep
MAX_INT = 2**31 - 1    # bound of the integer sampling fields
MIN_TEMPERATURE = 1e-6  # below it sampling is greedy in all but overflow
# What every `k3` object carries, in order (None where unknown); K3_FINAL only when set.
K3_FIELDS = ("s_per_token", "gb_read", "mb_per_s", "true_hit_rate", "rss_gb", "budget_gb",
             "compute_s", "wait_trunk_s", "wait_experts_s")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


def error_body(code: int, message: str, kind: str | None = None, **extra: Any) -> dict:
    return {
        "error": {
            "code": code,
            "message": message,
            "type": kind or ERROR_TYPES.get(code, "server_error"),
            **extra,
        }
    }


class BadRequest(Exception):
    def __init__(self, message: str, code: int = 400, kind: str | None = None, **extra: Any):
        super().__init__(message)
        self.code, self.kind, self.extra = code, kind, extra


# ---- requests -------------------------------------------------------------------------------


def _refuse_constant(name: str) -> Any:
    raise BadRequest(
        f"the request body has {name}, which is not a JSON number; send a finite number"
    )


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"the number {text[:40]} is out of range; send a finite number")
    return value


def _unicode(text: str) -> None:
    """Refuse a string holding a lone UTF-16 surrogate: JSON lets `"\\ud800"` through, but
    it is no character, and the tokenizer, the template and every UTF-8 writer fail on it."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRequest(
                f"the request body has a string with an unpaired surrogate "
                f"(\\u{ord(text[exc.start]):04x}), which is no Unicode character; send valid "
                "text (a character outside the BMP is a pair of \\u escapes)"
            ) from None


def parse_json(raw: bytes) -> Any:
    """Strict JSON: no NaN / Infinity (nor 1e400, which would read as infinity), at most
    MAX_JSON_DEPTH levels of nesting, no lone surrogate in a string value. Raises BadRequest."""
    too_deep = BadRequest(f"the request body nests more than {MAX_JSON_DEPTH} levels deep")
    try:
        value = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:  # deeper than Python's own limit
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc})") from None
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _unicode(item)
            continue
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise too_deep
        stack += [(child, depth + 1) for child in item]
    return value


@dataclass
class ChatRequest:
    messages: list
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: list[str]
    stream: bool
    include_usage: bool
    timings_per_token: bool
    thinking: bool
    effort: str
    reasoning_budget: int  # -1 = unlimited
    ignore_eos: bool = False


def _number(body: dict, key: str, kind: type, default: Any, lo: float, hi: float) -> Any:
    """body[key] as `kind` within [lo, hi] (bounds checked before any conversion, so a
    huge integer cannot overflow float()), or `default` when absent or null."""
    value = body.get(key)
    if value is None:
        return default
    what = "an integer" if kind is int else "a number"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and isinstance(value, float) and not value.is_integer())
    ):
        raise BadRequest(f"'{key}' must be {what}, not {json.dumps(value)[:40]}")
    if not lo <= value <= hi:
        raise BadRequest(f"'{key}' must be {what} from {lo:g} to {hi:g}")
    return kind(value)


def parse_chat_request(body: Any, default_budget: int) -> ChatRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array of {role, content} objects")
    max_tokens = _max_tokens(body)
    if body.get("n") not in (None, 1):
        raise BadRequest("'n' must be 1: the engine generates one choice per request")
    if body.get("tools"):
        raise BadRequest("tool calling is not supported by the bundled engine; send no 'tools'")
    stop = _stop(body)
    stream_options = _object(body, "stream_options")
    thinking, effort = _thinking(body)
    budget = _reasoning_budget(body, default_budget)
    seed = body.get("seed")
    seed = (
        secrets.randbits(31)
        if seed is None or seed == -1
        else _number(body, "seed", int, 0, lo=0, hi=2**63 - 1)
    )
    temperature, top_p = _temperature_top_p(body)
    return ChatRequest(
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=_number(body, "top_k", int, 0, lo=0, hi=MAX_INT),
        seed=seed,
        stop=stop,
        stream=bool(body.get("stream", False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        timings_per_token=bool(body.get("timings_per_token", False)),
        thinking=thinking,
        effort=effort,
        reasoning_budget=budget,
        ignore_eos=bool(body.get("ignore_eos", False)),
    )


def _max_tokens(body: dict) -> int | None:
    for key in ("n_predict", "max_completion_tokens", "max_tokens"):  # llama-server: n_predict wins
        if body.get(key) is not None:
            max_tokens = _number(body, key, int, None, lo=-1, hi=MAX_INT)
            if max_tokens == 0:
                raise BadRequest(f"'{key}' must be at least 1 (or -1 for no limit)")
            return None if max_tokens == -1 else max_tokens
    return None


def _object(body: dict, key: str) -> dict:
    value = body.get(key) or {}
    if not isinstance(value, dict):
        raise BadRequest(f"'{key}' must be an object")
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or an array of strings")
    return [s for s in stop if s]


def _thinking(body: dict) -> tuple[bool, str]:
    """(thinking on, effort) from chat_template_kwargs and reasoning_effort."""
    kwargs = _object(body, "chat_template_kwargs")
    thinking, effort = True, "max"
    for key in ("enable_thinking", "thinking"):
        if key in kwargs:
            thinking = bool(kwargs[key])
    if "thinking_effort" in kwargs:
        effort = str(kwargs["thinking_effort"])
    re_effort = body.get("reasoning_effort")
    if re_effort is not None:
        if re_effort == "none":
            thinking = False
        else:
            effort = str(re_effort)
    if thinking and effort not in EFFORTS:
        raise BadRequest(
            f"reasoning effort '{effort}' is not supported by Kimi-K3; use low, high or max "
            "(or reasoning_effort 'none' to turn thinking off)"
        )
    return thinking, effort


def _reasoning_budget(body: dict, default_budget: int) -> int:
    for key in ("reasoning_budget_tokens", "thinking_budget_tokens", "reasoning_budget"):
        if body.get(key) is not None:
            return _number(body, key, int, default_budget, lo=-1, hi=MAX_INT)
    return default_budget


def _temperature_top_p(body: dict) -> tuple[float, float]:
    top_p = _number(body, "top_p", float, 0.95, lo=0.0, hi=1.0)
    if top_p == 0:  # the sampler keeps the smallest set of tokens reaching top_p: none
        raise BadRequest("'top_p' must be above 0 and at most 1")
    temperature = _number(body, "temperature", float, 0.6, lo=0.0, hi=100.0)
    if 0 < temperature < MIN_TEMPERATURE:  # logits / temperature would overflow to inf
        raise BadRequest(f"'temperature' must be 0 (greedy) or from {MIN_TEMPERATURE:g} to 100")
    return temperature, top_p


# ---- chunks ---------------------------------------------------------------------------------


class ChunkIds:
    """The fields every chunk of one completion shares."""

    def __init__(self, model: str) -> None:
        self.id = "chatcmpl-" + secrets.token_urlsafe(24)[:32]
        self.created = int(time.time())
        self.model = model

    def base(self, obj: str) -> dict[str, Any]:
        return {
            "created": self.created,
            "id": self.id,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            "object": obj,
        }

    def sse(self, delta: dict | None, finish_reason: str | None = None, **extra: Any) -> str:
        chunk: dict[str, Any] = {}
        chunk["choices"] = (
            [] if delta is None else [{"finish_reason": finish_reason, "index": 0, "delta": delta}]
        )
        chunk.update(self.base("chat.completion.chunk"))
        chunk.update(extra)
        return f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ---- what the worker emits, and how each event reaches the client -------------------------


@overload
def k3_object(stats: TokenStats) -> dict[str, Any]: ...
@overload
def k3_object(stats: None) -> None: ...
@overload
def k3_object(stats: TokenStats | None) -> dict[str, Any] | None: ...
def k3_object(stats: TokenStats | None) -> dict[str, Any] | None:
    """A token's record as the `k3` object: floats rounded to the microsecond/kB; the
    final fields only when set."""
    if stats is None:
        return None
    out = {k: getattr(stats, k) for k in K3_FIELDS}
    out.update({k: getattr(stats, k) for k in K3_FINAL if getattr(stats, k) is not None})
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()}


@dataclass
class Answer:
    """One response being written: the chunk ids, the request, and what the events need
    from the job (timings, usage, the records of the opening and the last chunk). Collects
    the text of a non-streamed answer."""

    ids: ChunkIds
    req: ChatRequest
    timings: Callable[[], dict[str, Any]]
    usage: Callable[[], dict[str, Any]]
    first: TokenStats  # before any token: what the server knows (the RSS, the budget)
    final: Callable[[TokenStats | None], TokenStats]  # the last token's, completed
    last: TokenStats | None = None  # the latest token's statistics
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # generated, not yet in a chunk (SSE)

    def k3(self, stats: TokenStats | None) -> dict[str, Any]:
        """A chunk's `k3`, with the ids generated since the previous chunk."""
        ids, self.token_ids = self.token_ids, []
        return {**(k3_object(stats) or {}), "token_ids": ids}

    def opening(self) -> str:
        """The stream's first chunk: the role, and the `k3` before any token."""
        return self.ids.sse({"role": "assistant", "content": None}, k3=self.k3(self.first))


@dataclass(frozen=True)
class Token:
    """New text of a token (either part may be empty; `stats` None for the held-back tail)
    and its id (none for the tail). Every id reaches the client, in order, in the `k3`
    of the next chunk written, text or not (the final chunk has the last ones)."""

    stats: TokenStats | None
    reasoning: str
    content: str
    ids: tuple[int, ...] = ()
    ends = False

    def sse(self, a: Answer) -> str:
        a.last = self.stats or a.last
        a.token_ids += self.ids
        out = ""
        for key, text in (("reasoning_content", self.reasoning), ("content", self.content)):
            if text:
                extra: dict[str, Any] = {"k3": a.k3(a.last)}
                if a.req.timings_per_token:
                    extra["timings"] = a.timings()
                out += a.ids.sse({key: text}, **extra)
        return out

    def collect(self, a: Answer) -> None:
        a.last = self.stats or a.last
        a.reasoning.append(self.reasoning)
        a.content.append(self.content)
        a.token_ids += self.ids


@dataclass(frozen=True)
class End:
    """The answer is complete; `finish` is OpenAI's finish_reason."""

    finish: str
    ends = True

    def sse(self, a: Answer) -> str:
        last = a.final(a.last)
        final: dict[str, Any] = {"k3": a.k3(last)}
        if not a.req.include_usage or a.req.timings_per_token:
            final["timings"] = a.timings()
        out = a.ids.sse({}, finish_reason=self.finish, **final)
        if a.req.include_usage:
            out += a.ids.sse(None, usage=a.usage(), timings=a.timings(), k3=a.k3(last))
        return out + "data: [DONE]\n\n"

    def collect(self, a: Answer) -> tuple[int, dict[str, Any]]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(a.content)}
        if "".join(a.reasoning):
            message["reasoning_content"] = "".join(a.reasoning)
        body = a.ids.base("chat.completion")
        body.update(
            choices=[{"finish_reason": self.finish, "index": 0, "message": message}],
            usage=a.usage(),
            timings=a.timings(),
            k3={**k3_object(a.final(a.last)), "token_ids": a.token_ids},
        )
        return 200, body


@dataclass(frozen=True)
class Failed:
    """Generation failed; `message` is one sentence for the client."""

    message: str
    ends = True

    def sse(self, a: Answer) -> str:
        return f"data: {json.dumps(error_body(500, self.message))}\n\n"

    def collect(self, a: Answer) -> tuple[int, dict[str, Any]]:
        return 500, error_body(500, self.message)


@dataclass(frozen=True)
class Stopped:
    """Generation was cancelled: the client is gone, nothing more is written."""

    ends = True

    def sse(self, a: Answer) -> str:
        return ""

    def collect(self, a: Answer) -> tuple[int, None]:
        return 499, None


Event = Token | End | Failed | Stopped
