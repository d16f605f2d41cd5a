"""`python -m engine bench chat --restart` in its quick form: real servers (one restarted
before each turn with its states on disk, one kept running, one cold) and an answer
killed with SIGKILL halfway and continued. Structure and ids only, never timings."""

from __future__ import annotations

import argparse
import json

from engine.bench import chat as bench_chat
from engine.checkpoint.synth import synthesize


def test_bench_chat_restart_resumes_from_disk_with_the_cold_ids(tmp_path, capsys):
    ckpt = synthesize(tmp_path / "m", "small", seed=0)
    parser = argparse.ArgumentParser()
    bench_chat.add_arguments(parser)
    args = parser.parse_args(["--restart", "--json", "--checkpoint", str(ckpt),
                              "--reply-tokens", "8", "--checkpoint-every", "3"])
    assert bench_chat.main(args) == 0
    res = json.loads(capsys.readouterr().out)

    turns = res["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3, 4]
    for t in turns:
        rst, mem, cold = t["restarted"], t["in-memory"], t["cold"]
        assert t["same_ids"] and rst["ids"] == mem["ids"] == cold["ids"] and len(rst["ids"]) > 0
        assert cold["prefilled"] == t["prompt_tokens"] and cold["reused"] == 0
        assert rst["prefilled"] + rst["reused"] == t["prompt_tokens"]
        if t["turn"] == 1:
            assert rst["reused"] == mem["reused"] == 0
        else:  # the restarted server resumed from the folder what the running one kept
            assert 0 < rst["prefilled"] == mem["prefilled"] < t["prompt_tokens"]
        assert set(t) >= {"ratio_restarted", "ratio_in_memory", "restart_s"}
        assert all(s["gb_read"] > 0 for s in (rst, mem, cold))  # streaming under a budget
    assert [t["prompt_tokens"] for t in turns] == sorted(t["prompt_tokens"] for t in turns)

    killed = res["killed"]
    k, every = killed["killed_after"], killed["checkpoint_every"]
    assert killed["tokens"] == 16 and 8 <= k < 16 and every == 3
    assert killed["same_ids"]
    # the continuation prefilled only the ids after the last mid-answer checkpoint
    assert killed["prefilled"] == k - (k - 1) // every * every
    assert killed["reused"] == killed["prompt_tokens"] - killed["prefilled"]
    assert len(res["loadavg_before"]) == 3
