"""`k3tui pack` keeps the trunk bound to the checkpoint as a user meets it: `--verify`
names a layer that changed, a shard replaced by `download --verify --rehash` makes the
trunk stale (the engine and `doctor` refuse it, `pack` re-packs what changed), and the
engine's ids end equal to the shards'."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.checkpoint.trunk import pack
from k3tui.config import Config, save_config
from fakehub import FakeHub

REPO = str(Path(__file__).resolve().parents[3])
TINY_A = Path(REPO) / "tests" / "fixtures" / "kimi-k3" / "tiny-a"
REPO_ID = "acme/tiny-a"


def run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=REPO),
                          stdin=subprocess.DEVNULL, cwd=REPO)


def k3(*args: str) -> subprocess.CompletedProcess:
    return run("-m", "k3tui", *args)


def engine_ids(ck: Path, trunk: Path | None = None) -> subprocess.CompletedProcess:
    flags = ["--trunk", str(trunk), "--budget-gb", "0.01"] if trunk else []
    return run("-m", "engine", "run", str(ck), "--ids", "3,7,11,5", "--gen", "6", "--json",
               *flags)


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x20]))


def doctor_trunk(ck: Path) -> dict:
    p = k3("doctor", "--json", "--dir", str(ck))
    return next(c for c in json.loads(p.stdout)["checks"] if c["name"] == "trunk")


def test_pack_verify_names_the_layer_that_changed(tmp_path):
    ck = Path(shutil.copytree(TINY_A, tmp_path / "ck"))
    out = tmp_path / "trunk"
    assert k3("pack", str(ck), str(out), "--foreground").returncode == 0
    ok = k3("pack", str(ck), str(out), "--verify")
    assert ok.returncode == 0 and f"Every layer of the trunk in {out} matches" in ok.stdout
    entry = json.loads((out / "trunk.json").read_text())["layers"][2]
    flip(out / "trunk.bin", entry["file_off"] + entry["nbytes"] // 2)
    bad = k3("pack", str(ck), str(out), "--verify")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.splitlines()[0] == (f"k3tui: Layer 2 of the trunk in {out} does not match: "
                                          "its bytes in trunk.bin do not match its digest.")
    assert f"`k3tui pack {ck} {out}` re-packs what changed" in bad.stderr
    assert k3("pack", str(ck), str(out), "--foreground").returncode == 0
    assert k3("pack", str(ck), str(out), "--verify").returncode == 0


def test_doctor_checks_the_trunk_against_the_checkpoint(tmp_path):
    """The trunk beside the checkpoint, where `k3tui pack` put it (<dir>-trunk): ok while it
    matches; a shard replaced since is a blocker that names the layer and `k3tui pack`."""
    ck = Path(shutil.copytree(TINY_A, tmp_path / "ck"))
    cfg = Config()
    cfg.model.dir = str(ck)
    save_config(cfg)
    assert k3("pack", "--foreground").returncode == 0
    check = doctor_trunk(ck)
    assert check["status"] == "ok" and f"{ck}-trunk matches the checkpoint" in check["detail"]
    shard = sorted(ck.glob("model-00005-*.safetensors"))[0]
    (ck / "x.part").write_bytes(shard.read_bytes())
    os.replace(ck / "x.part", shard)
    check = doctor_trunk(ck)
    assert check["status"] == "fail" and check["next"] == "k3tui pack"
    assert f"{shard.name} is not the file layer 4 of the trunk" in check["detail"]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    remote = Path(shutil.copytree(TINY_A, tmp_path / "remote"))
    h = FakeHub(remote, REPO_ID, cdn=True, lfs_min=4096)
    monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    yield h
    h.stop()


def test_a_shard_replaced_by_download_rehash_makes_the_trunk_stale(hub, tmp_path):
    """Layer 6's shard rots in the middle of its run (not the first or last 4 KiB the
    fingerprint samples), the trunk is packed from it, then `download --verify --rehash`
    fetches the shard again. On main the rotten trunk stayed in use and `pack` said there
    was nothing to do."""
    ck, out = tmp_path / "ck", tmp_path / "trunk"
    assert k3("download", REPO_ID, "--dir", str(ck), "--foreground").returncode == 0
    pack(ck, out)
    entry = json.loads((out / "trunk.json").read_text())["layers"][6]
    shard = ck / entry["shard"]
    flip(shard, entry["run_start"] + entry["nbytes"] // 2)
    assert k3("pack", str(ck), str(out), "--foreground").returncode == 0  # from the rot
    p = k3("download", REPO_ID, "--dir", str(ck), "--verify", "--rehash", "--foreground")
    assert p.returncode == 0 and entry["shard"] in p.stdout, p.stdout
    refused = engine_ids(ck, out)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert f"{shard.name} is not the file layer 6 of the trunk in {out}" in refused.stderr
    p = k3("pack", str(ck), str(out), "--foreground")
    assert p.returncode == 0 and "Packed" in p.stdout, p.stdout
    pack(ck, tmp_path / "fresh")
    assert (out / "trunk.bin").read_bytes() == (tmp_path / "fresh" / "trunk.bin").read_bytes()
    got, want = engine_ids(ck, out), engine_ids(ck)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["generated_ids"] == json.loads(want.stdout)["generated_ids"]
