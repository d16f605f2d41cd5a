"""`k3tui bench download`: k3tui's downloader vs `snapshot_download`, same run, same hub.

A loopback fake hub (tests/support/fakehub.py in a subprocess, LFS files redirected to a
"CDN" port like the real Hub; it is test support, so this runs from a clone, not a wheel)
serves a few hundred MB of random data, unthrottled and then with a per-connection cap
(as the Hub's CDN caps each connection). Both clients fetch the snapshot with their
default parallelism (snapshot_download: one connection per file, up to 8; k3tui: 8
connections over 64 MiB ranges, so one large file is fetched over several), alternating
order over the rounds; the best wall time of each is compared. k3tui also hashes (sha256) and fsyncs
what it writes; snapshot_download (HTTP path) checks only the size. Printed: throughput
ratio (k3tui / snapshot_download, target >= 1.0) and k3tui's CPU seconds per GB (process
CPU time: client threads only, the hub runs elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from k3tui.errors import K3Error
from k3tui.units import GB, MB, MiB

REPO = "bench/model"
# The loopback hub is the tests' fake: it is in a clone, next to the package, never in a wheel.
FAKEHUB = Path(__file__).resolve().parents[2] / "tests" / "support" / "fakehub.py"


def _make_source(src: Path, total_mb: int, n_files: int) -> list[Path]:
    """Random (incompressible) shards; reused across runs when the sizes match."""
    size = total_mb * MB // n_files
    src.mkdir(parents=True, exist_ok=True)
    want = {f"model-{i + 1:05d}-of-{n_files:05d}.safetensors" for i in range(n_files)}
    for old in src.iterdir():
        if old.name not in want or old.stat().st_size != size:
            old.unlink()
    paths = []
    for name in sorted(want):
        p = src / name
        if not p.exists():
            with open(p, "wb") as fh:
                left = size
                while left:
                    n = min(left, 16 << 20)
                    fh.write(os.urandom(n))
                    left -= n
        paths.append(p)
    return paths


def _start_hub(src: Path, throttle_mbps: float = 0.0,
               latency_ms: float = 0.0) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, str(FAKEHUB), str(src), "--repo", REPO, "--cdn",
           "--latency-ms", str(latency_ms)]
    if throttle_mbps:
        cmd += ["--throttle-mbps", str(throttle_mbps)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    if not line or line[0] != "endpoint":
        proc.kill()
        raise RuntimeError("the loopback hub did not start")
    return proc, line[1]


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def _timed(fn) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def _compare(src: Path, paths: list[Path], base: Path, rounds: int,
             throttle_mbps: float, a: argparse.Namespace) -> dict:
    """Both clients with their default parallelism on one hub, alternating order."""
    hub, endpoint = _start_hub(src, throttle_mbps, a.latency_ms)
    os.environ["HF_ENDPOINT"] = endpoint
    try:
        from huggingface_hub import snapshot_download

        from k3tui.hub import Options, download, fetch_snapshot
        from k3tui.hub.sync import WORKERS

        snap = fetch_snapshot(REPO, token=False)

        def run_hf(dest: Path) -> None:
            snapshot_download(REPO, revision=snap.commit, local_dir=dest, endpoint=endpoint,
                              token=False)

        def run_k3(dest: Path) -> None:
            res = download(snap, dest, workers=a.workers or WORKERS, log=lambda m: None,
                           opts=Options(token=None, **({"range_bytes": a.range_mib * MiB}
                                                       if a.range_mib else {})))
            if not res.ok:
                raise RuntimeError(f"k3tui download failed: {res.error}")

        results: dict[str, list[tuple[float, float]]] = {"hf": [], "k3tui": []}
        runners = {"hf": run_hf, "k3tui": run_k3}
        for r in range(rounds):
            for who in (("hf", "k3tui") if r % 2 == 0 else ("k3tui", "hf")):
                dest = base / f"out-{who}"
                shutil.rmtree(dest, ignore_errors=True)
                results[who].append(_timed(lambda run=runners[who], d=dest: run(d)))
                for f in paths:
                    if (dest / f.name).stat().st_size != f.stat().st_size:
                        raise RuntimeError(f"{who} produced a wrong-size {f.name}")
                shutil.rmtree(dest, ignore_errors=True)
    finally:
        hub.terminate()
        hub.wait(10)
    total = sum(q.stat().st_size for q in paths)
    hf_s = min(w for w, _ in results["hf"])
    k3_s = min(w for w, _ in results["k3tui"])
    return {"throttle_mb_s_per_connection": throttle_mbps or None, "hf_s": hf_s,
            "k3tui_s": k3_s, "hf_mb_s": total / hf_s / MB, "k3tui_mb_s": total / k3_s / MB,
            "ratio_vs_hf": hf_s / k3_s,
            "cpu_s_per_gb": min(c for _, c in results["k3tui"]) / (total / GB),
            "hf_cpu_s_per_gb": min(c for _, c in results["hf"]) / (total / GB)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k3tui bench download", description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=int, default=400, help="total MB served (default 400)")
    p.add_argument("--files", type=int, default=4, help="number of files (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (best time counts)")
    p.add_argument("--throttle-mbps", type=float, default=50.0,
                   help="per-connection cap of the throttled run (0: unthrottled only)")
    p.add_argument("--latency-ms", type=float, default=0.0,
                   help="the hub waits this long before each content answer (a CDN's time "
                   "to first byte; default 0)")
    p.add_argument("--workers", type=int, default=0,
                   help="k3tui's connections (default: its default, 8); for a sweep")
    p.add_argument("--range-mib", type=int, default=0,
                   help="k3tui's range size in MiB (default: its default, 64); for a sweep")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--keep", action="store_true",
                   help="keep the last round's downloads (out-hf/, out-k3tui/ in the bench folder)")
    a = p.parse_args(argv)
    if not FAKEHUB.is_file():
        raise K3Error(f"`k3tui bench download` serves its files from the tests' loopback hub "
                      f"({FAKEHUB} is missing: an installed wheel has no tests).",
                      "run it from a clone: `git clone …; pip install -e '.[test]'`", 2)
    if a.size_mb < 1 or a.files < 1 or a.rounds < 1 or min(a.throttle_mbps, a.latency_ms,
                                                            a.workers, a.range_mib) < 0:
        p.error("--size-mb, --files and --rounds must be positive, the others >= 0")

    # huggingface_hub reads these at import: plain HTTP path, quiet, no telemetry call
    for k in ("HF_HUB_DISABLE_XET", "HF_HUB_DISABLE_TELEMETRY", "HF_HUB_DISABLE_PROGRESS_BARS"):
        os.environ[k] = "1"
    from k3tui.paths import get_paths

    base = get_paths().bench_dir / "download"
    src = base / "src"
    paths = _make_source(src, a.size_mb, a.files)
    load_before = _loadavg()
    runs = [_compare(src, paths, base, a.rounds, t, a)
            for t in ([0.0, a.throttle_mbps] if a.throttle_mbps else [0.0])]
    from k3tui.hub.sync import WORKERS
    from k3tui.hub.transfer import RANGE_BYTES

    out = {"bytes": sum(q.stat().st_size for q in paths), "files": a.files,
           "rounds": a.rounds, "reference": "huggingface_hub.snapshot_download",
           "latency_ms": a.latency_ms, "k3tui_connections": a.workers or WORKERS,
           "k3tui_range_mib": a.range_mib or RANGE_BYTES // MiB,
           "hf_connections": min(8, a.files), "loadavg": load_before,
           "k3tui_hashes_sha256": True, **runs[0], "runs": runs}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"served {out['bytes'] / MB:,.0f} MB in {a.files} files from a loopback hub "
          f"(CDN redirect, {a.latency_ms:g} ms to first byte), best of {a.rounds}; "
          f"load before {out['loadavg']}")
    print(f"  snapshot_download: {out['hf_connections']} connections (one per file); "
          f"k3tui: {out['k3tui_connections']} connections, "
          f"{out['k3tui_range_mib']} MiB ranges")
    for r in runs:
        cap = r["throttle_mb_s_per_connection"]
        print(f"  {'unthrottled' if not cap else f'{cap:g} MB/s per connection'}:")
        print(f"    snapshot_download: {r['hf_mb_s']:8.1f} MB/s  "
              f"{r['hf_cpu_s_per_gb']:.2f} CPU s/GB  (size check only)")
        print(f"    k3tui download   : {r['k3tui_mb_s']:8.1f} MB/s  "
              f"{r['cpu_s_per_gb']:.2f} CPU s/GB  (sha256 + fsync + resumable)")
        print(f"    ratio_vs_hf {r['ratio_vs_hf']:.2f}  (k3tui throughput / hf; target >= 1.0)")
    print(f"  load after: {_loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
