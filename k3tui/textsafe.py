"""Text from outside (a model, a server, a log) made safe to put on a terminal.

A model or any OpenAI-compatible server can write escape sequences: OSC 52 sets the
clipboard, OSC 0 the window title, OSC 8 hides a link, CSI 6n makes the terminal type its
answer into our stdin, CSI 2J clears the screen. `clean` removes every escape sequence
(7-bit and 8-bit forms), every other C0/C1 control character and the bidi overrides;
newline and tab stay.
Markup is the UI's job: show the result with markup off (or as a `rich.text.Text`).
No UI imports here.
"""

from __future__ import annotations

import re

# ESC or its 8-bit C1 twin introduces each form; strings run to ST (ESC \ or 0x9c) or BEL.
_SEQUENCE = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"                      # CSI ... final byte
    r"|(?:\x1b[]P^_X]|[\x90\x98\x9d\x9e\x9f])"               # OSC DCS PM APC SOS ...
    r"[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"                  # ... up to BEL or ST
    r"|\x1b[ -/]*[0-~]"                                      # two-byte escapes (ESC c, ESC 7)
)
# What is left of an unterminated or cut sequence, any other control character, and the
# bidi embeddings, overrides and isolates, which make a line display in another order than
# it reads (code or a command that is not what it looks like); right-to-left text keeps
# its direction without them.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def clean(text: str) -> str:
    """`text` without escape sequences or control characters, newline and tab kept.

    CRLF becomes LF; a lone CR (which would let text overwrite its own line) is dropped.
    """
    if not text:
        return text
    text = text.replace("\r\n", "\n")
    return _CONTROL.sub("", _SEQUENCE.sub("", text))
