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
- The models come from the `ModelProvider` (model/provider.py); today every
  session runs on its one model.
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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
from anyio import to_thread

from kvwake.daemon.gcwatch import Collector
from kvwake.daemon.config import Settings
from kvwake.daemon.gilwatch import GilWatch
from kvwake.daemon.model.engine import Engine, Plan
from kvwake.daemon.model.generation import GenerateParams, GenerateResult, OnEvent
from kvwake.daemon.model.provider import LoadedModel, ModelProvider
from kvwake.daemon.model.thread import EngineThread
from kvwake.daemon.timing import Latency, Phases
from kvwake.daemon.session_state import Session, check_json, check_session_id, common_prefix
from kvwake.daemon.sessions.entries import Entries, Entry
from kvwake.daemon.session_state import new_session_id as make_session_id
from kvwake.errors import BusyError, InvalidParamsError, NotFoundError

if TYPE_CHECKING:  # the remote tier (and obstore) load only when serve has --remote
    from kvwake.daemon.sessions.remote_tier import RemoteTier

__all__ = ["Prepared", "SessionManager"]

log = logging.getLogger("kvwake.sessions")
TURNS_KEPT = 64  # generate calls whose phases status keeps
COPY_WAIT_S = 10.0  # a call waits this long for a session lent to another's prefix copy, then is BUSY


@dataclass(frozen=True)
class Prepared:
    """A request's prompt rendered once and checked once (`SessionManager.prepare`): its params against the
    model, its length against the context and the memory; `generate` appends it without checking again."""

    plan: Plan
    params: GenerateParams


