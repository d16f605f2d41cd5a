"""`k3tui download`, `k3tui jobs` and `k3tui pack` as a user runs them (subprocesses)."""

from __future__ import annotations

import json

import pytest
from hub_helpers import BIG, REPO_ID, SMALL, k3

from k3tui import jobs
from k3tui.config import Config, save_config


def test_dl_foreground_verify_refetches_flipped_byte(hub, repo_dir, tmp_path):
    out = tmp_path / "out"
    p = k3("download", REPO_ID, "--dir", str(out), "--foreground")
    assert "every file" in p.stdout and "verified" in p.stdout
    assert (out / BIG).read_bytes() == (repo_dir / BIG).read_bytes()
    p = k3("download", REPO_ID, "--dir", str(out))
    assert "already here and verified" in p.stdout and not jobs.list_jobs()
    with open(out / SMALL, "r+b") as fh:
        fh.seek(12345)
        b = fh.read(1)
        fh.seek(12345)
        fh.write(bytes([b[0] ^ 0x80]))
    p = k3("download", REPO_ID, "--dir", str(out), "--verify", "--foreground")
    assert f"Refetched 1 files that did not match: {SMALL}" in p.stdout
    assert (out / SMALL).read_bytes() == (repo_dir / SMALL).read_bytes()


def test_dl_defaults_come_from_the_config(hub, repo_dir, tmp_path):
    out = tmp_path / "configured"
    cfg = Config()
    cfg.model.repo, cfg.model.dir, cfg.model.include = REPO_ID, str(out), ["*.json"]
    save_config(cfg)
    p = k3("download", "--detach")
    assert str(out) in p.stdout and "1 files" in p.stdout
    assert k3("jobs", "attach").returncode == 0
    assert sorted(x.name for x in out.iterdir()) == [".k3tui", "config.json"]


def test_dl_cli_errors_are_one_sentence(hub, tmp_path):
    p = k3("download", check=False)
    assert p.returncode == 2 and "No model is configured" in p.stderr
    p = k3("download", REPO_ID, "--rehash", check=False)
    assert p.returncode == 2 and "--rehash only makes sense with --verify" in p.stderr
    p = k3("download", "acme/missing", "--dir", str(tmp_path / "x"), check=False)
    assert p.returncode == 1 and "was not found" in p.stderr
    p = k3("jobs", "attach", "nope", check=False)
    assert p.returncode == 2 and "No job matches 'nope'" in p.stderr
    assert "No jobs" in k3("jobs").stdout
    for p in (k3("download", check=False), k3("jobs", "cancel", "x", check=False)):
        assert "Traceback" not in p.stderr


def test_dl_default_dir_is_under_models(hub, tmp_path, _isolated_home):
    p = k3("download", REPO_ID, "--include", "config.json", "--foreground")
    assert (_isolated_home / "models" / "tiny" / "config.json").is_file(), p.stdout


@pytest.fixture
def checkpoint(tmp_path):
    from engine.checkpoint.synth import synthesize

    return synthesize(tmp_path / "ck", size="tiny")


def test_dl_pack_job_reports_layers_and_saves_trunk_dir(checkpoint, tmp_path):
    cfg = Config()
    cfg.model.dir = str(checkpoint)
    save_config(cfg)
    p = k3("pack", "--detach")
    job_id = jobs.list_jobs()[0]["id"]
    assert job_id in p.stdout
    assert k3("jobs", "attach", job_id).returncode == 0
    st = jobs.read_state(job_id)
    assert st["kind"] == "pack" and st["status"] == "done"
    assert st["done_bytes"] == st["total_bytes"] > 0
    assert isinstance(st["layer"], int) and st["layer"] >= 1
    trunk = checkpoint.with_name(checkpoint.name + "-trunk")
    assert (trunk / "trunk.json").is_file() and (trunk / "trunk.bin").stat().st_size > 0
    from k3tui.config import load_config

    assert load_config().model.trunk_dir == str(trunk)
    p = k3("pack", str(checkpoint), str(trunk), "--foreground")
    assert "already holds this checkpoint's trunk" in p.stdout
    assert "Forgot 1 finished job" in k3("jobs", "clean").stdout
    assert not jobs.list_jobs() and trunk.is_dir()


def test_dl_pack_refuses_a_folder_without_config(tmp_path):
    p = k3("pack", str(tmp_path), check=False)
    assert p.returncode == 2 and "is not a checkpoint folder" in p.stderr


def test_dl_gated_repo_uses_the_stored_login(repo_dir, tmp_path, monkeypatch):
    """No HF_TOKEN, no login: refused with how to log in. After `hf auth login` (the token
    file in HF_HOME) the detached job downloads; the token never reaches the CDN or logs."""
    import os

    from fakehub import FakeHub

    with FakeHub(repo_dir, REPO_ID, cdn=True, gated_token="hf_stored") as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        out = tmp_path / "out"
        p = k3("download", REPO_ID, "--dir", str(out), check=False)
        assert p.returncode == 1 and "is gated" in p.stderr and "hf auth login" in p.stderr
        token_file = tmp_path / "hf_home_token"
        token_file.write_text("hf_stored\n")
        monkeypatch.setenv("HF_TOKEN_PATH", str(token_file))
        k3("download", REPO_ID, "--dir", str(out), "--detach")
        job = jobs.list_jobs()[0]
        assert k3("jobs", "attach", job["id"]).returncode == 0
        assert (out / BIG).read_bytes() == (repo_dir / BIG).read_bytes()
        hub_port = int(hub.endpoint.rsplit(":", 1)[1])
        assert not any(e["auth"] for e in hub.requests() if e["port"] != hub_port)
        assert "hf_stored" not in open(job["log"]).read()
        assert "hf_stored" not in json.dumps(jobs.read_state(job["id"]))
        assert os.environ.get("HF_TOKEN") is None


@pytest.mark.parametrize("where", ["proc", "file"])
def test_dl_a_folder_no_download_can_be_written_to_is_refused_first(hub, tmp_path, where):
    """`--dir /proc/x` said "Not enough space … only 0.0 MB free" after asking the Hub; a
    folder that cannot be made (a pseudo filesystem) or a file is now refused before the Hub
    is asked, in one sentence that names it, and nothing is left behind."""
    target = "/proc/k3tui-dl-test" if where == "proc" else str(tmp_path / "a-file")
    if where == "file":
        (tmp_path / "a-file").write_text("mine")
    p = k3("download", REPO_ID, "--dir", target, "--foreground", check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    first = p.stderr.splitlines()[0]
    assert first.startswith(f"k3tui: {target} ") and (
        "cannot hold a download" in first or "is a file, not a folder" in first), p.stderr
    assert "Checking" not in p.stdout and not hub.requests(), (p.stdout, hub.requests())
    assert "space" not in p.stderr
    if where == "file":
        assert (tmp_path / "a-file").read_text() == "mine"
    assert [x.name for x in tmp_path.iterdir() if x.name.startswith(".k3tui-probe")] == []
