"""What the session manager keeps per session (`Entry`) and per operation (`Latency`)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvwake.daemon.session import Session

__all__ = ["Entry", "Latency"]


class Latency:
    """The last 1024 samples of one operation's duration, in ms."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=1024)

    def add(self, ms: float) -> None:
        self.samples.append(ms)

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {"count": 0, "p50_ms": None, "p99_ms": None}
        ordered = sorted(self.samples)
        pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)  # noqa: E731
        return {"count": len(ordered), "p50_ms": pick(0.5), "p99_ms": pick(0.99)}


@dataclass
class Entry:
    """A session the daemon knows: `session` is None while it sleeps."""

    id: str
    session: Session | None = None
    busy: str | None = None
    last_used: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.time)
