"""Kimi-K3's XTML chat template, and an incremental parser for what the model writes.

Rendering (spec 1.6): elements are `<|open|>tag attrs<|sep|> … <|close|>tag<|sep|>`, every
message ends with `<|end_of_msg|>`. Control tokens are inserted as ids; all text (including
attribute values) is encoded with specials disabled, so a literal `<|open|>` typed by a
user stays text. Text segments are encoded one by one: BPE never merges across a control
token, and the thinking-effort sentence stays one segment as the official encoder does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from engine.text.tokenizer import StreamDecoder, Tokenizer

OPEN, CLOSE, SEP, END_OF_MSG, EOS = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]"
CONTROL = (OPEN, CLOSE, SEP, END_OF_MSG)
EFFORTS = ("low", "high", "max")  # `medium` is named in the sentence but refused upstream

EFFORT_SENTENCE = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including "
    "the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)


class TemplateError(ValueError):
    """A conversation the template cannot render, explained in one sentence."""


@dataclass(frozen=True)
class Control:
    """A control token (one of CONTROL) in a rendered segment list."""

    name: str


@dataclass(frozen=True)
class ReplyEnd:
    """Where an assistant message's rendering ends (no id): the worker keeps the state
    there, so a reply whose text does not encode back to the ids the model generated
    costs the next turn only its own prefill, once."""


Segment = Union[str, Control, ReplyEnd]


def _attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _open(tag: str, attrs: Sequence[tuple[str, str]] = ()) -> list[Segment]:
    text = tag + "".join(f' {k}="{_attr(v)}"' for k, v in attrs)
    return [Control(OPEN), text, Control(SEP)]


def _close(tag: str) -> list[Segment]:
    return [Control(CLOSE), tag, Control(SEP)]


_CLOSING = _close("message") + [Control(END_OF_MSG)]  # how every message ends


def _message(
    role: str, body: list[Segment], attrs: Sequence[tuple[str, str]] = ()
) -> list[Segment]:
    return (
        _open("message", [("role", role), *attrs])
        + body
        + _close("message")
        + [Control(END_OF_MSG)]
    )


def _text(value: Any, what: str) -> str:
    """Message content: a string, or OpenAI-style parts `[{"type": "text", "text": …}]`."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        out = []
        for part in value:
            if (
                isinstance(part, Mapping)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                out.append(part["text"])
            else:
                raise TemplateError(
                    f"{what} has a content part that is not text; only text is supported"
                )
        return "".join(out)
    raise TemplateError(f"{what} content must be a string or a list of text parts")


def _channels(reasoning: str, content: str, thinking: bool) -> list[Segment]:
    """An assistant turn's channels: think (when thinking), then response."""
    out: list[Segment] = []
    if thinking:
        out += _open("think") + ([reasoning] if reasoning.strip() else []) + _close("think")
    return out + _open("response") + ([content] if content else []) + _close("response")


def render_segments(
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: bool = True,
    effort: str = "max",
    add_generation_prompt: bool = True,
) -> list[Segment]:
    """The conversation as text segments and control tokens, in order: a function of
    the messages alone (earlier replies are rendered from their text)."""
    if thinking and effort not in EFFORTS:
        raise TemplateError(
            f"thinking effort {effort!r} is not supported by Kimi-K3; "
            f"use one of {', '.join(EFFORTS)}"
        )
    out: list[Segment] = []
    if thinking:
        out += _message(
            "system", [EFFORT_SENTENCE.format(effort=effort)], [("type", "thinking-effort")]
        )
    tool_index = 0
    for n, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise TemplateError(f"message {n} is not an object with role and content")
        role = msg.get("role")
        what = f"message {n} ({role})"
        name = msg.get("name")
        attrs = [("name", name)] if isinstance(name, str) and name else []
        content = _text(msg.get("content"), what)
        body: list[Segment] = [content] if content else []
        if role in ("system", "user"):
            out += _message(role, body, attrs)
        elif role == "assistant":
            tool_index = 0
            reasoning = _text(msg.get("reasoning_content"), what) if thinking else ""
            out += _message("assistant", _channels(reasoning, content, thinking), attrs)
            out.append(ReplyEnd())
        elif role == "tool":
            tool_index += 1
            tool = msg.get("name") or msg.get("tool_name")
            if not isinstance(tool, str) or not tool:
                raise TemplateError(f"{what} needs the tool's name in 'name'")
            out += _message("tool", body, [("tool", tool), ("index", str(tool_index))])
        else:
            raise TemplateError(f"{what}: role must be system, user, assistant or tool")
    if add_generation_prompt:
        out += _open("message", [("role", "assistant")]) + _open(
            "think" if thinking else "response"
        )
    return out


def segments_to_text(segments: Iterable[Segment]) -> str:
    """Readable XTML (diagnostics only; token ids come from `ChatTemplate.render`)."""
    return "".join(
        s.name if isinstance(s, Control) else s
        for s in segments
        if not isinstance(s, ReplyEnd)
    )


@dataclass(frozen=True)
class Rendered:
    """A prompt's ids, and where each assistant message in it ends (ReplyEnd)."""

    ids: list[int]
    reply_ends: tuple[int, ...] = ()


class ChatTemplate:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.control_ids = {name: tokenizer.special(name) for name in CONTROL}

    def render(self, messages: Sequence[Mapping[str, Any]], **kw: Any) -> list[int]:
        return self.render_full(messages, **kw).ids

    def render_full(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        thinking: bool = True,
        effort: str = "max",
        add_generation_prompt: bool = True,
    ) -> Rendered:
        segments = render_segments(
            messages, thinking=thinking, effort=effort,
            add_generation_prompt=add_generation_prompt,
        )
        return self._ids(segments)

    def _ids(self, segments: Sequence[Segment]) -> Rendered:
        texts = [s for s in segments if isinstance(s, str)]
        encoded = iter(self.tok.encode_batch(texts))
        ids: list[int] = []
        ends: list[int] = []
        for s in segments:
            if isinstance(s, Control):
                ids.append(self.control_ids[s.name])
            elif isinstance(s, ReplyEnd):
                ends.append(len(ids))
            else:
                ids += next(encoded)
        return Rendered(ids, tuple(ends))

    def text_turn(self, reasoning: str, content: str, *, thinking: bool = True) -> list[int]:
        """A reply as its next turn renders it from the text the client got: the ids after
        the generation prompt (which opened the message and its first channel)."""
        return self._ids(_channels(reasoning, content, thinking)[3:] + _CLOSING).ids

    def round_trips(self, generated: Sequence[int], reasoning: str, content: str, *,
                    thinking: bool = True) -> bool:
        """Whether the reply's text renders back to the ids the model generated (all but an
        end id, which is never fed), so that its kept end state serves the next turn."""
        ids = [int(i) for i in generated]
        if ids and ids[-1] in self.end_ids():
            ids.pop()
        return self.text_turn(reasoning, content, thinking=thinking)[: len(ids)] == ids

    def parser(self, *, thinking: bool = True) -> OutputParser:
        return OutputParser(self.tok, thinking=thinking)

    def end_ids(self) -> tuple[int, ...]:
        """Both declared end ids: the released model ends turns with [EOS]."""
        ids = [self.tok.special(END_OF_MSG)]
        if EOS in self.tok.specials:
            ids.append(self.tok.special(EOS))
        return tuple(ids)


# ---------------------------------------------------------------------------------------
# parsing the completion


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


MAX_TAG_CHARS = 64  # a "tag" longer than this was not a tag: give it back as text


@dataclass
class OutputParser:
    """Feed generated ids one by one; get reasoning and content text as it becomes whole.

    The generation prompt already opened the think (or response) channel. Control tokens
    switch channels (`<|close|>think<|sep|><|open|>response<|sep|>`) and never appear in
    the text; either end id finishes the message. Text outside both channels (between
    tags) counts as content so nothing the model writes is dropped silently. A tag is
    held back until its `<|sep|>`: one that proves not to be a tag (another opens first,
    or it runs past MAX_TAG_CHARS) is given back as text, one the end cuts is dropped."""

    tok: Tokenizer
    thinking: bool = True
    channel: str = ""  # "think" | "response" | "" (between tags)
    done: bool = False
    reasoning_tokens: int = 0  # tokens generated while the think channel was open
    _tag: list[int] | None = None  # ids of a tag being read: None = not in a tag
    _tag_kind: str = ""
    _decoders: dict[str, StreamDecoder] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.channel = "think" if self.thinking else "response"
        self._ids = {name: self.tok.special(name) for name in CONTROL}
        self._end = {self.tok.special(END_OF_MSG)}
        if EOS in self.tok.specials:
            self._end.add(self.tok.special(EOS))

    @property
    def in_reasoning(self) -> bool:
        return self.channel == "think" and not self.done

    @property
    def in_tag(self) -> bool:
        """Between `<|open|>`/`<|close|>` and its `<|sep|>`."""
        return self._tag is not None

    def _emit(self, out: ParsedDelta, token_id: int | None = None, text: str | None = None) -> None:
        key = "think" if self.channel == "think" else "response"
        dec = self._decoders.setdefault(key, self.tok.stream_decoder())
        piece = dec.add(token_id) if token_id is not None else text or ""
        if key == "think":
            out.reasoning += piece
        else:
            out.content += piece

    def _flush_channel(self, out: ParsedDelta) -> None:
        key = "think" if self.channel == "think" else "response"
        dec = self._decoders.pop(key, None)
        if dec is not None:
            self._emit(out, text=dec.flush())

    def feed(self, token_id: int) -> ParsedDelta:
        out = ParsedDelta()
        if self.done:
            return out
        if self.channel == "think":
            self.reasoning_tokens += 1
        if token_id in self._end:
            self._flush_channel(out)
            self.done = True
            self.channel = ""
            return out
        if token_id in (self._ids[OPEN], self._ids[CLOSE]):
            if self._tag is not None:  # a tag inside a tag: the first was text after all
                self._tag_as_text(out)
            self._tag, self._tag_kind = [], OPEN if token_id == self._ids[OPEN] else CLOSE
            return out
        if self._tag is not None:
            if token_id == self._ids[SEP]:
                self._apply_tag(out)
            else:
                self._tag.append(token_id)
                if len(self.tok.decode(self._tag)) > MAX_TAG_CHARS:
                    self._tag_as_text(out)
            return out
        if self.tok.is_special(token_id):
            return out  # stray control/reserved ids carry no text
        self._emit(out, token_id)
        return out

    def _apply_tag(self, out: ParsedDelta) -> None:
        name = self.tok.decode(self._tag or []).strip().split(" ", 1)[0]
        kind, self._tag = self._tag_kind, None
        if kind == OPEN and name in ("think", "response"):
            self._flush_channel(out)
            self.channel = name
        elif kind == CLOSE and name in ("think", "response", "message"):
            self._flush_channel(out)
            self.channel = ""

    def _tag_as_text(self, out: ParsedDelta) -> None:
        ids, kind, self._tag = self._tag or [], self._tag_kind, None
        self._emit(out, text=kind)
        for i in ids:
            self._emit(out, i)

    def finish(self) -> ParsedDelta:
        """Flush an incomplete UTF-8 tail at the end. A tag still open (the token limit or
        an end id cut it before its `<|sep|>`) is dropped: a control token and half a
        tag name are not text the model wrote."""
        out = ParsedDelta()
        self._tag = None
        for key in list(self._decoders):
            piece = self._decoders.pop(key).flush()
            if key == "think":
                out.reasoning += piece
            else:
                out.content += piece
        return out
