"""What a failed connection to a server means, in one sentence and a next step.

Below both clients of a remote server (endpoint.py's check and openai_stream.py's chat), so
an untrusted certificate reads the same in both and neither imports the other for it.
"""

from __future__ import annotations

import ssl

import httpx


def ssl_error(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error anywhere in an exception's chain, if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def describe_transport_error(exc: BaseException, where: str) -> tuple[str, str]:
    """(sentence, next step) for a connection that failed: certificate, TLS, DNS, refused."""
    tls = ssl_error(exc)
    if isinstance(tls, ssl.SSLCertVerificationError):
        reason = tls.verify_message or "certificate verification failed"
        return (f"The TLS certificate of {where} is not trusted ({reason}), so k3tui "
                "did not send the key.",
                "if the server uses a private CA, trust it: export SSL_CERT_FILE="
                "/path/to/ca.pem (the check and the chat both read it); turning "
                "verification off lets anyone in between read your key")
    if tls is not None:
        return (f"The TLS handshake with {where} failed ({tls.reason or tls}).",
                "check the scheme: https:// for a TLS server, http:// for a plain one")
    if isinstance(exc, httpx.TimeoutException):
        return (f"{where} did not answer within the time limit.",
                "check that the server is running and reachable from this machine")
    text = str(exc).lower()
    if "name or service not known" in text or "nodename nor servname" in text \
            or "temporary failure in name resolution" in text:
        return f"The host of {where} cannot be resolved.", "check the URL's host name"
    return (f"Nothing answers at {where} ({exc.__class__.__name__}: connection "
            "refused or unreachable).",
            "start the server first (`k3tui plan --recipe rpc|sglang|vllm` shows how), "
            "or check the URL and port")
