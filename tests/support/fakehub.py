"""A loopback Hugging Face Hub for tests and `k3tui bench download` (stdlib only).

It serves one model repo from a local folder with the routes and headers huggingface_hub
2.x relies on (`/api/models/...`, `HEAD`/`GET /{repo}/resolve/{rev}/{file}`), an optional
"CDN" on a second port (another origin, as on the real Hub, so tokens must not follow the
redirect), gated/invalid-token answers, and per-file fault plans for the content GETs.

    hub = FakeHub(folder, "acme/tiny", cdn=True)
    hub.faults["model-00001.safetensors"] = [Fault.cut(5_000_000), Fault.status(503)]

Each GET of a file's bytes pops the next fault of that file. A hostile hub: `hub.listed_as`
lists a file under another name (`{"config.json": "../x"}`, then `rescan()`), and
`hub.wrong_sha256` advertises a wrong sha256 for the LFS files it names. `hub.log` records every
request (method, path, range, whether Authorization was sent, which port) and every body
sent (file, start, bytes actually written to the socket); `peak_in_flight[file]` is the
most answers of one file sent at once. Range is honoured as the Hub's CDN does: one
`bytes=a-b`, `a-` or `-n` gets 206 with Content-Range, one past the end 416, several 200;
`honour_range = False` is a server without Range support. The throttle caps each TCP
connection (across its keep-alive requests), like the CDN's per-connection cap.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from k3tui.units import MB, MiB


@dataclass
class Fault:
    """One misbehaviour for one content GET. Build with the classmethods."""

    kind: str            # cut | reset | status | stall | ignore_range | corrupt | hold | lie
    at: int = 0          # bytes of the body sent before the fault (relative to this response)
    status: int = 0
    seconds: float = 0.0
    event: threading.Event | None = None
    lie: str = ""

    @classmethod
    def range_lie(cls, lie: str) -> Fault:
        """A 206 whose headers lie: `total` (Content-Range names another file size),
        `garbage` (an unreadable Content-Range), `short` (a shorter range than asked, its
        bytes honest), `length` (Content-Length one KiB short of the Content-Range, and that
        many bytes sent)."""
        return cls("lie", lie=lie)

    @classmethod
    def cut(cls, at: int) -> Fault:
        """Send `at` body bytes, then close the connection cleanly (FIN)."""
        return cls("cut", at=at)

    @classmethod
    def reset(cls, at: int) -> Fault:
        """Send `at` body bytes, then reset the connection (RST)."""
        return cls("reset", at=at)

    @classmethod
    def http_status(cls, status: int) -> Fault:
        """Answer the GET with this status (429 carries Retry-After: 0)."""
        return cls("status", status=status)

    @classmethod
    def stall(cls, at: int, seconds: float) -> Fault:
        """Send `at` bytes, then go silent for `seconds`, then close."""
        return cls("stall", at=at, seconds=seconds)

    @classmethod
    def ignore_range(cls) -> Fault:
        """Answer a Range request with 200 and the whole file."""
        return cls("ignore_range")

    @classmethod
    def corrupt(cls, at: int) -> Fault:
        """Flip one byte at absolute file offset `at` in this response."""
        return cls("corrupt", at=at)

    @classmethod
    def hold(cls, at: int, event: threading.Event) -> Fault:
        """Send `at` bytes, then wait until `event` is set, then send the rest."""
        return cls("hold", at=at, event=event)


def _parse_range(value: str, size: int):
    """(start, end) of one `bytes=` range (end inclusive), "unsatisfiable", or None when the
    header is to be ignored (several ranges, another unit, unreadable): RFC 9110 §14."""
    unit, _, spec = value.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return None
    a, dash, b = spec.strip().partition("-")
    if not dash or not (a.isdigit() or b.isdigit()) or (a and not a.isdigit()) or \
            (b and not b.isdigit()):
        return None
    if not a:                                 # the last n bytes
        n = int(b)
        return (max(0, size - n), size - 1) if n and size else "unsatisfiable"
    start, end = int(a), min(int(b), size - 1) if b else size - 1
    if b and int(b) < start:
        return None
    return (start, end) if start < size else "unsatisfiable"


def _lie(lie: str, start: int, end: int, size: int) -> tuple[int, str]:
    """(Content-Length, Content-Range) of a 206 that lies (see Fault.range_lie)."""
    length = end - start + 1
    if lie == "total":
        return length, f"bytes {start}-{end}/{size + 1}"
    if lie == "garbage":
        return length, f"bytes {start}-/{size}; x"
    if lie == "short":
        half = max(1, length // 2)
        return half, f"bytes {start}-{start + half - 1}/{size}"
    assert lie == "length", lie
    return max(0, length - 1024), f"bytes {start}-{end}/{size}"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            h.update(block)
    return h.hexdigest()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], OSError):   # a client hanging up is normal here
            super().handle_error(request, client_address)


class FakeHub:
    def __init__(self, root: Path | str, repo_id: str, *, cdn: bool = False,
                 gated_token: str | None = None, noaccess_tokens: tuple[str, ...] = (),
                 lfs_min: int = MiB, host: str = "127.0.0.1", port: int = 0):
        self.root, self.repo_id, self.cdn = Path(root), repo_id, cdn
        self.gated_token, self.noaccess_tokens = gated_token, set(noaccess_tokens)
        self.lfs_min = lfs_min
        self.faults: dict[str, list[Fault]] = {}
        self.listed_as: dict[str, str] = {}         # real relative path → name in the listing
        self.wrong_sha256: set[str] = set()         # listed names whose sha256 is a lie
        self.throttle_bps: float | None = None      # per connection, as the Hub's CDN caps
        self.latency_s = 0.0                        # before each content answer (first byte)
        self.honour_range = True                    # False: every Range answered 200, whole
        self.in_flight: dict[str, int] = {}         # content answers being sent, per file
        self.peak_in_flight: dict[str, int] = {}
        self.log: list[dict] = []
        self.held: list[threading.Event] = []      # released by stop()
        self.lock = threading.RLock()
        self.files: dict[str, dict] = {}
        self.rescan()
        handler = self._handler_class()
        self.httpd = _Server((host, port), handler)
        self.endpoint = f"http://{host}:{self.httpd.server_address[1]}"
        self.servers = [self.httpd]
        if cdn:   # another origin: a second listener on its own port
            self.cdn_httpd = _Server((host, 0), handler)
            self.cdn_base = f"http://{host}:{self.cdn_httpd.server_address[1]}"
            self.servers.append(self.cdn_httpd)
        for srv in self.servers:
            threading.Thread(target=srv.serve_forever, daemon=True).start()

    # -- repo content -------------------------------------------------------------------
    def rescan(self) -> None:
        """(Re)index the folder: sizes, sha256 for LFS-sized files, git blob ids."""
        files = {}
        for full in sorted(p for p in self.root.rglob("*") if p.is_file()):
            rel = full.relative_to(self.root).as_posix()
            rel = self.listed_as.get(rel, rel)
            size = full.stat().st_size
            if size >= self.lfs_min:
                sha = _file_sha256(full)
                ptr = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\n"
                       f"size {size}\n").encode()
                files[rel] = {"path": rel, "full": full, "size": size, "sha256": sha,
                              "oid": git_blob_sha1(ptr), "lfs": {"oid": sha, "size": size,
                                                                  "pointerSize": len(ptr)}}
            else:
                oid = git_blob_sha1(full.read_bytes())
                files[rel] = {"path": rel, "full": full, "size": size, "sha256": None,
                              "oid": oid, "lfs": None}
        digest = hashlib.sha1(json.dumps([(f["path"], f["oid"]) for f in files.values()])
                              .encode()).hexdigest()
        with self.lock:
            self.files, self.commit = files, digest

    def stop(self) -> None:
        for event in self.held:
            event.set()
        for srv in self.servers:
            srv.shutdown()
            srv.server_close()

    def __enter__(self) -> FakeHub:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def body_bytes(self, name: str) -> int:
        """Bytes of `name` the hub wrote to sockets so far (all GETs)."""
        with self.lock:
            return sum(e["sent"] for e in self.log if e.get("event") == "body"
                       and e["file"] == name)

    def requests(self, **match) -> list[dict]:
        with self.lock:
            return [e for e in self.log if "method" in e
                    and all(e.get(k) == v for k, v in match.items())]

    # -- HTTP -----------------------------------------------------------------------------
    def _handler_class(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"     # keep-alive, so every answer has Content-Length

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.handle(self)

            do_GET = do_POST = do_HEAD

        return Handler

    def _send(self, h, status: int, body: bytes = b"", headers: dict | None = None,
              ctype: str = "application/json") -> bool:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)
        return True

    def _error(self, h, status: int, code: str | None, msg: str, extra: dict | None = None):
        headers = {"X-Error-Message": msg, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        return self._send(h, status, json.dumps({"error": msg}).encode(), headers)

    def _auth_ok(self, h, need_access: bool) -> bool:
        """Invalid token → 401 (any route); gated without access → 401/403 GatedRepo."""
        auth = h.headers.get("Authorization")
        token = auth.split(" ", 1)[1] if auth and " " in auth else None
        known = {self.gated_token, *self.noaccess_tokens} - {None}
        if token is not None and token not in known:
            self._error(h, 401, None, "Invalid credentials in Authorization header")
            return False
        if need_access and self.gated_token is not None and token != self.gated_token:
            self._error(h, 401 if token is None else 403, "GatedRepo",
                        f"Access to model {self.repo_id} is restricted and you are not in "
                        "the authorized list.")
            return False
        return True

    def _entry(self, f: dict) -> dict:
        e = {"type": "file", "path": f["path"], "size": f["size"], "oid": f["oid"]}
        if f["lfs"]:
            e["lfs"] = f["lfs"]
        return e

    def handle(self, h) -> None:
        u = urlsplit(h.path)
        path, qs = unquote(u.path), parse_qs(u.query)
        with self.lock:
            self.log.append({"method": h.command, "path": path, "range": h.headers.get("Range"),
                             "auth": "Authorization" in h.headers,
                             "port": h.server.server_address[1], "time": time.monotonic()})
            files, commit = self.files, self.commit
        api, res = f"/api/models/{self.repo_id}", f"/{self.repo_id}/resolve/"
        if path.startswith("/cdn/"):          # signed-URL stand-in: anyone may fetch
            f = next((f for f in files.values() if f["sha256"] == path[5:]), None)
            return self._body(h, f, commit) if f else self._error(h, 404, None, "no such blob")
        if path.startswith(api):              # metadata stays public when gated (like the Hub)
            if self._auth_ok(h, need_access=False):
                self._metadata(h, path[len(api):], qs, files, commit)
            return None
        if path.startswith(res):
            return self._resolve(h, path[len(res):], files, commit)
        return self._error(h, 404, "RepoNotFound", "Repository not found")

    def _metadata(self, h, rest: str, qs: dict, files: dict, commit: str) -> None:
        if rest == "/auth-check":
            if self._auth_ok(h, need_access=True):
                self._send(h, 200, b"{}")
        elif rest == "" or rest.startswith("/revision/"):
            rev = rest[len("/revision/"):] if rest else "main"
            if rev not in ("main", commit):
                return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
            info = {"id": self.repo_id, "modelId": self.repo_id, "sha": commit,
                    "private": False, "gated": "manual" if self.gated_token else False,
                    "siblings": [self._sibling(f, qs.get("blobs", ["false"])[0] == "true")
                                 for f in files.values()]}
            self._send(h, 200, json.dumps(info).encode())
        elif rest.startswith("/tree/"):
            self._send(h, 200, json.dumps([self._entry(f) for f in files.values()]).encode())
        elif rest.startswith("/paths-info/"):
            n = int(h.headers.get("Content-Length") or 0)
            form = parse_qs(h.rfile.read(n).decode())
            self._send(h, 200, json.dumps([self._entry(files[p]) for p in
                                           form.get("paths", []) if p in files]).encode())
        else:
            self._error(h, 404, "RepoNotFound", "Repository not found")
        return None

    def _sibling(self, f: dict, blobs: bool) -> dict:
        s: dict = {"rfilename": f["path"]}
        if blobs:
            s.update(size=f["size"], blobId=f["oid"])
            if f["lfs"]:
                sha = f["sha256"]
                if f["path"] in self.wrong_sha256:
                    sha = hashlib.sha256(b"not " + sha.encode()).hexdigest()
                s["lfs"] = {"sha256": sha, "size": f["size"],
                            "pointerSize": f["lfs"]["pointerSize"]}
        return s

    def _resolve(self, h, rest: str, files: dict, commit: str) -> None:
        rev, _, name = rest.partition("/")
        if rev not in ("main", commit) and self.listed_as:   # `main/../x` arrives as `x`
            rev, name = commit, rest
        if rev not in ("main", commit):
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if not self._auth_ok(h, need_access=True):
            return None
        f = files.get(name) or self._as_sent(name, files)
        if f is None:
            return self._error(h, 404, "EntryNotFound", f"{name} does not exist",
                               {"X-Repo-Commit": commit})
        if f["lfs"] and self.cdn:         # the Hub answers LFS files with a 302 to its CDN
            return self._send(h, 302, b"", {
                "Location": f"{self.cdn_base}/cdn/{f['sha256']}?sig=x",
                "X-Repo-Commit": commit, "ETag": f'"{f["oid"]}"',
                "X-Linked-Etag": f'"{f["sha256"]}"', "X-Linked-Size": str(f["size"])})
        return self._body(h, f, commit)

    @staticmethod
    def _as_sent(name: str, files: dict) -> dict | None:
        """A hostile listed name arrives as the client's URL library normalised it
        (`main/sub/../../x` → `x`): serve it by its last component, as a lax mirror would."""
        last = name.replace("\\", "/").rsplit("/", 1)[-1]
        return next((f for f in files.values()
                     if f["path"].replace("\\", "/").rsplit("/", 1)[-1] == last), None)

    def _body(self, h, f: dict, commit: str) -> None:
        size, start, end, status = f["size"], 0, f["size"] - 1, 200
        fault = None
        if h.command == "GET":
            with self.lock:
                plan = self.faults.get(f["path"])
                fault = plan.pop(0) if plan else None
                if fault is not None and fault.event is not None:
                    self.held.append(fault.event)
        if fault and fault.kind == "status":
            extra = {"Retry-After": "0"} if fault.status == 429 else {}
            h.close_connection = True
            return self._error(h, fault.status, None, f"fake hub says {fault.status}", extra)
        rng = h.headers.get("Range")
        if rng and self.honour_range and not (fault and fault.kind == "ignore_range"):
            got = _parse_range(rng, size)
            if got == "unsatisfiable":
                return self._error(h, 416, None, "range not satisfiable",
                                   {"Content-Range": f"bytes */{size}"})
            if got is not None:
                start, end, status = *got, 206
        etag = f["sha256"] if f["lfs"] else f["oid"]
        length, crange = end - start + 1, f"bytes {start}-{end}/{size}"
        if fault and fault.kind == "lie":
            status, length, crange = 206, *_lie(fault.lie, start, end, size)
        if self.latency_s and h.command == "GET":
            time.sleep(self.latency_s)
        h.send_response(status)
        h.send_header("Content-Type", "application/octet-stream")
        if self.honour_range:
            h.send_header("Accept-Ranges", "bytes")
        h.send_header("ETag", f'"{etag}"')
        h.send_header("X-Repo-Commit", commit)
        h.send_header("Content-Length", str(length))
        if status == 206:
            h.send_header("Content-Range", crange)
        h.end_headers()
        if h.command == "HEAD":
            return
        sent = 0
        name = f["path"]
        with self.lock:
            self.in_flight[name] = self.in_flight.get(name, 0) + 1
            self.peak_in_flight[name] = max(self.peak_in_flight.get(name, 0),
                                            self.in_flight[name])
        try:
            sent = self._stream(h, f, start, length, fault)
        finally:
            with self.lock:
                self.in_flight[name] -= 1
                self.log.append({"event": "body", "file": name, "start": start,
                                 "sent": sent, "fault": fault.kind if fault else None})

    def idle(self) -> bool:
        """No content answer is being sent (a killed client's answers have ended)."""
        with self.lock:
            return not any(self.in_flight.values())

    def _stream(self, h, f: dict, start: int, count: int, fault: Fault | None) -> int:
        """Write the body (or its faulty version); returns bytes handed to the socket."""
        sock = h.connection
        limit = count
        if fault and fault.kind in ("cut", "reset", "stall", "hold"):
            limit = min(fault.at, count)
        with open(f["full"], "rb") as fh:
            if fault is None and self.throttle_bps is None:
                h.wfile.flush()
                sent = 0
                while sent < count:       # sendfile: the hub costs the client no CPU
                    n = sock.sendfile(fh, start + sent, count - sent)
                    if not n:
                        break
                    sent += n
                return sent
            fh.seek(start)
            sent = self._paced(h, fh, start, limit, fault)
            if fault is None or fault.kind in ("ignore_range", "corrupt", "lie"):
                return sent
            return self._fault_end(h, sock, fh, start, sent, count, fault)

    def _paced(self, h, fh, start: int, limit: int, fault: Fault | None) -> int:
        """Up to `limit` bytes in small writes, throttled per connection (the handler is
        one per connection: its clock carries over keep-alive requests, idle time earns no
        credit), one byte flipped for "corrupt"."""
        sock, sent = h.connection, 0
        step = 256 << 10
        rate = self.throttle_bps
        if rate:                  # small steps, so a slow hub trickles instead of pausing
            step = int(min(step, max(4096, rate / 20)))
        while sent < limit:
            block = fh.read(min(step, limit - sent))
            if not block:
                break
            if fault and fault.kind == "corrupt" and start + sent <= fault.at < \
                    start + sent + len(block):
                i = fault.at - start - sent
                block = block[:i] + bytes([block[i] ^ 0xFF]) + block[i + 1:]
            if rate:
                due = max(getattr(h, "pace_due", 0.0), time.monotonic())
                h.pace_due = due + len(block) / rate
                if due > time.monotonic():
                    time.sleep(due - time.monotonic())
            sock.sendall(block)
            sent += len(block)
        return sent

    @staticmethod
    def _fault_end(h, sock, fh, start: int, sent: int, count: int, fault: Fault) -> int:
        """After the cut-off point: hold then finish, or stall / reset / close."""
        if fault.kind == "hold":
            assert fault.event is not None
            fault.event.wait()          # then send the rest as if nothing happened
            fh.seek(start + sent)
            while sent < count:
                block = fh.read(min(MiB, count - sent))
                sock.sendall(block)
                sent += len(block)
            return sent
        if fault.kind == "stall":
            time.sleep(fault.seconds)
        h.close_connection = True
        if fault.kind == "reset":     # SO_LINGER 0: close sends RST, not FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        else:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return sent


def main(argv: list[str] | None = None) -> int:
    """`python tests/support/fakehub.py DIR --repo acme/m`: serve until killed."""
    p = argparse.ArgumentParser(prog="python tests/support/fakehub.py")
    p.add_argument("folder")
    p.add_argument("--repo", default="acme/tiny")
    p.add_argument("--cdn", action="store_true", help="redirect LFS files to a second port")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--throttle-mbps", type=float, default=0.0, help="per-connection MB/s cap")
    p.add_argument("--latency-ms", type=float, default=0.0,
                   help="wait before each content answer (a CDN's time to first byte)")
    a = p.parse_args(argv)
    hub = FakeHub(a.folder, a.repo, cdn=a.cdn, port=a.port)
    if a.throttle_mbps:
        hub.throttle_bps = a.throttle_mbps * MB
    hub.latency_s = a.latency_ms / 1000
    print(f"endpoint {hub.endpoint}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        hub.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
