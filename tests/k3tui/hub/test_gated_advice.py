"""A refused download says which token was sent (HF_TOKEN, `hf auth login`, or the one
`k3tui setup` stored) and how to replace that one, through the real CLI."""

from __future__ import annotations

import pytest
from hub_helpers import REPO_ID, k3

from k3tui.config import save_credential
from fakehub import FakeHub
from k3tui.paths import get_paths


@pytest.fixture
def gated(repo_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-login-token"))
    with FakeHub(repo_dir, REPO_ID, gated_token="hf_good", noaccess_tokens=("hf_pending",)) \
            as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        yield hub


def refused(tmp_path) -> str:
    p = k3("download", REPO_ID, "--dir", str(tmp_path / "out"), check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    return " ".join(p.stderr.split())


def test_polish_no_token_mentions_every_way_to_give_one(gated, tmp_path):
    err = refused(tmp_path)
    assert "is gated" in err
    assert "HF_TOKEN" in err and "hf auth login" in err
    assert "k3tui setup" in err and str(get_paths().credentials_file) in err


def test_polish_refused_stored_token_says_it_is_the_setup_one(gated, tmp_path):
    save_credential("hf_token", "hf_expired")
    err = refused(tmp_path)
    assert f"token that `k3tui setup` stored in {get_paths().credentials_file} was refused" \
        in err
    assert "run `k3tui setup` and paste a new token" in err
    assert "hf_expired" not in err


def test_polish_refused_login_token_names_hf_auth_login(gated, tmp_path, monkeypatch):
    save_credential("hf_token", "hf_good")            # shadowed by the login file
    login = tmp_path / "login-token"
    login.write_text("hf_expired\n")
    monkeypatch.setenv("HF_TOKEN_PATH", str(login))
    err = refused(tmp_path)
    assert f"saved by `hf auth login` ({login}) was refused" in err
    assert "run `hf auth login` with a new token" in err
    assert "k3tui setup" not in err


def test_polish_refused_env_token_and_no_access(gated, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_expired")
    err = refused(tmp_path)
    assert "token in HF_TOKEN was refused" in err and "export HF_TOKEN=" in err
    save_credential("hf_token", "hf_pending")
    monkeypatch.delenv("HF_TOKEN")
    err = refused(tmp_path)
    assert "token that `k3tui setup` stored in" in err and "has no access to acme/tiny" in err
    assert "request or accept access" in err
