"""`bench stream --peer`: the C peer beside the engine.

The peer (kimi-k3-in-c v1.0.0) cannot ship with the tests, so they use a stand-in that
speaks its documented CLI (spec §2.9): the same flags, exit codes, step table and --out
JSON, decoding with `python -m engine run` underneath so its ids are real. Its step 0 is
reported 5 s slow and counted in seconds_per_token, as the real peer counts its prompt step.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from engine.bench.peer import PeerError, compare, parse_steps, render
from engine.checkpoint.synth import synthesize
from engine.checkpoint.trunk import pack
from engine.kernels import compute_threads
from engine.weights.planner import gb_arg, make_plan
from k3vocab import GB
from engine.weights.streaming import CheckpointMap

REPO = str(Path(__file__).resolve().parents[3])
STEP0_EXTRA_S = 5.0

STANDIN = '''#!{python}
"""A stand-in for kimi-k3-in-c v1.0.0's `k3 <model_dir> [options]`."""
import json, os, subprocess, sys, time
mode, log = os.environ.get("STANDIN_MODE", "ok"), os.environ.get("STANDIN_LOG")
args = sys.argv[1:]
model, opts, flags = args.pop(0), {{}}, []
while args:
    a = args.pop(0)
    if a == "--incremental":
        flags.append(a)
    elif a in ("--ids", "--gen", "--trunk", "--trunk-gb", "--cache-gb", "--out") and args:
        opts[a] = args.pop(0)
    else:
        print("unknown option " + a, file=sys.stderr)
        sys.exit(2)
if log:
    with open(log, "a") as f:
        f.write(json.dumps({{"argv": sys.argv[1:], "omp": os.environ.get("OMP_NUM_THREADS")}})
                + "\\n")
if mode == "hang":
    time.sleep(3600)
if mode == "exit":
    print("k3_cache: budget 0.00 GB gives 4 slots, but top-4 needs at least 5.",
          file=sys.stderr)
    sys.exit(1)
run = subprocess.run([sys.executable, "-m", "engine", "run", model, "--ids", opts["--ids"],
                      "--gen", opts.get("--gen", "8"), "--trunk", opts["--trunk"],
                      "--trunk-gb", opts["--trunk-gb"], "--cache-gb", opts["--cache-gb"],
                      "--stop", "-1", "--json"], capture_output=True, text=True)
if run.returncode:
    print(run.stderr, file=sys.stderr)
    sys.exit(1)
r = json.loads(run.stdout.splitlines()[-1])
gen, secs = r["generated_ids"], list(r["seconds_per_token"])
secs[0] += {step0}  # the prompt's step: slow, and inside seconds_per_token
if mode == "wrong-ids":
    gen = gen[:-1] + [gen[-1] + 1]
print("STEP   TOKEN      SECONDS      CACHE HIT  READ GB    TOK/S")
print("-" * 68)
for i, (t, s) in enumerate(zip(gen, secs)):
    print("%-6d %-10d %-12.2f %-10.1f %-10.2f %.3f" % (i, t, s, 100.0, 0.0, 1 / s))
print("-" * 68)
if mode == "no-out":
    sys.exit(0)
prompt = [int(x) for x in opts["--ids"].split(",")]
with open(os.path.join(model, "config.json")) as f:
    layers = json.load(f)["text_config"]["num_hidden_layers"]
with open(opts.get("--out", "k3_run.json"), "w") as f:
    if mode == "malformed":
        f.write('{{"prompt_ids":[1,2')
    else:
        f.write('{{"prompt_ids":%s,"generated_ids":%s,"full_ids":%s,"layers":%d,'
                '"seconds_per_token":%.4f}}\\n' % (json.dumps(prompt), json.dumps(gen),
                json.dumps(prompt + gen), layers, sum(secs) / len(secs)))
