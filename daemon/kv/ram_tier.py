"""The RAM tier of the prefix cache: decoded blocks, least recently used out first.

Popular prefixes (a system prompt every agent starts with) are served from here
without touching the disk or the decompressor. Entries are the verified,
decoded arrays the store returned, keyed by chain key (which names the whole
prefix and the bundle, so an entry can never serve another model). Bounded by
bytes; a block larger than the whole budget is simply not kept. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvwake.store import Tensor

__all__ = ["RamTier"]

Arrays = dict[str, Tensor]


def nbytes(arrays: Arrays) -> int:
    return sum(t.array.nbytes for t in arrays.values())


class RamTier:
    """An LRU map chain key -> decoded block arrays, at most `budget_bytes` in total."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._items: OrderedDict[str, Arrays] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> Arrays | None:
        with self._lock:
            arrays = self._items.get(key)
            if arrays is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return arrays

    def put(self, key: str, arrays: Arrays) -> None:
        size = nbytes(arrays)
        if size > self.budget:
            return
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return
            self._items[key] = arrays
            self._bytes += size
            while self._bytes > self.budget:
                _, old = self._items.popitem(last=False)
                self._bytes -= nbytes(old)
