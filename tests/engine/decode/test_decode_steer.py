"""Demo steering: readable words, scripted think -> response -> end, deterministic per seed."""

from __future__ import annotations

import numpy as np

from engine.decode.steer import DemoSteer, Forced, end_of_answer, think_to_response
from engine.text.chat_template import ChatTemplate


def model_logits(tok, logits_seed: int, position: int) -> np.ndarray:
    """Stands in for the model's real logits at `position` (the same for every run)."""
    rng = np.random.default_rng((logits_seed, position))
    return rng.standard_normal(tok.vocab_size).astype(np.float32)


def run(tok, seed: int, logits_seed: int = 0, thinking: bool = True, given: list[int] = ()):
    """The steered answer; with `given`, the steer is primed on those first ids and the
    answer continues from them."""
    tpl = ChatTemplate(tok)
    parser, forced = tpl.parser(thinking=thinking), Forced()
    steer = DemoSteer(tok, parser, forced, seed=seed, think_tokens=20, answer_tokens=30)
    ids, reasoning, content = [], "", ""
    for i in given:
        steer(len(ids), model_logits(tok, logits_seed, len(ids)), given=i)
        ids.append(i)
        parser.feed(i)
    for _ in range(400):
        logits = steer(len(ids), model_logits(tok, logits_seed, len(ids)))
        assert np.count_nonzero(logits > -1e29) == 1  # exactly one choice left
        ids.append(int(np.argmax(logits)))
        d = parser.feed(ids[-1])
        reasoning, content = reasoning + d.reasoning, content + d.content
        if parser.done:
            break
    return ids, reasoning, content, parser


def sublist(small, big) -> int:
    return next(i for i in range(len(big)) if big[i : i + len(small)] == small)


def test_srv_steer_scripted_structure(test_tok):
    ids, reasoning, content, parser = run(test_tok, seed=1)
    assert parser.done and ids[-1] == test_tok.special("[EOS]")
    switch = sublist(think_to_response(test_tok), ids)
    assert 20 <= switch <= 20 + 14  # closes after the sentence that passes ~20 tokens
    assert ids[-len(end_of_answer(test_tok)):] == end_of_answer(test_tok)
    for text in (reasoning, content):
        assert text.endswith(".") and text[0].isupper()
        words = text.replace(".", " ").replace(",", " ").split()
        assert words and all(w.isalpha() for w in words)
    assert len(content.split()) >= 20


def test_srv_steer_deterministic_and_follows_logits(test_tok):
    a = run(test_tok, seed=5)[0]
    assert a == run(test_tok, seed=5)[0]
    assert a != run(test_tok, seed=6)[0]
    assert a != run(test_tok, seed=5, logits_seed=1)[0]  # the model's logits matter too


def test_srv_steer_without_thinking_answers_directly(test_tok):
    ids, reasoning, content, parser = run(test_tok, seed=2, thinking=False)
    assert reasoning == "" and content and parser.done
    assert test_tok.special("<|open|>") not in ids[: len(ids) - len(end_of_answer(test_tok))]


def test_srv_steer_continued_from_any_cut_is_the_uninterrupted_run(test_tok):
    """Primed on the first k ids of an answer, the steer writes the rest as it did: its
    choices depend on the seed, the position and the ids before it only (also when the
    cut falls inside the tags it forces)."""
    whole = run(test_tok, seed=3)[0]
    for k in range(1, len(whole)):
        assert run(test_tok, seed=3, given=whole[:k])[0] == whole, k
