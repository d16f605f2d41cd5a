"""Where the model's bytes come from: the `WeightSource` protocol (source.py), the resident
source, and the streaming one under a memory budget — the expert cache (experts.py), the
ring of read-ahead slots over `engine.core.directio`, the I/O schedule the model's math
stays out of (schedule.py), the budget planner (planner.py; geometry.py plans without
weights) and the machine's memory facts (sysmem.py)."""
