"""Errors the engine raises for bad input; callers print them as one sentence."""


class EngineError(Exception):
    """A checkpoint, config, plan or I/O problem explained in one sentence."""


class ConfigError(EngineError):
    pass


class CheckpointError(EngineError):
    pass


class PlanError(EngineError):
    """A memory plan that cannot fit; the message carries the numbers."""


class ReadError(EngineError):
    """A short read or I/O error: generation stops rather than use missing weights."""
