"""llama.cpp `llama-server` as a supervised backend, with the DGX Spark lessons built in.

What the DGX Spark study had to discover by failing, done here for the user:
* `--cpu-moe` without `--no-host` asked for 545 GB of pinned host memory → always paired.
* `--mmap/--no-mmap` were removed from current builds → `--load-mode mmap`, but only when
  the binary's `--help` lists it (flags are detected, never assumed).
* page cache + another GPU user (ollama, 36 GiB) exhausted unified memory and froze the
  machine → a busy-GPU pre-flight guard, and a cgroup memory limit (systemd-run user scope
  with MemoryMax and MemorySwapMax=0, read back to prove it applies), no restart loop.
* empty answers after long reasoning → an explicit `--reasoning-budget`.

Rooms: `binary` (find/install the pinned build, what its --help supports), `gguf` (headers,
shards), `command` (the argv and why each flag is there), `server` (the busy-GPU guard, the
memory limit, start/readiness/exit story). Seams for tests: `help_text`/`version_text` on
`inspect_binary`, `runner` for the systemd-run check, `cgroup_dir` for the cgroup v2 subtree,
`report` for the probe.
"""
