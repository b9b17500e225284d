"""The RAM tier of the prefix cache: decoded blocks, least recently used out first.

Popular prefixes (a system prompt every agent starts with) are served from here
without touching the disk or the decompressor. Entries are the verified,
decoded arrays the store returned, keyed by chain key (which names the whole
prefix and the bundle, so an entry can never serve another model); restore
points too, under "point:" and the chain key of the block they close
(kv/prefixhit.py). Bounded by
bytes; a block larger than the whole budget is simply not kept. Thread-safe.

Reads of one block are single-flight. Each restore first says which blocks it
will need (`wanting`); a block needed by several restores at once is read and
decoded by one of them (`take` makes it the *flight*), and the others wait for
it and take its arrays (`land`). Landed arrays stay held for the restores that
still want them even when the LRU budget is smaller than the shared prefix, and
go once the last of those has taken them or ended; the LRU keeps them after
that, within its budget.

Blocks read ahead (kv/hot_set.py: the hot set read during start-up) land
outside the LRU budget too, each held for the snapshots planned to wake with
it (`claim`) until they have woken (`woken`) or the reader gives up on them
(`drop_prefetched`); such an entry may be a block's staged image
(hot_set.StagedImage) rather than its arrays. Its reads go through the same
flights (`begin`), so a wake that needs a block being read ahead waits for
that read, and a block a wake is reading, or has read, is not read ahead again.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

from kvwake.store import Tensor

__all__ = ["Flight", "RamTier", "Wants"]

Arrays = dict[str, Tensor]


def nbytes(arrays: Arrays | Any) -> int:
    """Bytes of a block's arrays, or of an entry read ahead that says its own (`nbytes`)."""
    if not isinstance(arrays, dict):
        return arrays.nbytes
    return sum(t.array.nbytes for t in arrays.values())


