"""The engine's lowest room: the primitives every other room may import and that import
nothing of the engine but `engine.errors` and `engine.jsonfile` — the strict config.json
reader (config.py) and the O_DIRECT reads into aligned buffers (directio.py)."""
