"""`python -m engine serve`: the wire protocol — requests, errors, typed answer events and
their SSE / JSON form (protocol.py) —, the generation worker (worker.py) and the routes and
uvicorn wiring (app.py)."""
