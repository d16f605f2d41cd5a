"""A packed trunk is bound to what it derives from (engine/checkpoint/binding.py): a pack
killed with SIGKILL and resumed after its trunk.bin was deleted, truncated or rewritten
re-packs what it lost; a shard changed after the pack makes the trunk stale; trunk bytes
changed after the pack are refused on their first read; a full disk is one sentence and
leaves nothing behind. Each ends with the engine's ids equal to the shards' ids."""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.checkpoint.trunk import pack
from k3vocab import GB
from engine.weights.streaming import CheckpointMap

REPO = str(Path(__file__).resolve().parents[3])
IDS = "3,7,11,5"

# A pack in a real process that stops dead at a chosen point and waits to be killed:
# after the progress file lists layer N ("after N"), before trunk.json is written
# ("before-finish"), or inside the compact pack's first layer ("first-compact-layer").
CHILD = r"""
import json, sys, time
from pathlib import Path
from engine.checkpoint import compact_pack, trunk

ck, out, mode, compact = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"

def pause(*_):
    print("paused", flush=True)
    while True:
        time.sleep(60)

def listed():
    try:
        state = json.loads((out / trunk.PROGRESS).read_text())
        return [e["layer"] for e in state["layers"]]
    except (OSError, ValueError, KeyError):
        return []

def progress(done, total, layer):
    if mode.startswith("after ") and int(mode.split()[1]) in listed():
        pause()

if mode == "before-finish":
    trunk.Session.finish = pause
if mode == "first-compact-layer":
    compact_pack._pack_layer = pause
trunk.pack(ck, out, progress=progress, compact=compact)
print("finished", flush=True)
"""


def env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=REPO, PYTHONDONTWRITEBYTECODE="1", **extra)


