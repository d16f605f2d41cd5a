"""A full disk names the exact command that resumes the download: the user's repo, --dir
and --include, not a bare `k3tui download` that would fall back to the config's defaults.
Real CLI, real detached job; the disk fills at the write seam (os.pwritev) of the child
processes through a sitecustomize on PYTHONPATH."""

from __future__ import annotations

import shlex

import pytest
from hub_helpers import BIG, REPO_ID, SMALL, k3

from k3tui import jobs

FULL_AFTER = 2 * (1 << 20) + 1000          # bytes that fit before ENOSPC

SITECUSTOMIZE = '''
import errno, os
if os.environ.get("K3_TEST_DISK_BYTES"):
    _left = [int(os.environ["K3_TEST_DISK_BYTES"])]
    _real = os.pwritev

    def _pwritev(fd, pieces, offset):
        if _left[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = _real(fd, [b"".join(pieces)[:_left[0]]], offset)
        _left[0] -= n
        return n
    os.pwritev = _pwritev
'''


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("K3TUI_DL_MAX_FAILURES", "2")
    monkeypatch.setenv("K3_TEST_DISK_BYTES", str(FULL_AFTER))
    return monkeypatch


def resume_cmd(text: str) -> list[str]:
    """The command between the backticks after "then rerun"."""
    flat = " ".join(text.split())
    assert "is full" in flat, flat
    cmd = flat.split("then rerun `", 1)[1].split("`", 1)[0]
    return shlex.split(cmd)


@pytest.mark.parametrize("mode", ["--detach", "--foreground"])
def test_polish_disk_full_prints_the_command_that_resumes(hub, repo_dir, tmp_path, small_disk,
                                                          mode):
    out = tmp_path / "my dir"                  # a space: the command must be quoted
    args = ["download", REPO_ID, "--dir", str(out), "--include", "*.safetensors"]
    p = k3(*args, mode, check=False)
    if mode == "--detach":
        job = jobs.list_jobs()[0]
        p = k3("jobs", "attach", job["id"], check=False)
        text = p.stdout + p.stderr + jobs.read_state(job["id"])["message"]
    else:
        text = p.stdout + p.stderr
    assert p.returncode == 1, text
    cmd = resume_cmd(text)
    assert cmd[:5] == ["k3tui", "download", REPO_ID, "--dir", str(out)]
    assert cmd[5:7] == ["--include", "*.safetensors"]
    assert ("--foreground" in cmd) == (mode == "--foreground")
    assert "--resume-as" not in cmd
    small_disk.delenv("K3_TEST_DISK_BYTES")     # space freed: the printed command resumes
    before = len(hub.log)
    p = k3(*cmd[1:], *(["--detach"] if mode == "--detach" else []))
    if mode == "--detach":
        job_id = p.stdout.split("Started job ", 1)[1].split(":", 1)[0]
        assert k3("jobs", "attach", job_id).returncode == 0
    assert (out / BIG).read_bytes() == (repo_dir / BIG).read_bytes()
    assert (out / SMALL).read_bytes() == (repo_dir / SMALL).read_bytes()
    assert not (out / "config.json").exists()      # --include was kept
    sent = sum(e["sent"] for e in hub.log[before:] if e.get("event") == "body")
    total = (repo_dir / BIG).stat().st_size + (repo_dir / SMALL).stat().st_size
    assert sent < total             # it resumed: what reached the disk was not fetched again
