"""The server's kept conversation states: prefix reuse between chat turns.

Every chat request carries the whole conversation, so the next turn's prompt ids start
with the ids of the previous prompt and reply. The worker keeps the model state right
after each prompt and right after each reply (ids as generated, not re-tokenised text);
a new request resumes from the longest kept state whose ids are a prefix of its prompt and
prefills only the rest. Least recently used states go first when the budget is full.

A client sends earlier replies back as text, and encoding that text again may split it
into other ids than the model generated; so the store also remembers each reply's ids by
the shape of its text, and the template renders a history turn that matches as those ids.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from engine.model.state import ModelState
from engine.text.chat_template import ReplyKey

MAX_REPLIES = 64  # generated replies remembered by their text (a few kB each)


class SnapshotStore:
    def __init__(self, budget_bytes: int):
        self.budget = max(0, int(budget_bytes))
        self._kept: OrderedDict[tuple[int, ...], ModelState] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self._replies: OrderedDict[ReplyKey, tuple[int, ...]] = OrderedDict()

    def remember_reply(self, key: ReplyKey, ids: tuple[int, ...]) -> None:
        if not ids:
            return
        with self._lock:
            self._replies.pop(key, None)
            self._replies[key] = ids
            while len(self._replies) > MAX_REPLIES:
                self._replies.popitem(last=False)

    def replies(self) -> dict[ReplyKey, tuple[int, ...]]:
        with self._lock:
            return dict(self._replies)

    @property
    def used_bytes(self) -> int:
        return sum(s.nbytes() for s in self._kept.values())

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, state: ModelState) -> bool:
        """Keep `state` (the store owns it from now on); evict the least recently used
        ones to make room. False when it alone is larger than the budget."""
        size = state.nbytes()
        if not state.ids or size > self.budget:
            return False
        key = tuple(state.ids)
        with self._lock:
            self._kept.pop(key, None)
            self._kept[key] = state
            while self.used_bytes > self.budget:
                self._kept.popitem(last=False)
        return True

    def take(self, prompt_ids: list[int]) -> ModelState | None:
        """A copy of the kept state covering the longest prefix of `prompt_ids` (all of
        them only if it kept the logits to sample from), marked recently used; the kept
        one is never handed out, so whatever the caller does to the copy leaves it intact."""
        best: tuple[int, ...] | None = None
        with self._lock:
            for key, state in self._kept.items():
                n = len(key)
                fits = n < len(prompt_ids) or (n == len(prompt_ids) and state.logits is not None)
                if fits and (best is None or n > len(best)) and list(key) == prompt_ids[:n]:
                    best = key
            if best is None:
                return None
            self._kept.move_to_end(best)
            return self._kept[best].snapshot()