def killed_pack(ck: Path, out: Path, mode: str, compact: bool = False) -> None:
    """Start a pack, wait until it has paused where `mode` says, and SIGKILL it there."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(ck), str(out), mode,
                              "1" if compact else "0"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and not line:
            ready, _, _ = select.select([child.stdout], [], [], 1.0)
            if ready:
                line = child.stdout.readline().strip() or "eof"
        assert line == "paused", (line, child.stderr.read() if line == "eof" else "")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL


def engine(*args, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *map(str, args)], capture_output=True,
                          text=True, env=env(), cwd=REPO, timeout=300, preexec_fn=preexec_fn)


def repack(ck: Path, out: Path, *flags: str) -> dict:
    p = engine("pack", ck, out, "--json", *flags)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def ids(ck: Path, trunk: Path | None = None) -> list[int]:
    """The engine's ids: from the shards (resident), or streaming `trunk` under a budget
    that keeps some layers out of RAM (read through the ring)."""
    flags: list = []
    if trunk is not None:
        g = CheckpointMap(ck).geometry()
        budget = (2 * max(g.layer_bytes) + g.min_expert_slots * g.expert_slot_bytes) / GB
        flags = ["--trunk", trunk, "--budget-gb", f"{budget:.6f}"]
    p = engine("run", ck, "--ids", IDS, "--gen", "6", "--json", *flags)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["generated_ids"]


def refused(p: subprocess.CompletedProcess, *needles: str) -> str:
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    for n in needles:
        assert n in last, (n, last)
    return last


def same_trunk(got: Path, want: Path) -> None:
    assert (got / "trunk.bin").read_bytes() == (want / "trunk.bin").read_bytes()
    assert json.loads((got / "trunk.json").read_text()) == \
        json.loads((want / "trunk.json").read_text())
    assert not (got / "trunk.progress.json").exists()
    assert not list(got.glob("*.tmp"))


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    """A copy of the 13-layer reference checkpoint (its shards are rewritten by tests)."""
    import shutil

    src = Path(REPO) / "tests" / "fixtures" / "kimi-k3" / "tiny-a"
    return Path(shutil.copytree(src, tmp_path_factory.mktemp("binding") / "ck"))


@pytest.fixture(scope="module")
def fresh(ck, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fresh")
    pack(ck, root / "bf16")
    pack(ck, root / "c12", compact=True)
    return {"bf16": root / "bf16", "c12": root / "c12"}


@pytest.fixture(scope="module")
def shard_ids(ck) -> list[int]:
    return ids(ck)


def layer_span(trunk: Path, layer: int) -> tuple[int, int]:
    entry = json.loads((trunk / "trunk.json").read_text())["layers"][layer]
    return entry["file_off"], entry["nbytes"]


# (damage, layers of 0-3 a resumed BF16 pack keeps, ... a resumed compact pack keeps)
DAMAGE = {"deleted": (0, 0), "truncated": (2, 2), "zeroed": (3, 1)}


@pytest.mark.parametrize("fmt", ["bf16", "c12"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resumed_pack_after_a_kill_re_packs_what_trunk_bin_lost(ck, fresh, shard_ids, tmp_path,
                                                                fmt, damage):
    """Killed after layer 3 was recorded; then trunk.bin deleted, cut inside layer 2, or
    layer 1 zeroed in place (same file, same size). On main the resumed pack trusted the
    progress file: 'success', layers of zeros, other ids, no word."""
    out, compact = tmp_path / "t", fmt == "c12"
    killed_pack(ck, out, "after 3", compact)
    binary = out / "trunk.bin"
    if damage == "deleted":
        binary.unlink()
    elif damage == "truncated":
        off, n = layer_span(fresh[fmt], 2)
        os.truncate(binary, off + n // 2)
    else:
        off, n = layer_span(fresh[fmt], 1)
        with open(binary, "r+b") as f:
            f.seek(off)
            f.write(bytes(n))
    summary = repack(ck, out, *(["--compact"] if compact else []))
    assert summary["layers_copied"] == 13 - DAMAGE[damage][compact]
    same_trunk(out, fresh[fmt])
    assert ids(ck, out) == shard_ids


def test_compact_pack_killed_over_a_killed_bf16_pack_leaves_nothing_to_trust(
        ck, fresh, shard_ids, tmp_path):
    """`pack --compact` into the folder of a killed BF16 pack truncates trunk.bin: on main
    it left the BF16 progress file behind, and the next BF16 pack trusted it."""
    out = tmp_path / "t"
    killed_pack(ck, out, "after 3")
    killed_pack(ck, out, "first-compact-layer", compact=True)
    assert (out / "trunk.bin").stat().st_size == 0
    assert json.loads((out / "trunk.progress.json").read_text())["format"] == "k3-c12"
    assert repack(ck, out)["layers_copied"] == 13
    same_trunk(out, fresh["bf16"])
    assert ids(ck, out) == shard_ids


@pytest.mark.parametrize("how", ["in place", "replaced"])
def test_a_shard_changed_after_the_pack_makes_the_trunk_stale(ck, tmp_path, copy_checkpoint,
                                                              how):
    """Layer 6's run changes in the middle (not its first or last 4 KiB, which the
    fingerprint samples): rewritten in place, or replaced by rename as a re-download does.
    On main the trunk kept being used and `pack` said there was nothing to do."""
    mine = copy_checkpoint(ck, tmp_path / "ck")
    out = tmp_path / "t"
    pack(mine, out)
    entry = json.loads((out / "trunk.json").read_text())["layers"][6]
    shard = mine / entry["shard"]
    mid = entry["run_start"] + (entry["nbytes"] // 2)
    data = bytearray(shard.read_bytes())
    data[mid:mid + 16] = bytes(b ^ 0x5A for b in data[mid:mid + 16])
    if how == "in place":
        with open(shard, "r+b") as f:
            f.seek(mid)
            f.write(data[mid:mid + 16])
    else:
        (mine / "new.part").write_bytes(data)
        os.replace(mine / "new.part", shard)
    last = refused(engine("run", mine, "--ids", IDS, "--gen", "2", "--trunk", out,
                          "--budget-gb", "1"), f"{shard.name} is not the file layer 6",
                   "`k3tui pack`")
    assert last.count(". ") == 0  # one sentence
    summary = repack(mine, out)
    assert summary["layers_copied"] == 1 and summary["layers_verified"] == 12
    pack(mine, tmp_path / "fresh")
    same_trunk(out, tmp_path / "fresh")
    assert ids(mine, out) == ids(mine)


def test_a_shard_rewritten_with_the_same_bytes_is_rebound_without_a_copy(ck, tmp_path,
                                                                         copy_checkpoint):
    mine = copy_checkpoint(ck, tmp_path / "ck")
    out = tmp_path / "t"
    pack(mine, out)
    shard = sorted(mine.glob("model-00004-*.safetensors"))[0]
    (mine / "same.part").write_bytes(shard.read_bytes())
    os.replace(mine / "same.part", shard)
    refused(engine("run", mine, "--ids", IDS, "--gen", "2", "--trunk", out, "--budget-gb", "1"),
            "is not the file layer 3")
    summary = repack(mine, out)
    assert summary["already_packed"] and summary["layers_copied"] == 0
    assert ids(mine, out) == ids(mine)


@pytest.mark.parametrize("fmt", ["bf16", "c12"])
def test_trunk_bytes_changed_after_the_pack_are_refused_on_their_first_read(
        ck, fresh, shard_ids, tmp_path, fmt):
    import shutil

    out = Path(shutil.copytree(fresh[fmt], tmp_path / "t"))
    off, n = layer_span(out, 4)
    with open(out / "trunk.bin", "r+b") as f:
        f.seek(off + n // 3)
        byte = f.read(1)
        f.seek(off + n // 3)
        f.write(bytes([byte[0] ^ 1]))
    refused(engine("run", ck, "--ids", IDS, "--gen", "2", "--trunk", out, "--budget-gb", "1"),
            "layer 4 of the trunk", "does not match the digest it was packed with",
            "`k3tui pack`")
    verdict = engine("pack", ck, out, "--verify")
    assert verdict.returncode == 1 and "Traceback" not in verdict.stderr
    assert verdict.stdout.startswith(f"layer 4 of the trunk in {out} does not match: its "
                                     "bytes in trunk.bin do not match its digest;")
    flags = ["--compact"] if fmt == "c12" else []
    summary = repack(ck, out, *flags)
    assert summary["layers_copied"] == (1 if fmt == "bf16" else 9)  # c12: offsets follow
    same_trunk(out, fresh[fmt])
    ok = engine("pack", ck, out, "--verify")
    assert ok.returncode == 0 and "every layer of the trunk" in ok.stdout
    assert ids(ck, out) == shard_ids


def test_a_trunk_without_digests(ck, fresh, tmp_path):
    """Ours without digests (an older k3tui, whose resume could zero layers): refused, and
    pack re-packs it whole. The C peer's (no fingerprint, no digests): used, unchecked, and
    the forecast line says so."""
    import shutil

    out = Path(shutil.copytree(fresh["bf16"], tmp_path / "t"))
    meta = json.loads((out / "trunk.json").read_text())
    meta.pop("sources")
    for e in meta["layers"]:
        e.pop("sha256"), e.pop("source_sha256")
    (out / "trunk.json").write_text(json.dumps(meta))
    refused(engine("run", ck, "--ids", IDS, "--gen", "2", "--trunk", out, "--budget-gb", "1"),
            "packed by an older k3tui, without the per-layer digests")
    meta.pop("fingerprint")
    (out / "trunk.json").write_text(json.dumps(meta))
    assert "not checked: packed without per-layer digests" in CheckpointMap(ck, out).trunk_kind
    assert repack(ck, out)["layers_copied"] == 13
    same_trunk(out, fresh["bf16"])


def _file_size_limit(nbytes: int):
    def limit() -> None:  # in the child: writes past it fail with EFBIG, like a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit


def test_pack_on_a_full_disk_is_one_sentence_and_leaves_nothing_behind(ck, fresh, tmp_path):
    """Files cannot grow past 32 KiB (trunk.bin needs 2.9 MB, trunk.json 65 KB, the
    progress file a few KB). On main: an OSError traceback and trunk.json.tmp left."""
    out = tmp_path / "t"
    p = engine("pack", ck, out, preexec_fn=_file_size_limit(32 << 10))
    last = refused(p, "writing trunk.bin failed", "free disk space")
    assert p.stderr.count("error:") == 1 and last.startswith("error: ")
    assert not list(out.glob("*.tmp"))
    killed_pack(ck, out, "before-finish")  # every layer in place, trunk.json not yet
    p = engine("pack", ck, out, preexec_fn=_file_size_limit(32 << 10))
    refused(p, f"writing {out / 'trunk.json'} failed", "free disk space")
    assert not list(out.glob("*.tmp")) and not (out / "trunk.json").exists()
    assert (out / "trunk.progress.json").is_file()
    assert repack(ck, out)["layers_copied"] == 0  # every layer kept, checked
    same_trunk(out, fresh["bf16"])


def test_a_hostile_progress_file_is_checked_not_obeyed(ck, fresh, tmp_path):
    """Entries of the wrong shape, a digest that is not this layer's, a compact offset that
    is a float: nothing of it is trusted, nothing crashes, the pack is whole."""
    out = tmp_path / "t"
    killed_pack(ck, out, "after 3")
    state = json.loads((out / "trunk.progress.json").read_text())
    state["layers"] = [{"layer": [1]}, "x", {"layer": 2, "sha256": "0" * 64,
                                            "source_sha256": "0" * 64}, *state["layers"][:2]]
    (out / "trunk.progress.json").write_text(json.dumps(state))
    assert repack(ck, out)["layers_copied"] == 11  # 0 and 1 are whole; the rest re-packed
    same_trunk(out, fresh["bf16"])
    killed_pack(ck, tmp_path / "c", "after 3", compact=True)
    state = json.loads((tmp_path / "c" / "trunk.progress.json").read_text())
    state["layers"][0]["file_off"] = 0.0
    (tmp_path / "c" / "trunk.progress.json").write_text(json.dumps(state))
    assert repack(ck, tmp_path / "c", "--compact")["layers_copied"] == 13
    same_trunk(tmp_path / "c", fresh["c12"])
