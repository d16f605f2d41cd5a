"""`k3tui bench download`: k3tui's download loop vs `hf_hub_download`, same run, same hub.

A loopback fake hub (a subprocess, LFS files redirected to a "CDN" port like the real Hub)
serves a few hundred MB of random data. Both clients fetch every file, one file at a time
by default, alternating order over the rounds; the best wall time of each is compared.
k3tui also hashes (sha256) and fsyncs what it writes; hf_hub_download (HTTP path) checks
only the size. Every round, both clients' files are compared byte for byte with the source
(outside the timing): a fast client that fetched the wrong bytes fails the bench. Printed:
throughput ratio (k3tui / hf, target >= 1.0) and k3tui's CPU seconds per GB (process CPU
time: client threads only, the hub runs elsewhere).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from k3tui.units import GB, MB

REPO = "bench/model"


def _make_source(src: Path, total_mb: int, n_files: int) -> list[Path]:
    """Random (incompressible) shards; reused across runs when the sizes match."""
    size = total_mb * 1_000_000 // n_files
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


def _start_hub(src: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "k3tui.testing.fakehub", str(src),
                             "--repo", REPO, "--cdn"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    if not line or line[0] != "endpoint":
        proc.kill()
        raise RuntimeError("the loopback hub did not start")
    return proc, line[1]


def _timed(fn) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k3tui bench download", description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=int, default=400, help="total MB served (default 400)")
    p.add_argument("--files", type=int, default=4, help="number of files (default 4)")
    p.add_argument("--workers", type=int, default=1, help="files in parallel, both clients")
    p.add_argument("--rounds", type=int, default=2, help="rounds (best time counts)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--keep", action="store_true",
                   help="keep the last round's downloads (out-hf/, out-k3tui/ in the bench folder)")
    a = p.parse_args(argv)
    if a.size_mb < 1 or a.files < 1 or a.rounds < 1 or a.workers < 1:
        p.error("--size-mb, --files, --rounds and --workers must be positive")

    # huggingface_hub reads these at import: plain HTTP path, quiet, no telemetry call
    for k in ("HF_HUB_DISABLE_XET", "HF_HUB_DISABLE_TELEMETRY", "HF_HUB_DISABLE_PROGRESS_BARS"):
        os.environ[k] = "1"
    from k3tui.paths import get_paths

    base = get_paths().bench_dir / "download"
    src = base / "src"
    paths = _make_source(src, a.size_mb, a.files)
    total = sum(q.stat().st_size for q in paths)
    hub, endpoint = _start_hub(src)
    os.environ["HF_ENDPOINT"] = endpoint
    try:
        from huggingface_hub import hf_hub_download

        from k3tui.hub import Options, download, fetch_snapshot

        snap = fetch_snapshot(REPO, token=False)

        def run_hf(dest: Path) -> None:
            def one(name: str) -> None:
                hf_hub_download(REPO, name, revision=snap.commit, local_dir=dest,
                                endpoint=endpoint, token=False)
            with ThreadPoolExecutor(a.workers) as pool:
                list(pool.map(one, [f.name for f in snap.files]))

        def run_k3(dest: Path) -> None:
            res = download(snap, dest, workers=a.workers, opts=Options(token=None),
                           log=lambda m: None)
            if not res.ok:
                raise RuntimeError(f"k3tui download failed: {res.error}")

        results: dict[str, list[tuple[float, float]]] = {"hf": [], "k3tui": []}
        runners = {"hf": run_hf, "k3tui": run_k3}
        for r in range(a.rounds):
            order = ("hf", "k3tui") if r % 2 == 0 else ("k3tui", "hf")
            for who in order:
                dest = base / f"out-{who}"
                shutil.rmtree(dest, ignore_errors=True)
                results[who].append(_timed(lambda run=runners[who], d=dest: run(d)))
                for f in paths:
                    if not filecmp.cmp(f, dest / f.name, shallow=False):
                        raise RuntimeError(f"{who} produced a {f.name} unlike the source")
                if not (a.keep and r == a.rounds - 1):
                    shutil.rmtree(dest, ignore_errors=True)
    finally:
        hub.terminate()
        hub.wait(10)

    hf_s = min(w for w, _ in results["hf"])
    k3_s = min(w for w, _ in results["k3tui"])
    gb = total / GB
    out = {
        "bytes": total, "files": a.files, "workers": a.workers, "rounds": a.rounds,
        "hf_s": round(hf_s, 3), "k3tui_s": round(k3_s, 3),
        "hf_mb_s": round(total / hf_s / MB, 1), "k3tui_mb_s": round(total / k3_s / MB, 1),
        "ratio_vs_hf": round(hf_s / k3_s, 3),
        "cpu_s_per_gb": round(min(c for _, c in results["k3tui"]) / gb, 3),
        "hf_cpu_s_per_gb": round(min(c for _, c in results["hf"]) / gb, 3),
        "k3tui_hashes_sha256": True,
    }
    if a.json:
        print(json.dumps(out))
    else:
        print(f"served {total / MB:,.0f} MB in {a.files} files from a loopback hub "
              f"(CDN redirect), {a.workers} file(s) at a time, best of {a.rounds}")
        print(f"  hf_hub_download : {out['hf_mb_s']:8.1f} MB/s  "
              f"{out['hf_cpu_s_per_gb']:.2f} CPU s/GB  (size check only)")
        print(f"  k3tui download  : {out['k3tui_mb_s']:8.1f} MB/s  "
              f"{out['cpu_s_per_gb']:.2f} CPU s/GB  (sha256 + fsync + resumable)")
        print(f"  ratio_vs_hf {out['ratio_vs_hf']:.2f}  (k3tui throughput / hf; target >= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
