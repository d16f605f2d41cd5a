"""Tokenizer: the test vocabulary's format, and parity with tiktoken as an independent oracle."""

from __future__ import annotations

import base64
import json
import random

import pytest
import tiktoken

from engine.tokenizer import SPLIT_PATTERN, Tokenizer, read_ranks, write_test_tokenizer

N_RANKS = 1792


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("vocab")
    write_test_tokenizer(d, N_RANKS)
    return d


@pytest.fixture(scope="module")
def tok(vocab_dir) -> Tokenizer:
    return Tokenizer.from_dir(vocab_dir)


@pytest.fixture(scope="module")
def oracle(vocab_dir):
    ranks = read_ranks(vocab_dir / "tiktoken.model")
    return tiktoken.Encoding("k3-test", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={})


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
    with pytest.raises(ValueError, match="supports only"):
        write_test_tokenizer(tmp_path, 1_000_000)
