"""The blocks of the sessions a model's load waits for, read into memory beside the load (issue 53).

Part of the session manager's models (sessions/models.py holds one `ReadAhead`). An operation on an asleep
session of a model that is not loaded waits for the model's load, then wakes the session. Its blocks are read
and verified meanwhile, beside the weights' load, into the RAM tier the new engine takes, by the reader of the
hot set read during start-up (kv/hot_set.py: its claims on the RAM tier, its single-flight reads, its budget),
so the wake after the load takes them from memory (docs/decisions.md, "A load reads its sessions' blocks
ahead"). The sessions read are those whose operations wait for the load when it starts, and those that come
while it still reads.

What is read is held for a session until its operation ends: its wake lets its blocks go as every wake does
(pipeline.wake), and an operation that did not wake it (its model's load failed, the session was deleted
meanwhile, it woke another snapshot) lets them go as it ends (`HotSet.let_go`). A failed load stops its reader,
and an unload the reader of the model's load: what they held goes. What no wake took within the reader's
KEEP_S goes too.

Only a request that names an asleep session waits for a load this way (the RPC session operations); an HTTP
request's session is found after the load, with the model's tokenizer, and its wake reads its own blocks.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from kvwake.daemon.config import Settings
from kvwake.daemon.kv import restore_buffers
from kvwake.daemon.kv.hot_set import HotSet, available_memory
from kvwake.daemon.kv.ram_tier import RamTier
from kvwake.store import Store

__all__ = ["WAKING_OPS", "ReadAhead", "new_reader"]

WAKING_OPS = ("append", "chat", "generate", "wake")  # claims whose operation wakes an asleep session first


def new_reader(settings: Settings, store: Store, *, sessions: Iterable[str] | None = None,
               other_bundles: frozenset[str] = frozenset()) -> HotSet:
    """A reader (not started) filling a new RAM tier for an engine about to load: `sessions`' heads, else the
    recent heads (the restart's hot set) but those of `other_bundles`. Blocks are kept in the form this machine's
    wakes take fastest: staged images where restores stage (plain KV), else their arrays; within
    `restart_prefetch_bytes`, by default a quarter of the memory available now."""
    tuning = settings.tuning
    staged = restore_buffers.restore_mode(tuning.restore_mode) == "staged" and settings.kv_bits is None
    budget = tuning.restart_prefetch_bytes
    return HotSet(store, RamTier(settings.ram_tier_bytes), staged=staged, other_bundles=other_bundles,
                  sessions=sessions, budget_bytes=available_memory() // 4 if budget is None else budget)


class ReadAhead:
    """Each model's reader of its load's sessions (see the module docstring); used on the event loop."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._waiting: dict[str, Counter[str]] = {}  # model -> asleep sessions whose operations wait for its load
        self._readers: dict[str, HotSet] = {}  # model -> the reader of its load (reading, or held for its wakes)

    @contextlib.contextmanager
    def waiting(self, model: str, session_id: str) -> Iterator[None]:
        """Inside: an operation that wakes asleep session `session_id` waits for `model`'s load; the load's reader
        reads the session's blocks (a reader reading already takes it too), and lets them go as it ends."""
        waiting = self._waiting.setdefault(model, Counter())
        waiting[session_id] += 1
        reader = self._readers.get(model)
        if reader is not None:
            reader.add(session_id)
        try:
            yield
        finally:
            waiting[session_id] -= 1
            last = waiting[session_id] <= 0
            if last:
                del waiting[session_id]
            if not waiting and self._waiting.get(model) is waiting:
                del self._waiting[model]
            reader = self._readers.get(model)
            # only the last operation on it lets it go: another refused BUSY meanwhile ends first, and its end
            # must not take away what the one that claimed it will wake from
            if reader is not None and last:
                reader.let_go(session_id)

    def begin(self, model: str, settings: Settings) -> HotSet | None:
        """The reader of `model`'s load about to start, started: the blocks of the sessions waiting for it, read
        into a RAM tier of its own for the new engine; None when none waits, or `load_prefetch` is off."""
        sessions = list(self._waiting.get(model, ()))
        if not sessions or not settings.tuning.load_prefetch:
            return None
        reader = self._readers[model] = new_reader(settings, self.store, sessions=sessions)
        return reader.start()

    def end(self, model: str) -> HotSet | None:
        """`model`'s reader taken away (its load failed, or the model is unloaded): the caller stops it
        (`HotSet.stop` drops what it holds; it blocks while a read ends: from a worker thread)."""
        return self._readers.pop(model, None)

    def status(self, model: str) -> dict[str, Any] | None:
        """The reader of `model`'s load (`HotSet.status`), None when it had none."""
        reader = self._readers.get(model)
        return reader.status() if reader is not None else None

    def close(self) -> None:
        """Stop every reader (the daemon stops: before the store closes)."""
        for reader in self._readers.values():
            reader.stop()
        self._readers.clear()
