"""Fixtures shared by the engine's tests: a learned test vocabulary and writable copies of
checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.text.bpe_train import write_test_tokenizer
from engine.text.tokenizer import Tokenizer

N_RANKS = 1792


@pytest.fixture(scope="session")
def vocab_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("srv_vocab")
    write_test_tokenizer(d, N_RANKS)
    return d


@pytest.fixture(scope="session")
def test_tok(vocab_dir) -> Tokenizer:
    return Tokenizer.from_dir(vocab_dir)


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
