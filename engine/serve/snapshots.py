"""The server's kept conversation states: prefix reuse between chat turns.

Every chat request carries the whole conversation, so the next turn's prompt ids start
with the ids of the previous prompt and reply. The worker keeps the model state right
after each prompt, right after each reply (the ids as generated), and at the end of the
last earlier reply in a prompt (the ids its text renders to); a new request resumes from
the longest kept state whose ids are a prefix of its prompt and prefills only the rest.
Least recently used states go first when the budget is full.

What is kept only makes an answer faster, never different: the prompt is rendered from
the request alone. A reply whose text does not encode back to the ids the model generated
(a `\\xNN` escape of bytes that formed no character, a split BPE would not make) misses
its generated end state; the next turn resumes after the prompt before it and prefills the
reply once, and the state kept at its rendered end serves every turn after.

States belong to their owner, the API key of the request that made them (by
`owner_of`, a digest: the key itself is never kept): a request only ever resumes its own
key's states, so another key's prompt is as cold as on a fresh server (cache_n 0, the
same answer) and a guess at it learns nothing. The budget is shared: one key's states can
push another's out, which says that the other key is busy, not what it sent.

With a state folder (engine/serve/durable.py) every kept state is also written to disk
before the answer that made it goes on, and a request resumes from disk when the folder
holds a longer prefix than memory: a restarted server resumes where the last one stopped.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from engine.model.state import ModelState
from engine.serve.durable import StateDir

OWNER_DOMAIN = b"k3-engine kept-state owner\0"


def owner_of(api_key: str | None) -> str:
    """The owner of what a request with `api_key` keeps: "" without a key (one user), else
    a digest of the key, stable across restarts so kept states on disk can stay owned."""
    if not api_key:
        return ""
    return hashlib.sha256(OWNER_DOMAIN + api_key.encode()).hexdigest()


class SnapshotStore:
    def __init__(self, budget_bytes: int, disk: StateDir | None = None):
        self.budget = max(0, int(budget_bytes))
        self.disk = disk
        # (owner, ids) -> state, least recently used first, all owners in one order
        self._kept: OrderedDict[tuple[str, tuple[int, ...]], ModelState] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return sum(s.nbytes() for s in self._kept.values())

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, state: ModelState, *, owner: str = "") -> bool:
        """Keep `state` for `owner` (the store owns it from now on), in memory when it fits
        the budget (the least recently used go to make room) and in the state folder.
        False when it was kept nowhere."""
        if not state.ids:
            return False
        key = (owner, tuple(state.ids))
        kept = self._remember(key, state)
        if self.disk is not None:
            if self.disk.has(*key):
                self.disk.touch(*key)
                kept = True
            else:
                kept = self.disk.save(state, owner) or kept
        return kept

    def _remember(self, key: tuple[str, tuple[int, ...]], state: ModelState) -> bool:
        if state.nbytes() > self.budget:
            return False
        with self._lock:
            self._kept.pop(key, None)
            self._kept[key] = state
            while self.used_bytes > self.budget:
                self._kept.popitem(last=False)
        return True

    def drop(self, ids: list[int], *, owner: str = "") -> None:
        """Forget `owner`'s state for exactly `ids` (a superseded mid-answer checkpoint)."""
        key = (owner, tuple(ids))
        with self._lock:
            self._kept.pop(key, None)
        if self.disk is not None:
            self.disk.drop(*key)

    def take(self, prompt_ids: list[int], *, owner: str = "") -> ModelState | None:
        """A copy of `owner`'s kept state covering the longest prefix of `prompt_ids` (all
        of them only if it kept the logits to sample from), marked recently used; the kept
        one is never handed out, so whatever the caller does to the copy leaves it intact.
        From the state folder when it holds a longer one than memory (checked as read; a
        refused file falls back to what memory has)."""
        best: tuple[str, tuple[int, ...]] | None = None
        with self._lock:
            for key, state in self._kept.items():
                who, ids = key
                n = len(ids)
                fits = n < len(prompt_ids) or (n == len(prompt_ids) and state.logits is not None)
                if (who == owner and fits and (best is None or n > len(best[1]))
                        and list(ids) == prompt_ids[:n]):
                    best = key
            if best is not None:
                self._kept.move_to_end(best)
                found = self._kept[best].snapshot()
        if self.disk is not None:
            on_disk = self.disk.best(prompt_ids, owner, len(best[1]) if best else 0)
            loaded = self.disk.load(owner, on_disk) if on_disk is not None else None
            if on_disk is not None and loaded is not None:
                # kept in memory too when it fits, handed out as a copy
                return loaded.snapshot() if self._remember((owner, on_disk), loaded) else loaded
        return found if best is not None else None
