"""Decoding: the loop (generate.py), sampling (sampler.py), the demo model's steering
(steer.py) and the one typed per-token statistics record (stats.py)."""
