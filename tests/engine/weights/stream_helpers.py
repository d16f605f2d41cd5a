"""Helpers for the streaming-source tests."""

from __future__ import annotations


class Recorder:
    """Forwards to a StreamingSource (expert guesses too) and records each experts() call
    with the experts that were resident before it."""

    def __init__(self, src):
        self.src = src
        self.index = src.index
        self.wants_guesses = src.wants_guesses
        self.calls: list[tuple[int, list[int], set]] = []

    def layer(self, i):
        return self.src.layer(i)

    def guess(self, layer, ids):
        self.src.guess(layer, ids)

    def resident_layer(self, index):
        return self.src.resident_layer(index)

    def experts(self, layer, ids):
        self.calls.append((layer, list(ids), set(self.src.cache.resident())))
        return self.src.experts(layer, ids)

    def model_tensor(self, name):
        return self.src.model_tensor(name)

    def stats(self):
        return self.src.stats()
