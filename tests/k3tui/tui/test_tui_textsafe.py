"""The sanitiser, and every place backend text enters the UI going through it."""

from __future__ import annotations

import pytest
from tui_helpers import build_app, settle, wait_until

from k3tui.backends.events import BackendError, ContentDelta, ReasoningDelta
from k3tui.backends.openai_stream import ChunkInterpreter, error_event
from k3tui.history import History
from k3tui.textsafe import clean
from k3tui.tui.app import BackendInfo
from scripted import ScriptedStream
from k3tui.tui.widgets.prompt import Prompt

ESC = "\x1b"


@pytest.mark.parametrize("raw", [
    f"{ESC}]52;c;SElKQUNLRUQ=\x07",            # OSC, BEL-terminated
    f"{ESC}]52;c;SElKQUNLRUQ={ESC}\\",         # OSC, ST-terminated
    f"{ESC}]8;;http://evil.example/{ESC}\\",   # OSC 8 link
    f"{ESC}[2J", f"{ESC}[6n", f"{ESC}[?1049l", f"{ESC}[38;5;196m", f"{ESC}[>0q",
    f"{ESC}P+q544e{ESC}\\", f"{ESC}_apc{ESC}\\", f"{ESC}^pm{ESC}\\", f"{ESC}Xsos{ESC}\\",
    f"{ESC}c", f"{ESC}7", f"{ESC}(B",
    "\x9b6n", "\x9d0;title\x07", "\x9d0;title\x9c", "\x90dcs\x9c",
    "\x07", "\x08", "\x00", "\x0b", "\x0c", "\x7f", "\x85", "\r",
])
def test_clean_removes_sequences_and_controls(raw):
    assert clean(f"a{raw}b") == "ab"


def test_clean_keeps_text_newlines_tabs_and_unicode():
    text = "line 1\n\tindented [bold]not markup[/] — ünïcødé 漢字 🙂\n"
    assert clean(text) == text
    assert clean("one\r\ntwo\rthree") == "one\ntwothree"  # CRLF kept as LF, lone CR gone


def test_clean_leaves_no_escape_from_a_cut_sequence():
    for cut in (f"x{ESC}]52;c;QUJD", f"x{ESC}[", f"x{ESC}", "x\x9b", f"x{ESC}P12"):
        assert not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in clean(cut))


def test_stream_events_are_cleaned_where_they_enter():
    interp = ChunkInterpreter()
    events = interp.chunk({"choices": [{"index": 0, "delta": {
        "reasoning_content": f"think{ESC}]0;T\x07", "content": f"ans{ESC}[2Jwer"}}]})
    texts = [e.text for e in events if isinstance(e, (ContentDelta, ReasoningDelta))]
    assert texts == ["think", "answer"]
    err = error_event({"message": f"boom{ESC}]52;c;QQ==\x07 [/]"}, 500)
    assert ESC not in err.message and "[/]" in err.message


def test_header_cleans_the_model_id():
    header = BackendInfo("remote", f"fake{ESC}]0;TITLE\x07-k3").header()
    assert "fake-k3" in header.plain and ESC not in header.plain and "TITLE" not in header.plain


def test_export_is_clean_even_for_rows_saved_raw(tmp_path):
    history = History(tmp_path / "h.sqlite3")
    cid = history.new_conversation("t")
    history.add_message(cid, "assistant", f"old{ESC}]52;c;QQ==\x07 row",
                        reasoning=f"r{ESC}[6n")
    out = history.export_markdown(cid)
    assert ESC not in out and "QQ==" not in out and "old row" in out


async def test_markup_in_a_backend_error_does_not_end_the_chat(tmp_path):
    """A server error quoting `[bold]` and `[/]`: notification and status line show it
    as text (before: textual.markup.MarkupError ended the app)."""
    message = f"The backend reported an error: bad [bold]thing[/] {ESC}]0;T\x07 [/x]."
    app = build_app(tmp_path, ScriptedStream("partial", error=BackendError(message, "[/]")))
    async with app.run_test() as pilot:
        app.chat.query_one(Prompt).post_message(Prompt.Submitted("hi"))
        await wait_until(pilot, lambda: app.chat.turns_finished == 1)
        await settle(app, pilot)
        assert app.is_running
        notes = [n.message for n in app._notifications]
        assert any("bad [bold]thing[/]" in n and ESC not in n for n in notes), notes
        status = app.chat.current.query_one(".status-line").render()
        assert "bad [bold]thing[/]" in str(status)


async def test_answers_loaded_from_history_are_cleaned(tmp_path):
    history = History(tmp_path / "h.sqlite3")
    cid = history.new_conversation("t")
    history.add_message(cid, "user", f"q{ESC}]0;T\x07")
    history.add_message(cid, "assistant", f"old{ESC}]52;c;QQ==\x07 answer")
    app = build_app(tmp_path, history=history, conversation_id=cid)
    async with app.run_test() as pilot:
        await settle(app, pilot)
        answer = app.chat._last_answer()
        assert answer.body == "old answer"          # what Ctrl+Y would copy
        assert app.chat.query("UserMessage").first().text == "q"


def test_the_backend_log_view_is_cleaned(tmp_path):
    """F5 shows the backend's own log: its escape sequences never reach the Log widget."""
    from k3tui.tui.screens.startup import tail
    log = tmp_path / "server.log"
    log.write_bytes(f"loading{ESC}]52;c;QQ==\x07 model\n{ESC}[2Jready\x9b6n\n".encode())
    assert tail(log) == ["loading model", "ready"]


def test_bidi_overrides_are_removed_and_rtl_text_is_kept():
    # "Trojan source": RLO ... PDI makes `rm -rf ~ # safe` display as something else
    tricky = "echo safe\u202e ~ fr- mr\u2066 # \u2069\u202c"
    assert clean(tricky) == "echo safe ~ fr- mr # "
    for ch in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069":
        assert clean(f"a{ch}b") == "ab"
    hebrew_arabic = "שלום עולם — مرحبا بالعالم"
    assert clean(hebrew_arabic) == hebrew_arabic
