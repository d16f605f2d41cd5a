"""Fixtures shared by the engine's tests: a learned test vocabulary and writable copies of
checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.text.bpe_train import write_test_tokenizer
from engine.text.tokenizer import Tokenizer

N_RANKS = 1792
REAL_RANKS = 163_584  # Kimi-K3's: specials at 163,584..163,839 (spec 1.6)


@pytest.fixture(scope="session")
def vocab_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("srv_vocab")
    write_test_tokenizer(d, N_RANKS)
    return d


@pytest.fixture(scope="session")
def test_tok(vocab_dir) -> Tokenizer:
    return Tokenizer.from_dir(vocab_dir)


@pytest.fixture(scope="session")
def real_vocab_dir(tmp_path_factory) -> Path:
    """A test vocabulary with the real shapes (built once per session: ~3 s)."""
    d = tmp_path_factory.mktemp("real_vocab")
    write_test_tokenizer(d, REAL_RANKS)
    return d


@pytest.fixture(scope="session")
def real_tok(real_vocab_dir) -> Tokenizer:
    return Tokenizer.from_dir(real_vocab_dir)


@pytest.fixture
def copy_checkpoint():
    """copy_checkpoint(src, dst): a writable copy of a checkpoint folder."""

    def copy_checkpoint(src: Path, dst: Path) -> Path:
        """A writable copy of a checkpoint folder."""
        shutil.copytree(src, dst)
        for f in dst.iterdir():
            f.chmod(0o644)
        return dst

    return copy_checkpoint
