"""A remote OpenAI-compatible endpoint: checked before k3tui trusts it with a chat.

`check_endpoint` is what the wizard runs before it saves a remote config: `/health`
where the server has one (llama-server, SGLang, vLLM, the bundled engine), `/v1/models`
(the model names), then a one-token chat completion (which proves the key even where
the model list is public, as on llama-server). Every failure comes
back as one sentence and a next step — a wrong key, an untrusted certificate, nothing
listening, a model still loading — never a traceback.

The API key comes from the environment variable the config names (`[remote]
api_key_env`) or from credentials.toml (0600). It is sent only in the Authorization
header, never logged, and shown only masked (`…wxyz`). TLS certificates are verified
unless the caller explicitly passes `verify_tls=False`; a private CA is trusted through
`SSL_CERT_FILE` (httpx reads it, so the chat does too) or a CA file path passed here,
instead of turning verification off.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from k3tui.backends.openai_stream import MAX_MODELS_BYTES, parse_json
from k3tui.backends.transport import describe_transport_error
from k3tui.textsafe import clean
from k3tui.units import MiB

CREDENTIAL_KEY = "remote_api_key"
CONNECT_TIMEOUT_S = 10.0
TEST_TIMEOUT_S = 120.0  # a busy cluster may queue the one-token request behind others
MAX_ANSWER_BYTES = MAX_MODELS_BYTES  # the largest answer a check reads: a model listing
MAX_MODEL_ID = 256  # characters of a model id kept (and shown, and saved)


@dataclass(frozen=True)
class EndpointCheck:
    ok: bool
    message: str                 # one sentence: what was found, or what is wrong
    models: list[str] = field(default_factory=list)
    health_ok: bool | None = None  # None: the server has no /health (that is fine)
    test_ok: bool = False
    next_step: str = ""
    warnings: list[str] = field(default_factory=list)
    auth: str = ""               # "missing" / "refused" when the key was the problem

    def __post_init__(self) -> None:
        # The server writes part of every sentence here (its error text, a redirect's
        # Location, model ids): none of it reaches the terminal with escape sequences.
        object.__setattr__(self, "message", clean(self.message))
        object.__setattr__(self, "next_step", clean(self.next_step))
        object.__setattr__(self, "warnings", [clean(w) for w in self.warnings])

    def describe(self) -> str:
        lines = [self.message]
        lines += [f"  warning: {w}" for w in self.warnings]
        if self.next_step:
            lines.append(f"  next: {self.next_step}")
        return "\n".join(lines)


def mask_key(key: str | None) -> str:
    """What may be shown of a key: its last 4 characters, and only if it is long enough."""
    if not key:
        return "(none)"
    return "…" + key[-4:] if len(key) >= 12 else "…" * 3


def resolve_api_key(api_key_env: str = "") -> tuple[str | None, str]:
    """The key and where it came from (for display): the named variable, then credentials."""
    if api_key_env:
        value = os.environ.get(api_key_env)
        if value:
            return value.strip(), f"${api_key_env}"
    from k3tui.config import load_credentials

    value = load_credentials().get(CREDENTIAL_KEY)
    if value:
        return value.strip(), "credentials.toml"
    return None, ""


def tls_verify(verify_tls: bool | str) -> bool | ssl.SSLContext:
    """httpx `verify`: the default trust store, a private CA file, or (explicitly) off."""
    if isinstance(verify_tls, str):
        return ssl.create_default_context(cafile=verify_tls)
    return bool(verify_tls)


def http_client(verify_tls: bool | str = True, **kwargs: Any) -> httpx.AsyncClient:
    """An async client with the same TLS policy, for `stream_chat(..., client=…)`."""
    return httpx.AsyncClient(verify=tls_verify(verify_tls), **kwargs)


def _roots(url: str) -> tuple[str, str]:
    base = url.strip().rstrip("/")
    root = base.removesuffix("/v1")
    return root, root + "/v1"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def transport_warnings(url: str, verify_tls: bool | str = True) -> list[str]:
    """What is unsafe about reaching `url` this way (shown before anything is sent)."""
    parts = urlsplit(url.strip())
    warnings = []
    if parts.scheme == "http" and parts.hostname and not _is_loopback(parts.hostname):
        warnings.append("plain http to another machine: the API key and the chat travel "
                        "unencrypted; use https or an SSH tunnel")
    if verify_tls is False and parts.scheme == "https":
        warnings.append("TLS verification is off: anyone in between could read the key")
    return warnings


def _fail(message: str, next_step: str, **kw: Any) -> EndpointCheck:
    return EndpointCheck(ok=False, message=message, next_step=next_step, **kw)


def _transport_failure(exc: BaseException, where: str) -> EndpointCheck:
    return _fail(*describe_transport_error(exc, where))


class _TooLarge(Exception):
    """An answer longer than MAX_ANSWER_BYTES (its path in args[0])."""


def _fetch(http: httpx.Client, method: str, url: str, **kwargs: Any) -> httpx.Response:
    """`http.request`, except that the body is read only up to MAX_ANSWER_BYTES (a server
    answering with gigabytes raises _TooLarge instead of filling memory)."""
    with http.stream(method, url, **kwargs) as resp:
        data = bytearray()
        for chunk in resp.iter_bytes():
            data += chunk
            if len(data) > MAX_ANSWER_BYTES:
                raise _TooLarge(urlsplit(url).path)
        headers = [(k, v) for k, v in resp.headers.raw  # bytes: a Location may be latin-1
                   if k.lower() not in (b"content-encoding", b"content-length",
                                        b"transfer-encoding")]
        return httpx.Response(resp.status_code, headers=headers, content=bytes(data),
                              request=resp.request)


def _json(resp: httpx.Response) -> Any:
    """The body as JSON; ValueError also for nesting deeper than Python can read."""
    return parse_json(resp.content)


def _error_text(resp: httpx.Response, api_key: str | None) -> str:
    try:
        body = _json(resp)
        err = body.get("error", body) if isinstance(body, dict) else body
        text = err.get("message") if isinstance(err, dict) else str(err)
    except ValueError:
        text = resp.text
    text = " ".join(clean(str(text or "")[:10_000]).split())[:200]
    if api_key:  # some servers echo the key they refused
        text = text.replace(api_key, mask_key(api_key))
    return text


def check_endpoint(url: str, api_key: str | None, verify_tls: bool | str = True, *,
                   model: str | None = None, timeout: float = TEST_TIMEOUT_S) -> EndpointCheck:
    """Health, model listing and a one-token test request against an OpenAI-compatible URL.

    `url` may be the server root or its `/v1`. `verify_tls` is True (default trust
    store), a CA file path, or False (explicitly insecure; reported as a warning).
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return _fail(f"{url!r} is not an http:// or https:// URL.",
                     "give the server's address, e.g. https://cluster.example:8000/v1")
    root, v1 = _roots(url)
    where = f"{parts.scheme}://{parts.netloc}"
    warnings = transport_warnings(url, verify_tls)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S)
    try:
        verify = tls_verify(verify_tls)
    except (OSError, ssl.SSLError) as exc:
        return _fail(f"Cannot use {verify_tls} as a CA certificate file ({exc}).",
                     "give the PEM file of the CA that signed the server's certificate")
    try:
        with httpx.Client(verify=verify, timeout=limits, headers=headers,
                          follow_redirects=False) as http:
            return _run_checks(http, root, v1, where, api_key, model, warnings)
    except _TooLarge as exc:
        return _fail(f"{where} answered {exc.args[0]} with more than "
                     f"{MAX_ANSWER_BYTES // MiB} MiB, which no OpenAI-compatible server sends.",
                     "check that the URL points at an OpenAI-compatible server",
                     warnings=warnings)
    except (httpx.TransportError, ssl.SSLError) as exc:
        failed = _transport_failure(exc, where)
        return EndpointCheck(ok=False, message=failed.message, next_step=failed.next_step,
                             warnings=warnings)
    except httpx.InvalidURL as exc:
        return _fail(f"{url!r} is not a valid URL ({exc}).", "check the address for typos")
    except httpx.HTTPError as exc:
        return _fail(f"Talking to {where} failed ({exc.__class__.__name__}: {exc}).",
                     "check that the URL points at an OpenAI-compatible server",
                     warnings=warnings)


