"""Where the model's bytes come from: the `WeightSource` protocol (source.py), the resident
source, and the streaming one under a memory budget — the expert cache (experts.py), the
ring of read-ahead slots over `engine.core.directio`, the budget planner (planner.py) and
the machine's memory facts (sysmem.py)."""