'''


@pytest.fixture(scope="module")
def ck_trunk(tmp_path_factory):
    root = tmp_path_factory.mktemp("peer")
    ck = synthesize(root / "ck", "small", seed=5)
    pack(ck, root / "trunk")
    return ck, root / "trunk"


@pytest.fixture
def standin(tmp_path, monkeypatch):
    path = tmp_path / "k3"
    path.write_text(STANDIN.format(python=sys.executable, step0=STEP0_EXTRA_S))
    path.chmod(0o755)
    monkeypatch.setenv("STANDIN_LOG", str(tmp_path / "argv.jsonl"))
    monkeypatch.setenv("PYTHONPATH", REPO)
    return path


def _budgets(ck: Path) -> list[str]:
    g = CheckpointMap(ck).geometry()
    floor = (2 * max(g.layer_bytes) + g.min_expert_slots * g.expert_slot_bytes) / GB
    return [f"{floor:.6f}", f"{floor * 2:.6f}"]


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_peer_runs_in_turn_with_the_plans_split_and_its_prompt_step_untimed(ck_trunk, standin):
    ck, trunk = ck_trunk
    budgets = _budgets(ck)
    res = compare(standin, ck, trunk, budgets, tokens=3, runs=2, timeout=300)
    calls = _log(standin.parent / "argv.jsonl")
    assert len(calls) == 2 * len(budgets)
    g = CheckpointMap(ck, trunk).geometry()
    for i, call in enumerate(calls):
        argv = call["argv"]
        opt = dict(zip(argv, argv[1:]))
        # The same split the engine's own plan chose (computed apart), not the budget
        # handed over whole; --incremental like the engine; OMP threads = compute threads.
        plan = make_plan(g, budget_gb=float(budgets[i // 2]), check_memory=False)
        assert float(opt["--trunk-gb"]) * GB == pytest.approx(plan.pinned_bytes
                                                               + plan.ring_bytes, abs=1)
        assert math.floor(float(opt["--cache-gb"]) * GB / g.expert_slot_bytes) \
            == plan.expert_slots
        assert argv[0] == str(ck) and opt["--trunk"] == str(trunk) and opt["--gen"] == "3"
        assert "--incremental" in argv
        assert opt["--ids"] == ",".join(map(str, res["prompt_ids"]))
        assert call["omp"] == str(compute_threads())
    for rung in res["rungs"]:
        assert rung["ids_agree"] is True and rung["peer_ids"] == rung["engine_ids"]
        assert len(rung["peer_ids"]) == 3
        # seconds_per_token carries the 5 s prompt step (>= 1.67 s/token over 3 steps);
        # the peer's figure must be the steps after it, like the engine's.
        assert rung["peer_s_per_token"] < 1.0
        assert all(s >= STEP0_EXTRA_S for s in rung["peer_step0_s"])
        assert rung["ratio"] == pytest.approx(rung["peer_s_per_token"]
                                              / rung["engine_s_per_token"])
        assert rung["engine_peak_rss_gb"] > 0 and rung["peer_peak_rss_gb"] > 0
    assert " yes " in render(res)


def test_peer_ids_that_disagree_are_reported_as_no(ck_trunk, standin, monkeypatch):
    ck, trunk = ck_trunk
    monkeypatch.setenv("STANDIN_MODE", "wrong-ids")
    res = compare(standin, ck, trunk, _budgets(ck)[:1], tokens=3, runs=1, timeout=300)
    assert res["rungs"][0]["ids_agree"] is False
    assert " NO " in render(res)


@pytest.mark.parametrize("mode, timeout, message", [
    ("malformed", 300, "the peer's --out file is not valid JSON"),
    ("no-out", 300, "wrote no --out file"),
    ("exit", 300, r"failed at the .* budget \(exit 1\): k3_cache: budget"),
    ("hang", 3, "did not finish within 3 s"),
])
def test_a_broken_peer_is_one_clear_sentence(ck_trunk, standin, monkeypatch, mode, timeout,
                                             message):
    ck, trunk = ck_trunk
    monkeypatch.setenv("STANDIN_MODE", mode)
    with pytest.raises(PeerError, match=message):
        compare(standin, ck, trunk, _budgets(ck)[:1], tokens=3, runs=1, timeout=timeout)


# An excerpt of the real peer's stdout (v1.0.0 built from its release commit, the bench
# checkpoint at its 0.53 GB split): step 0 is the prompt, inside seconds_per_token 1.5490.
REAL_STDOUT = b"""trunk stream: 0.98 GB packed, 3/13 layers PINNED (0.27 GB), ring 2 x 0.08 GB
              reads use O_DIRECT (page cache bypassed)
STEP   TOKEN      SECONDS      CACHE HIT  READ GB    TOK/S
--------------------------------------------------------------------
0      11253      7.67         90.2       1.04       0.130
1      27662      0.66         100.0      0.32       1.518
2      22095      0.69         100.0      0.32       1.446
3      26009      0.71         100.0      0.32       1.403
4      29371      0.67         100.0      0.32       1.491
5      9436       0.65         100.0      0.32       1.542
6      2853       0.67         100.0      0.32       1.501
7      9164       0.68         100.0      0.32       1.478
--------------------------------------------------------------------
8 tokens in 12.4 s, 1.55 s/token average
"""
REAL_IDS = [11253, 27662, 22095, 26009, 29371, 9436, 2853, 9164]


def test_the_real_peers_step_table_gives_the_steps_after_the_prompt():
    steps = parse_steps(REAL_STDOUT, REAL_IDS, 1.5490)
    assert steps["s_per_token"] == pytest.approx((1.5490 * 8 - 7.67) / 7)
    assert (steps["step0_s"], steps["pinned_layers"]) == (7.67, 3)
    with pytest.raises(PeerError, match="one step per generated id"):
        parse_steps(REAL_STDOUT, REAL_IDS[:-1] + [1], 1.5490)
    with pytest.raises(PeerError, match="not the same run"):
        parse_steps(REAL_STDOUT, REAL_IDS, 0.9)


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "bench", "stream", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=600)


def test_cli_refuses_a_missing_or_non_executable_peer_before_anything_runs(tmp_path):
    plain = tmp_path / "k3.txt"
    plain.write_text("not a program")
    for path, says in ((tmp_path / "nope", "no such file"), (plain, "not an executable")):
        out = _bench("--peer", str(path), "--workdir", str(tmp_path / "work"))
        assert out.returncode == 1
        assert out.stderr.startswith("error: --peer ") and says in out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "work").exists()  # nothing synthesised for a peer that cannot run


def test_cli_with_a_malformed_peer_exits_1_with_one_sentence(ck_trunk, standin, monkeypatch,
                                                             tmp_path):
    ck, _ = ck_trunk
    monkeypatch.setenv("STANDIN_MODE", "malformed")
    out = _bench("--checkpoint", str(ck), "--peer", str(standin), "--no-pack",
                 "--budget-gb", _budgets(ck)[0], "--ladder", "max", "--tokens", "3",
                 "--workdir", str(tmp_path / "work"))
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        "error: the peer's --out file is not valid JSON")


def test_cli_json_has_a_peer_part_for_every_rung(ck_trunk, standin, tmp_path):
    ck, _ = ck_trunk
    budget = _budgets(ck)[0]
    out = _bench("--checkpoint", str(ck), "--peer", str(standin), "--peer-runs", "1",
                 "--no-pack", "--budget-gb", budget, "--ladder", "max", "--tokens", "3",
                 "--json", "--workdir", str(tmp_path / "work"))
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    rungs = res["peer"]["rungs"]
    g = CheckpointMap(ck).geometry()
    assert [r["budget"] for r in rungs] == [budget, gb_arg(g.trunk_bytes + g.all_experts_bytes)]
    assert all(r["ids_agree"] for r in rungs)
    assert rungs[0]["peer_ids"] == rungs[1]["peer_ids"]  # identical at every budget
    assert (tmp_path / "work" / f"{ck.name}-trunks" / "trunk-bf16" / "trunk.bin").is_file()
