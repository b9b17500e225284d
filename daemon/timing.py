"""Timing: named spans of one operation (`Phases`: where a start, a sleep or a turn went) and the latest
samples of a recurring one (`Latency`: p50/p99/max)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

__all__ = ["Latency", "Phases"]


class Phases:
    """Where an operation went: named spans, each in ms from the mark before it (the first from `since`, a
    `time.perf_counter()` reading, else from when this was made)."""

    def __init__(self, since: float | None = None) -> None:
        self._last = time.perf_counter() if since is None else since
        self.origin = self._last  # the first span's start (what `elapsed_ms` counts from)
        self.ms: dict[str, float] = {}

    def elapsed_ms(self, at: float) -> float:
        """`at` (a `time.perf_counter()` reading) in ms from the first span's start."""
        return round((at - self.origin) * 1000, 1)

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.ms[name] = round((now - self._last) * 1000, 1)
        self._last = now


class Latency:
    """The last `kept` samples of one operation's duration, in ms."""

    def __init__(self, kept: int = 1024) -> None:
        self.samples: deque[float] = deque(maxlen=kept)

    def add(self, ms: float) -> None:
        self.samples.append(ms)

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
        ordered = sorted(self.samples)
        pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)  # noqa: E731
        return {"count": len(ordered), "p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": pick(1.0)}
