"""One window's conversation and the consuming of one answer's stream. No Textual here.

The screen gives `consume` an `AnswerView` (its handler for the stream's events: the
answer widget and the panes) and the session does the rest: which messages go into a
request, committing the prompt before the request goes out, saving a streaming answer
every `SAVE_EVERY_S`, and the turn's final status and note.

Several windows can share one history. The session keeps `shown`, the conversation as
this window shows it, and a request is built from that, never from the store: a window
never sends turns it has not shown. Before acting on the conversation the screen asks
`changed_elsewhere` and, when another window added to it, shows it again instead. While
a window shows a conversation it marks it (`History.show`), so a window started without
naming one opens the most recent conversation no other window shows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

from k3tui.backends.events import (
    BackendError,
    ContentDelta,
    Finished,
    ReasoningDelta,
    TokenStats,
    TurnProgress,
    Waiting,
)
from k3tui.history import Conversation, History, Message

# What `queue` gives for each answer when answers go through the turn queue: the backend's
# URL (the queue's key) and the turn's settings (k3tui/answers/store.py); None: stream here.
QueueFn = Callable[[], "tuple[str, dict[str, Any]] | None"]

SAVE_EVERY_S = 1.0  # how often a streaming answer is written to the history


class AnswerView(Protocol):
    """Where one answer's events go; `content` / `reasoning` are what it holds so far."""

    content: str
    reasoning: str

    async def add_content(self, text: str) -> None: ...
    async def add_reasoning(self, text: str) -> None: ...
    def token(self, ev: TokenStats) -> None: ...
    def finished(self, ev: Finished) -> None: ...
    def waiting(self, message: str) -> None: ...
    def progress(self, ev: TurnProgress) -> None: ...
    def failed(self, message: str, next_step: str, retry: bool) -> None: ...
    def turn_meta(self) -> dict[str, Any]: ...
    def cancelled_status(self) -> str: ...
    async def done(self, status: str, note: str) -> None: ...


def _seen(m: Message) -> tuple:
    """What a window shows of a message: a row whose id came back (SQLite reuses the
    largest id after a delete) with other text is another message."""
    return m.id, m.role, m.content, m.reasoning, m.status


def _status_line(view: AnswerView, ev: Waiting | TurnProgress) -> None:
    """The events that only say how the answer stands (the status line under it)."""
    if isinstance(ev, Waiting):
        view.waiting(f"⏳ {ev.message}")
    else:
        view.progress(ev)


