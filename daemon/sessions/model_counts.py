"""The sessions of each model, counted as entries come, go and are claimed (`Entries.models`).

So what asks about one model's sessions (status's counts per model, whether a model is in use before it is
unloaded) reads two counters instead of walking every session known: thousands of asleep conversations
are a supported scale. Counted by `Entry.model` (None: the default model), which changes only through
`Entries.rebind`.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

__all__ = ["ModelCounts"]


class Counted(Protocol):
    model: str | None
    busy: str | None


class ModelCounts:
    """Per model name (as entries hold it): the sessions known, and those claimed now (busy)."""

    def __init__(self) -> None:
        self.known: Counter[str | None] = Counter()
        self.busy: Counter[str | None] = Counter()

    def add(self, entry: Counted) -> None:
        self.known[entry.model] += 1
        self.busy[entry.model] += entry.busy is not None

    def remove(self, entry: Counted) -> None:
        self.known[entry.model] -= 1
        self.busy[entry.model] -= entry.busy is not None

    def claimed(self, entry: Counted, was: str | None, now: str | None) -> None:
        """An entry's claim changed from `was` to `now` (None: idle)."""
        self.busy[entry.model] += (now is not None) - (was is not None)

    def claims(self) -> int:
        """Sessions claimed now, of every model."""
        return sum(self.busy.values())
