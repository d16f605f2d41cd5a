"""The chat's core without a terminal: turns, their queue, and the runner that answers them.

Every answer is a turn in the history store (`store`), queued per backend and answered by
a detached runner process (`runner`), so it outlives the terminal, the chat and the SSH
session that sent it. No Textual here: the TUI and the shell commands read and command it.
"""
