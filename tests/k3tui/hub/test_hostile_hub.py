"""A hub that lies: file names leading out of the target folder, a symlink in the folder
leading out, a sha256 that never matches, a download from a second $K3TUI_HOME, a repo id
that is not one. The real CLI against the loopback fake hub."""

from __future__ import annotations

import hashlib
import os
import threading
from email.utils import formatdate
from pathlib import Path

import pytest
from hub_helpers import BIG, REPO_ID, SMALL, k3, wait_for

from k3tui import jobs
from k3tui.hub import CHUNK_BYTES
from fakehub import Fault
from k3tui.hub.transfer import RETRY_AFTER_CAP_S, retry_after_s


def tree(root: Path, skip: tuple[Path, ...]) -> dict[str, bytes | str]:
    """Every file and symlink under `root` (but not under `skip`), with its content."""
    out: dict[str, bytes | str] = {}
    for p in root.rglob("*"):
        if any(p == s or s in p.parents for s in skip):
            continue
        if p.is_symlink():
            out[str(p)] = "-> " + os.readlink(p)
        elif p.is_file():
            out[str(p)] = p.read_bytes()
    return out


def content_gets(hub) -> list[dict]:
    return [e for e in hub.log if e.get("event") == "body"]


@pytest.fixture
def outside(tmp_path) -> Path:
    """The folder that holds the target: a user's file `x` sits beside it."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"the user's own file\n")
    return tmp_path / "a"


HOSTILE = ["../x", "sub/../../x", "a/..", "ABS", "C:\\x", "sub\\..\\..\\x", "x\x00y",
           "x\x1b]52;c;aGk=\x07", ".k3tui/verified.json", "sub//x", "./x"]


@pytest.mark.parametrize("mode", [(), ("--verify", "--foreground")], ids=["job", "verify"])
@pytest.mark.parametrize("name", HOSTILE)
def test_dl_hostile_name_refuses_the_whole_download(hub, repo_dir, tmp_path, outside, name,
                                                    mode):
    out = outside / "out"
    name = str(outside / "x") if name == "ABS" else name       # the user's file, absolute
    hub.listed_as["config.json"] = name                       # listed first (sorted)
    hub.rescan()
    before = tree(tmp_path, skip=(out, repo_dir))
    p = k3("download", REPO_ID, "--dir", str(out), *mode, check=False)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"The Hub's file list names {name!r}" in p.stderr
    assert "whole download" in p.stderr and "next:" in p.stderr
    assert "Traceback" not in p.stderr
    assert tree(tmp_path, skip=(out, repo_dir)) == before      # nothing outside changed
    assert not content_gets(hub)                               # and nothing was fetched
    assert not jobs.list_jobs()


@pytest.mark.parametrize("link", ["sub", ".k3tui", "config.json"])
def test_dl_symlink_in_the_target_leading_out_is_refused(hub, repo_dir, tmp_path, outside,
                                                         link):
    """`out/sub` → a folder outside (where `sub/extra.bin` would land), `out/.k3tui` →
    outside (the partials), `out/config.json` → the user's file (verify would replace it)."""
    out = outside / "out"
    out.mkdir()
    (out / link).symlink_to(outside / "x" if link == "config.json" else outside)
    before = tree(tmp_path, skip=(repo_dir,))
    for mode in ((), ("--verify", "--rehash", "--foreground")):
        p = k3("download", REPO_ID, "--dir", str(out), *mode, check=False)
        assert p.returncode == 2, p.stdout + p.stderr
        assert "leads outside the folder through a symlink" in p.stderr
        assert "Traceback" not in p.stderr
    assert tree(tmp_path, skip=(repo_dir,)) == before
    assert not content_gets(hub)


