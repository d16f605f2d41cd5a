"""A recorded nvidia-smi: `python fake_nvidia_smi.py DIR --query-…=FIELDS --format=…`.

Prints DIR's recording for the query, with nvidia-smi's exit codes for what it cannot do:
an unknown query field (older drivers, e.g. `addressing_mode`) and a missing driver.
"""

import sys
from pathlib import Path

folder = Path(sys.argv[1])
args = sys.argv[2:]
if (folder / "error.txt").exists():
    sys.stdout.write((folder / "error.txt").read_text())
    sys.exit(9)
query = next((a for a in args if a.startswith("--query-")), "")
kind, _, fields = query[len("--query-"):].partition("=")
name = "addressing_mode.csv" if fields == "addressing_mode" else \
    {"gpu": "query-gpu.csv", "compute-apps": "compute-apps.csv"}.get(kind, "unknown")
if not (folder / name).exists():
    print(f'Field "{fields}" is not a valid field to query.')
    sys.exit(2)
sys.stdout.write((folder / name).read_text())