class ChatSession:
    """With `queue`, an answer is a turn (k3tui/answers): queued in the store, answered by
    the backend's detached runner, and followed here from the store, so it goes on when
    this chat ends. Without it (the demo, whose engine ends with the chat), the chat holds
    the stream itself."""

    def __init__(self, history: History, conversation_id: int | None = None,
                 system_prompt: str = "", queue: QueueFn | None = None) -> None:
        self.history = history
        self.queue = queue
        self.turn_id: int | None = None   # the turn being followed, when queued
        self.turn_messages: set[int] = set()  # messages of turns this window sent or followed
        self.asked = conversation_id  # the one the user named (`chat --conversation ID`)
        self.system_prompt = system_prompt
        self.conversation_id: int | None = None
        self.shown: list[Message] = []  # the conversation as this window shows it
        self._mark: int | None = None

    def open(self, conversation_id: int | None) -> list[Message]:
        """Show `conversation_id` (None: a new conversation, stored with its first prompt);
        returns its messages."""
        self._set_conversation(conversation_id)
        self.shown = [] if conversation_id is None else self.history.messages(conversation_id)
        return list(self.shown)

    def _set_conversation(self, conversation_id: int | None) -> None:
        if conversation_id != self.conversation_id or self._mark is None:
            self.history.hide(self._mark)
            self._mark = None if conversation_id is None else self.history.show(conversation_id)
        self.conversation_id = conversation_id

    def close(self) -> None:
        self.history.hide(self._mark)
        self._mark = None

    def first_free(self) -> tuple[int | None, list[Conversation]]:
        """The conversation a window opens when none was named: the most recent one no
        other window shows (None: a new one), and the more recent ones it passed over."""
        passed: list[Conversation] = []
        for conv in self.history.list_conversations():
            if not self.history.shown_elsewhere(conv.id):
                return conv.id, passed
            passed.append(conv)
        return None, passed

    def changed_elsewhere(self) -> bool:
        """Whether the stored conversation is no longer exactly what this window shows
        (another window added to it, edited it or deleted it)."""
        if self.conversation_id is None:
            return False
        self._reread(*self.turn_messages)   # what their runners wrote is not a change
        stored = self.history.messages(self.conversation_id)
        if not stored and self.history.get_conversation(self.conversation_id) is None:
            return True
        return [_seen(m) for m in stored] != [_seen(m) for m in self.shown]

    def request_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system_prompt:
            out.append({"role": "system", "content": self.system_prompt})
        for m in self.shown:
            if m.role == "assistant" and (m.status in ("streaming", "error") or not m.content):
                continue
            msg = {"role": m.role, "content": m.content}
            if m.role == "assistant" and m.reasoning:
                # sent back as streamed, so the engine renders the turn as the ids it
                # generated and resumes its kept state instead of prefilling it again
                msg["reasoning_content"] = m.reasoning
            out.append(msg)
        return out

    def _add(self, role: str, content: str, status: str = "done") -> int:
        assert self.conversation_id is not None
        message_id = self.history.add_message(self.conversation_id, role, content,
                                              status=status)
        self.shown.append(Message(message_id, self.conversation_id, role, content,
                                  status=status))
        return message_id

    def add_prompt(self, text: str, *, backend: str, model: str) -> None:
        """Committed before the request goes out: a crash from here on loses nothing typed."""
        if self.conversation_id is None:
            title = " ".join(text.split())[:48]
            self._set_conversation(self.history.new_conversation(title, backend=backend,
                                                                 model=model))
        self._add("user", text)

    def _store(self) -> Any:
        from k3tui.answers.store import TurnStore

        return TurnStore(self.history)

    def start_answer(self) -> int:
        target = self.queue() if self.queue is not None else None
        if target is None:
            self.turn_id = None
            return self._add("assistant", "", status="streaming")
        self.turn_id, message_id = self._enqueue(target)
        return message_id

    def _enqueue(self, target: tuple[str, dict[str, Any]]) -> tuple[int, int]:
        """A turn answering the conversation as shown, behind the backend's others."""
        from k3tui.answers.runner import ensure_runner

        assert self.conversation_id is not None
        backend, settings = target
        turn = self._store().enqueue(self.conversation_id, None, backend, settings)
        self.shown.append(Message(turn.message_id, self.conversation_id, "assistant", "",
                                  status="streaming"))
        ensure_runner(backend)
        self.turn_messages.add(turn.message_id)
        return turn.id, turn.message_id

    def queue_behind(self) -> tuple[int, int] | None:
        """While an answer runs: the prompt just added gets a turn queued behind it (its
        id and its answer's message), which the runner answers after the one running, with
        that one's answer in its request. None: answers do not go through the queue here."""
        target = self.queue() if self.queue is not None else None
        return None if target is None else self._enqueue(target)

    def cancel_queued(self, turn_id: int) -> bool:
        """Take back a turn that has not started: stopped, then its prompt and empty answer
        deleted, so the turns behind it are asked without them. False: it has started (or
        ended) meanwhile, and stays (the compare-and-set in the store decides)."""
        store = self._store()
        store.finish(turn_id, "stopped", "taken back before it started", only_from="queued")
        turn = store.get(turn_id)
        if turn.state != "stopped" or turn.started is not None:
            return False
        prompt = [m for m in self.shown if m.id < turn.message_id][-1:]
        gone = {turn.message_id} | {m.id for m in prompt if m.role == "user"}
        for message_id in gone:
            self.history.delete_message(message_id)
        self.shown = [m for m in self.shown if m.id not in gone]
        self.turn_messages -= gone
        return True

    def active_turn(self, message_id: int) -> int | None:
        """The turn that fills `message_id` if it is queued or running (a chat opened on
        answers in progress), else None."""
        turn = self._store().turn_of_message(message_id)
        return turn.id if turn is not None and turn.state in ("queued", "running") else None

    def follow_queued(self, turn_id: int, message_id: int) -> None:
        """Follow a turn this window queued behind another, however it stands now."""
        self.turn_id = turn_id
        self.turn_messages.add(message_id)

    def stream_for(self, messages: list[dict[str, Any]], direct: Callable[..., Any]) -> Any:
        """The answer's events: read back from the store for a queued turn, else `direct`."""
        if self.turn_id is not None:
            from k3tui.answers.follow import follow_turn

            return follow_turn(self._store(), self.turn_id)
        return direct(messages)

    def _reread(self, *message_ids: int) -> None:
        """A queued turn's message is its runner's to write: show it as stored."""
        stored = {m.id: m for m in self.history.messages(self.conversation_id or -1)
                  if m.id in message_ids}
        self.shown = [stored.get(m.id, m) for m in self.shown]

    def drop_last(self, role: str) -> Message | None:
        """Delete the last message if it is `role`'s (history and `shown`); it, or None."""
        if not self.shown or self.shown[-1].role != role:
            return None
        message = self.shown.pop()
        self.history.delete_message(message.id)
        return message

    def _saved(self, message_id: int, **fields: Any) -> None:
        self.history.update_message(message_id, **fields)
        self.shown = [dataclasses.replace(m, **fields) if m.id == message_id else m
                      for m in self.shown]

    async def consume(self, stream: Any, view: AnswerView,
                      message_id: int) -> None:
        """Feed `stream` to `view` until it ends, is cancelled ("stopped") or fails; then
        close it, save the answer with its final status and tell the view (`done`)."""
        status, note = "done", ""
        last_save = time.monotonic()
        try:
            async for ev in stream:
                match ev:
                    case ContentDelta():
                        await view.add_content(ev.text)
                    case ReasoningDelta():
                        await view.add_reasoning(ev.text)
                    case TokenStats():
                        view.token(ev)
                    case Finished():
                        view.finished(ev)
                        note = ev.note
                        if ev.finish_reason == "length":
                            note = note or "(stopped at the max_tokens limit)"
                    case BackendError():
                        status, note = "error", ev.message
                        view.failed(ev.message, ev.next_step, ev.retry)
                        break
                    case Waiting() | TurnProgress():
                        _status_line(view, ev)
                if self.turn_id is None and time.monotonic() - last_save > SAVE_EVERY_S:
                    last_save = time.monotonic()
                    self.history.update_message(message_id, content=view.content,
                                                reasoning=view.reasoning)
        except asyncio.CancelledError:
            status = view.cancelled_status()  # Esc stopped it, or k3tui quit
            if self.turn_id is not None and status == "stopped":
                self._store().request_stop(self.turn_id)  # Esc stops it; a quit does not
            raise
        except Exception as exc:  # a client bug or a dropped connection: never a traceback
            status, note = "error", f"{type(exc).__name__}: {exc}"
            view.failed(note, "", True)
        finally:
            try:
                await stream.aclose()  # closes the HTTP stream, which stops the server
            except Exception:
                pass
            if self.turn_id is None:
                self._saved(message_id, content=view.content, reasoning=view.reasoning,
                            status=status, meta=view.turn_meta())
            else:
                self._reread(message_id)
            await view.done(status, note)
