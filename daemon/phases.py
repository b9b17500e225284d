"""Named spans of one operation, in ms: where a daemon's start, a sleep or a turn went."""

from __future__ import annotations

import time

__all__ = ["Phases"]


class Phases:
    """Where an operation went: named spans, each in ms from the mark before it (the first from `since`, a
    `time.perf_counter()` reading, else from when this was made)."""

    def __init__(self, since: float | None = None) -> None:
        self._last = time.perf_counter() if since is None else since
        self.ms: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.ms[name] = round((now - self._last) * 1000, 1)
        self._last = now