class Flight:
    """One read of a block in progress, that other restores may wait for; `land` ends it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.arrays: Arrays | None = None  # what it landed: None when it failed or kept nothing


class Wants:
    """The blocks one restore still needs (`RamTier.wanting`); `done(key)` once it has one (any thread)."""

    def __init__(self, tier: RamTier, keys: list[str]) -> None:
        self._tier, self._left, self._lock = tier, set(keys), threading.Lock()

    def done(self, key: str) -> None:
        with self._lock:
            if key not in self._left:
                return
            self._left.discard(key)
        self._tier._unwant([key])

    def close(self) -> None:
        with self._lock:
            left, self._left = list(self._left), set()
        self._tier._unwant(left)


class RamTier:
    """An LRU map chain key -> decoded block arrays, at most `budget_bytes` in total, with single-flight reads."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._items: OrderedDict[str, Arrays] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._flights: dict[str, Flight] = {}
        self._wants: dict[str, int] = {}  # chain key -> restores that will need it
        self._held: dict[str, Arrays] = {}  # landed blocks other restores still want, outside the budget
        self._prefetched: dict[str, Any] = {}  # blocks read ahead, outside the budget, while claimed
        self._claims: dict[str, list[str]] = {}  # snapshot id -> the keys read ahead for it
        self._claimed: dict[str, int] = {}  # chain key -> snapshots still to wake with it
        self._read_here: set[str] = set()  # claimed blocks a restore read itself first: not read ahead after it
        self.prefetched_bytes = 0
        self.hits = self.misses = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> Arrays | None:
        with self._lock:
            return self._get(key)

    def _get(self, key: str) -> Arrays | None:
        arrays = self._items.get(key)
        if arrays is not None:
            self._items.move_to_end(key)
        else:
            arrays = self._held.get(key)
            if arrays is None:
                arrays = self._prefetched.get(key)
        if arrays is None:
            self.misses += 1
            return None
        self.hits += 1
        return arrays

    def put(self, key: str, arrays: Arrays) -> None:
        size = nbytes(arrays)
        if size > self.budget:
            return
        with self._lock:
            self._put(key, arrays, size)

    def _put(self, key: str, arrays: Arrays, size: int) -> None:
        if key in self._items:
            self._items.move_to_end(key)
            return
        self._items[key] = arrays
        self._bytes += size
        while self._bytes > self.budget:
            _, old = self._items.popitem(last=False)
            self._bytes -= nbytes(old)

    @contextlib.contextmanager
    def wanting(self, keys: Iterable[str]) -> Iterator[Wants]:
        """Say that one restore will need these blocks, for as long as it runs (or until `Wants.done`)."""
        wants = Wants(self, list(dict.fromkeys(keys)))
        with self._lock:
            for key in wants._left:
                self._wants[key] = self._wants.get(key, 0) + 1
        try:
            yield wants
        finally:
            wants.close()

    def _unwant(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                left = self._wants.get(key, 0) - 1
                if left > 0:
                    self._wants[key] = left
                else:
                    self._wants.pop(key, None)
                    self._held.pop(key, None)

    def shared(self, key: str) -> bool:
        """Whether another running restore wants this block too: its reader should land it for them."""
        with self._lock:
            return self._wants.get(key, 0) > 1

    def take(self, key: str) -> tuple[Arrays | None, Flight | None]:
        """The block's arrays when resident (or once the flight reading it lands): (arrays, None); else
        (None, flight): the caller reads it, and must `land` the flight whatever happens."""
        while True:
            with self._lock:
                arrays = self._get(key)
                if arrays is not None:
                    return arrays, None
                flight = self._flights.get(key)
                if flight is None:
                    flight = self._flights[key] = Flight()
                    return None, flight
            flight.done.wait()
            if flight.arrays is not None:
                with self._lock:
                    self.hits += 1
                return flight.arrays, None
            # the reader failed or kept nothing: read it here (a damaged block fails with this restore's facts)

    def land(self, key: str, flight: Flight, arrays: Arrays | None, read_for: str | None = None) -> None:
        """End a flight `take` handed out: its arrays (None: nothing to share) go to its waiters, to the
        restores that still want the block, and to the LRU within its budget. `read_for`: the snapshot whose wake
        read the block (and verified it): where that snapshot is the last to claim it, the reader ahead, which had
        not begun it, will not read it now (a block other claimants still wait for is read ahead for them)."""
        with self._lock:
            if arrays is not None:
                size = nbytes(arrays)
                if size <= self.budget:
                    self._put(key, arrays, size)
                if self._wants.get(key, 0) > 1:
                    self._held[key] = arrays
            if read_for is not None and self._claimed.get(key, 0) == 1 and key in self._claims.get(read_for, ()):
                self._read_here.add(key)  # the reader ahead had not begun it: not read a second time for no one
            flight.arrays = arrays
            self._flights.pop(key, None)
        flight.done.set()

    # -- blocks read ahead (kv/hot_set.py) ---------------------------------------------------------------

    def claim(self, snapshot_id: str, keys: Iterable[str]) -> None:
        """The blocks to be read ahead for one snapshot: held once read until it wakes (`woken`)."""
        keys = list(dict.fromkeys(keys))
        with self._lock:
            self._claims.setdefault(snapshot_id, []).extend(keys)
            for key in keys:
                self._claimed[key] = self._claimed.get(key, 0) + 1

    def claims_left(self) -> int:
        """Snapshots claiming blocks read ahead that have not woken."""
        with self._lock:
            return len(self._claims)

    def claimed(self, key: str) -> bool:
        """Whether a snapshot not yet woken still wants this block read ahead."""
        with self._lock:
            return self._claimed.get(key, 0) > 0

    def begin(self, key: str) -> Flight | None:
        """A flight for reading the block ahead, to end with `land_prefetched`; None when it is resident, being
        read (by a restore, or another reader) or was read by a restore already: it is not read twice."""
        with self._lock:
            if key in self._items or key in self._held or key in self._prefetched or key in self._flights or \
                    key in self._read_here:
                return None
            flight = self._flights[key] = Flight()
            return flight

    def land_prefetched(self, key: str, flight: Flight, entry: Any | None) -> None:
        """End a `begin` flight: its entry (None: the read failed) goes to the restores waiting for it, and is
        held while a snapshot not yet woken claims it."""
        with self._lock:
            if entry is not None and self._claimed.get(key, 0) > 0 and key not in self._prefetched:
                self._prefetched[key] = entry
                self.prefetched_bytes += nbytes(entry)
            flight.arrays = entry
            self._flights.pop(key, None)
        flight.done.set()

    def woken(self, snapshot_id: str) -> None:
        """A snapshot's wake ended (whatever came of it): the blocks read ahead for it and no other snapshot
        go; those that are arrays stay in the LRU within its budget."""
        with self._lock:
            for key in self._claims.pop(snapshot_id, ()):
                left = self._claimed.get(key, 0) - 1
                if left > 0:
                    self._claimed[key] = left
                    continue
                self._claimed.pop(key, None)
                self._read_here.discard(key)
                self._unprefetch(key)

    def drop_prefetched(self) -> None:
        """Every block read ahead goes (the reader's time to hold them is up, or the daemon stops)."""
        with self._lock:
            self._claims.clear()
            self._claimed.clear()
            self._read_here.clear()
            for key in list(self._prefetched):
                self._unprefetch(key)

    def _unprefetch(self, key: str) -> None:
        entry = self._prefetched.pop(key, None)
        if entry is None:
            return
        size = nbytes(entry)
        self.prefetched_bytes -= size
        if isinstance(entry, dict) and size <= self.budget:
            self._put(key, entry, size)
