"""`python -m engine synth OUT --tokenizer-only`: the test tokenizer added to a checkpoint
already written (the cached real-width slice predates it), its shards left untouched."""

from __future__ import annotations

import subprocess
import sys

from engine.checkpoint.synth import synthesize
from engine.text.tokenizer import Tokenizer


def synth(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "synth", *args],
                          capture_output=True, text=True, timeout=120)


def test_tokenizer_only_adds_the_checkpoints_vocabulary_and_keeps_the_shards(tmp_path):
    ckpt = synthesize(tmp_path / "ck", "tiny", overrides={"vocab_size": 1024 + 256})
    assert not (ckpt / "tiktoken.model").exists()  # tiny gets no tokenizer
    shards = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    # --size says slice, but the checkpoint's own config decides the vocabulary
    done = synth(str(ckpt), "--size", "slice", "--tokenizer-only")
    assert done.returncode == 0, done.stderr
    assert "not Kimi's vocabulary" in done.stdout
    assert Tokenizer.from_dir(ckpt).vocab_size == 1024 + 256
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.name in shards} == shards
    # a tokenizer already there is never overwritten
    before = (ckpt / "tiktoken.model").read_bytes()
    again = synth(str(ckpt), "--tokenizer-only")
    assert again.returncode == 2 and "already has tiktoken.model" in again.stderr
    assert "Traceback" not in again.stderr
    assert (ckpt / "tiktoken.model").read_bytes() == before


def test_tokenizer_only_refuses_a_damaged_config_in_one_sentence(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    done = synth(str(tmp_path), "--tokenizer-only")
    assert done.returncode == 2 and done.stderr.startswith("error: ")
    assert "Traceback" not in done.stderr and not (tmp_path / "tiktoken.model").exists()
