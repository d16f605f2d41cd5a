"""The one error type users see: a sentence saying what is wrong and the next step."""

from __future__ import annotations


class K3Error(Exception):
    """A failure explained to the user. `exit_code` 1 = failed, 2 = usage / refused."""

    def __init__(self, message: str, next_step: str = "", exit_code: int = 1):
        super().__init__(message)
        self.message = message
        self.next_step = next_step
        self.exit_code = exit_code

    def __str__(self) -> str:
        return f"{self.message}\n  next: {self.next_step}" if self.next_step else self.message
