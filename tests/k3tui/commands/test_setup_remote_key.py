"""`k3tui setup --yes` against an endpoint that wants a key: the advice names the flag the
user types (--api-key-env) and the exact command, not the config key `api_key_env`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from probe_helpers import RMT_ENDPOINT, fake_endpoint

from k3tui.config import config_exists

KEY = "sk-loopback-key-1234"


def setup_yes(*args: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "MY_K3_KEY"}
    e.update(env)
    return subprocess.run([sys.executable, "-m", "k3tui", "setup", "--yes", *args],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, env=e,
                          timeout=60, check=False)


@pytest.mark.skipif(not RMT_ENDPOINT.is_file(), reason="the remote area's test endpoint is absent")
def test_polish_setup_yes_key_advice_names_the_flag(tmp_path):
    with fake_endpoint(tmp_path, KEY) as (port, _):
        url = f"http://127.0.0.1:{port}/v1"
        for args, env, expect in [
            ((), {}, "--api-key-env K3_API_KEY"),                        # no key at all
            (("--api-key-env", "MY_K3_KEY"), {}, "MY_K3_KEY is not set"),  # variable unset
            (("--api-key-env", "MY_K3_KEY"), {"MY_K3_KEY": "sk-wrong-000000"},
             "check the key in $MY_K3_KEY"),                             # wrong key
        ]:
            p = setup_yes("--remote-url", url, *args, **env)
            err = " ".join(p.stderr.split())
            assert p.returncode == 1 and "the config was not saved" in err, err
            assert expect in err, err
            assert "`api_key_env`" not in err and "Traceback" not in err
            assert f"k3tui setup --yes --remote-url {url} --api-key-env" in err
            assert "sk-wrong" not in err and not config_exists()
        # the advice works: the same command with the variable set saves the config
        p = setup_yes("--remote-url", url, "--api-key-env", "MY_K3_KEY", MY_K3_KEY=KEY)
        assert p.returncode == 0, p.stderr
        assert config_exists()


def test_polish_chat_401_advice_names_what_to_type():
    from k3tui.backends.openai_stream import error_event

    ev = error_event({"code": 401, "message": "Invalid API Key",
                      "type": "authentication_error"}, 401)
    assert "--api-key-env NAME" in ev.next_step and "k3tui setup" in ev.next_step
    assert "`api_key_env`" not in ev.next_step
