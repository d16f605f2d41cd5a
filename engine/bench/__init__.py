"""Benchmarks that print ratios measured side by side in one run; `python -m engine bench
WHICH` runs one (the list, with what each compares, is in engine/commands/bench.py)."""
