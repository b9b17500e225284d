"""The daemon's side of the shared tier: uploads, adoption of remote sessions, leases, remote prefixes.

Where the work runs: every S3 call and every verification runs on worker
threads (`anyio.to_thread`, and the Remote's own pool for parallel fetches),
never on the engine thread or the event loop, so a slow or dead server never
stalls another session (invariant 7). Only the decoded blocks' arrays reach
the engine: fetched blocks go to the RAM tier, so a wake from the remote does
not decode them twice.

Ownership (the lease rule; docs/decisions.md, "Remote tier (issue 13)"):
- A session's lease history is a series of create-only objects; the newest is
  its state: "held" by one daemon, or "released".
- A daemon publishes a session's snapshots only while it holds its lease (checked
  right before each manifest is written). It takes the lease of a session it
  created at its first upload, if no daemon has one.
- `session.sleep(release=true)` uploads, then releases. Another daemon may then
  wake it (taking the next epoch); the first one must take the lease back (and
  gets the newest remote snapshot) before it wakes the session again.
- A lease held by a daemon that died stays held: `session.wake(take_over=true)`
  takes it anyway. If the old owner was not dead after all, its later snapshots
  stay local (its uploads see the lease moved on and say so) and it may not wake
  the session again until it takes the lease back.
This daemon's view of its leases is kept in `<data dir>/remote/leases.json`, so
it survives a restart and a session it holds wakes without asking the remote.

Every model's sessions and prompts go to their own bundle's namespace
(store/remote/client.py: `v1/<bundle>/`), a `Remote` each, connected when first
used: a snapshot's upload by its bundle, a prefix lookup and an adoption by the
model of the request, a release where the session's lease was taken; listing
and gc cover the namespaces this daemon has used since it started (the default
model's always). `remote` is the default model's, whose health `status` shows.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import asdict
from typing import Any

import anyio
from anyio import from_thread, to_thread

from kvwake.daemon.config import Settings
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.sessions.remote_leases import LeaseBook, daemon_id
from kvwake.errors import BusyError, KvwakeError, NotFoundError, RemoteUnavailableError
from kvwake.store.format.keys import chain_keys
from kvwake.store.remote.client import Remote
from kvwake.store.remote.gc import collect
from kvwake.store.remote.objects import Lease, RemoteConfig
from kvwake.store.remote.shared_prompts import fetch_prefix, upload_prefix
from kvwake.store.remote.snapshots import LostLeaseError, fetch_snapshot, upload_snapshot


__all__ = ["RemoteTier"]

log = logging.getLogger("kvwake.remote")
RETRY_MAX_S = 5.0


class RemoteTier:
    """Everything the session manager asks of the shared tier."""

    def __init__(self, settings: Settings, engine: Engine) -> None:
        assert settings.remote is not None
        self.engine, self.store, self.settings = engine, engine.store, settings
        folder = settings.data_dir / "remote"
        self.config = RemoteConfig(settings.remote, settings.remote_endpoint, settings.remote_access_key_id,
                                   settings.remote_secret_access_key, settings.remote_region, settings.remote_timeout_s)
        self.daemon_id = daemon_id(folder)
        self.remote = self._open(engine.bundle.hash)
        self.remotes = {engine.bundle.hash: self.remote}  # bundle hash -> its namespace's Remote (connected)
        self.homes: dict[str, str] = {}  # session id -> the bundle whose namespace holds its lease
        self._opening = threading.Lock()
        self.book = LeaseBook(folder / "leases.json")
        self.ready = anyio.Event()
        # (session id, snapshot id) of a snapshot, or (None, last chain key) of a warmed prefix (`prefixes`:
        # its bundle and tokens)
        self._send, self._receive = anyio.create_memory_object_stream[tuple[str | None, str]](settings.remote_queue)
        self.taken: tuple[str | None, str] | None = None  # the upload `run` took from the queue and has not finished
        self.prefixes: dict[str, tuple[str, list[int]]] = {}
        self.uploaded: dict[str, anyio.Event] = {}
        self.failed: dict[str, tuple[KvwakeError, float]] = {}  # snapshot id -> (why its last upload failed, when)
        self.counters = {"upload_queue_full": 0, "upload_failures": 0, "prefix_blocks": 0, "prefix_partial_tokens": 0,
                         "prefix_lookups_late": 0,
                         "uploaded_prefixes": 0, "adopted": 0}

    def _open(self, bundle: str) -> Remote:
        remote = Remote(self.config, bundle, self.daemon_id)
        remote.health.slow_s = self.settings.remote_prefix_deadline_s  # slower than a prefix lookup waits: "slow"
        remote.keep_history = self.settings.keep_history  # the remote gc keeps as much of our sessions' history
        return remote

    def remote_for(self, bundle: str) -> Remote:
        """The namespace of model bundle `bundle`, its identity checked (connected) at its first use
        (blocking: a worker thread's). RemoteUnavailableError, InvalidParamsError as `Remote.connect`."""
        with self._opening:
            remote = self.remotes.get(bundle)
            if remote is None:
                remote = self._open(bundle)
                try:
                    remote.connect(self.store.block_tokens, self.store.bundle(bundle) or {})
                except BaseException:
                    remote.close()
                    raise
                self.remotes[bundle] = remote
        return remote

    def _home(self, session_id: str) -> Remote:
        """The namespace of a session's lease: where it was taken, else its head snapshot's bundle's (after a
        restart), else the default model's (blocking)."""
        bundle = self.homes.get(session_id)
        if bundle is None:
            try:
                head = self.store.session(session_id)["head"]
            except NotFoundError:
                head = None
            bundle = self.store.snapshot(head).bundle if head else self.remote.bundle
        return self.remote_for(bundle)

    def close(self) -> None:
        self._send.close()  # the upload queue: whatever is still queued is uploaded at the next start
        self._receive.close()
        for remote in list(self.remotes.values()):
            remote.close()

    def status(self) -> dict[str, Any]:
        h = self.remote.health
        # Answering is not yet ready: until the identity check has returned, remote reads and adoption
        # refuse (REMOTE_UNAVAILABLE), so the state says "connecting", never "ok" before they would work.
        state = "connecting" if h.state in ("ok", "slow") and not self.ready.is_set() else h.state
        return {"url": self.settings.remote, "endpoint": self.settings.remote_endpoint, "state": state,
                "error": h.error, "since": h.since, "last_ok": h.last_ok, "last_call_s": h.last_call_s,
                "daemon": self.remote.daemon_id,
                "queued": self._send.statistics().current_buffer_used,
                "uploading": self.taken[1] if self.taken is not None else None,
                **{k: sum(r.counters[k] for r in list(self.remotes.values())) for k in self.remote.counters},
                **self.counters}

    @property
    def healthy(self) -> bool:
        """Answering: "ok", or "slow" (a prefix lookup's deadline bounds what a slow server costs)."""
        return self.remote.health.state in ("ok", "slow")

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await to_thread.run_sync(lambda: fn(*args))

    # -- start and uploads ----------------------------------------------------

    async def run(self) -> None:
        """Connect (retrying while the server is down), queue local heads not yet published, then upload forever."""
        delay = 0.2
        while True:
            try:
                await self._run(self.remote.connect, self.store.block_tokens, self.engine.bundle.description)
                break
            except KvwakeError as exc:
                log.warning("remote not ready", extra={"error": exc.message})
                await anyio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
        self.ready.set()
        log.info("remote ready", extra={"remote": self.settings.remote, "daemon": self.remote.daemon_id})
        for row in await self._run(self.store.sessions):
            if row["head"] is not None and not self.needs_lease(row["id"]):
                self.enqueue(row["id"], row["head"])
        async for item in self._receive:
            self.taken = item  # a stop that cancels this upload finishes it in `flush`
            await self._upload_retrying(*item)
            self.taken = None

    def enqueue_prefix(self, tokens: list[int], bundle: str | None = None) -> None:
        """Queue a warmed prefix of model bundle `bundle` (None: the default model's): its blocks, its short
        last one too, for upload under a prefix manifest (store/remote/shared_prompts.py)."""
        bundle = bundle or self.remote.bundle
        keys = chain_keys(bundle, tokens, self.store.block_tokens, partial=True)
        if keys:
            self.prefixes[keys[-1]] = (bundle, list(tokens))
            self.enqueue(None, keys[-1])

    def enqueue(self, session_id: str | None, snapshot_id: str) -> None:
        """Queue a committed local snapshot for upload (never blocks: a full queue drops it, counted)."""
        self.uploaded.setdefault(snapshot_id, anyio.Event())
        try:
            self._send.send_nowait((session_id, snapshot_id))
        except anyio.WouldBlock:
            self.counters["upload_queue_full"] += 1
            log.warning("upload queue full; snapshot stays local", extra={"session": session_id, "snapshot": snapshot_id})

    async def _upload_retrying(self, session_id: str | None, snapshot_id: str) -> None:
        delay = 0.2
        while True:
            try:
                await self._upload(session_id, snapshot_id)
                return
            except RemoteUnavailableError as exc:  # the server is down or refusing: keep it, try again
                self.failed[snapshot_id] = (exc, time.monotonic())
                await anyio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
            except KvwakeError as exc:  # lease lost, snapshot pruned, local damage: this one will not go
                self.counters["upload_failures"] += 1
                self.failed[snapshot_id] = (exc, time.monotonic())
                log.warning("upload failed", extra={"session": session_id, "snapshot": snapshot_id, "error": exc.message})
                self.uploaded[snapshot_id].set()
                return

    async def _upload(self, session_id: str | None, snapshot_id: str) -> None:
        if session_id is None:  # a warmed prefix: no session, no lease; its manifest keeps its blocks
            bundle, tokens = self.prefixes[snapshot_id]
            info = await self._run(lambda: upload_prefix(self.remote_for(bundle), self.store, tokens))
            self.counters["uploaded_prefixes"] += 1
            self.uploaded[snapshot_id].set()
            log.info("uploaded prefix", extra=info or {})
            return
        remote = await self._run(lambda: self.remote_for(self.store.snapshot(snapshot_id).bundle))  # its model's
        self.homes[session_id] = remote.bundle
        lease = self.book.get(session_id)
        if lease is None:  # a session this daemon made: its lease is taken at the first upload, if nobody has one
            try:
                lease = await self._run(lambda: remote.acquire(session_id, only_new=True))
            except BusyError:
                await self._run(self.book.set, session_id, Lease(0, self.remote.daemon_id, "lost", time.time()))
                raise
            await self._run(self.book.set, session_id, lease)
        if lease.state != "held" or lease.daemon != self.remote.daemon_id:
            raise LostLeaseError(f"session {session_id} is not held by this daemon (lease {lease.state}); "
                                 f"snapshot {snapshot_id} stays local", session_id=session_id)
        try:
            info = await self._run(upload_snapshot, remote, self.store, snapshot_id, lease)
        except LostLeaseError:
            await self._run(self.book.set, session_id, Lease(lease.epoch, lease.daemon, "lost", lease.time))
            raise
        self.failed.pop(snapshot_id, None)
        self.uploaded[snapshot_id].set()
        log.info("uploaded", extra={"session": session_id, **info})

    async def wait_uploaded(self, session_id: str, snapshot_id: str) -> None:
        """Wait until the remote holds the snapshot. RemoteUnavailableError when the remote is not connected,
        when an upload attempt fails after the wait began (it is retried in the background), or after 3x
        the request timeout."""
        if snapshot_id not in self.uploaded:
            self.enqueue(session_id, snapshot_id)
        began, done = time.monotonic(), self.uploaded[snapshot_id]
        with anyio.move_on_after(self.settings.remote_timeout_s * 3 if self.ready.is_set() else 0):
            while not done.is_set() and (snapshot_id not in self.failed or self.failed[snapshot_id][1] < began):
                await anyio.sleep(0.02)
        failure = self.failed.get(snapshot_id, (None, 0.0))[0]
        if isinstance(failure, LostLeaseError):  # BUSY: another daemon took the session over; it stays local here
            raise failure
        if failure is not None or not done.is_set():
            why = (failure.message if failure is not None else "the upload did not finish in time"
                   if self.ready.is_set() else f"not connected: {self.remote.health.error or 'still connecting'}")
            raise RemoteUnavailableError(f"snapshot {snapshot_id} of session {session_id} is committed locally but "
                                         f"the remote does not hold it: {why}", session_id=session_id,
                                         snapshot_id=snapshot_id, remote=self.settings.remote)

    async def release(self, session_id: str) -> bool:
        """Give the session's lease up (after its head is uploaded): another daemon may take it."""
        lease = self.book.get(session_id)
        if lease is None or lease.state != "held":
            return False
        remote = await self._run(self._home, session_id)
        if await self._run(remote.release, session_id, lease):
            await self._run(self.book.set, session_id, Lease(lease.epoch + 1, lease.daemon, "released", lease.time))
            return True
        return False

    # -- reads: adoption and prefixes -----------------------------------------

    def _check_ready(self) -> None:
        if not self.ready.is_set():
            raise RemoteUnavailableError(f"remote {self.settings.remote} is not connected: "
                                         f"{self.remote.health.error or 'still connecting'}",
                                         remote=self.settings.remote, state=self.remote.health.state)

    def needs_lease(self, session_id: str) -> bool:
        """Whether waking this local session must take its lease first (it was released or taken over)."""
        lease = self.book.get(session_id)
        return lease is not None and lease.state != "held"

    async def adopt(self, session_id: str, *, take_over: bool = False, engine: Engine | None = None) -> dict[str, Any]:
        """Take the session's lease and bring its newest remote snapshot into the local store, from the
        namespace of `engine`'s model (None: the default model's).

        Raises NotFoundError (no such remote session), BusyError (another daemon holds it),
        CorruptBlockError (refused, nothing kept), RemoteUnavailableError.
        """
        self._check_ready()
        engine = engine or self.engine
        remote = await self._run(self.remote_for, engine.bundle.hash)
        if await self._run(remote.head, session_id) is None:
            raise NotFoundError(f"no session {session_id!r} of model {engine.model_name} here or on remote "
                                f"{self.settings.remote}", session_id=session_id)
        lease = await self._run(lambda: remote.acquire(session_id, take_over=take_over))
        self.homes[session_id] = remote.bundle
        await self._run(self.book.set, session_id, lease)  # an fsync: off the event loop
        try:
            head = await self._run(remote.head, session_id)
            result = await self._run(fetch_snapshot, remote, self.store, head, session_id, engine.ram_tier.put)
        except BaseException:
            with contextlib.suppress(Exception):  # give back what we cannot serve
                await self.release(session_id)
            raise
        self.counters["adopted"] += 1
        log.info("adopted", extra={"session": session_id, "epoch": lease.epoch, **result})
        return result

    def prefetch(self, tokens: list[int], engine: Engine | None = None) -> int:
        """Remote blocks continuing the local prefix of `tokens`, then a published partial piece (for a
        model served through restore points: the run's points instead), under the deadline, into the RAM
        tier (points: into the store); `engine`: the request's model (None: the default one). Returns the
        whole blocks added (0 when unhealthy).

        Blocking, on the calling worker thread (an append's, which is waiting for this anyway): it takes
        no second worker thread, so any number of cold appends at once cannot starve anyio's pool.
        The counters are updated on the event loop.
        """
        engine = engine or self.engine
        if not self.healthy or len(tokens) < engine.min_partial:
            return 0
        deadline, began = self.settings.remote_prefix_deadline_s, time.monotonic()
        try:
            n, partial = fetch_prefix(self.remote_for(engine.bundle.hash), self.store, tokens, deadline_s=deadline,
                                      min_partial=engine.min_partial, on_block=engine.ram_tier.put,
                                      with_points=engine.points.enabled)
        except KvwakeError as exc:  # a prefix lookup never fails an append: it prefills instead
            log.warning("remote prefix lookup failed; prefilling", extra={"error": exc.message})
            return 0
        from_thread.run_sync(self._count_prefetch, n, partial, time.monotonic() - began >= deadline)
        return n

    def _count_prefetch(self, n: int, partial: int, late: bool) -> None:
        if late:  # the rest is prefilled; status says why at once
            deadline = self.settings.remote_prefix_deadline_s
            self.counters["prefix_lookups_late"] += 1
            self.remote.health.report(False, f"a prefix lookup got no answer within {deadline} s; prefilled "
                                      f"after {n} remote blocks", "slow")
        self.counters["prefix_blocks"] += n
        self.counters["prefix_partial_tokens"] += partial

    async def gc(self, grace_s: float, verify: bool) -> dict[str, Any]:
        """One remote gc run (store/remote/gc.py) in the default model's namespace, and one in each other
        namespace this daemon has used (under "namespaces": their bundle hash and report); this daemon's store
        puts back what it can of damaged objects."""
        self._check_ready()
        reports = []
        for remote in list(self.remotes.values()):
            report = await self._run(lambda remote=remote: collect(remote, self.store, grace_s=grace_s, verify=verify))
            log.info("remote gc", extra={"bundle": remote.bundle, **asdict(report)})
            reports.append({"bundle": remote.bundle, **asdict(report)})
        first = {k: v for k, v in reports[0].items() if k != "bundle"}
        return {**first, "namespaces": reports[1:]} if len(reports) > 1 else first

    async def sessions(self) -> tuple[list[str], str | None]:
        """Remote session ids, and an error when they could not be listed (never raises)."""
        if not self.ready.is_set() or not self.healthy:
            return [], self.remote.health.error or "remote not connected"
        try:
            listed = [await self._run(remote.sessions) for remote in list(self.remotes.values())]
            return sorted({sid for ids in listed for sid in ids}), None
        except KvwakeError as exc:
            return [], exc.message

    async def flush(self, timeout_s: float) -> None:
        """At shutdown, after `run` was cancelled: finish the upload it had taken from the queue (the stop
        cut it between two steps; running it again skips what is already there), then upload what is
        queued, for at most timeout_s in all. What is not uploaded by then stays local and is queued
        again at the next start."""
        with anyio.move_on_after(timeout_s):
            if self.taken is not None and self.healthy:
                await self._upload_retrying(*self.taken)
                self.taken = None
            while self._send.statistics().current_buffer_used and self.healthy:
                await self._upload_retrying(*self._receive.receive_nowait())
