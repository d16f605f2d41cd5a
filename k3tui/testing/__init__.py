"""Test fakes for what cannot run here (the Hub, a model backend) and the screenshot scenes:
used by the tests, the benchmarks and scripts/screenshots.py, never by product code paths
(an import-linter contract in pyproject.toml keeps it so)."""
