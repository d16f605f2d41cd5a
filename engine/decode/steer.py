"""Logits hooks: forced tokens (reasoning budget, channel tags) and the demo steering.

A hook is called by `engine.generate.generate` before each token is sampled, with the ids
generated so far and the real logits of the forward pass; it returns the logits to sample
from. Forcing a token = returning logits where only that id is possible.

`DemoSteer` is for `--steer-demo` (a random-weight model): it keeps the real forward pass
but restricts each choice to readable words of the test vocabulary (the model's logits
still rank them), and scripts the XTML channel structure: a thinking paragraph of about
`think_tokens`, the tags that open the response channel, an answer of about
`answer_tokens`, then the closing tags and the end id. Its choices depend only on the
seed, the position in the answer and the ids before it (every draw is keyed by the seed
and the position), so an answer continued from its first k ids, with the steer primed on
them (`given`), goes on as the uninterrupted run did.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from engine.text.bpe_train import TRAINING_TEXT
from engine.text.chat_template import CLOSE, EOS, OPEN, SEP, OutputParser
from engine.text.tokenizer import Tokenizer

DEMO_NOTICE = "demo model — random weights, not Kimi-K3"
NEG = -1e30

LogitsHook = Callable[[Sequence[int], np.ndarray], np.ndarray]


def only(token_id: int, logits: np.ndarray) -> np.ndarray:
    """Logits that make `token_id` the only possible choice."""
    out = np.full(logits.shape, NEG, dtype=np.float32)
    out[token_id] = 0.0
    return out


def tag_ids(tok: Tokenizer, kind: str, name: str) -> list[int]:
    """`<|open|>name<|sep|>` or `<|close|>name<|sep|>` as ids."""
    return [tok.special(kind), *tok.encode(name), tok.special(SEP)]


def think_to_response(tok: Tokenizer) -> list[int]:
    return tag_ids(tok, CLOSE, "think") + tag_ids(tok, OPEN, "response")


def end_of_answer(tok: Tokenizer) -> list[int]:
    end = tok.special(EOS) if EOS in tok.specials else tok.special("<|end_of_msg|>")
    return tag_ids(tok, CLOSE, "response") + tag_ids(tok, CLOSE, "message") + [end]


class Forced:
    """A queue of ids to force, one per step, ahead of any other steering."""

    def __init__(self) -> None:
        self.queue: deque[int] = deque()

    def push(self, ids: Sequence[int]) -> None:
        self.queue.extend(ids)

    def take(self, logits: np.ndarray) -> np.ndarray | None:
        return only(self.queue.popleft(), logits) if self.queue else None


_LOWER = re.compile(rb"^ [a-z]{2,}$|^ a$")
_CAP = re.compile(rb"^[A-Z][a-z]+$")
_CAP_SPACE = re.compile(rb"^ [A-Z][a-z]+$")


class DemoSteer:
    """Readable words in a scripted think → response structure (see module doc)."""

    def __init__(self, tok: Tokenizer, parser: OutputParser, forced: Forced, *, seed: int = 0,
                 think_tokens: int = 24, answer_tokens: int = 40) -> None:
        self.tok, self.parser, self.forced = tok, parser, forced
        self.think_tokens, self.answer_tokens = think_tokens, answer_tokens
        self.seed = int(seed)
        classes: dict[str, list[int]] = {"lower": [], "cap": [], "cap_space": []}
        for i in range(tok.n_ranks):
            b = tok.id_to_bytes(i)
            for name, pat in (("lower", _LOWER), ("cap", _CAP), ("cap_space", _CAP_SPACE)):
                if pat.match(b):
                    classes[name].append(i)
        # Prefer tokens that are whole English words (not fragments such as " gre").
        known = {w.lower() for w in re.findall(r"[A-Za-z]+", TRAINING_TEXT)}
        for name, ids in classes.items():
            whole = [i for i in ids if tok.id_to_bytes(i).strip().decode().lower() in known]
            if len(whole) >= 20:
                classes[name] = whole
        if not classes["lower"] or not (classes["cap"] or classes["cap_space"]):
            raise ValueError("this vocabulary has no whole-word tokens to steer a demo with")
        self.words = {k: np.array(v or classes["cap_space"]) for k, v in classes.items()}
        self.period, self.comma = tok.encode(".")[0], tok.encode(",")[0]
        self.channel_tokens = 0
        self._channel = ""
        self._sentence_words = 0
        self._sentence_len = 0
        self._recent: deque[int] = deque(maxlen=6)

    def _draw(self, position: int, what: int) -> np.random.Generator:
        """The generator of draw `what` at `position` of the answer: never shared, so a
        continuation draws what the uninterrupted run drew there."""
        return np.random.default_rng((self.seed, int(position), what))

    def _new_length(self, position: int) -> int:
        return int(self._draw(position, 0).integers(5, 13))

    def __call__(self, position: int, logits: np.ndarray, given: int | None = None
                 ) -> np.ndarray:
        """The logits to sample the id at `position` of the answer from. `given`: prime
        the steer with the id the answer already has there (a continuation)."""
        forced = self.forced.take(logits)
        if forced is not None:
            return forced
        channel = self.parser.channel
        if channel != self._channel:
            self._channel, self.channel_tokens = channel, 0
            self._sentence_words, self._sentence_len = 0, self._new_length(position)
        if channel not in ("think", "response"):
            self.forced.push(tag_ids(self.tok, OPEN, "response"))
            return self.forced.take(logits)
        self.channel_tokens += 1
        limit = self.think_tokens if channel == "think" else self.answer_tokens
        if self._sentence_words >= self._sentence_len:
            self._sentence_words, self._sentence_len = 0, self._new_length(position)
            if self.channel_tokens >= limit:  # close the channel after a whole sentence
                end = think_to_response if channel == "think" else end_of_answer
                self.forced.push(end(self.tok))
            return only(self.period, logits)
        if (
            self._sentence_words == self._sentence_len // 2
            and self._draw(position, 1).random() < 0.25
            and self._sentence_words
        ):
            self._sentence_len += 1
            self._sentence_words += 1
            return only(self.comma, logits)
        if self._sentence_words == 0:
            pool = self.words["cap"] if self.channel_tokens == 1 else self.words["cap_space"]
        else:
            pool = self.words["lower"]
        choice = given if given is not None else self._pick(pool, logits, position)
        self._sentence_words += 1
        self._recent.append(choice)
        return only(choice, logits)

    def _pick(self, pool: np.ndarray, logits: np.ndarray, position: int) -> int:
        """The model's logits rank the allowed words; seeded Gumbel noise adds variety
        a random-weight model lacks; recent words are skipped."""
        scores = logits[pool].astype(np.float64)
        spread = scores.std() or 1.0
        scores = (scores - scores.mean()) / spread + self._draw(position, 2).gumbel(size=len(pool))
        for i in np.argsort(-scores):
            if int(pool[i]) not in self._recent:
                return int(pool[i])
        return int(pool[int(np.argmax(scores))])
