"""What the Hub says about a repo: files, sizes, hashes, the pinned commit, access, and the
one order in which Hugging Face tokens count (`hub_tokens`).

huggingface_hub does what it is good at here (URLs, auth headers, typed errors); the bytes
are fetched by `k3tui.hub.transfer`. Every call carries a timeout: `model_info` without one
can hang forever.
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from k3tui.errors import K3Error

META_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None      # LFS files
    blob_id: str | None     # git blob sha1, used to verify small non-LFS files


@dataclass(frozen=True)
class RepoSnapshot:
    repo: str
    revision: str           # what the user asked for
    commit: str             # pinned for the whole download
    files: tuple[RemoteFile, ...]
    gated: bool
    endpoint: str

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def hub_endpoint() -> str:
    """`HF_ENDPOINT` as huggingface_hub reads it (read now, so a job's env applies)."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


@dataclass(frozen=True)
class HubToken:
    """A Hugging Face token on hand, where it lives, and how to replace it there."""

    value: str
    where: str    # "the HF_TOKEN environment variable", "your `hf auth login` token (PATH)"…
    origin: str   # the words that follow "The Hugging Face token" (never the token itself)
    replace: str  # how to put a new one there
    stored_by_setup: bool = False


NEW_TOKEN = "export HF_TOKEN=<a new token from huggingface.co/settings/tokens>"


def login_token_path() -> Path:
    """Where `hf auth login` saves its token (huggingface_hub's rule, read now, so a job's
    environment applies)."""
    if os.environ.get("HF_TOKEN_PATH"):
        return Path(os.environ["HF_TOKEN_PATH"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "token"


def hub_tokens() -> list[HubToken]:
    """Every token on hand, in THE order k3tui uses (huggingface_hub's, then k3tui's own):
    HF_TOKEN (or the older HUGGING_FACE_HUB_TOKEN), then `hf auth login`'s token, then the one
    `k3tui setup` stored in credentials.toml. The first one is the token that is sent, so
    `k3tui setup` and `k3tui download` never disagree about which one counts."""
    from k3tui.config import load_credentials
    from k3tui.paths import get_paths

    found = [HubToken(value, f"the {var} environment variable", f"in {var}", NEW_TOKEN)
             for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
             if (value := (os.environ.get(var) or "").strip())]
    login = login_token_path()
    try:
        value = login.read_text().strip() if login.is_file() else ""
    except (OSError, UnicodeDecodeError):
        value = ""
    if value:
        found.append(HubToken(value, f"your `hf auth login` token ({login})",
                              f"saved by `hf auth login` ({login})",
                              f"run `hf auth login` with a new token, or {NEW_TOKEN}"))
    stored = str(load_credentials().get("hf_token") or "").strip()
    if stored:
        creds = get_paths().credentials_file
        found.append(HubToken(stored, f"{creds}", f"that `k3tui setup` stored in {creds}",
                              f"run `k3tui setup` and paste a new token when it asks, or "
                              f"{NEW_TOKEN} (it takes precedence)", stored_by_setup=True))
    return found


def hub_token_source() -> HubToken | None:
    """The token a Hub request sends (None: none, or HF_HUB_DISABLE_IMPLICIT_TOKEN is set)."""
    if os.environ.get("HF_HUB_DISABLE_IMPLICIT_TOKEN"):
        return None
    found = hub_tokens()
    return found[0] if found else None


def hub_token() -> str | None:
    source = hub_token_source()
    return source.value if source else None


def token_origin(token: str) -> tuple[str, str]:
    """Where `token` comes from (words that follow "The Hugging Face token") and how to
    replace it from there."""
    source = next((t for t in hub_tokens() if t.value == token), None)
    return (source.origin, source.replace) if source else ("", "use a valid token")


def redact(text: str) -> str:
    """Drop URL query strings (signed CDN URLs) from anything we log or show."""
    return re.sub(r"(https?://[^\s'\"?]+)\?[^\s'\"]*", r"\1?…", text)


def http():
    """The HTTP client module huggingface_hub itself uses (httpx2 in 2.x). Plain `httpx`
    would also import rich (its CLI), which core modules must not pull in."""
    try:
        from huggingface_hub.utils import httpx as mod
    except ImportError:   # huggingface_hub < 1.31
        import httpx as mod
    return mod


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: transport failures, timeouts, 408/429/5xx."""
    from huggingface_hub.errors import HfHubHTTPError

    httpx = http()
    if isinstance(exc, (httpx.TransportError, TimeoutError, ConnectionError)):
        return True
    status = _status(exc)
    if isinstance(exc, (HfHubHTTPError, httpx.HTTPStatusError)) and status is not None:
        return status in (408, 429) or status >= 500
    return False


def _status(exc: BaseException) -> int | None:
    resp = getattr(exc, "response", None)
    return getattr(resp, "status_code", None)


def explain(exc: BaseException, repo: str, revision: str = "main",
            token_sent: bool | str = False) -> K3Error:
    """Turn a huggingface_hub / httpx error into one sentence and the next step.

    `token_sent` is the token that was sent (or just True/False): with the token, the advice
    names where it came from (HF_TOKEN, `hf auth login`, or the one `k3tui setup` stored)."""
    from huggingface_hub import errors as e

    from k3tui.paths import get_paths

    page = f"{hub_endpoint()}/{repo}"
    status = _status(exc)
    origin, replace_token = (token_origin(token_sent) if isinstance(token_sent, str)
                             and token_sent else ("", "use a valid token"))
    from_origin = f" {origin}" if origin else ""
    give_token = ("set HF_TOKEN, run `hf auth login`, or paste it into `k3tui setup` (stored "
                  f"0600 in {get_paths().credentials_file})")
    if isinstance(exc, e.OfflineModeIsEnabled):
        return K3Error("HF_HUB_OFFLINE is set, so the Hub cannot be asked for the file list.",
                       "unset HF_HUB_OFFLINE to download", 2)
    if isinstance(exc, e.GatedRepoError):     # subclass of RepositoryNotFoundError: first
        if status == 403:
            return K3Error(f"The Hugging Face token{from_origin} has no access to {repo} yet.",
                           f"request or accept access on {page} with the account that token "
                           "belongs to (manual approval can take time), then rerun")
        if token_sent:
            return K3Error(f"The Hugging Face token{from_origin} was refused (invalid or "
                           f"expired), and {repo} is gated.",
                           replace_token + ", then rerun")
        return K3Error(f"{repo} is gated: downloading it needs a Hugging Face token.",
                       f"accept the terms on {page}, then {give_token}, and rerun")
    if isinstance(exc, e.RevisionNotFoundError):
        return K3Error(f"{repo} has no revision '{revision}'.",
                       "check --revision (a branch, tag or 40-hex commit)")
    if isinstance(exc, e.RepositoryNotFoundError):
        return K3Error(f"Repository {repo} was not found (or it is private).",
                       "check the name (owner/model) and, for a private repo, your token")
    if isinstance(exc, e.RemoteEntryNotFoundError):
        return K3Error(f"A file of {repo} disappeared from the Hub during the download.",
                       "rerun `k3tui download` to pick up the repo's current file list")
    if status == 401:
        if token_sent:
            return K3Error(f"The Hugging Face token{from_origin} was refused (invalid or "
                           "expired).", replace_token + ", then rerun")
        return K3Error(f"The Hub refused access to {repo} without a token.",
                       f"{give_token}, then rerun")
    if status == 403:
        return K3Error(f"The Hub refused access to {repo} (403).",
                       f"check the permissions of the token{from_origin} and the repo page "
                       f"{page}")
    if is_transient(exc):
        return K3Error(f"Could not reach the Hub at {hub_endpoint()} ({type(exc).__name__}).",
                       "check the network (or HF_ENDPOINT) and rerun; nothing is lost")
    return K3Error(redact(f"The Hub answered with an error: {exc}".split("\n")[0]),
                   "rerun; if it persists, check the repo page " + page)


_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9_.-]{1,96}")


def check_repo_id(repo: str) -> str:
    """Refuse what cannot be a Hub model id (OWNER/NAME of letters, digits, '-', '_', '.')
    before any request: a typo then gets one line instead of a 404 after a round trip."""
    name = repo.partition("/")[2]
    if not _REPO_ID.fullmatch(repo) or ".." in repo or "--" in repo or \
            name.startswith((".", "-")) or name.endswith((".", ".git")):
        raise K3Error(f"{repo!r} is not a Hub repo id (it must be OWNER/NAME, e.g. "
                      "moonshotai/Kimi-K3).", "give the full id: `k3tui download OWNER/NAME`", 2)
    return repo


def fetch_snapshot(repo: str, revision: str = "main", include: list[str] | None = None, *,
                   token: str | None | bool = None, timeout: float = META_TIMEOUT_S,
                   attempts: int = 4, backoff_s: float = 1.0) -> RepoSnapshot:
    """One `model_info(files_metadata=True)`: every file's size and sha256 + the commit.

    Transient errors are retried a few times; anything else becomes a K3Error.
    `include` filters by glob (a file matching any glob is kept).
    """
    from huggingface_hub import HfApi

    check_repo_id(repo)
    if token is None:
        token = hub_token()
    endpoint = hub_endpoint()
    api = HfApi(endpoint=endpoint, token=token if token else False)
    for attempt in range(attempts):
        try:
            info = api.model_info(repo, revision=revision, files_metadata=True,
                                  timeout=timeout)
            break
        except Exception as exc:
            if not is_transient(exc) or attempt == attempts - 1:
                raise explain(exc, repo, revision, token_sent=token or False) from None
            time.sleep(backoff_s * 2 ** attempt)
    files = []
    for s in info.siblings or []:
        if include and not any(fnmatch.fnmatch(s.rfilename, g) for g in include):
            continue
        lfs = s.lfs
        size = lfs.size if lfs is not None else s.size
        if size is None:
            raise K3Error(f"The Hub did not report the size of {s.rfilename}.",
                          "rerun; if it persists, report the repo and HF_ENDPOINT")
        files.append(RemoteFile(s.rfilename, int(size), lfs.sha256 if lfs else None,
                                s.blob_id))
    if include and not files:
        raise K3Error(f"No file of {repo} matches --include {' '.join(include)}.",
                      "check the globs (quote them so the shell does not expand them)")
    return RepoSnapshot(repo, revision, info.sha or revision, tuple(files),
                        bool(info.gated), endpoint)


def check_access(snapshot: RepoSnapshot, *, token: str | None | bool = None,
                 timeout: float = META_TIMEOUT_S) -> None:
    """HEAD the first file: gated/invalid-token errors surface before any job starts."""
    if not snapshot.files:
        return
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    if token is None:
        token = hub_token()
    url = hf_hub_url(snapshot.repo, snapshot.files[0].name, revision=snapshot.commit,
                     endpoint=snapshot.endpoint)
    try:
        get_hf_file_metadata(url, token=token if token else False, timeout=timeout)
    except Exception as exc:
        if is_transient(exc):
            return   # the download loop retries these; only refusals matter here
        raise explain(exc, snapshot.repo, snapshot.revision,
                      token_sent=token or False) from None
