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
from k3vocab import EFFORTS  # `medium` is named in the sentence below but refused upstream

OPEN, CLOSE, SEP, END_OF_MSG, EOS = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]"
CONTROL = (OPEN, CLOSE, SEP, END_OF_MSG)

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


@dataclass(frozen=True)
class Opened:
    """Where a partial assistant turn (the last message, `"partial": true`) opened: what
    follows is the answer so far, which generation continues."""


@dataclass(frozen=True)
class Given:
    """An assistant turn's ids as the server sent them (`k3_token_ids`), rendered as they
    are once `ChatTemplate` has checked that they parse to the message's text."""

    ids: tuple[Any, ...]
    reasoning: str
    content: str
    what: str
    partial: bool
    thinking: bool


Segment = Union[str, Control, ReplyEnd, Opened, Given]
MAX_GIVEN_IDS = 1 << 20  # k3_token_ids of one message (a longer one exceeds any context)


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


def _assistant(msg: Mapping[str, Any], what: str, content: str,
               attrs: Sequence[tuple[str, str]], thinking: bool,
               last: bool) -> tuple[list[Segment], bool]:
    """An assistant message: from its text, or from its `k3_token_ids`; whole, or (when
    `"partial": true`, the last message only) opened and left open. And whether partial."""
    partial = msg.get("partial", False)
    if partial not in (True, False):
        raise TemplateError(f"{what}: 'partial' must be true or false")
    if partial and not last:
        raise TemplateError(f"{what} is partial: only the last message may be")
    reasoning = _text(msg.get("reasoning_content"), what)
    given = msg.get("k3_token_ids")
    out = _open("message", [("role", "assistant"), *attrs])
    out += _open("think" if thinking else "response")
    if partial:
        out.append(Opened())
    if given is not None:
        if not isinstance(given, list) or len(given) > MAX_GIVEN_IDS:
            raise TemplateError(
                f"{what}: 'k3_token_ids' must be an array of at most {MAX_GIVEN_IDS} token ids")
        out.append(Given(tuple(given), reasoning, content, what, partial, thinking))
        if not partial:
            out.append(Control(END_OF_MSG))  # the ids hold the rest of the closing
    else:
        rest = _channels(reasoning if thinking else "", content, thinking)[3:]
        if partial and thinking and not content:  # still thinking, as far as it went
            rest = [reasoning] if reasoning else []
        elif partial:  # the response has begun
            rest = rest[:-3]
        out += rest if partial else rest + _CLOSING
    return out + ([] if partial else [ReplyEnd()]), partial


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
            turn, partial = _assistant(msg, what, content, attrs, thinking,
                                       last=n == len(messages) - 1)
            out += turn
            if partial:
                return out
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
        s.name if isinstance(s, Control) else f"<{len(s.ids)} ids>" if isinstance(s, Given)
        else s
        for s in segments
        if not isinstance(s, (ReplyEnd, Opened))
    )


@dataclass(frozen=True)
class Rendered:
    """A prompt's ids, where each assistant message in it ends (ReplyEnd), and the ids of
    a partial last answer so far (after its generation prompt), or None."""

    ids: list[int]
    reply_ends: tuple[int, ...] = ()
    partial: list[int] | None = None


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
        opened = None
        for s in segments:
            if isinstance(s, Control):
                ids.append(self.control_ids[s.name])
            elif isinstance(s, ReplyEnd):
                ends.append(len(ids))
            elif isinstance(s, Opened):
                opened = len(ids)
            elif isinstance(s, Given):
                ids += self._given(s)
            else:
                ids += next(encoded)
        return Rendered(ids, tuple(ends), None if opened is None else ids[opened:])

    def _given(self, g: Given) -> list[int]:
        """A message's `k3_token_ids`, checked: token ids, no end id but the last, and parsed
        as the server parsed them (the text streamed, or with the held-back tail) they give
        exactly the message's reasoning_content and content. A whole message gets the
        closing tags of the channel the ids stopped in (as the template renders a reply
        the limit cut); a partial one is left open."""
        vocab, ends = self.tok.vocab_size, set(self.end_ids())
        ids = list(g.ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab
                   for i in ids):
            raise TemplateError(f"{g.what}: 'k3_token_ids' must hold token ids from 0 to "
                                f"{vocab - 1}")
        body = ids[:-1] if ids and ids[-1] in ends and not g.partial else ids
        if ends.intersection(body):
            raise TemplateError(f"{g.what}: 'k3_token_ids' holds an end id before its last id"
                                if not g.partial else
                                f"{g.what} is partial but its 'k3_token_ids' end the message")
        parser = self.parser(thinking=g.thinking)
        streamed = ParsedDelta()
        for i in body:
            d = parser.feed(i)
            streamed.reasoning += d.reasoning
            streamed.content += d.content
        channel = parser.channel
        tail = parser.finish()
        whole = (streamed.reasoning + tail.reasoning, streamed.content + tail.content)
        if (g.reasoning, g.content) not in ((streamed.reasoning, streamed.content), whole):
            raise TemplateError(
                f"{g.what}: its 'k3_token_ids' do not give its reasoning_content and content; "
                "send the ids the server sent for this message, or leave k3_token_ids out")
        if g.partial:
            return body
        closed = [self.control_ids[CLOSE], *self.tok.encode("message"), self.control_ids[SEP]]
        if body[-len(closed):] == closed:  # the model closed the message itself
            return body
        tail_segments = {"think": _close("think") + _open("response") + _close("response"),
                         "response": _close("response")}.get(channel, [])
        return body + self._ids(tail_segments + _close("message")).ids

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
