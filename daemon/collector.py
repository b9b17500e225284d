"""Python's garbage collector: its pauses watched, and the daemon's start-up objects kept out of them.

A full collection (generation 2) walks every tracked object; after its imports and the model's load a
daemon holds about 80,000 of them, and a full collection took 35 ms on the 2-core VM. It runs on the
thread whose allocation tripped it: on the engine thread that is one decode step longer by that much,
the long gaps a decoding neighbour saw during a prefill (docs/decisions.md). `freeze()` after start-up
moves what exists into the permanent generation, which collections skip: those objects live as long as
the daemon anyway. `Collector` times every collection per generation (`status.gc`).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from kvwake.daemon.phases import Latency

__all__ = ["Collector"]


class Collector:
    """Counts and times the collector's runs per generation, from `install()` on."""

    def __init__(self, kept: int = 256) -> None:
        self.counts = [0, 0, 0]
        self.pauses = [Latency(kept) for _ in range(3)]
        self._began: float | None = None

    def install(self) -> Collector:
        if self._observe not in gc.callbacks:
            gc.callbacks.append(self._observe)
        return self

    def uninstall(self) -> None:
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        """gc's callback: runs with the GIL held on the collecting thread; collections do not nest."""
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            generation = info["generation"]
            self.counts[generation] += 1
            self.pauses[generation].add((time.perf_counter() - self._began) * 1000)
            self._began = None

    @staticmethod
    def freeze() -> int:
        """Move every object tracked now into the permanent generation (once start-up is done); returns how
        many are frozen in all."""
        gc.freeze()
        return gc.get_freeze_count()

    def summary(self) -> dict[str, Any]:
        """{"frozen": objects in the permanent generation, "generations": [{"collections", and "p50_ms",
        "p99_ms", "max_ms" of the latest runs} for generations 0, 1, 2]}."""
        return {"frozen": gc.get_freeze_count(),
                "generations": [{"collections": n, **{k: v for k, v in p.summary().items() if k != "count"}}
                                for n, p in zip(self.counts, self.pauses)]}
