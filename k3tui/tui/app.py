"""The chat app: one screen with the conversation, the prompt and the latency / I/O panes.

Backends stay out of the widgets: the app is given a `stream(messages)` callable that
yields `k3tui.backends.events` (the real OpenAI-compatible client, or a scripted fake in
tests), a `History` store and a `Monitor`. One worker consumes the stream; Esc cancels
it, which closes the HTTP stream.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.geometry import Offset
from textual.screen import Screen
from textual.widgets import Footer, Static
from textual.worker import Worker, WorkerState

from k3tui import clipboard
from k3tui.backends.events import (
    StreamEvent,
)
from k3tui.history import History
from k3tui.monitor import Monitor, Sample
from k3tui.textsafe import clean
from k3tui.tui.handler import AnswerHandler
from k3tui.tui.session import ChatSession, QueueFn
from k3tui.tui.stats import LatencyStats
from k3tui.units import gb_amount
from k3tui.tui.widgets.messages import AssistantMessage, UserMessage, code_blocks
from k3tui.tui.widgets.panes import IOPane, LatencyPane
from k3tui.tui.widgets.prompt import Prompt
from k3tui.tui.widgets.sparkline import terminal_is_ascii

StreamFn = Callable[[list[dict[str, Any]]], AsyncIterator[StreamEvent]]
ChatMessage = UserMessage | AssistantMessage
NARROW = 100        # below this width the panes move under the chat
SHORT = 20          # and below this height they hide (F2 shows them): the chat keeps room


@dataclass
class BackendInfo:
    """What the header shows, and which process the I/O pane follows."""

    kind: str = "remote"            # bundled | llama-server | remote
    model: str = ""
    preset: str = ""
    budget_gb: float | None = None
    url: str = ""
    pid: int | None = None
    log_path: str = ""
    label: str = ""                 # e.g. the demo's "random weights" warning
    pool: list[str] = field(default_factory=list)  # a pool head's workers, host:port each
    shared: bool = False            # a detached service other chats use too: quitting keeps it

    def header(self) -> Text:
        """The label (the demo's warning) first, so 80 columns never cut it off."""
        parts = [(self.label, "bold reverse")] if self.label else []
        parts += [(self.kind, ""), (self.model or "model ?", "bold")]
        if self.preset:
            parts.append((f"preset {self.preset}", ""))
        if self.budget_gb:   # llama-server's is the process's limit, the engine's a budget
            word = "limit" if self.kind == "llama-server" else "budget"
            parts.append((f"{word} {gb_amount(self.budget_gb)}", ""))
        if self.shared:
            parts.append(("shared: `k3tui serve stop` stops it", "dim"))
        text = Text(" ", no_wrap=True, overflow="ellipsis")
        for i, (part, style) in enumerate(parts):
            if i:
                text.append(" │ ", style="dim")
            text.append(clean(part), style=style)  # the model id is the server's text
        return text


def finished_notice(text: str) -> str:
    """BEL, then OSC 9 and OSC 777 notifications carrying `text`, which is cleaned of every
    control character (an ESC or BEL in it would end the sequence and run the rest) and of
    `;` (OSC 777's separator)."""
    what = clean(text).replace("\n", " ").replace("\t", " ").replace(";", ",")
    return f"\a\x1b]9;{what}\x07\x1b]777;notify;k3tui;{what}\x07"


class ChatLog(VerticalScroll):
    """The conversation. It follows a growing answer only while the view is at the
    bottom (within 2 rows): someone reading further up is never yanked down."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.following = True
        self.held = False  # a message is highlighted: stay on it, follow nothing

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        self.following = not self.held and new_value >= self.max_scroll_y - 2

    # The content's (virtual) size changes on a layout without a Resize event (those come
    # only when the widget's own region changes): both keep a followed answer in view.
    def watch_virtual_size(self) -> None:
        self._keep_following()

    def on_resize(self) -> None:
        self._keep_following()

    def _keep_following(self) -> None:
        if self.following:
            self.scroll_end(animate=False, immediate=True)

    def scroll_to_region(self, region: Any, **kwargs: Any) -> Any:
        """The reasoning block collapsing as its answer starts asks to be scrolled into view
        (Textual's Collapsible does), which pulled a followed answer back up for good: while
        the view follows, the bottom wins (Ctrl+T lets go first to show what it opens)."""
        if self.following:
            return Offset(0, 0)
        return super().scroll_to_region(region, **kwargs)

    def hold(self, held: bool) -> None:
        self.held = held
        self.following = not held and self.scroll_y >= self.max_scroll_y - 2

    def follow(self) -> None:
        self.held = False
        self.following = True
        self.scroll_end(animate=False, immediate=True)


HINT = ("Type a message below and press Enter to send (Ctrl+J for a new line). F1 lists "
        "every key; Ctrl+O opens earlier conversations.")
DEMO_NOTE = ("The demo model's replies are meaningless by design: random weights steered to "
             "readable words. The streaming, the reasoning and both panes are real; "
             "`k3tui setup` leads to Kimi-K3.")


class ChatScreen(Screen):
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+r", "regenerate", "Regen", priority=True),
        Binding("ctrl+e", "edit_last", "Edit", priority=True),
        Binding("ctrl+t", "toggle_reasoning", "Think", priority=True),
        Binding("ctrl+o", "conversations", "Chats", priority=True),
        Binding("ctrl+n", "new_chat", "New", priority=True),
        Binding("ctrl+y", "copy_answer", "Copy", priority=True),
        Binding("ctrl+g", "copy_code", "Copy code", show=False, priority=True),
        # Ctrl+arrows where the terminal sends them (tmux does); Alt+arrows where the
        # desktop takes Ctrl+arrows (macOS Mission Control).
        Binding("ctrl+up,alt+up", "pick(-1)", "Pick", show=False, priority=True),
        Binding("ctrl+down,alt+down", "pick(1)", "Pick next", show=False, priority=True),
        # The prompt has the focus, so the chat would never see these: the screen takes them.
        Binding("pageup", "scroll_chat(-1)", "Scroll up", show=False, priority=True),
        Binding("pagedown", "scroll_chat(1)", "Scroll down", show=False, priority=True),
        Binding("f1", "keys", "Keys", priority=True),
        Binding("f2", "toggle_panes", "Panes", show=False, priority=True),
        Binding("f3", "downloads", "Downloads", show=False, priority=True),
        Binding("f4", "packing", "Packing", show=False, priority=True),
        Binding("f5", "backend_log", "Backend", show=False, priority=True),
        Binding("f6", "machine", "Machine", show=False, priority=True),
    ]

    def __init__(self, session: ChatSession, new: bool = False) -> None:
        super().__init__()
        self.session = session
        self.new = new  # start empty instead of opening the most recent conversation
        self.stats = LatencyStats()
        self.k3: dict[str, Any] = {}
        self.last_sample: Sample | None = None
        self._shown_version = -1
        self._shown_at = 0.0
        self._gen: Worker | None = None
        self.esc_stopped = False  # Esc cancelled the answer (else the app quitting did)
        self.current: AssistantMessage | None = None
        self.current_id: int | None = None
        self.turns_finished = 0
        self.sampling = True  # the benchmark switches it off to measure its share
        self._told_dead = False
        self.picked: ChatMessage | None = None   # the highlighted message (Ctrl+Up / Ctrl+Down)
        self._code_at: tuple[ChatMessage, int] | None = None  # the block Ctrl+G copied last
        self._prompt_at_pick = ""  # the prompt's text when the highlight moved
        self.last_error: tuple[str, str] | None = None  # the last backend error, its next step
        # prompts sent while an answer ran, in order: (turn id, its answer's message, widget)
        self.queued: list[tuple[int, int, UserMessage]] = []

    @property
    def conversation_id(self) -> int | None:
        return self.session.conversation_id

    @property
    def k3app(self) -> ChatApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        app = self.k3app
        yield Static(app.backend.header(), id="header")
        with Horizontal(id="body"):
            yield ChatLog(id="chat")
            with Vertical(id="side"):
                yield LatencyPane(ascii=app.ascii, id="latency")
                yield IOPane(ascii=app.ascii, id="io")
        yield Prompt(app.history.user_prompts(), id="prompt")
        yield Footer()

    async def on_mount(self) -> None:
        app = self.k3app
        self._fit_layout()
        if not self.new:
            await self._open_at_start()
        await self._hint()
        if app.sample_hz > 0:
            self.set_interval(1 / app.sample_hz, self.sample_now)
        self.set_interval(0.25, self.refresh_panes)
        self.query_one(Prompt).focus()
        self.refresh_panes(force=True)

    def on_resize(self) -> None:
        self._fit_layout()

    def _fit_layout(self) -> None:
        """Narrow: the panes go under the chat; narrow and short (40x12): they would leave
        the chat a row or two, so they hide until F2 asks for them."""
        width, height = self.app.size
        self.set_class(width < NARROW, "narrow")
        self.set_class(width < NARROW and height < SHORT, "short")

    def on_unmount(self) -> None:
        self.session.close()

    # conversation ----------------------------------------------------------------------
    async def _open_at_start(self) -> None:
        """The conversation named (`--conversation`), else the most recent one that no
        other window shows: two windows on one home never share a conversation unasked."""
        history = self.k3app.history
        asked = self.session.asked
        if asked is not None:
            if history.get_conversation(asked) is None:
                self._tell(f"There is no conversation {asked}; this window starts a new one "
                           "(Ctrl+O lists them).", severity="warning")
                return
            await self.load_conversation(asked)
            return
        conversation_id, passed = self.session.first_free()
        if passed:
            now = (f"opened “{clean(history.get_conversation(conversation_id).title)}”"
                   if conversation_id is not None else "starts a new one")
            self._tell(f"Your most recent conversation, “{clean(passed[0].title)}”, is open "
                       f"in another k3tui window, so this window {now} (Ctrl+O opens any).")
        if conversation_id is not None:
            await self.load_conversation(conversation_id)

    async def load_conversation(self, conversation_id: int) -> None:
        shared = conversation_id != self.conversation_id and \
            self.k3app.history.shown_elsewhere(conversation_id)
        messages = self.session.open(conversation_id)
        await self._show_messages(messages)
        if shared:
            self._tell("This conversation is open in another k3tui window too; each window "
                       "sends only the turns it shows.")

    def _tell(self, message: str, severity: str = "information") -> None:
        """A notice that may come while the screen mounts: shown once it is drawn (a toast
        posted before then never appears)."""
        self.call_after_refresh(self.notify, message, severity=severity,  # type: ignore[arg-type]
                                timeout=10, markup=False)

    async def _show_messages(self, messages: list[Any]) -> None:
        self.clear_pick()
        chat = self.query_one("#chat", ChatLog)
        await chat.remove_children()
        widgets: list[UserMessage | AssistantMessage] = []
        # Turns in progress (their runner answers them): the first is followed live, the
        # ones behind it are shown queued under their prompts and followed in order.
        first: tuple[int, int, UserMessage | None] | None = None
        queued: list[tuple[int, int, UserMessage]] = []
        for m in messages:
            if m.role == "user":
                widgets.append(UserMessage(m.content, classes="user"))
            elif m.role == "assistant":
                turn = self.session.active_turn(m.id) if m.status == "streaming" else None
                user = widgets[-1] if widgets and isinstance(widgets[-1], UserMessage) else None
                if turn is not None and first is None and (user or m is messages[-1]):
                    first = (turn, m.id, user)   # (a regenerated answer has no prompt)
                    continue
                if turn is not None and user is not None:
                    user.set_queued(True)
                    queued.append((turn, m.id, user))
                    continue
                widgets.append(AssistantMessage(content=m.content, reasoning=m.reasoning,
                                                status=m.status, classes="assistant"))
        await chat.mount_all(widgets)
        await self._hint()
        chat.follow()
        self.queued = queued
        if first is not None and not self.generating:
            turn_id, message_id, after = first
            self.session.follow_queued(turn_id, message_id)
            await self._start_answer(following=message_id, after=after)

    async def _hint(self) -> None:
        """An empty chat says what to do (a first run, Ctrl+N); the first message replaces it."""
        found = self.query("#chat").results(ChatLog)
        chat = next(found, None)
        if chat is None:  # a callback that outlived the screen (the app quit meanwhile)
            return
        empty = not any(isinstance(w, (UserMessage, AssistantMessage)) for w in chat.children)
        hints = chat.query("#chat-hint")
        demo = "random weights" in self.k3app.backend.label
        text = f"{HINT}\n\n{DEMO_NOTE}" if demo else HINT
        if empty and not hints:
            await chat.mount(Static(text, id="chat-hint"))
        elif empty:  # the backend changed meanwhile (d on the start-up screen: the demo)
            hints.first(Static).update(text)
        elif not empty and hints:
            await hints.remove()

    @property
    def generating(self) -> bool:
        return self._gen is not None and self._gen.state in (WorkerState.PENDING,
                                                             WorkerState.RUNNING)

    async def _changed_elsewhere(self, kept: str) -> bool:
        """Another window changed this conversation since this one showed it: show it as
        it is now and say so (`kept`: what happened to the user's action) instead of
        sending turns this window never showed."""
        if not self.session.changed_elsewhere():
            return False
        conversation_id = self.conversation_id
        assert conversation_id is not None
        if self.k3app.history.get_conversation(conversation_id) is None:
            await self.action_new_chat()
            what = "was deleted in another k3tui window; this window starts a new one"
        else:
            await self._show_messages(self.session.open(conversation_id))
            what = "was changed in another k3tui window and is shown as it is now"
        self.notify(f"This conversation {what}: {kept}.", severity="warning", timeout=12)
        return True

    @on(Prompt.Submitted)
    async def send(self, event: Prompt.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        if self.generating and self.session.queue is None:  # the demo: the chat holds it
            self.notify("Still answering: press Esc to stop first.", severity="warning")
            return
        if await self._changed_elsewhere("nothing was sent, your message is still in the box"):
            return
        if self.generating:
            await self._queue(text)
            return
        backend = self.k3app.backend
        self.session.add_prompt(text, backend=backend.kind, model=backend.model)
        prompt = self.query_one(Prompt)
        prompt.remember(text)
        prompt.text = ""
        await self.query_one("#chat").mount(UserMessage(text, classes="user"))
        await self._hint()
        await self._start_answer()

    async def _queue(self, text: str) -> None:
        """A prompt sent while an answer runs: stored with a turn queued behind it, shown
        as queued, and followed when the answers before it end (`_next_queued`)."""
        backend = self.k3app.backend
        self.session.add_prompt(text, backend=backend.kind, model=backend.model)
        prompt = self.query_one(Prompt)
        prompt.remember(text)
        prompt.text = ""
        queued = self.session.queue_behind()
        assert queued is not None   # only called when answers go through the queue
        user = UserMessage(text, classes="user")
        user.set_queued(True)
        self.queued.append((*queued, user))
        await self.query_one("#chat", ChatLog).mount(user)
        self.query_one("#chat", ChatLog).follow()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """The answer followed has ended (or Esc stopped it): follow the next queued one;
        not when k3tui quits (a cancel without Esc), which leaves them to their runner."""
        ended = event.state in (WorkerState.SUCCESS, WorkerState.ERROR) or \
            (event.state == WorkerState.CANCELLED and self.esc_stopped)
        if event.worker is self._gen and self.queued and ended:
            self.call_later(self._next_queued)

    async def _next_queued(self) -> None:
        """The runner answers the queued turns in order, with or without this chat; the
        chat follows the next one (one stopped from a shell meanwhile shows how it ended)."""
        if self.generating or not self.queued or not self.is_attached:
            return
        turn_id, message_id, user = self.queued.pop(0)
        user.set_queued(False)
        self.session.follow_queued(turn_id, message_id)
        await self._start_answer(following=message_id, after=user)

    async def _take_back(self, user: UserMessage) -> None:
        """Esc on a queued prompt: its turn is cancelled and its text comes back to the box
        (to edit and send again) unless the box holds other typing (Up recalls it then)."""
        entry = next(q for q in self.queued if q[2] is user)
        if not self.session.cancel_queued(entry[0]):
            self.notify("That prompt's answer has started; Esc stops it once it shows.")
            return
        self.queued.remove(entry)
        self.clear_pick()
        await user.remove()
        prompt = self.query_one(Prompt)
        if prompt.text.strip():
            self.notify("Taken back; the box was not empty, so Up recalls the prompt.")
        else:
            prompt.text = user.text
            prompt.move_cursor(prompt.document.end)
            self.notify("Taken back: edit it and send it again, or clear the box.")

    async def _start_answer(self, following: int | None = None,
                            after: UserMessage | None = None) -> None:
        """A new answer, or (`following`: its message) one in progress in the store; a
        queued one goes `after` its prompt."""
        messages = self.session.request_messages() if following is None else []
        self.current_id = self.session.start_answer() if following is None else following
        self.clear_pick()
        self.current = AssistantMessage(classes="assistant")
        chat = self.query_one("#chat", ChatLog)
        await chat.mount(self.current, after=after)
        chat.follow()  # sending a prompt jumps to the bottom
        self.stats.start(self.k3app.clock())
        self.esc_stopped = False
        self._gen = self.run_worker(self._generate(messages, self.current, self.current_id),
                                    group="gen", exclusive=True, exit_on_error=False)

    async def _generate(self, messages: list[dict[str, Any]], widget: AssistantMessage,
                        message_id: int) -> None:
        await self.session.consume(self.session.stream_for(messages, self.k3app.stream),
                                   AnswerHandler(self, widget), message_id)

    def tell_finished(self, status: str) -> None:
        """An answer ended while this chat is open: the bell, and a desktop notification
        (OSC 9 and OSC 777; terminals without them ignore both). The text is ours, cleaned
        of control characters all the same, so it cannot end the sequence early."""
        app = self.app
        if not app.is_headless and app._driver is not None:
            app._driver.write(finished_notice(
                f"the answer is {'done' if status == 'done' else 'failed'}"))

    def answer_done(self) -> None:
        """The first demo answer says once what its words are (they read like canned text)."""
        self.turns_finished += 1
        if self.turns_finished == 1 and "random weights" in self.k3app.backend.label:
            self.notify(DEMO_NOTE, title="demo model", timeout=15)

    def learn_budget(self, budget_gb: Any) -> None:
        """The engine reports the budget it runs under; the header shows it."""
        backend = self.k3app.backend
        if isinstance(budget_gb, (int, float)) and budget_gb > 0 and not backend.budget_gb:
            backend.budget_gb = float(budget_gb)
            self.query_one("#header", Static).update(backend.header())

    def turn_meta(self) -> dict[str, Any]:
        snap = self.stats.snapshot()
        return {"tokens": snap.tokens, "ttft_ms": snap.ttft_ms,
                "ms_per_token": snap.gen_ms_per_token, "p50_ms": snap.p50_ms,
                "p95_ms": snap.p95_ms, "backend": self.k3app.backend.kind,
                "model": self.k3app.backend.model}

    def backend_failed(self, message: str, next_step: str, retry: bool) -> None:
        """`message` is the server's words: never markup (a `[` must not end the chat).
        `retry`: whether ctrl+r (the same request again) can help."""
        # Each part is a sentence of its own: "…:8099." then "Start it…", never "8099.. start".
        self.last_error = (message, next_step)  # `chat --smoke` prints it
        parts = [p.strip().rstrip(".") for p in (message, next_step) if p.strip()]
        text = " ".join(f"{p[0].upper()}{p[1:]}." for p in parts)
        again = "; press ctrl+r to retry" if retry else ""
        self.notify(clean(f"{text} Your history is saved{again}."),
                    title="backend problem", severity="error", timeout=12, markup=False)

    # actions ---------------------------------------------------------------------------
    async def action_stop(self) -> None:
        """Esc stops the answer (always: it comes first) and ends a highlight; on a
        highlighted queued prompt it takes that prompt back instead."""
        picked = self._picked()
        if isinstance(picked, UserMessage) and picked.queued:
            await self._take_back(picked)
            return
        if self.generating and self._gen is not None:
            self.esc_stopped = True
            self._gen.cancel()
        self.clear_pick(follow=True)

    async def _drop_last_answer(self) -> bool:
        """Remove the last assistant message (history and screen); False if the turn has
        no prompt to answer again."""
        if self.session.drop_last("assistant") is None:
            return bool(self.session.shown) and self.session.shown[-1].role == "user"
        answers = self.query("#chat > AssistantMessage")
        if answers:
            await answers.last().remove()
        return True

    async def action_regenerate(self) -> None:
        if self.generating:
            self.notify("Press Esc to stop the current answer first.", severity="warning")
            return
        app = self.k3app
        if app.starter is not None and not app.backend_alive():
            app.start_backend(then=self.action_regenerate)  # the backend died: restart it
            return
        if await self._changed_elsewhere("nothing was regenerated"):
            return
        if not await self._drop_last_answer():
            self.notify("Nothing to regenerate yet.")
            return
        await self._start_answer()

    async def action_edit_last(self) -> None:
        """Put the last prompt back in the box and forget that turn, to edit and resend."""
        if self.generating or self.conversation_id is None:
            return
        if await self._changed_elsewhere("nothing was taken back to edit"):
            return
        await self._drop_last_answer()
        last = self.session.drop_last("user")
        if last is None:
            self.notify("Nothing to edit yet.")
            return
        users = self.query("#chat > UserMessage")
        if users:
            await users.last().remove()
        prompt = self.query_one(Prompt)
        prompt.text = last.content
        prompt.move_cursor(prompt.document.end)
        prompt.focus()
        await self._hint()

    def action_toggle_reasoning(self) -> None:
        picked = self._picked()
        answers = [a for a in self.query("#chat > AssistantMessage") if a.reasoning]
        if isinstance(picked, AssistantMessage) and picked.reasoning:
            answers = [picked]
        if answers:
            if answers[-1].reasoning_block.collapsed:  # opening it: show it, stop following
                self.query_one("#chat", ChatLog).following = False
            answers[-1].toggle_reasoning()

    def _last_answer(self) -> AssistantMessage | None:
        answers = self.query("#chat > AssistantMessage")
        return answers.last() if answers else None  # type: ignore[return-value]

    # the highlight: Ctrl+Up / Ctrl+Down pick a message for Ctrl+Y / Ctrl+G / Ctrl+T ------
    def _messages(self) -> list[ChatMessage]:
        return [w for w in self.query_one("#chat", ChatLog).children
                if isinstance(w, (UserMessage, AssistantMessage))]

    def _picked(self) -> ChatMessage | None:
        """The highlighted message, if it is still on screen (regenerate removes one)."""
        return self.picked if self.picked is not None and self.picked.parent else None

    def _label(self, message: ChatMessage) -> str:
        """'answer 2 of 5' / 'prompt 1 of 5': what the user sees counted in the chat."""
        kind = type(message)
        same = [m for m in self._messages() if type(m) is kind]
        word = "answer" if kind is AssistantMessage else "prompt"
        return f"{word} {same.index(message) + 1} of {len(same)}" if message in same else word

    def action_pick(self, step: int) -> None:
        messages = self._messages()
        if not messages:
            self.notify("No messages yet: nothing to highlight.")
            return
        picked = self._picked()
        if picked is None:
            if step > 0:
                return  # already past the newest message, at the prompt
            index = len(messages) - 1
        else:
            index = messages.index(picked) + step
        if index >= len(messages):
            self.clear_pick(follow=True)  # down past the newest: back to the prompt
            return
        if index < 0:
            self.app.bell()  # already the first message
            return
        self._set_pick(messages[index])

    def _set_pick(self, message: ChatMessage) -> None:
        old = self._picked()
        if old is not None and old is not message:
            old.set_picked(None)
        self.picked = message
        self._code_at = None
        self._prompt_at_pick = self.query_one(Prompt).text
        message.set_picked(self._label(message))
        self.query_one("#chat", ChatLog).hold(True)  # reading it: a stream must not scroll away
        self.call_after_refresh(self._show_picked, message)  # once its new border is laid out

    def _show_picked(self, message: ChatMessage) -> None:
        """Scroll only when some of it is out of view; a long message shows its start."""
        chat = self.query_one("#chat", ChatLog)
        if self._picked() is message and \
                not chat.scrollable_content_region.contains_region(message.region):
            chat.scroll_to_widget(message, animate=False, top=True, immediate=True)

    def clear_pick(self, follow: bool = False) -> None:
        picked, self.picked = self.picked, None
        self._code_at = None
        if picked is None:
            return
        if picked.parent is not None:  # Ctrl+E / Ctrl+R may have removed it
            picked.set_picked(None)
        chat = self.query_one("#chat", ChatLog)
        if follow:
            chat.follow()
        else:
            chat.hold(False)

    @on(Prompt.Changed)
    def _typed(self, event: Prompt.Changed) -> None:
        """Typing in the prompt (or recalling one) ends the highlight; the view stays.
        Compared by text: a Changed still queued from before the highlight moved is not."""
        if event.text_area.text != self._prompt_at_pick:
            self.clear_pick()

    # copying -------------------------------------------------------------------------------
    def _copy(self, text: str, what: str, then: str = "") -> None:
        routes = self.k3app.copy(text)
        names = {"osc52": "OSC 52", "tmux": "tmux's buffer", "app": "the app only: no terminal"}
        how = " + ".join(names.get(r, r) for r in routes) or "nothing"
        if not then and self._picked() is None and len(self._messages()) > 2:
            then = " Ctrl+Up highlights an earlier message to copy."
        self.notify(f"Copied {what} ({len(text)} chars) via {how}.{then}")

    def _copy_target(self) -> ChatMessage | None:
        return self._picked() or self._last_answer()

    def action_copy_answer(self) -> None:
        target = self._copy_target()
        then = ""
        if target is not None and not target.body and self._picked() is None:
            # the last answer was stopped in its reasoning: the latest one with text
            earlier = [a for a in self.query("#chat > AssistantMessage") if a.body]
            if earlier:
                target = earlier[-1]
                then = " (The last answer has no text: it was stopped while reasoning.)"
        text = "" if target is None else target.body
        if target is None or not text:
            self.notify("No answer to copy yet." if target is None or self.picked is None
                        else f"{self._label(target).capitalize()} is empty.")
            return
        self._code_at = None
        self._copy(text, self._label(target), then)

    def action_scroll_chat(self, pages: int) -> None:
        """PgUp / PgDn scroll the conversation; back at the bottom it follows the answer."""
        chat = self.query_one("#chat", ChatLog)
        if pages < 0:
            chat.scroll_page_up(animate=False)
        else:
            chat.scroll_page_down(animate=False)

    def action_copy_code(self) -> None:
        """The last code block; pressed again on the same message, the one before it."""
        target = self._copy_target()
        text = "" if target is None else target.body
        blocks = code_blocks(text)
        if target is None or not blocks:
            self.notify("The last answer has no code block." if self.picked is None
                        else f"{self._label(target).capitalize()} has no code block.")
            return
        index = len(blocks) - 1
        if self._code_at is not None and self._code_at[0] is target:
            index = (min(self._code_at[1], len(blocks)) - 1) % len(blocks)
        self._code_at = (target, index)
        what = f"the code block of {self._label(target)}" if len(blocks) == 1 else \
            f"code block {index + 1} of {len(blocks)} from {self._label(target)}"
        then = f" Ctrl+G again: block {(index - 1) % len(blocks) + 1}." if len(blocks) > 1 else ""
        self._copy(blocks[index], what, then)

    async def action_new_chat(self) -> None:
        if self.generating:
            self.notify("Press Esc to stop the current answer first.", severity="warning")
            return
        self.session.open(None)
        self.clear_pick(follow=True)
        await self.query_one("#chat").remove_children()
        await self._hint()
        self.stats.start(None)
        self.refresh_panes(force=True)

    def action_conversations(self) -> None:
        if self.generating:
            self.notify("Press Esc to stop the current answer first.", severity="warning")
            return
        from k3tui.tui.screens.conversations import ConversationsScreen

        async def opened(conversation_id: int | None) -> None:
            if conversation_id is not None:
                await self.load_conversation(conversation_id)
            elif self.conversation_id is not None and \
                    self.k3app.history.get_conversation(self.conversation_id) is None:
                await self.action_new_chat()

        self.app.push_screen(ConversationsScreen(self.k3app.history, self.conversation_id),
                             opened)

    def action_keys(self) -> None:
        from k3tui.tui.screens.keys import KeysScreen

        self.app.push_screen(KeysScreen())

    def action_toggle_panes(self) -> None:
        side = self.query_one("#side")
        side.display = not side.display

    def action_downloads(self) -> None:
        from k3tui.tui.screens.jobs import JobsScreen

        self.app.push_screen(JobsScreen("download"))

    def action_packing(self) -> None:
        from k3tui.tui.screens.jobs import JobsScreen

        self.app.push_screen(JobsScreen("pack"))

    def action_backend_log(self) -> None:
        from k3tui.tui.screens.startup import LogScreen

        self.app.push_screen(LogScreen(self.k3app.backend.log_path))

    def action_machine(self) -> None:
        from k3tui.tui.screens.machine import MachineScreen

        self.app.push_screen(MachineScreen())

    # panes -------------------------------------------------------------------------------
    def sample_now(self) -> None:
        self._check_backend()
        monitor = self.k3app.monitor
        if monitor is None or not self.sampling:
            return
        self.last_sample = monitor.sample()
        self.show_io()

    def show_io(self) -> None:
        backend = self.k3app.backend
        k3 = self.k3
        if not self.generating:  # the engine's MB/s is its last token's: stale once it ends
            k3 = {k: v for k, v in k3.items() if k != "mb_per_s"}
        self.query_one(IOPane).show(self.last_sample, k3, backend.budget_gb, backend.kind)

    def _check_backend(self) -> None:
        """A backend we started that died while idle: say so once, offer the restart."""
        app = self.k3app
        alive = app.backend_alive()
        if not alive and not self._told_dead and app.starter is not None:
            self._told_dead = True
            self.notify("The backend process has stopped. Your history is saved; press "
                        "ctrl+r to restart it and retry, or F5 for its log.",
                        title="backend stopped", severity="error", timeout=30)
        elif alive:
            self._told_dead = False

    def refresh_panes(self, force: bool = False) -> None:
        """At most 4 Hz (the timer, never per token), and only when the numbers moved."""
        now = time.monotonic()
        if not force and now - self._shown_at < 0.2:
            return  # a late timer tick followed by a punctual one
        if force or self.stats.version != self._shown_version:
            self._shown_at = now
            self._shown_version = self.stats.version
            self.query_one(LatencyPane).show(self.stats.snapshot())
        if force:
            self.show_io()


class ChatApp(App):
    CSS_PATH = "styles/k3tui.tcss"
    TITLE = "k3tui"
    ENABLE_COMMAND_PALETTE = False

    def __init__(self, *, stream: StreamFn, history: History,
                 backend: BackendInfo | None = None, monitor: Monitor | None = None,
                 clock: Callable[[], float] = time.monotonic, ascii: bool | None = None,
                 conversation_id: int | None = None, new_conversation: bool = False,
                 sample_hz: float = 2.0,
                 system_prompt: str = "", theme: str | None = None,
                 on_ready: Callable[[ChatApp], Any] | None = None,
                 starter: Callable[[Callable[[Any], None]], Any] | None = None,
                 on_started: Callable[[Any], None] | None = None,
                 backend_alive: Callable[[], bool] | None = None,
                 demo: Callable[[], Callable[[Callable[[Any], None]], Any]] | None = None,
                 queue: QueueFn | None = None,
                 ) -> None:
        super().__init__()
        self.queue = queue  # answers go through the turn queue (k3tui/answers)
        self.stream = stream
        self.history = history
        self.backend = backend or BackendInfo()
        self.monitor = monitor
        self.clock = clock
        self.ascii = terminal_is_ascii() if ascii is None else ascii
        self.sample_hz = sample_hz
        self.system_prompt = system_prompt
        self._conversation_id = conversation_id
        self._new_conversation = new_conversation
        self._on_ready = on_ready
        self.starter = starter
        self._on_started = on_started
        self.backend_alive = backend_alive or (lambda: True)
        self.demo = demo  # switches to the demo model and returns its starter (None: no offer)
        if theme:
            self.theme = theme

    def on_mount(self) -> None:
        # Rich's default inline-code style is "on black": unreadable on a light theme.
        from rich.theme import Theme

        dark = self.current_theme.dark
        self.console.push_theme(Theme({
            "markdown.code": "bold cyan" if dark else "bold #005f87",
            "markdown.item.bullet": "bold yellow" if dark else "bold #875f00",
        }))

    def action_help_quit(self) -> None:
        """Ctrl+C: Textual's own toast ("Press ctrl+q to quit the app") said nothing of what
        quitting stops, nor how to copy, which is what Ctrl+C often means."""
        self.notify("Ctrl+Q quits k3tui (and stops a backend it started). Esc stops an "
                    "answer; Ctrl+Y copies it.", title="Ctrl+C does not quit here")

    def get_default_screen(self) -> Screen:
        return ChatScreen(ChatSession(self.history, self._conversation_id, self.system_prompt,
                                      queue=self.queue), new=self._new_conversation)

    @property
    def chat(self) -> ChatScreen:
        return next(s for s in self.screen_stack if isinstance(s, ChatScreen))

    def on_ready(self) -> None:
        if self.history.notice:  # e.g. an unreadable history was moved aside
            self.notify(self.history.notice, title="chat history", severity="warning",
                        timeout=60, markup=False)
        if self.starter is not None:
            self.start_backend()
        if self._on_ready is not None:
            self._on_ready(self)

    def start_backend(self, then: Callable[[], Any] | None = None) -> None:
        """Show the start-up screen until `starter` returns a running backend."""
        from k3tui.tui.screens.startup import StartupScreen

        assert self.starter is not None

        def started(running: Any) -> None:
            if self._on_started is not None:
                self._on_started(running)
            chat = self.chat
            chat.query_one("#header", Static).update(self.backend.header())
            self.call_later(chat._hint)  # the demo's note, when d chose the demo
            if self.monitor is not None:
                self.monitor.set_pid(self.backend.pid)
                if self.backend.pool:
                    self.monitor.set_pool(self.backend.pool, self.backend.log_path)
            if screen.typed:  # typed while the start-up screen covered the chat: kept
                chat.query_one(Prompt).insert(screen.typed)
            if then is not None:
                self.call_later(then)

        from k3tui.paths import log_stamps, newest_log_since

        before = log_stamps()

        def log_path() -> str | None:
            """The backend's log: known once it runs, else the newest log written since."""
            if self.backend.log_path:
                return self.backend.log_path
            newest = newest_log_since(before)
            return str(newest) if newest else None

        title = clean(f"starting the {self.backend.kind} backend: {self.backend.model}")
        screen = StartupScreen(title, self.starter, log_path)
        self.push_screen(screen, started)

    def use_demo(self) -> Callable[[Callable[[Any], None]], Any]:
        """The start-up screen's d: from now on the demo model is the backend."""
        assert self.demo is not None
        self.starter, self.demo = self.demo(), None
        return self.starter

    def copy(self, text: str) -> list[str]:
        """Textual's copy (the in-app clipboard, for pasting into the prompt, and OSC 52 to
        the terminal), then tmux's buffer and a local clipboard tool where there are."""
        self.copy_to_clipboard(text)
        if self.is_headless:
            return ["app"]
        return ["osc52", *clipboard.copy_beyond_terminal(text)]
