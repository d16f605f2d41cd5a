"""The test vocabulary at Kimi-K3's real shapes (163,584 ranks + 256 specials, spec 1.6):
learned ranks, then generated merges. The server, template and detokeniser run at the
real vocabulary on it (issue 15)."""

from __future__ import annotations

import hashlib
import random

import tiktoken

from engine.text.tokenizer import SPLIT_PATTERN, derive_merges, read_ranks

REAL_RANKS = 163_584
TEXTS = [
    "The lighthouse keeper woke before the sun. Zürich, São Paulo, Ελληνικά, Русский язык.",
    "机器学习是人工智能的一个分支。こんにちは、世界。안녕하세요 😀👍🏽 e\u0301 ½ ² 3.14159",
    "def f(x):\n    return x**2  # square\n\tTabs  and   spaces \u00a0\u3000\r\n",
]


def test_real_vocab_has_the_real_shapes(real_tok):
    assert (real_tok.vocab_size, real_tok.n_ranks) == (163_840, REAL_RANKS)
    assert (real_tok.bos_id, real_tok.eos_id, real_tok.pad_id) == (163584, 163585, 163839)
    named = ["<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "<|media_pad|>"]
    assert [real_tok.special(n) for n in named] == [163586, 163587, 163588, 163589, 163605]
    assert real_tok.decode([163600]) == "<|reserved_token_163600|>"


def test_real_vocab_every_rank_is_reachable_and_deterministic(real_vocab_dir):
    ranks = read_ranks(real_vocab_dir / "tiktoken.model")
    assert len(ranks) == REAL_RANKS
    # one merge per multi-byte rank: HF's merge list builds every token
    assert len(derive_merges(ranks)) == REAL_RANKS - 256
    # the same bytes on every run and machine (seeded growth, no hash order)
    digest = hashlib.sha256((real_vocab_dir / "tiktoken.model").read_bytes()).hexdigest()
    assert digest == REAL_DIGEST


def test_real_vocab_round_trips_and_matches_tiktoken(real_tok, real_vocab_dir):
    ranks = read_ranks(real_vocab_dir / "tiktoken.model")
    oracle = tiktoken.Encoding(
        "k3-real-test", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    grown = [t.decode() for t, r in ranks.items() if r >= REAL_RANKS - 20_000]
    rng = random.Random(7)
    texts = TEXTS + ["".join(rng.choice(grown) for _ in range(40)) for _ in range(50)]
    for text in texts:
        ids = real_tok.encode(text)
        assert ids == oracle.encode_ordinary(text), repr(text)
        assert real_tok.decode(ids) == text
        sd = real_tok.stream_decoder()
        assert "".join(sd.add(i) for i in ids) + sd.flush() == text
    # the generated words are what text of them encodes to: whole tokens, not bytes
    assert max(max(real_tok.encode(t)) for t in texts[3:]) >= REAL_RANKS - 20_000


REAL_DIGEST = "742b7e2981835e8cffebbc025c4915e43da7720890e45df6cb3cf871f203f5df"
