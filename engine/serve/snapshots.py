"""The server's kept conversation states: prefix reuse between chat turns.

Every chat request carries the whole conversation, so the next turn's prompt ids start
with the ids of the previous prompt and reply. The worker keeps the model state right
after each prompt and right after each reply (ids as generated, not re-tokenised text);
a new request resumes from the longest kept state whose ids are a prefix of its prompt and
prefills only the rest. Least recently used states go first when the budget is full.

A client sends earlier replies back as text, and encoding that text again may split it
into other ids than the model generated; so the store also remembers each reply's ids by
the shape of its text, and the template renders a history turn that matches as those ids.

States and replies belong to their owner, the API key of the request that made them (by
`owner_of`, a digest: the key itself is never kept): a request only ever resumes its own
key's states, so another key's prompt is as cold as on a fresh server (cache_n 0, the
same answer) and a guess at it learns nothing. The budget is shared: one key's states can
push another's out, which says that the other key is busy, not what it sent.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from engine.model.state import ModelState
from engine.text.chat_template import ReplyKey

MAX_REPLIES = 64  # generated replies remembered by their text (a few kB each)
OWNER_DOMAIN = b"k3-engine kept-state owner\0"


def owner_of(api_key: str | None) -> str:
    """The owner of what a request with `api_key` keeps: "" without a key (one user), else
    a digest of the key, stable across restarts so kept states on disk can stay owned."""
    if not api_key:
        return ""
    return hashlib.sha256(OWNER_DOMAIN + api_key.encode()).hexdigest()


class SnapshotStore:
    def __init__(self, budget_bytes: int):
        self.budget = max(0, int(budget_bytes))
        # (owner, ids) -> state, least recently used first, all owners in one order
        self._kept: OrderedDict[tuple[str, tuple[int, ...]], ModelState] = OrderedDict()
        self._lock = threading.Lock()
        self._replies: OrderedDict[tuple[str, ReplyKey], tuple[int, ...]] = OrderedDict()

    def remember_reply(self, key: ReplyKey, ids: tuple[int, ...], *, owner: str = "") -> None:
        if not ids:
            return
        with self._lock:
            self._replies.pop((owner, key), None)
            self._replies[(owner, key)] = ids
            while len(self._replies) > MAX_REPLIES:
                self._replies.popitem(last=False)

    def replies(self, *, owner: str = "") -> dict[ReplyKey, tuple[int, ...]]:
        """The replies `owner`'s requests generated, by the shape of their text."""
        with self._lock:
            return {key: ids for (who, key), ids in self._replies.items() if who == owner}

    @property
    def used_bytes(self) -> int:
        return sum(s.nbytes() for s in self._kept.values())

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, state: ModelState, *, owner: str = "") -> bool:
        """Keep `state` for `owner` (the store owns it from now on); evict the least
        recently used ones to make room. False when it alone is larger than the budget."""
        size = state.nbytes()
        if not state.ids or size > self.budget:
            return False
        key = (owner, tuple(state.ids))
        with self._lock:
            self._kept.pop(key, None)
            self._kept[key] = state
            while self.used_bytes > self.budget:
                self._kept.popitem(last=False)
        return True

    def take(self, prompt_ids: list[int], *, owner: str = "") -> ModelState | None:
        """A copy of `owner`'s kept state covering the longest prefix of `prompt_ids` (all
        of them only if it kept the logits to sample from), marked recently used; the kept
        one is never handed out, so whatever the caller does to the copy leaves it intact."""
        best: tuple[str, tuple[int, ...]] | None = None
        with self._lock:
            for key, state in self._kept.items():
                who, ids = key
                n = len(ids)
                fits = n < len(prompt_ids) or (n == len(prompt_ids) and state.logits is not None)
                if (who == owner and fits and (best is None or n > len(best[1]))
                        and list(ids) == prompt_ids[:n]):
                    best = key
            if best is None:
                return None
            self._kept.move_to_end(best)
            return self._kept[best].snapshot()