def _key_refused(resp: httpx.Response, where: str, api_key: str | None,
                 health_ok: bool | None, warnings: list[str],
                 models: list[str] | None = None) -> EndpointCheck:
    detail = _error_text(resp, api_key)
    # callers that know how the key was given (the setup flags, the wizard) say it better
    where_from = ("the environment variable it is read from: `--api-key-env NAME` on the "
                  "command line, remote.api_key_env in the config")
    if api_key:
        msg = (f"{where} refused the API key {mask_key(api_key)} ({resp.status_code}"
               f"{': ' + detail if detail else ''}).")
        step = f"check the key, or {where_from}"
        auth = "refused"
    else:
        msg = f"{where} needs an API key ({resp.status_code})."
        step = f"give one: put it in {where_from}, or enter it in `k3tui setup`"
        auth = "missing"
    return _fail(msg, step, models=models or [], health_ok=health_ok, warnings=warnings,
                 auth=auth)


def _run_checks(http: httpx.Client, root: str, v1: str, where: str, api_key: str | None,
                model: str | None, warnings: list[str]) -> EndpointCheck:
    # 1. /health: optional (hosted APIs have none); 503 means "up, still loading".
    health_ok: bool | None = None
    resp = _fetch(http, "GET", root + "/health")
    if resp.status_code == 200:
        health_ok = True
    elif resp.status_code == 503:
        return _fail(f"{where} is up but not ready: it is still loading the model (503).",
                     "wait until loading finishes (its log shows progress), then check again",
                     health_ok=False, warnings=warnings)
    # 2. /v1/models: names the model (and proves the key where the list is protected).
    resp = _fetch(http, "GET", v1 + "/models")
    if resp.status_code in (401, 403):
        return _key_refused(resp, where, api_key, health_ok, warnings)
    if resp.is_redirect:
        location = resp.headers.get("location", "?")
        return _fail(f"{where} redirects /v1/models to {location}.",
                     "use the address it redirects to (often https://…) as the URL",
                     health_ok=health_ok, warnings=warnings)
    if resp.status_code == 404:
        return _fail(f"{where} has no {urlsplit(v1).path}/models: not an OpenAI-compatible "
                     "server at this path.",
                     "use the server's root URL or its /v1 (e.g. http://host:8000/v1)",
                     health_ok=health_ok, warnings=warnings)
    if resp.status_code != 200:
        return _fail(f"{where} answered {resp.status_code} to /v1/models: "
                     f"{_error_text(resp, api_key)}.", "check the server's log",
                     health_ok=health_ok, warnings=warnings)
    try:
        data = _json(resp).get("data", [])
        ids = [clean(str(m["id"])[:MAX_MODEL_ID]) for m in data
               if isinstance(m, dict) and isinstance(m.get("id"), (str, int))]
        models = [i for i in ids if i.strip()]
    except (ValueError, AttributeError, TypeError):
        return _fail(f"{where}/v1/models did not return OpenAI-style JSON.",
                     "check that the URL points at an OpenAI-compatible server",
                     health_ok=health_ok, warnings=warnings)
    chosen = model or (models[0] if models else None)
    if model and models and model not in models:
        warnings.append(f"model {model!r} is not in the served list ({', '.join(models[:5])})")
    # 3. One token through the whole path: proves the model really answers.
    body: dict[str, Any] = {"model": chosen or "default", "max_tokens": 1, "stream": False,
                            "messages": [{"role": "user", "content": "Say OK."}]}
    resp = _fetch(http, "POST", v1 + "/chat/completions", json=body)
    if resp.status_code in (401, 403):  # some servers (llama-server) list models without a key
        return _key_refused(resp, where, api_key, health_ok, warnings, models)
    if resp.status_code != 200:
        hint = ("the model is still loading; wait and check again" if resp.status_code == 503
                else "pick a model from the list" if resp.status_code in (400, 404)
                else "check the server's log")
        return _fail(f"The test request to {where} failed ({resp.status_code}: "
                     f"{_error_text(resp, api_key)}).", hint,
                     models=models, health_ok=health_ok, warnings=warnings)
    try:
        choices = _json(resp)["choices"]
        assert isinstance(choices, list) and choices
    except (ValueError, KeyError, TypeError, AssertionError):
        return _fail(f"{where} answered the test request without choices.",
                     "check that it is an OpenAI-compatible chat server",
                     models=models, health_ok=health_ok, warnings=warnings)
    health = {True: "health ok", None: "no /health (fine)", False: "health failed"}[health_ok]
    key = f"key {mask_key(api_key)}" if api_key else "no key"
    return EndpointCheck(
        ok=True, models=models, health_ok=health_ok, test_ok=True, warnings=warnings,
        message=f"{where} works: {health}, {len(models)} model(s) "
                f"({', '.join(models[:3]) or 'unnamed'}), a one-token test answered ({key}).")
