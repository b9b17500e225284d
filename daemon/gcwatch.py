"""Python's garbage collector, watched: every run counted and timed per generation (`status.gc`).

A full collection (generation 2) walks every tracked object; after its imports and the model's load a
daemon holds tens of thousands of them, and a full collection of that many runs on whichever thread's
allocation tripped it: on the engine thread, one decode step longer by that much. Suspected of the long
gaps a decoding neighbour saw during a prefill, it was measured there instead (bench/batching.py's
prefill row; docs/decisions.md, "Batched generation (issue 11)"): only short generation-0 runs, no
full one, and freezing the start's objects out of reach (`gc.freeze()`) changed nothing there. A model's
load is where a full collection does run (its allocations trip it, and every thread waits): the collector
is off while a model loads and what the process holds is frozen after (model/switching.py). `status.gc`
keeps the question answerable on any machine.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from kvwake.daemon.timing import Latency

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

    def summary(self) -> dict[str, Any]:
        """{"frozen": objects in the permanent generation (gc.freeze), "generations": [{"collections", and
        "p50_ms", "p99_ms", "max_ms" of the latest runs} for generations 0, 1, 2]}."""
        return {"frozen": gc.get_freeze_count(),
                "generations": [{"collections": n, **{k: v for k, v in p.summary().items() if k != "count"}}
                                for n, p in zip(self.counts, self.pauses)]}
