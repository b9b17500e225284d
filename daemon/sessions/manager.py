"""Sessions in the daemon: hot or asleep, one operation at a time, slept when idle or over budget.

Concurrency rules:
- MLX work runs on the engine thread (`EngineThread`); store work (SQLite,
  compression, disk) on anyio worker threads; the event loop only orchestrates.
- One operation at a time per session. A second mutating operation on a busy
  session fails at once with BUSY (agents should not overlap turns on one
  conversation; failing fast beats a hidden queue). Reads (info, list) never wait.
  The one wait: a session lent for a moment to another session's prefix copy
  (`_hot_prefix`, one engine job) is waited for, not BUSY.
- The manager orchestrates, the engine computes. An append is the engine's
  steps called in order: plan (render, on a worker thread), check, make room
  (other sessions sleep, on the loop), a prefix (a hot session's copy, else
  stored blocks), apply. Each step that touches MLX runs on a worker thread with
  `mlx` = the engine thread's `call`: its MLX steps go to the engine thread one
  short job at a time (other sessions' generation interleaves with them), codec
  and disk work to the engine's pool. Sleep, wake and warm likewise.
- The models come from the `ModelProvider` (model/provider.py); each session runs
  on its own model, loaded on demand, the operation's model a context variable
  (sessions/models.py).
- Generate calls of different sessions decode together, one batched forward
  pass per step (model/decoder.py); prefill runs one chunk per engine job between
  decode steps, so a long prompt delays the others by about one chunk.
- A client that disconnects mid-generation stops it after the current token;
  the tokens generated so far stay in the session. One that disconnects
  mid-prefill (a chat's or an append's) stops it before the next chunk
  (CANCELLED): its input stays in the session, the next call prefills the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
from anyio import to_thread

from kvwake.daemon.gcwatch import Collector
from kvwake.daemon.config import Settings
from kvwake.daemon.gilwatch import GilWatch
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.provider import LoadedModel, ModelProvider
from kvwake.daemon.model.registry import ModelSpec, Registry
from kvwake.daemon.model.thread import EngineThread
from kvwake.daemon.timing import Latency, Phases
from kvwake.daemon.session_state import Session, check_json, check_session_id, common_prefix
from kvwake.daemon.sessions.conversations import Conversations, Prepared
from kvwake.daemon.sessions.entries import Entries, Entry
from kvwake.daemon.sessions.models import CURRENT, ModelKeeping, Starter
from kvwake.daemon.sessions.room import RoomKeeping
from kvwake.daemon.sessions.shared_prefill import Pending, SharedPrefills
from kvwake.daemon.session_state import new_session_id as make_session_id
from kvwake.errors import BusyError, InvalidParamsError, NotFoundError

if TYPE_CHECKING:  # the remote tier (and obstore) load only when serve has --remote
    from kvwake.daemon.kv.hot_set import HotSet
    from kvwake.daemon.sessions.remote_tier import RemoteTier

__all__ = ["Prepared", "SessionManager"]

log = logging.getLogger("kvwake.sessions")
TURNS_KEPT = 64  # generate calls whose phases status keeps
WAITING_WAKES = 256  # threads for wakes waiting on a wake in flight (SessionManager.waiting_wakes)
COPY_WAIT_S = 10.0  # a call waits this long for a session lent to another's prefix copy, then is BUSY


class SessionManager(Conversations, RoomKeeping, ModelKeeping):
    """All session operations the fronts call (RPC methods, HTTP routes), over the models of `models`: those
    `registry` names (None: the loaded ones), loaded by `start` on demand (None: only those loaded)."""

    def __init__(self, models: ModelProvider, settings: Settings, registry: Registry | None = None,
                 start: Starter | None = None) -> None:
        self.models, self.settings = models, settings
        self.store = self.models.get().engine.store  # one store: every model's sessions and blocks (by bundle hash)
        self.entries = Entries()  # its `hot` indexes the hot ones: nothing below walks every session
        self.latency = {"sleep": Latency(), "wake": Latency(), "generate_ttft": Latency()}
        # The latest generate calls' phases, ms each: where a first token's time went (status "turns")
        self.turns: deque[dict[str, Any]] = deque(maxlen=TURNS_KEPT)
        self.counters = {"sleeps": 0, "wakes": 0, "auto_sleeps": 0, "room_sleeps": 0, "sleep_failures": 0,
                         "generations": 0, "prefix_copies": 0, "prefix_waits": 0,
                         "wake_waits": 0}
        # Per model: appends prefilling a fresh cache now, and the requests that share their prompt waiting on them
        self._shared: dict[str, SharedPrefills] = {}
        self._waiting_wakes: anyio.CapacityLimiter | None = None  # made on the event loop (`waiting_wakes`)
        self.stopping = False
        # KV taken from sessions (slept, deleted, replaced by a wake) and being freed on the engine thread: its bytes
        self.releasing: dict[asyncio.Task, int] = {}
        self.remote: RemoteTier | None = None  # the shared tier, when serve has --remote
        self.started = Phases()  # where the daemon's start went (serve.py marks it)
        self.hot_set: HotSet | None = None  # the hot set's reader (kv/hot_set.py), when serve.py started one
        self.collector = Collector()  # the garbage collector's runs (serve.py installs it)
        self.gil_watch: GilWatch | None = None  # waits for the GIL, when KVWAKE_GIL_WATCH_MS asks (serve.py)
        self._init_models(registry or Registry([ModelSpec(m.name, None) for m in models]), start)

    @property
    def model(self) -> LoadedModel:
        """The model the operation in hand runs on (sessions/models.py): its scope's, else the default one,
        else (the default unloaded) the first loaded."""
        name = CURRENT.get()
        if name is None and self.registry.default.name in self.models:
            name = self.registry.default.name
        return self.models.get(name)

    @property
    def shared(self) -> SharedPrefills:
        """The operation's model's prefills in flight (a prompt's KV is shared within one model only)."""
        name = self.model.name
        if name not in self._shared:
            self._shared[name] = SharedPrefills(self.engine.min_partial)
        return self._shared[name]

    @property
    def engine(self) -> Engine:
        return self.model.engine

    @property
    def thread(self) -> EngineThread:
        return self.model.thread

    def model_names(self) -> list[str]:
        """The names of the models served, the default first (loaded or not)."""
        return [spec.name for spec in self.registry]

    async def load(self) -> None:
        """Know every session the store holds (all asleep after a start), each with its model (by its head's
        bundle, when several are served)."""
        rows = await to_thread.run_sync(self.store.sessions)
        bundles = {} if len(self.registry) == 1 else \
            {r["id"]: r["bundle"] for r in await to_thread.run_sync(self.store.snapshots)}
        for row in rows:
            model = self.model_for_stored(row["id"], bundles.get(row["head"]))
            self.entries[row["id"]] = Entry(row["id"], created=row["created"], model=model)

    # -- claiming -------------------------------------------------------------

    def entry(self, session_id: Any) -> Entry:
        entry = self.entries.get(check_session_id(session_id))
        if entry is None:
            raise NotFoundError(f"no session {session_id!r}", session_id=session_id)
        return entry

    @contextlib.asynccontextmanager
    async def claim(self, session_id: Any, op: str, take_over: bool = False) -> AsyncIterator[Entry]:
        if self.remote is not None and op not in ("delete", "sleep") and check_session_id(session_id) not in self.entries:
            name = self.model_name()  # published by another daemon: ours now, of the request's model
            async with self.use(name) as model:
                await self.remote.adopt(session_id, take_over=take_over, engine=model.engine)
            self.entries.setdefault(session_id, Entry(session_id, model=name))
        entry = self.entry(session_id)
        # its model's engine (a turn asked of another model refused); its blocks read while its model loads
        with self.model_scope(entry, op), self.reading_ahead(entry, op):
            async with contextlib.nullcontext() if op in ("sleep", "delete") else self.use(self.model_of(entry)):
                with anyio.move_on_after(COPY_WAIT_S):  # lent for a prefix copy (_hot_prefix): one engine job
                    while entry.busy == "copy":
                        await anyio.sleep(0.002)
                if entry.busy:
                    raise BusyError(f"session {entry.id} is busy ({entry.busy}); retry when it is done",
                                    session_id=entry.id, busy_with=entry.busy)
                entry.busy = op
                try:
                    yield entry
                finally:
                    entry.busy, entry.last_used = None, time.monotonic()

    async def awake(self, entry: Entry, target: list[int] | None = None) -> Session:
        """The entry's session, woken first if it sleeps (the caller holds the claim); `target`: the tokens the
        turn that wakes it will hold, when known (a front's prepared prompt: `_wake`)."""
        if entry.session is None:
            await self._wake(entry, None, target=target)
        assert entry.session is not None
        return entry.session

    # -- lifecycle operations -------------------------------------------------

    async def create(self, session_id: Any = None, system: Any = None, metadata: Any = None,
                     exist_ok: bool = False) -> dict[str, Any]:
        session_id = check_session_id(session_id) if session_id is not None else make_session_id()
        if metadata is not None and not isinstance(metadata, dict):
            raise InvalidParamsError("metadata must be a map")
        check_json(metadata or {}, "metadata")
        if system is not None and not isinstance(system, str):
            raise InvalidParamsError("system must be a string")
        async with self.use(self.model_name()) as model:  # the request's model (a front's scope), else the default
            return await self._create(session_id, system, metadata, exist_ok, model.name)

    async def _create(self, session_id: str, system: str | None, metadata: dict | None, exist_ok: bool,
                      model: str) -> dict[str, Any]:
        if session_id in self.entries:
            if exist_ok:
                return {"session_id": session_id, "created": False}
            raise InvalidParamsError(f"session {session_id} exists", session_id=session_id, exists=True)
        session = Session(session_id, metadata=dict(metadata or {}))
        if system:
            session.mode, session.messages = "chat", [{"role": "system", "content": system}]
        entry = self.entries[session_id] = Entry(session_id, session=session, busy="create", model=model)
        try:
            # An empty first snapshot makes the session itself durable: its system prompt and
            # metadata survive a crash before its first sleep.
            await to_thread.run_sync(self.store.ensure_session, session_id, metadata or {})
            await to_thread.run_sync(lambda: self.engine.sleep(session, free=False, mlx=self.thread.call))
        except BaseException:
            self.entries.pop(session_id, None)
            raise
        finally:
            entry.busy = None
        return {"session_id": session_id, "created": True}

    async def _wake(self, entry: Entry, snapshot_id: str | None, take_over: bool = False,
                    target: list[int] | None = None) -> dict[str, Any]:
        """Wake the entry's session from its head (or `snapshot_id`). `target`: the tokens of the turn that wakes
        it. On a model cut by restore points, a turn whose tokens part from the head's before its end (a client
        re-rendering the last reply) cannot keep what a wake restores: the session is woken to the deepest
        stored point at or before the parting instead (`_wake_to_point`), one restore, not a whole wake and then
        the append's restore of that point."""
        if self.remote is not None and self.remote.needs_lease(entry.id):  # released or taken over: take it back
            await self.remote.adopt(entry.id, take_over=take_over, engine=self.engine)
        snapshot = snapshot_id
        if snapshot is None:
            row = await to_thread.run_sync(self.store.session, entry.id)
            if row["head"] is None:  # a session with no snapshot yet starts empty, it is not missing
                entry.session = Session(entry.id, metadata=row["metadata"])
                return {"snapshot_id": None, "tokens": 0, "blocks_from_memory": 0, "blocks_from_disk": 0, "ms": 0.0,
                        "phases_ms": {}}
            snapshot = row["head"]
        engine = self.engine
        # Read and verified once (its bundle too, before anyone sleeps for it). The wake takes the head's as it
        # is: gc never evicts a head, and the claim keeps it the head. A snapshot named by the caller may be
        # pruned meanwhile: the wake reads that one again under the store's read lock (NOT_FOUND, not a
        # missing block, if it went).
        record = await to_thread.run_sync(engine.record, snapshot)
        if self.releasing and self.hot_bytes() > self.hot_budget():
            await self.released()  # over the budget until KV being freed is gone: wait for it before adding more
        # the snapshot's KV must fit beside the hot sessions' (paged: the pages it adds, not those it maps)
        await self.make_room(entry, len(record.token_ids), added=lambda: engine.wake_bytes(record))
        parting = common_prefix(record.token_ids, target) if target is not None and not engine.cuttable \
            and engine.points.enabled and snapshot_id is None else len(record.token_ids)
        if parting < len(record.token_ids):
            session, info = await self._wake_to_point(entry, record, target, parting)
        else:
            session, info = await self._wake_whole(entry, snapshot, record, snapshot_id is None)
        replaced, entry.session = entry.session, session
        if replaced is not None:  # a hot session woken from another snapshot: its KV freed where MLX runs
            self._release(replaced)
        self.latency["wake"].add(info["ms"])
        entry.woke = info  # the turn that woke it traces it (conversations.py)
        self.counters["wakes"] += 1
        log.info("wake", extra={"session": entry.id, **info})
        return info

    async def _wake_to_point(self, entry: Entry, record: Any, target: list[int],
                             parting: int) -> tuple[Session, dict[str, Any]]:
        """(The entry's session with its head's state and tokens, its cache restored to the deepest stored
        point within the first `parting` tokens of `target` (kv/prefixhit.py), or none; what the wake did)."""
        engine, started = self.engine, time.perf_counter()
        session = Session.from_state(entry.id, list(record.token_ids), record.metadata, record.id,  # checked first
                                     engine.kv.vocab_size)
        cache, tokens = await to_thread.run_sync(
            lambda: engine.stored_prefix(list(target[: parting + 1]), self.thread.call))
        session.cache, session.processed = cache, tokens if cache is not None else 0
        return session, {"snapshot_id": record.id, "tokens": session.processed, "to_point": True,
                         "parting": parting, "ms": round((time.perf_counter() - started) * 1000, 3), "phases_ms": {}}

    async def _wake_whole(self, entry: Entry, snapshot: str, record: Any,
                          head: bool) -> tuple[Session, dict[str, Any]]:
        """(The entry's session restored from `snapshot` whole, its wake's result): blocks another wake in flight
        shares are copied from it (`_wake_prefix`). `head`: the snapshot is the head, read as `record`."""
        engine = self.engine
        read = record if head else None
        async with self._wake_prefix(entry, record) as ((cache, tokens), flight):
            prefix = (cache, tokens) if cache is not None else None
            waits = isinstance(cache, Pending)  # its thread waits for a wake in flight once its own blocks are in
            session, info = await to_thread.run_sync(
                lambda: engine.wake(entry.id, snapshot, self.thread.call, record=read, prefix=prefix),
                limiter=self.waiting_wakes() if waits else None)
            if flight is not None:  # those waiting on this wake copy from it when the block ends
                flight.session = session
            elif waits and info["blocks_shared"]:
                self.counters["wake_waits"] += 1  # it took blocks from a wake in flight
        return session, info

    def waiting_wakes(self) -> anyio.CapacityLimiter:
        """The threads of wakes that wait for a wake in flight (shared_prefill.Pending), apart from the default
        worker threads: waiters never take the threads that renders, sleeps and their own leader need."""
        if self._waiting_wakes is None:
            self._waiting_wakes = anyio.CapacityLimiter(WAITING_WAKES)
        return self._waiting_wakes

    async def wake(self, session_id: Any, snapshot_id: Any = None, take_over: bool = False) -> dict[str, Any]:
        async with self.claim(session_id, "wake", take_over) as entry:
            if entry.session is not None and snapshot_id is None:
                return {"snapshot_id": entry.session.head, "tokens": len(entry.session.tokens), "already_awake": True}
            return await self._wake(entry, snapshot_id, take_over)

    async def sleep(self, session_id: Any, *, label: str | None = None, free: bool = True,
                    remote_wait: bool = False, release: bool = False) -> dict[str, Any]:
        """Sleep; with remote_wait, return once the remote holds the snapshot; with release, then give up
        the session's lease so another daemon may wake it."""
        async with self.claim(session_id, "sleep") as entry:
            if entry.session is None:
                head = await to_thread.run_sync(self.store.session, entry.id)
                info = {"snapshot_id": head["head"], "already_asleep": True}
            else:
                info = await self._sleep(entry, label=label, free=free)
            if (remote_wait or release) and info["snapshot_id"] is not None:
                if self.remote is None:
                    raise InvalidParamsError("remote_wait and release need a daemon serving with --remote")
                await self.remote.wait_uploaded(entry.id, info["snapshot_id"])
                info["released"] = await self.remote.release(entry.id) if release else False
            return info

    async def _sleep(self, entry: Entry, *, label: str | None = None, free: bool = True) -> dict[str, Any]:
        session = entry.session
        assert session is not None
        try:
            # The pipeline cleans up after itself (files removed, lock released) before it raises;
            # a worker thread is not interrupted by cancellation, so it always gets to.
            info = await to_thread.run_sync(
                lambda: self.engine.sleep(session, label=label, free=False, mlx=self.thread.call))
        except BaseException as exc:
            self.counters["sleep_failures"] += 1
            log.error("sleep failed; session stays hot", extra={"session": entry.id, "error": repr(exc)})
            raise
        if free:  # committed: the reply goes now, the KV is freed after it (`_release`)
            entry.session = None
            self._release(session)
        if self.remote is not None:
            self.remote.enqueue(entry.id, info["snapshot_id"])
        self.latency["sleep"].add(info["ms"])
        self.counters["sleeps"] += 1
        log.info("sleep", extra={"session": entry.id, **info})
        return info

    async def delete(self, session_id: Any) -> dict[str, Any]:
        async with self.claim(session_id, "delete") as entry:
            if self.model_of(entry) in self.models:  # an unloaded model's writer has no checkpoint in flight
                await to_thread.run_sync(self.engine.forget, entry.id)  # no checkpoint of it commits after this
            removed = 0
            with contextlib.suppress(NotFoundError):  # a store failure keeps the session known, as it still is
                removed = await to_thread.run_sync(self.store.delete_session, entry.id)
            if entry.session is not None:  # gone from the store: its KV goes too (not before: see above)
                self._release(entry.session)
            self.entries.pop(entry.id, None)
            return {"session_id": entry.id, "snapshots_removed": removed}

    async def snapshot_now(self, session_id: Any, label: str | None) -> str:
        """A snapshot of the session as it is now; a hot session stays hot."""
        async with self.claim(session_id, "checkpoint") as entry:
            if entry.session is None:
                head = (await to_thread.run_sync(self.store.session, entry.id))["head"]
                if head is None:
                    raise InvalidParamsError(f"session {entry.id} has no state to checkpoint", session_id=entry.id)
                summary = await to_thread.run_sync(self.store.snapshot_summary, head)
                if label is not None and summary["label"] not in (None, label):
                    # The head already carries another checkpoint's label: copy it (blocks shared), keep both.
                    return await to_thread.run_sync(lambda: self.store.fork(head, entry.id, label=label))
                if label is not None:
                    await to_thread.run_sync(self.store.set_label, head, label)
                return head
            return (await self._sleep(entry, label=label, free=False))["snapshot_id"]

    async def fork(self, session_id: Any, new_session_id: Any = None, snapshot_id: Any = None) -> dict[str, Any]:
        new_id = check_session_id(new_session_id) if new_session_id is not None else make_session_id()
        self.entry(session_id)
        if new_id in self.entries:
            raise InvalidParamsError(f"session {new_id} exists", session_id=new_id)
        # Reserve the new id now: the snapshot below takes a while, and a concurrent
        # session.create of the same id must get "exists", not be overwritten by the fork.
        reserved = self.entries[new_id] = Entry(new_id, busy="fork", model=self.model_of(self.entry(session_id)))
        try:
            source = snapshot_id if snapshot_id is not None else await self.snapshot_now(session_id, None)
            record = await to_thread.run_sync(self.store.snapshot, source)
            if record.session_id != self.entry(session_id).id:
                raise InvalidParamsError(f"snapshot {source} is not from session {session_id}", snapshot_id=source)
            forked = await to_thread.run_sync(self.store.fork, source, new_id)
        except BaseException:
            self.entries.pop(new_id, None)
            raise
        finally:
            reserved.busy = None
        return {"session_id": new_id, "snapshot_id": forked, "from_snapshot": source}

    # -- store-level operations -----------------------------------------------

    async def import_snapshot(self, path: Any, session_id: Any = None) -> dict[str, Any]:
        """Import a portable snapshot; its session becomes known (asleep) if it was not."""
        if session_id is not None:
            check_session_id(session_id)
        result = await to_thread.run_sync(lambda: self.store.import_(path, session_id=session_id))
        await self.bind_imported(result["session_id"], result["snapshot_id"])  # on its bundle's model
        return result
