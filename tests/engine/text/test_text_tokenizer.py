"""Tokenizer: the test vocabulary's format, and parity with tiktoken as an independent oracle."""

from __future__ import annotations

import base64
import json
import random

import pytest
import tiktoken

from engine.text.bpe_train import write_test_tokenizer
from engine.text.tokenizer import SPLIT_PATTERN, Tokenizer, read_ranks

N_RANKS = 1792


@pytest.fixture
def tok(test_tok) -> Tokenizer:
    return test_tok  # the session's test vocabulary (tests/engine/conftest.py)


@pytest.fixture(scope="module")
def oracle(vocab_dir):
    ranks = read_ranks(vocab_dir / "tiktoken.model")
    return tiktoken.Encoding(
        "k3-test", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )


def test_srv_files_have_exact_ranks_and_specials_in_kimi_order(vocab_dir):
    lines = (vocab_dir / "tiktoken.model").read_text().splitlines()
    assert len(lines) == N_RANKS
    ranks = [int(line.split()[1]) for line in lines]
    assert ranks == list(range(N_RANKS))
    toks = [base64.b64decode(line.split()[0]) for line in lines]
    assert toks[:256] == [bytes([b]) for b in range(256)]
    assert len(set(toks)) == N_RANKS
    assert b" the" in toks and b" and" in toks  # word-level merges exist
    added = json.loads((vocab_dir / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert sorted(int(k) for k in added) == list(range(N_RANKS, N_RANKS + 256))
    names = [added[str(N_RANKS + i)]["content"] for i in range(6)]
    assert names == ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"]
    assert added[str(N_RANKS + 255)]["content"] == "[PAD]"


def test_srv_write_is_deterministic(tmp_path, vocab_dir):
    write_test_tokenizer(tmp_path, N_RANKS)
    assert (tmp_path / "tiktoken.model").read_bytes() == (vocab_dir / "tiktoken.model").read_bytes()


def test_srv_too_many_ranks_is_refused(tmp_path):
    with pytest.raises(ValueError, match="256 to 262144 ranks"):
        write_test_tokenizer(tmp_path, 1_000_000)


PARITY_CASES = {
    "ascii": "The quick brown fox jumps over the lazy dog. Hello, World! a+b=c; x_1 = f(y) # ok",
    "han": "机器学习是人工智能的一个分支。今天天气很好abc漢字テスト中文English混合",
    "kana_hangul": "こんにちは、世界。カタカナ ひらがな 안녕하세요 세계",
    "emoji": "😀😃 🎉👍🏽 👨‍👩‍👧 family ❤️✨ rocket🚀launch",
    "numbers": "0 12 123 1234 12345 3.14159 2026-11-29 $1,000,000 ١٢٣ ½ ²",
    "contractions": "It's I'M we'll they'd you've she's CAN'T Don't o'clock 'tis 're",
    "newlines": "line one\nline two\r\nline three\r\rfour\n\n\nfive \n \n\t\nsix",
    "whitespace": "   leading    inner\t\ttabs   \u00a0nbsp  \u3000ideographic    trailing   ",
    "accents": "Café naïve résumé Zürich Ελληνικά Русский ÉCOLE ǅungla e\u0301",
    "specials_as_text": "<|open|>message<|sep|> [BOS] <|end_of_msg|> [EOS]",
    "code": "def f(x):\n    return x**2  # square\n\nfor i in range(10):\n\tprint(i)\n",
}


@pytest.mark.parametrize("name", sorted(PARITY_CASES))
def test_srv_parity_with_tiktoken(tok, oracle, name):
    text = PARITY_CASES[name]
    ids = tok.encode(text)
    assert ids == oracle.encode(text)
    assert tok.decode(ids) == text


def test_srv_parity_random_strings(tok, oracle):
    rng = random.Random(1234)
    pools = [
        lambda: rng.randrange(32, 127),
        lambda: rng.randrange(0x4E00, 0x9FFF),
        lambda: rng.randrange(0x1F300, 0x1FAFF),
        lambda: rng.choice([9, 10, 13, 32, 0xA0, 0x3000]),
        lambda: rng.randrange(0x300, 0x370),  # combining marks
        lambda: rng.randrange(0xAC00, 0xD7A3),
        lambda: rng.randrange(0x80, 0x2FFF),
    ]
    for _ in range(400):
        text = "".join(chr(rng.choice(pools)()) for _ in range(rng.randrange(1, 120)))
        assert tok.encode(text) == oracle.encode(text), repr(text)
    for _ in range(300):  # random bytes, decoded leniently into text
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80)))
        text = raw.decode("utf-8", errors="replace")
        assert tok.encode(text) == oracle.encode(text), repr(text)


def test_srv_parity_training_text(tok, oracle):
    from engine.text.bpe_train import TRAINING_TEXT

    assert tok.encode(TRAINING_TEXT) == oracle.encode(TRAINING_TEXT)


def test_srv_special_strings_never_become_special_ids(tok):
    text = "<|open|>message<|sep|>[EOS]<|end_of_msg|>"
    ids = tok.encode(text)
    assert all(i < tok.n_ranks for i in ids)
    assert tok.special("<|open|>") == N_RANKS + 3
    assert tok.special("<|end_of_msg|>") == N_RANKS + 2
    assert tok.eos_id == N_RANKS + 1 and tok.bos_id == N_RANKS
    assert tok.decode([tok.special("<|open|>")]) == "<|open|>"
    assert tok.decode([tok.special("<|open|>"), 72], skip_special=True) == "H"


def test_srv_stream_decoder_never_emits_half_a_character(tok):
    text = "añ 你好 😀👍🏽 ok"
    data = text.encode()
    # byte-level ids: the worst case, every multi-byte character split across tokens
    sd = tok.stream_decoder()
    pieces = [sd.add(b) for b in data] + [sd.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[data.index("你".encode())] == ""  # first byte of 你 alone: nothing yet
    # real ids: concatenation of the pieces equals decode()
    ids = tok.encode(text * 3)
    sd = tok.stream_decoder()
    assert "".join(sd.add(i) for i in ids) + sd.flush() == tok.decode(ids)


def test_srv_stream_decoder_escapes_invalid_bytes_and_controls(tok):
    sd = tok.stream_decoder()
    pieces = [sd.add(0xFF), sd.add(ord("a")), sd.add(0xE4), sd.add(0xBD)]
    assert pieces == ["\\xff", "a", "", ""]  # 0xE4 0xBD may still become 你: held
    assert sd.flush() == "\\xe4\\xbd"  # it never did: the tail is escaped at the end
    sd = tok.stream_decoder()
    out = "".join(sd.add(b) for b in b"a\x07b\x1b[2Jc\td\n\r\xc2\x9b") + sd.flush()
    assert out == "a\\x07b\\x1b[2Jc\td\n\r\\x9b"  # BEL, ESC and C1 CSI escaped


def test_srv_split_pattern_read_from_tokenization_kimi(tmp_path, vocab_dir):
    from engine.text.tokenizer import split_pattern_from_dir

    (tmp_path / "tokenization_kimi.py").write_text(
        'class T:\n    pat_str = "|".join([r"""[a-z]+""", r"""\\s+""", r"""."""])\n'
    )
    assert split_pattern_from_dir(tmp_path) == r"[a-z]+|\s+|."
    assert split_pattern_from_dir(vocab_dir) == SPLIT_PATTERN


def test_srv_missing_files_are_one_clear_sentence(tmp_path):
    from engine.errors import CheckpointError

    with pytest.raises(CheckpointError, match="tiktoken.model is missing"):
        Tokenizer.from_dir(tmp_path)
