"""The hot set read during start-up: the stored blocks of the sessions touched last before a stop, read and
verified into the RAM tier while the model loads, so the wakes that come right after "ready" take them from
memory (docs/decisions.md, "The hot set read during start-up"). The same reader serves a model's load on
demand: there it reads the heads of the sessions whose operations wait for that load (`sessions`, more
`add`ed while it reads; sessions/read_ahead.py).

Which sessions: the heads made within WINDOW_S of the newest one, newest first (`Store.recent_heads`): a stop
sleeps every hot session within moments, and a kill -9 leaves their latest checkpoints; nothing else is
recorded. Not those of another model of the daemon (`other_bundles`: the bundles the data dir's
model-bundles.json gives other names; a bundle it does not know is read). Their blocks, each once, in the
order the snapshots list them, until `budget_bytes`.

In what form: the form the wake here takes fastest. Where restores stage (a GPU), a block's runs as its ring
rows receive them, decompressed and verified (`StagedImage`): the wake copies them into its ring and joins
them on the device as if it had decoded them. A RAM-tier block's arrays would be copied into host views and
uploaded from there, which took a staged wake longer than decoding the block itself (pipeline.fill_spans).
Elsewhere (the CPU: decoders write the cache's own memory), the block's decoded arrays, as the RAM tier holds
a shared prompt's.

It yields: each block is read through a RAM-tier flight (`RamTier.begin`), so a wake that needs a block being
read waits for that read, a block a wake is reading or has read is not read again here, and no block is read twice; its
threads (a few) run below the daemon's priority (READER_NICE). A block is held while a snapshot
planned with it has not woken (`RamTier.claim`, `woken`), or until its session's operation ends without
waking it (`let_go`: a session is not planned after that); what no wake took within KEEP_S goes. `stop` ends
it between blocks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvwake.daemon.kv.pool import lower_priority
from kvwake.daemon.kv.ram_tier import RamTier
from kvwake.errors import KvwakeError, NotFoundError
from kvwake.store import BlockRef, SnapshotRecord, Store
from kvwake.store.format.codec import DTYPES, Stage, Tensor

__all__ = ["KEEP_S", "WINDOW_S", "HotSet", "StagedImage", "available_memory", "read_image"]

log = logging.getLogger("kvwake.hot_set")

WINDOW_S = 120.0  # heads made this long before the newest one are not part of the hot set
KEEP_S = 300.0  # blocks read ahead that no wake took by this long after the reading ended are dropped
# The reader's threads run this many nice levels below the daemon (Linux): where cores are short, the model's
# load and a request's work get them first, and the reading takes what is left
READER_NICE = 10
PLAN_WAIT_S = 2.0  # `wakes_ahead` waits this long at most for the plan (SQLite reads: milliseconds)
# Threads that read: a quarter of the cores, at most this many. The reading has the whole load's time, so a few
# threads finish it in time, and each reader takes the GIL between its decodes, which the load's own Python then
# waits for (docs/benchmarks.md, "fleet": the hot set read during start-up, here)
READERS = 4


def available_memory() -> int:
    """Bytes of RAM the machine could give now: Linux's MemAvailable, else all of it (the default budget's base)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class StagedImage:
    """One block as a staged restore's ring rows receive it: each run's (names, dtype, values, planes) as the
    codec asked its `Stage` for them, with the bytes it wrote there (verified), and the tensors not staged."""

    runs: list[tuple[tuple[str, ...], str, int, bool, list[np.ndarray]]]
    rest: dict[str, Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(row.nbytes for *_, rows in self.runs for row in rows)

    def stage_into(self, stage: Stage | None) -> bool:
        """Copy every run into the rows `stage` gives it; False (nothing copied) when it takes one not
        as it was read (another layout, or no ring): the caller reads the block instead."""
        if stage is None or not self.runs:
            return False
        pairs = []
        for names, dtype, values, planes, rows in self.runs:
            dest = stage(names, dtype, values, planes)
            if dest is None or [d.size for d in dest] != [r.size for r in rows]:
                return False
            pairs += zip(dest, rows)
        for dest, row in pairs:
            np.copyto(dest, row)
        return True


def read_image(store: Store, ref: BlockRef, record: SnapshotRecord) -> StagedImage | dict[str, Tensor]:
    """The block read and verified into staging of its own (a StagedImage); its arrays when no run of it
    stages (a format-1 file)."""
    runs: list[tuple[tuple[str, ...], str, int, bool, list[np.ndarray]]] = []

    def stage(names: tuple[str, ...], dtype: str, values: int, planes: bool) -> list[np.ndarray]:
        size = DTYPES[dtype][0].itemsize
        row = np.empty(values * size, np.uint8)  # one ring row's bytes: planes one after another, or the run
        rows = [row[p * values : (p + 1) * values] for p in range(size)] if planes else [row]
        runs.append((names, dtype, values, planes, rows))
        return rows

    rest = store.read_block(ref, snapshot_id=record.id, session_id=record.session_id, stage=stage)
    return StagedImage(runs, rest) if runs else rest


class HotSet:
    """The background reader: `start` once the store is open, `stop` before it closes (any time: it ends
    between blocks). `staged`: keep StagedImages (restores stage here), else decoded arrays. `sessions`: read
    the heads of these sessions, and of those `add`ed while it reads; None: the recent heads."""

    def __init__(self, store: Store, tier: RamTier, *, staged: bool, budget_bytes: int,
                 workers: int | None = None, other_bundles: frozenset[str] = frozenset(),
                 sessions: Iterable[str] | None = None) -> None:
        self.store, self.tier, self.staged, self.budget = store, tier, staged, budget_bytes
        # the bundles other models of this daemon had here: their sessions wake on those models, loaded later
        # (or never), so their blocks are not read into this model's memory
        self.other_bundles = other_bundles
        self._sessions = list(sessions) if sessions is not None else None  # to plan next (None: the recent heads)
        self._open = sessions is not None  # whether `add` still gives it sessions (until it runs out of them)
        self._claims: dict[str, tuple[str, str]] = {}  # session id -> (the snapshot claimed for it, its bundle)
        self.bundle: str | None = None  # the loaded engine's, once known (`keep_bundle`): no other is planned
        self._gone: set[str] = set()  # sessions let go (`let_go`): not planned any more
        self._seen: set[str] = set()  # the blocks planned, of every round
        self._total = 0  # their bytes
        self.workers = workers or max(1, min(READERS, (os.cpu_count() or 1) // 4))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.counts = {"sessions": 0, "other_models": 0, "other_bundles": 0, "blocks_planned": 0, "bytes_planned": 0,
                       "blocks_read": 0, "bytes_read": 0, "blocks_skipped": 0, "blocks_failed": 0}
        self.read_keys: list[str] = []  # every block read here, in order (tests: none twice)
        self._faulted = False  # a read failed for a reason of the reader's own (logged once, with its trace)
        self.ms: float | None = None  # start to the last read
        self.state = "idle"
        self._planned = threading.Event()  # the sessions to read are counted (`wakes_ahead`)

    def start(self) -> HotSet:
        self.state = "planning"
        driver = threading.Thread(target=self._run, name="kvwake-hot-set", daemon=True)
        self._threads.append(driver)
        driver.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the reading (the reads under way finish), and drop what it read."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        self.tier.drop_prefetched()
        if not any(thread.is_alive() for thread in self._threads):
            self.state = "stopped"  # what it held is gone (a reading that had ended still said "held")

    def add(self, session_id: str) -> bool:
        """Read the head of `session_id` too (an operation on it waits for the same load); False when the reading
        has ended (its wake reads its blocks itself)."""
        with self._lock:
            if not self._open:
                return False
            self._gone.discard(session_id)
            if session_id not in self._claims and session_id not in self._sessions:  # not planned twice
                self._sessions.append(session_id)
            return True

    def let_go(self, session_id: str) -> None:
        """`session_id`'s operation ended: its wake let its blocks go already, or none came (its model's load
        failed, the session was deleted, the operation did not wake it). What was read ahead for it and no other
        session goes; it is not planned any more."""
        with self._lock:
            self._gone.add(session_id)
            claim = self._claims.pop(session_id, None)
        if claim is not None:
            self.tier.woken(claim[0])

    def keep_bundle(self, bundle: str) -> None:
        """The engine that takes the tier loaded with `bundle`: a snapshot of another (of the same model's name,
        its weights changed since) cannot wake on it, so what was read ahead for it goes and none is planned
        from now on. (Its wake would be refused, and its blocks held until KEEP_S, the warm-up waiting for it.)"""
        with self._lock:
            self.bundle = bundle
            stale = [(sid, snapshot) for sid, (snapshot, b) in self._claims.items() if b != bundle]
            for sid, _ in stale:
                del self._claims[sid]
                self._gone.add(sid)
        for _, snapshot in stale:
            self.tier.woken(snapshot)
        self.counts["other_bundles"] += len(stale)

    def wakes_ahead(self, timeout_s: float = PLAN_WAIT_S) -> int:
        """How many sessions the hot set holds, the wakes that may come at once after the start (the model's
        load makes a staging slot for each: devplanes.warm); 0 when its plan is not made within `timeout_s`."""
        return self.counts["sessions"] if self._planned.wait(timeout_s) else 0

    def wakes_left(self) -> int:
        """Sessions of the hot set not yet woken (0 once their blocks were dropped: KEEP_S, or `stop`); while
        it is still planning, 1 (some may be)."""
        return self.tier.claims_left() if self._planned.is_set() else 1

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"state": self.state, "staged": self.staged, "ms": self.ms, "budget_bytes": self.budget,
                    "workers": self.workers, "held_bytes": self.tier.prefetched_bytes,
                    "wakes_left": self.wakes_left(), **self.counts}

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            # The store lock is held shared while planning and around each block's read, never across the whole
            # reading: gc waits for it exclusively, and every wake and sleep queues behind gc (StoreFiles.lock)
            with self.store.reading():
                try:
                    plan = self._plan(self._heads(self._take()))
                finally:
                    self._planned.set()
            self.state = "reading"
            self._read_all(plan)
            while (more := self._take()) and not self._stop.is_set():  # sessions added while it read
                with self.store.reading():
                    plan = self._plan(self._heads(more))
                self._read_all(plan)
        except Exception:  # noqa: BLE001 - the hot set is an optimization: the wakes read what it did not
            log.exception("reading the hot set failed")
        with self._lock:
            self._open = False
        self.ms = round((time.perf_counter() - started) * 1000, 1)
        self.state = "stopped" if self._stop.is_set() else "held"
        log.info("hot set read", extra=self.status())
        if not self._stop.wait(KEEP_S):
            self.state = "dropped"
            self.tier.drop_prefetched()

    def _take(self) -> list[str] | None:
        """The sessions to plan next: None (once) for the recent heads; [] when none is left, and from then on
        `add` refuses."""
        with self._lock:
            if self._sessions is None:
                self._sessions = []
                return None
            taken, self._sessions = self._sessions, []
            self._open = self._open and bool(taken)
            return taken

    def _heads(self, sessions: list[str] | None) -> list[str]:
        """The snapshots to read: the recent heads, or the heads of `sessions` (one with none, or gone, left out)."""
        if sessions is None:
            return self.store.recent_heads(WINDOW_S)
        heads = []
        for session_id in sessions:
            try:
                head = self.store.session(session_id)["head"]
            except NotFoundError:  # deleted meanwhile
                continue
            if head is not None:
                heads.append(head)
        return heads

    def _plan(self, heads: list[str]) -> list[tuple[BlockRef, SnapshotRecord]]:
        """Each block of the snapshots `heads` not planned before, with the first snapshot naming it, within the
        budget; claims registered (none for a session let go)."""
        plan: list[tuple[BlockRef, SnapshotRecord]] = []
        for snapshot_id in heads:
            if self._stop.is_set() or self._total >= self.budget:
                break
            try:
                record = self.store.snapshot(snapshot_id)  # its digest and chain verified
            except KvwakeError as exc:  # its wake will say so, with the same facts
                log.info("hot set: snapshot skipped", extra={"snapshot": snapshot_id, "why": str(exc)})
                continue
            if record.bundle in self.other_bundles:
                self.counts["other_models"] += 1
                continue
            keys, fresh, size = [], [], 0
            for ref in record.blocks:
                if ref.key not in self._seen:
                    if self._total + size + ref.raw_bytes > self.budget:
                        size = self.budget - self._total  # spent: no later snapshot is planned
                        break
                    fresh.append((ref, record))
                    size += ref.raw_bytes
                keys.append(ref.key)
            with self._lock:
                if record.session_id in self._gone:
                    continue
                if self.bundle is not None and record.bundle != self.bundle:  # `keep_bundle`: it cannot wake
                    self.counts["other_bundles"] += 1
                    continue
                self.tier.claim(record.id, keys)
                self._claims[record.session_id] = (record.id, record.bundle)
            self._seen.update(ref.key for ref, _ in fresh)
            self._total += size
            plan += fresh
            self.counts["sessions"] += 1
        self.counts["blocks_planned"] += len(plan)
        self.counts["bytes_planned"] += sum(r.raw_bytes for r, _ in plan)
        return plan

    def _read_all(self, plan: list[tuple[BlockRef, SnapshotRecord]]) -> None:
        todo: Iterator[tuple[BlockRef, SnapshotRecord]] = iter(plan)
        take = threading.Lock()

        def work() -> None:
            lower_priority(READER_NICE)
            while not self._stop.is_set():
                with take:
                    item = next(todo, None)
                if item is None:
                    return
                self._read(*item)

        readers = [threading.Thread(target=work, name=f"kvwake-hot-set-{i}", daemon=True)
                   for i in range(self.workers)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()

    def _read(self, ref: BlockRef, record: SnapshotRecord) -> None:
        flight = self.tier.begin(ref.key) if self.tier.claimed(ref.key) else None
        if flight is None:  # resident, being read by a wake, or its snapshots woke already
            self._add("blocks_skipped")
            return
        entry = None
        try:
            with self.store.reading():  # gc cannot evict the file meanwhile
                entry = read_image(self.store, ref, record) if self.staged else \
                    self.store.read_block(ref, snapshot_id=record.id, session_id=record.session_id)
        except KvwakeError as exc:  # the store's verdict on the block: the wake reads it and fails with these facts
            self._add("blocks_failed")
            log.info("hot set: block not read", extra={"block": ref.key, "why": repr(exc)})
        except Exception:  # noqa: BLE001 - a fault of the reader's own: shown (once), the wakes read the blocks
            self._add("blocks_failed")
            with self._lock:
                first, self._faulted = not self._faulted, True
            if first:
                log.exception("hot set: reading a block failed", extra={"block": ref.key})
        finally:
            self.tier.land_prefetched(ref.key, flight, entry)
        if entry is not None:
            with self._lock:
                self.counts["blocks_read"] += 1
                self.counts["bytes_read"] += ref.raw_bytes
                self.read_keys.append(ref.key)

    def _add(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1
