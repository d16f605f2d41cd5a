"""The token `k3tui setup` stores is used when neither HF_TOKEN nor `hf auth login` has one."""

from k3tui.config import save_credential
from k3tui.hub.remote import hub_token


def test_dl_hub_token_falls_back_to_the_wizard_credential():
    assert hub_token() is None  # conftest clears HF_TOKEN and points HF_HOME at a temp dir
    save_credential("hf_token", "hf_wizard_secret")
    assert hub_token() == "hf_wizard_secret"


def test_dl_hf_token_variable_wins(monkeypatch):
    save_credential("hf_token", "hf_wizard_secret")
    monkeypatch.setenv("HF_TOKEN", "hf_env_secret")
    assert hub_token() == "hf_env_secret"
