"""The token `k3tui setup` stores is used when neither HF_TOKEN nor `hf auth login` has one."""

from k3tui.config import save_credential
from k3tui.hub.metadata import hub_token


def test_dl_hub_token_falls_back_to_the_wizard_credential():
    assert hub_token() is None  # conftest clears HF_TOKEN and points HF_HOME at a temp dir
    save_credential("hf_token", "hf_wizard_secret")
    assert hub_token() == "hf_wizard_secret"


def test_dl_hf_token_variable_wins(monkeypatch):
    save_credential("hf_token", "hf_wizard_secret")
    monkeypatch.setenv("HF_TOKEN", "hf_env_secret")
    assert hub_token() == "hf_env_secret"


def test_dl_login_token_wins_over_the_stored_one_and_says_so(tmp_path, monkeypatch):
    from k3tui.hub.metadata import hub_token_source, token_origin

    save_credential("hf_token", "hf_wizard_secret")
    login = tmp_path / "token"
    login.write_text("hf_login_secret\n")
    monkeypatch.setenv("HF_TOKEN_PATH", str(login))
    source = hub_token_source()
    assert (source.value, source.stored_by_setup) == ("hf_login_secret", False)
    assert hub_token() == "hf_login_secret"
    assert token_origin("hf_wizard_secret")[0].startswith("that `k3tui setup` stored in")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    assert hub_token() is None