class SessionManager:
    """All session operations the fronts call (RPC methods, HTTP routes), over the models of `models`."""

    def __init__(self, models: ModelProvider, settings: Settings) -> None:
        self.models, self.settings = models, settings
        self.store = self.model.engine.store
        self.entries = Entries()  # its `hot` indexes the hot ones: nothing below walks every session
        self.latency = {"sleep": Latency(), "wake": Latency(), "generate_ttft": Latency()}
        # The latest generate calls' phases, ms each: where a first token's time went (status "turns")
        self.turns: deque[dict[str, Any]] = deque(maxlen=TURNS_KEPT)
        self.counters = {"sleeps": 0, "wakes": 0, "auto_sleeps": 0, "room_sleeps": 0, "sleep_failures": 0,
                         "generations": 0, "prefix_copies": 0}
        self.stopping = False
        # KV taken from sessions (slept, deleted, replaced by a wake) and being freed on the engine thread: its bytes
        self.releasing: dict[asyncio.Task, int] = {}
        self.remote: RemoteTier | None = None  # the shared tier, when serve has --remote
        self.started = Phases()  # where the daemon's start went (serve.py marks it)
        self.collector = Collector()  # the garbage collector's runs (serve.py installs it)
        self.gil_watch: GilWatch | None = None  # waits for the GIL, when KVWAKE_GIL_WATCH_MS asks (serve.py)

    @property
    def model(self) -> LoadedModel:
        """The model sessions run on: the provider's default (every session's, until models are chosen by
        name: its bundle hash ties each session to it)."""
        return self.models.get()

    @property
    def engine(self) -> Engine:
        return self.model.engine

    @property
    def thread(self) -> EngineThread:
        return self.model.thread

    def model_names(self) -> list[str]:
        """The names of the models served, the default first."""
        return self.models.names()

    async def load(self) -> None:
        """Know every session the store holds (all asleep after a start)."""
        for row in await to_thread.run_sync(self.store.sessions):
            self.entries[row["id"]] = Entry(row["id"], created=row["created"])

    # -- claiming -------------------------------------------------------------

    def entry(self, session_id: Any) -> Entry:
        entry = self.entries.get(check_session_id(session_id))
        if entry is None:
            raise NotFoundError(f"no session {session_id!r}", session_id=session_id)
        return entry

    @contextlib.asynccontextmanager
    async def claim(self, session_id: Any, op: str, take_over: bool = False) -> AsyncIterator[Entry]:
        if self.remote is not None and op not in ("delete", "sleep") and check_session_id(session_id) not in self.entries:
            await self.remote.adopt(session_id, take_over=take_over)  # published by another daemon: ours now
            self.entries.setdefault(session_id, Entry(session_id))
        entry = self.entry(session_id)
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

    async def awake(self, entry: Entry) -> Session:
        """The entry's session, woken first if it sleeps (the caller holds the claim)."""
        if entry.session is None:
            await self._wake(entry, None)
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
        if session_id in self.entries:
            if exist_ok:
                return {"session_id": session_id, "created": False}
            raise InvalidParamsError(f"session {session_id} exists", session_id=session_id, exists=True)
        session = Session(session_id, metadata=dict(metadata or {}))
        if system:
            session.mode, session.messages = "chat", [{"role": "system", "content": system}]
        entry = self.entries[session_id] = Entry(session_id, session=session, busy="create")
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

    async def _wake(self, entry: Entry, snapshot_id: str | None, take_over: bool = False) -> dict[str, Any]:
        if self.remote is not None and self.remote.needs_lease(entry.id):  # released or taken over: take it back
            await self.remote.adopt(entry.id, take_over=take_over)
        snapshot = snapshot_id
        if snapshot is None:
            row = await to_thread.run_sync(self.store.session, entry.id)
            if row["head"] is None:  # a session with no snapshot yet starts empty, it is not missing
                entry.session = Session(entry.id, metadata=row["metadata"])
                return {"snapshot_id": None, "tokens": 0, "blocks_from_memory": 0, "blocks_from_disk": 0, "ms": 0.0}
            snapshot = row["head"]
        engine = self.engine
        # Read and verified once (its bundle too, before anyone sleeps for it); the wake takes it as it is.
        record = await to_thread.run_sync(engine.record, snapshot)
        if self.releasing and self.hot_bytes() > self.hot_budget():
            await self.released()  # over the budget until KV being freed is gone: wait for it before adding more
        await self.make_room(entry, len(record.token_ids))  # the snapshot's KV must fit beside the hot sessions'
        session, info = await to_thread.run_sync(lambda: engine.wake(entry.id, mlx=self.thread.call, record=record))
        replaced, entry.session = entry.session, session
        if replaced is not None:  # a hot session woken from another snapshot: its KV freed where MLX runs
            self._release(replaced)
        self.latency["wake"].add(info["ms"])
        self.counters["wakes"] += 1
        log.info("wake", extra={"session": entry.id, **info})
        return info

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

    def _release(self, session: Session) -> None:
        """Free a session's KV (no entry holds it any more) on the engine thread, in short jobs
        (pipeline.release), not where its last reference happens to drop (the event loop: MLX memory off the
        engine thread, and a stall of every connection while a big cache is unmapped). In the background: the
        call that let it go (a sleep, a delete, a wake from another snapshot) replies first; its bytes count
        in hot_bytes until they are freed, and `released` waits for them."""
        nbytes = self.engine.cache_bytes(session)
        task = asyncio.get_running_loop().create_task(
            to_thread.run_sync(lambda: self.engine.release(session, self.thread.call)))
        self.releasing[task] = nbytes
        task.add_done_callback(self._freed)

    def _freed(self, task: asyncio.Task) -> None:
        self.releasing.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("freeing a session's KV failed", extra={"error": repr(task.exception())})

    async def released(self) -> None:
        """Wait until every KV let go so far is freed."""
        while self.releasing:
            await asyncio.wait(list(self.releasing))

    async def delete(self, session_id: Any) -> dict[str, Any]:
        async with self.claim(session_id, "delete") as entry:
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
        reserved = self.entries[new_id] = Entry(new_id, busy="fork")
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

    # -- conversation ---------------------------------------------------------

    async def append(self, session_id: Any, cancelled: Callable[[], bool] | None = None,
                     **inputs: Any) -> dict[str, Any]:
        """Append input; `cancelled` (the client left) stops its prefill between chunks (CANCELLED)."""
        async with self.claim(session_id, "append") as entry:
            stop = lambda: (cancelled is not None and cancelled()) or self.stopping  # noqa: E731
            return await self._append(await self.awake(entry), inputs, stop, entry)

    async def _append(self, session: Session, inputs: dict[str, Any] | Prepared,
                      stop: Callable[[], bool], entry: Entry | None = None) -> dict[str, Any]:
        """The engine's append, step by step: the plan (rendered on a worker thread, or a prepared prompt
        checked already), the check, room (other sessions sleep if the memory left for KV would not hold
        the session's new length beside them: `entry` is the claimed one), a prefix for a fresh cache,
        then the apply (prefill) on a worker thread."""
        engine = self.engine
        if isinstance(inputs, Prepared):
            plan = inputs.plan
            session.check_mode(plan.mode)
        else:
            plan = await to_thread.run_sync(lambda: engine.plan(session, **inputs))
            engine.check_fits(len(plan.target))  # before any prefill
        if entry is not None:
            await self.make_room(entry, len(plan.target))
        prefix = await self._prefix(session, plan.target)
        return await to_thread.run_sync(lambda: engine.apply(session, plan, prefix, self.thread.call, stop))

    async def prepare(self, inputs: dict[str, Any], params: GenerateParams) -> Prepared:
        """A front's request before any session is chosen: its params checked against the model (a bad schema
        refused before any compute), its conversation rendered once (on a worker thread) and its length
        checked against the context and the memory. `generate` takes it as it is."""
        self.check_params(params, inputs.get("tools"))
        plan = await to_thread.run_sync(lambda: self.engine.render(**inputs))
        self.engine.check_fits(len(plan.target))
        return Prepared(plan, params)

    async def render(self, inputs: dict[str, Any]) -> Plan:
        """A whole conversation (messages, text or tokens; tools) rendered, on a worker thread (nothing runs,
        no session is made: a token count)."""
        return await to_thread.run_sync(lambda: self.engine.render(**inputs))

    async def _prefix(self, session: Session, target: list[int]) -> tuple[list | None, int]:
        """What a fresh cache for `target` starts from instead of prefilling: the remote tier's blocks fetched
        into the RAM tier first, then another hot session's prefix copied when one holds at least
        `engine.min_partial` tokens of it, else the longest run of stored blocks; (None, 0) when the session
        keeps its own cache or the model's caches cannot be cut by token."""
        engine = self.engine
        if not engine.wants_prefix(session, target):
            return None, 0
        if self.remote is not None and session.cache is None:  # the remote may hold its prefix
            await to_thread.run_sync(self.remote.prefetch, target[: len(target) - 1])
        copied = await self._hot_prefix(session, target)
        if copied[0] is not None:
            return copied
        return await to_thread.run_sync(lambda: engine.stored_prefix(target, self.thread.call))

    async def _hot_prefix(self, session: Session, target: list[int]) -> tuple[list | None, int]:
        """A copy of the longest prefix of `target` that another hot, idle session's cache holds.

        For a session about to need a fresh cache (its first input; `_prefix` asks Engine.wants_prefix first:
        that and that the model's cache can be cut by token): agents that share a system prompt
        while the first one is still hot reuse its KV in memory, as the prefix cache would from disk once
        it slept. At least `engine.min_partial` tokens (below that the match is the chat template's
        opening). Returns (cache, tokens) or (None, 0); a source taken meanwhile is skipped, not waited for.
        """
        want, best, source = np.asarray(target[: len(target) - 1], dtype=np.int64), 0, None
        for entry in list(self.entries.hot.values()):
            s = entry.session
            if s is None or s is session or entry.busy or s.cache is None or not s.processed:
                continue
            shared = common_prefix(s.tokens[: s.processed], want)
            if shared > best:
                best, source = shared, entry
        if source is None or best < self.engine.min_partial:
            return None, 0
        try:
            async with self.claim(source.id, "copy"):
                src = source.session
                if src is None or src.cache is None or src.processed < best:
                    return None, 0
                cache = await self.thread.run(lambda: self.engine.copy_prefix(src, best))
        except BusyError:
            return None, 0
        self.counters["prefix_copies"] += 1
        logging.getLogger("kvwake.matching").info(  # the logger its message always had
            "prefix copied from a hot session", extra={"session": session.id, "source": source.id, "tokens": best})
        return cache, best

    def check_params(self, params: GenerateParams, tools: list[dict[str, Any]] | None = None) -> None:
        """What GenerateParams cannot check alone (it needs the model); raises InvalidParamsError.

        A structure is compiled here (and kept), so a bad schema is refused before any compute; a forced
        tool call without `tools` given is checked against the session's tools when the call starts.
        """
        structure = params.structure
        if structure is not None and (structure.kind != "tool_call" or tools is not None):
            self.engine.check_structure(params, tools)
        if any(token >= self.engine.vocab_size for token, _ in params.logit_bias):
            raise InvalidParamsError(f"logit_bias names a token id outside [0, {self.engine.vocab_size})",
                                     param="logit_bias")

    async def generate(self, session_id: Any, params: GenerateParams, on_event: OnEvent | None,
                       cancelled: Callable[[], bool], inputs: dict[str, Any] | Prepared | None = None,
                       on_claim: Callable[[], None] | None = None,
                       on_append: Callable[[dict[str, Any]], None] | None = None,
                       phases: dict[str, Any] | None = None) -> dict[str, Any]:
        """Generate in the session (after appending `inputs`: params, or a front's `Prepared` prompt).

        `on_claim` is called once the session is claimed: a BusyError before it means nothing was done.
        `on_append` gets the append's counts once the prompt is in the cache, before the first token:
        {"tokens", "prefilled", "reused", "computed"}, where "computed" is the prompt tokens this call
        computes (the prefilled ones and the pending last one), as the result's usage will count them.
        """
        if not isinstance(inputs, Prepared):  # a prepared one was checked as it was prepared
            self.check_params(params, (inputs or {}).get("tools"))
        called = time.perf_counter()
        async with self.claim(session_id, "chat" if inputs else "generate") as entry:
            if on_claim is not None:
                on_claim()
            session = await self.awake(entry)
            stop = lambda: cancelled() or self.stopping  # noqa: E731
            started = time.perf_counter()
            appended = await self._append(session, inputs, stop, entry) if inputs else {"prefilled": 0, "reused": 0}
            append_ms = (time.perf_counter() - started) * 1000
            if on_append is not None and inputs:  # a call starts from one pending token at least
                on_append({**appended, "computed": appended["prefilled"] + max(len(session.pending), 1)})
            session.reply_start = len(session.tokens)
            result = await self._decode(session, params, on_event, stop)
            self.engine.persist(session, self.thread.call, turn=True)  # the reply, in the background
            # A chat's prompt is the appended input too: its prefill counts in prompt tokens and time to first token.
            usage = {**result.usage, "prompt_tokens": result.usage["prompt_tokens"] + appended["prefilled"],
                     "ttft_ms": round(result.usage["ttft_ms"] + append_ms, 3),
                     "reused_tokens": appended["reused"], "prefilled_tokens": appended["prefilled"]}
            self.counters["generations"] += 1
            self.latency["generate_ttft"].add(usage["ttft_ms"])
            self.turns.append({"session": session.id, "at": round(time.time() - (time.perf_counter() - called), 4),
                               **(phases or {}), "claim_ms": round((started - called) * 1000, 2),
                               "append_ms": round(append_ms, 2), "first_token_ms": round(result.usage["ttft_ms"], 2),
                               "prefilled": appended["prefilled"]})
            return {"text": result.text, "content": result.content, "reasoning": result.reasoning,
                    "tool_calls": result.tool_calls,
                    "tool_call_errors": result.tool_call_errors, "tokens": result.tokens,
                    "finish_reason": result.finish_reason, "stop_sequence": result.stop_sequence, "usage": usage,
                    **({"append": appended} if inputs else {})}

    async def _decode(self, session: Session, params: GenerateParams, on_event: OnEvent | None,
                      stop: Callable[[], bool]) -> GenerateResult:
        """Prefill the pending tokens (chunked), then decode in the engine's decoder, batched with other calls."""
        engine, loop = self.engine, asyncio.get_running_loop()
        call = await to_thread.run_sync(lambda: engine.start_call(session, params, on_event, stop, self.thread.call))
        # The result comes through `post`, after the output the same step posted (streamed pieces first).
        ended: asyncio.Future[GenerateResult] = loop.create_future()
        call.future.add_done_callback(lambda f: self.thread.post(loop, _settle, ended, f))
        await self.thread.run(lambda: engine.decoder.join(call), quick=True)  # calls that come together join together
        # The session's cache belongs to the decoder until the call ends: the claim must outlive it,
        # so this wait is not cancelled (a client that leaves stops the call through `stop`).
        with anyio.CancelScope(shield=True):
            return await ended

    def post(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on `loop`; for fronts' streamed output, called on the engine thread: every call's
        output of one decode step reaches the loop in one hop, before the calls that step ended return."""
        self.thread.post(loop, fn, *args)

    # -- store-level operations -----------------------------------------------

    async def import_snapshot(self, path: Any, session_id: Any = None) -> dict[str, Any]:
        """Import a portable snapshot; its session becomes known (asleep) if it was not."""
        if session_id is not None:
            check_session_id(session_id)
        result = await to_thread.run_sync(lambda: self.store.import_(path, session_id=session_id))
        self.entries.setdefault(result["session_id"], Entry(result["session_id"]))
        return result

    async def warm(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Prefill a shared prompt once and pin it in the prefix cache (the engine's warm), from a hot
        session's copy of it or stored blocks where they hold some of it."""
        engine, scratch = self.engine, Session("prefix-warm")
        engine.check_warmable()
        plan = await to_thread.run_sync(lambda: engine.plan(scratch, **inputs))
        engine.check_fits(len(plan.target))
        prefix = await self._prefix(scratch, plan.target)
        info = await to_thread.run_sync(lambda: engine.warm(mlx=self.thread.call, scratch=scratch, prompt=plan,
                                                            prefix=prefix))
        if self.remote is not None:  # a warmed prompt serves every daemon sharing the remote
            self.remote.enqueue_prefix(scratch.tokens[: scratch.processed])
        return info

    # -- automatic sleep and shutdown -----------------------------------------

    def hot_bytes(self) -> int:
        """KV in memory: the hot sessions' and what is being freed."""
        return self.freeing_bytes() + sum(self.engine.cache_bytes(e.session) for e in self.entries.hot.values()
                                          if e.session is not None)

    def hot_budget(self) -> int:
        """Bytes of hot KV above which LRU sessions sleep: the settings', else the engine's from its memory."""
        configured = self.settings.hot_budget_bytes
        return configured if configured is not None else self.engine.hot_budget_bytes

    def freeing_bytes(self) -> int:
        return sum(self.releasing.values())

    def _growth(self, entry: Entry, tokens: int) -> int:
        """Bytes of KV the claimed entry's session takes on growing to `tokens` tokens (0 within its buffer, or
        without a memory limit to keep to)."""
        if self.engine.kv_room_bytes is None or tokens <= 0:
            return 0
        held = self.engine.cache_bytes(entry.session) if entry.session is not None else 0
        return max(0, self.engine.kv_bytes(tokens) - held)

    async def make_room(self, keep: Entry, tokens: int) -> int:
        """Before `keep`'s session grows to `tokens` tokens (a wake, a long prompt): sleep the least recently
        used idle sessions while the hot KV and that growth would not fit the memory left for KV beside the
        weights (`Engine.kv_room_bytes`); returns how many slept. The budget lets hot sessions hold half of
        that room, and one session may take all of it (Engine.check_fits), so a big one beside a full budget
        needs this; without it MLX would go past its limit (on CUDA it spills to host memory)."""
        room, growth = self.engine.kv_room_bytes, self._growth(keep, tokens)
        if room is None or growth == 0 or self.hot_bytes() + growth <= room:  # the common case: nothing to sort
            return 0
        return await self._sleep_lru(lambda e: self.hot_bytes() + growth > room, "room_sleeps", keep)

    async def enforce_limits(self) -> int:
        """Sleep idle sessions, then LRU ones while hot KV exceeds its budget; returns how many slept."""
        now = time.monotonic()
        return await self._sleep_lru(lambda e: now - e.last_used > self.settings.idle_timeout_s
                                     or self.hot_bytes() > self.hot_budget(), "auto_sleeps")

    async def _sleep_lru(self, needed: Callable[[Entry], bool], counter: str, keep: Entry | None = None) -> int:
        """Sleep idle hot sessions (not `keep`), least recently used first, while `needed(entry)` says so;
        each one's KV is freed before the next is looked at. Returns how many slept (counted in `counter`).
        A failed sleep is logged (in _sleep too) and the session stays hot: a later pass retries it."""
        slept = 0
        for e in sorted((e for e in self.entries.hot.values() if not e.busy and e is not keep),
                        key=lambda e: e.last_used):
            if not needed(e):
                break
            with contextlib.suppress(BusyError):
                try:
                    await self.sleep(e.id)
                    await self.released()  # its memory gone before the next is looked at
                    slept += 1
                    self.counters[counter] += 1
                except Exception as exc:
                    log.warning("sleep for memory failed", extra={"session": e.id, "error": repr(exc),
                                                                  "why": counter})
        return slept

    async def sleep_all(self) -> dict[str, Any]:
        """For shutdown: sleep every hot session; failures are logged and reported, not raised."""
        results: dict[str, Any] = {}
        for e in list(self.entries.hot.values()):
            try:
                results[e.id] = (await self.sleep(e.id))["snapshot_id"]
            except Exception as exc:
                results[e.id] = {"error": repr(exc)}
        await self.released()  # MLX memory freed on the engine thread before it stops
        return results


def _settle(ended: asyncio.Future, done: Any) -> None:
    """On the loop: `ended` takes the outcome of the call's `done` (a concurrent future)."""
    if ended.cancelled():
        return
    exc = done.exception()
    if exc is not None:
        ended.set_exception(exc)
    else:
        ended.set_result(done.result())
