"""Where the model's bytes come from: the `WeightSource` protocol (source.py), the resident
source, and the streaming one under a memory budget — direct I/O (io.py), the expert cache
(experts.py), the budget planner (planner.py) and the machine's memory facts (sysmem.py)."""