def test_dl_same_wrong_sha256_twice_is_kept_aside_and_not_fetched_again(hub, repo_dir,
                                                                          tmp_path):
    out = tmp_path / "out"
    hub.wrong_sha256.add(BIG)
    real = hashlib.sha256((repo_dir / BIG).read_bytes()).hexdigest()
    lie = hashlib.sha256(b"not " + real.encode()).hexdigest()
    said = f"does not match its bytes (got {real}, expected {lie} twice)"

    def gets() -> int:
        return sum(1 for e in content_gets(hub) if e["file"] == BIG)

    p = k3("download", REPO_ID, "--dir", str(out), "--foreground", check=False)
    assert p.returncode == 1 and f"The Hub's sha256 for {BIG} {said}" in p.stderr, p.stderr
    assert gets() == 2                     # once, then once more to rule out the network
    aside = out / ".k3tui" / "corrupt" / BIG
    assert aside.read_bytes() == (repo_dir / BIG).read_bytes()
    assert not (out / BIG).exists()
    assert (out / SMALL).read_bytes() == (repo_dir / SMALL).read_bytes()

    for mode in (("--foreground",), ()):   # a rerun, in this terminal and as a job
        p = k3("download", REPO_ID, "--dir", str(out), *mode, check=False)
        assert p.returncode != 0 and said in p.stdout + p.stderr, p.stdout + p.stderr
        assert "--retry-corrupt" in p.stdout + p.stderr
        assert gets() == 2                 # not fetched again
        assert aside.read_bytes() == (repo_dir / BIG).read_bytes()

    p = k3("download", REPO_ID, "--dir", str(out), "--foreground", "--retry-corrupt",
           check=False)
    assert p.returncode == 1 and said in p.stderr
    assert gets() == 3                     # the same bytes again: kept aside at once

    hub.wrong_sha256.clear()               # the repo is fixed
    p = k3("download", REPO_ID, "--dir", str(out), "--foreground", "--retry-corrupt")
    assert (out / BIG).read_bytes() == (repo_dir / BIG).read_bytes()


def test_dl_second_home_is_refused_by_the_lock_in_the_folder(hub, repo_dir, tmp_path,
                                                             monkeypatch, _isolated_home):
    out = tmp_path / "out"
    release = threading.Event()
    hub.faults[BIG] = [Fault.hold(2 * CHUNK_BYTES, release)]
    k3("download", REPO_ID, "--dir", str(out), "--detach", "--timeout", "120")
    job = wait_for(lambda: jobs.list_jobs() and jobs.list_jobs()[0], what="a job")
    wait_for(lambda: jobs.read_state(job["id"]).get("pid"), what="the job's pid")
    pid = jobs.read_state(job["id"])["pid"]

    monkeypatch.setenv("K3TUI_HOME", str(tmp_path / "other-home"))   # another user, say
    for mode in ("--detach", "--foreground"):
        p = k3("download", REPO_ID, "--dir", str(out), mode, check=False)
        assert p.returncode == 2, p.stdout + p.stderr
        assert (f"Another k3tui (pid {pid}: `k3tui download {REPO_ID} --dir {out} --timeout "
                "120`") in p.stderr
        assert f"K3TUI_HOME={_isolated_home}" in p.stderr and f"kill {pid}" in p.stderr
    assert not jobs.list_jobs()            # the second home started nothing

    monkeypatch.setenv("K3TUI_HOME", str(_isolated_home))
    again = k3("download", REPO_ID, "--dir", str(out), "--detach")   # same home: attaches
    assert f"Job {job['id']} is already downloading" in again.stdout
    release.set()
    assert k3("jobs", "attach", job["id"]).returncode == 0
    assert (out / BIG).read_bytes() == (repo_dir / BIG).read_bytes()
    p = k3("download", REPO_ID, "--dir", str(out), "--verify", "--rehash", "--foreground")
    assert "every file" in p.stdout and "Refetched" not in p.stdout   # the lock is no file


def test_dl_not_a_repo_id_is_refused_without_asking_the_hub(hub, tmp_path):
    for repo in ("notarepo", "acme/..", "a/b/c", "acme/x y"):
        p = k3("download", repo, "--dir", str(tmp_path / "x"), check=False)
        assert p.returncode == 2 and f"{repo!r} is not a Hub repo id" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr
    assert not hub.log


def test_dl_retry_after_both_forms_bounded():
    now = 1_700_000_000.0
    assert retry_after_s("120") == 120.0
    assert retry_after_s(formatdate(now + 45, usegmt=True), now=now) == 45.0
    assert retry_after_s(formatdate(now - 45, usegmt=True), now=now) == 0.0   # past
    assert retry_after_s(formatdate(now + 86400, usegmt=True), now=now) == RETRY_AFTER_CAP_S
    assert retry_after_s("99999") == RETRY_AFTER_CAP_S
    for junk in (None, "", "-5", "soon", "nan", "Wed, 99 Foo 2024"):
        assert retry_after_s(junk, now=now) == 0.0
