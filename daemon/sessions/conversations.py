"""A session's conversation in the daemon: input appended, replies generated, shared prompts warmed.

Part of the session manager (`SessionManager` in sessions/manager.py takes these methods), by
responsibility: here the turns, in manager.py the sessions' lifecycle, in room.py the memory.

The manager orchestrates, the engine computes. An append is the engine's steps called in order:
plan (rendered on a worker thread), check, make room (other sessions sleep, on the loop), a prefix (a
hot session's copy, else stored blocks), apply (the prefill, on a worker thread whose MLX steps go to
the engine thread one short job at a time). A front's request is `prepare`d once (params checked,
rendered, its length checked) and `generate` takes it as it is. Generate calls of different sessions
decode together, one batched forward pass per step (model/decoder.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from anyio import to_thread

from kvwake.daemon.model.decode_calls import Call
from kvwake.daemon.model.engine import Plan
from kvwake.daemon.model.generation import GenerateParams, GenerateResult, OnEvent
from kvwake.daemon.model.scheduler.steps import Arrival
from kvwake.daemon.session_state import Session, check_session_id
from kvwake.daemon.sessions.entries import Entry
from kvwake.daemon.sessions.hotkeys import shared_from
from kvwake.daemon.sessions.shared_prefill import NO_PREFIX, Flight, Pending, Prefix
from kvwake.errors import BusyError, InvalidParamsError
from kvwake.store import SnapshotRecord

__all__ = ["Conversations", "Prepared"]

T = TypeVar("T")


@dataclass(frozen=True)
class Prepared:
    """A request's prompt rendered once and checked once (`SessionManager.prepare`): its params against the
    model, its length against the context and the memory; `generate` appends it without checking again.
    `arrival`: the turn on its way to the engine from the moment it was prepared (EngineThread.arrive); the
    `generate` that takes it lands it, and whoever drops it without one lands it (`land`)."""

    plan: Plan
    params: GenerateParams
    render_ms: float = 0.0  # the render alone (status.turns: where a first token's time went)
    arrival: Arrival | None = None

    def land(self) -> None:
        """The turn is no longer on its way (it failed before its `generate`)."""
        if self.arrival is not None:
            self.arrival.land()


class Conversations:
    """The session manager's turns (see the module docstring); `SessionManager` holds the state they use."""

    # -- conversation ---------------------------------------------------------

    async def append(self, session_id: Any, cancelled: Callable[[], bool] | None = None,
                     **inputs: Any) -> dict[str, Any]:
        """Append input; `cancelled` (the client left) stops its prefill between chunks (CANCELLED)."""
        async with self.claim(session_id, "append") as entry:
            stop = lambda: (cancelled is not None and cancelled()) or self.stopping  # noqa: E731
            return (await self._append(await self.awake(entry), inputs, stop, entry))[0]

    async def _append(self, session: Session, inputs: dict[str, Any] | Prepared,
                      stop: Callable[[], bool], entry: Entry | None = None,
                      arrival: Arrival | None = None, then: Callable[[], T] | None = None) -> tuple[dict[str, Any], T | None]:
        """The engine's append, step by step: the plan (rendered on a worker thread, or a prepared prompt
        checked already), the check, room (other sessions sleep if the memory left for KV would not hold
        the session's new length beside them: `entry` is the claimed one), a prefix for a fresh cache,
        then the apply (prefill) on a worker thread; `arrival`: the turn's, landed by its first prefill job
        (turns that arrive together start as one pack: EngineThread.arrive). (The apply's counts, what
        `then` returned): `then` runs on the apply's worker thread after it (a turn's call made there, not
        after a hop back to the event loop and out to another worker thread)."""
        engine = self.engine
        mlx = self.thread.call if arrival is None else self.thread.calls_of(arrival)
        if isinstance(inputs, Prepared):
            plan = inputs.plan
            session.check_mode(plan.mode)
        else:
            plan = await to_thread.run_sync(lambda: engine.plan(session, **inputs))
            engine.check_fits(len(plan.target))  # before any prefill
        if entry is not None:  # paged: the pages it adds, not those it lists or maps
            await self.make_room(entry, len(plan.target), added=lambda: engine.append_bytes(session, plan.target))
        async with self._shared_prefix(session, plan.target, arrival) as (prefix, flight):
            if flight is not None:  # others wait on this prefill: its own client leaving does not stop it
                stop = lambda own=stop: self.stopping or (own() and not flight.waited())  # noqa: E731
            return await to_thread.run_sync(lambda: _and_then(engine.apply(session, plan, prefix, mlx, stop), then))

    async def prepare(self, inputs: dict[str, Any], params: GenerateParams) -> Prepared:
        """A front's request before any session is chosen: its params checked against the model (a bad schema
        refused before any compute), its conversation rendered once (on a worker thread) and its length
        checked against the context and the memory. `generate` takes it as it is."""
        self.check_params(params, inputs.get("tools"))
        started, arrival = time.perf_counter(), self.thread.arrive()  # on its way: others' packs wait for it
        try:
            plan = await to_thread.run_sync(lambda: self.engine.render(**inputs))
            rendered = time.perf_counter()
            self.engine.check_fits(len(plan.target))
        except BaseException:
            arrival.land()
            raise
        return Prepared(plan, params, round((rendered - started) * 1000, 2), arrival)

    async def render(self, inputs: dict[str, Any]) -> Plan:
        """A whole conversation (messages, text or tokens; tools) rendered, on a worker thread (nothing runs,
        no session is made: a token count)."""
        return await to_thread.run_sync(lambda: self.engine.render(**inputs))

    @contextlib.asynccontextmanager
    async def _shared_prefix(self, session: Session, target: list[int],
                             arrival: Arrival | None = None) -> AsyncIterator[tuple[Prefix, Flight | None]]:
        """(What a fresh cache for `target` starts from, the flight this append leads or None), for the block
        that prefills it (sessions/shared_prefill.py): a prefix of an append prefilling the same prompt now,
        waited for, else `_prefix`, and others may wait on this one: its flight lands (its waiters get their
        copies) when the block ends, however it ends. (NO_PREFIX, None) when the session keeps its own cache
        or the model's caches cannot be cut by token. `arrival`: the turn's, set aside while it waits (the
        leader's first job must not wait for it)."""
        engine = self.engine
        held = session.held_point is not None and await to_thread.run_sync(lambda: engine.held_serves(session, target))
        if not engine.wants_prefix(session, target, held):  # its cache kept, or set back to its held point
            yield NO_PREFIX, None
            return
        if not self.engine.cuttable:  # restore points: the leader's held ones, else a stored prefix
            async with self._point_flight(session, target, arrival) as (flight, waited, handed):
                if handed[0] is not None:
                    prefix = handed
                else:
                    await self._prefetch(session, target)  # the remote's blocks and points first
                    prefix = await to_thread.run_sync(lambda: self.engine.stored_prefix(target, self.thread.call))
                if waited and prefix[1]:
                    self.counters["prefix_waits"] += 1
                yield prefix, flight
            return
        held = target[: len(target) - 1]  # all but the pending last token
        waiting = self.shared.wait_for(held)
        if waiting is not None:
            with arrival.aside() if arrival is not None else contextlib.nullcontext():
                prefix = await waiting
            if prefix[0] is not None:
                self.counters["prefix_waits"] += 1
                logging.getLogger("kvwake.matching").info(
                    "prefix taken from a prefill in flight", extra={"session": session.id, "tokens": prefix[1]})
                yield prefix, None
                return
        flight = self.shared.lead(session, held)
        try:
            yield await self._prefix(session, target), flight
        finally:
            await self._land(flight)

    @contextlib.asynccontextmanager
    async def _point_flight(self, session: Session, target: list[int],
                            arrival: Arrival | None) -> AsyncIterator[tuple[Flight | None, bool, Prefix]]:
        """(The flight this append leads or None, whether it waited for one, the prefix its leader handed it or
        NO_PREFIX), for an append whose model cuts by restore points (a hot cache cannot be cut to share). One
        that shares enough of a prompt another append is prefilling now waits for that prefill to end and takes
        a copy of the leader's state at its deepest point within the shared tokens (the leader holds the
        points it takes while it leads: points.hold; one where its system prompt ends, points.stops), on the
        device; failing that (the leader failed, or held none there), it waits for the points the leader handed
        to the writer and restores from the store as any append does. Else it leads, and its waiters go on
        when it ends, however it ends. The leader never waits for its points' writes."""
        waiting = self.shared.wait_for(target[: len(target) - 1], align=self.engine.block_tokens)
        if waiting is not None:
            with arrival.aside() if arrival is not None else contextlib.nullcontext():
                handed = await waiting
                if handed[0] is not None and await to_thread.run_sync(  # the store holds more of its own tokens
                        lambda: self.engine.points.stored_after(target, handed[1], len(target) - 1)):
                    handed = NO_PREFIX  # (its own conversation's, stored before): that, not the copy
                if handed[0] is None:  # the points' copies made now (not in idle time: this turn is on its way)
                    with contextlib.suppress(RuntimeError):  # the writer stopped (the engine closing): the store
                        await to_thread.run_sync(lambda: self.engine.points.hurry(self.thread.call))
            yield None, True, handed
            return
        flight = self.shared.lead(session, target[: len(target) - 1])
        engine = self.engine
        session.point_trail = [] if engine.points.held else None
        try:
            yield flight, False, NO_PREFIX
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self.shared.land(flight, lambda counts: self.thread.run(
                        lambda: [engine.copy_point_prefix(session, n) for n in counts]))
                finally:  # the copies only the trail held freed where MLX runs
                    await self.thread.run(lambda: engine.end_trail(session))

    @contextlib.asynccontextmanager
    async def _wake_prefix(self, entry: Entry, record: SnapshotRecord) -> AsyncIterator[tuple[Prefix, Flight | None]]:
        """(The first blocks of the entry's wake from `record`, taken from another wake's cache, or NO_PREFIX;
        the flight this wake leads, or None). Sessions woken together (a restart's agents) share their
        prompt's blocks: the first wake leads, reads them and lands; the others wait for it and copy its
        first blocks on the device instead of reading them (pipeline.wake's `prefix`), then read only their
        own. Only a wake's cache will do: it holds the stored blocks' bytes, so the woken cache is the one
        reading them would give. A waiter reads its own blocks while the leader wakes and takes the leader's
        once it lands (`Pending`: pipeline.wake). With no wake to wait for, a hot session's blocks that a
        wake restored (`Session.restored`) will do too. Set the flight's session once woken; it lands when
        the block ends."""
        engine, bt = self.engine, self.engine.block_tokens
        held = list(record.token_ids[: len(record.blocks) * bt])  # what another wake's cache may give
        if not held or not engine.wakes_share:
            yield NO_PREFIX, None
            return
        found = self.shared.waits_on(held, align=bt, woken_only=True)
        if found is not None:  # its own blocks read while the leader wakes; the leader's taken once it lands
            logging.getLogger("kvwake.matching").info(
                "blocks to take from a wake in flight", extra={"session": entry.id, "tokens": found[1]})
            yield (Pending(found[0]), found[1]), None
            return
        waking = Session(entry.id)
        flight = self.shared.lead(waking, list(record.token_ids), woken=True)
        try:  # else a hot session's blocks a wake restored (a block resident already is not read again)
            yield await self._hot_prefix(waking, held, align=bt, restored_only=True), flight
        finally:
            await self._land(flight)

    async def _land(self, flight: Flight) -> None:
        """A flight's prefill ended: its waiters get their copies (one engine job), even while this append's
        own task is being cancelled."""
        session, engine = flight.session, self.engine
        with anyio.CancelScope(shield=True):
            await self.shared.land(flight, lambda counts: self.thread.run(
                lambda: [(engine.copy_prefix(session, n), n) for n in counts]))

    async def _prefix(self, session: Session, target: list[int]) -> Prefix:
        """What a fresh cache for `target` starts from instead of prefilling (the caller asked
        Engine.wants_prefix): the remote tier's blocks fetched into the RAM tier first, then another hot
        session's prefix copied when one holds at least `engine.min_partial` tokens of it, else the longest
        run of stored blocks."""
        engine = self.engine
        await self._prefetch(session, target)
        copied = await self._hot_prefix(session, target[: len(target) - 1])
        if copied[0] is not None:
            return copied
        return await to_thread.run_sync(lambda: engine.stored_prefix(target, self.thread.call))

    async def _prefetch(self, session: Session, target: list[int]) -> None:
        """The remote tier's blocks of `target` (and restore points) into the store and RAM tier, for a
        session about to start a fresh cache."""
        if self.remote is not None and session.cache is None:  # the remote may hold its prefix
            engine = self.engine  # the request's model: its namespace on the remote
            await to_thread.run_sync(lambda: self.remote.prefetch(target[: len(target) - 1], engine))

    async def _hot_prefix(self, session: Session, held: list[int], align: int = 1,
                          restored_only: bool = False) -> tuple[list | None, int]:
        """A copy of the longest prefix of `held` (the tokens a cache is wanted for) that another hot, idle
        session's cache holds; `align`: a whole number of these; `restored_only`: only tokens a wake restored
        from the stored blocks (`Session.restored`: for a wake, which must give the stored bytes).

        For a session about to need a fresh cache (its first input; `_prefix` asks Engine.wants_prefix first:
        that and that the model's cache can be cut by token): agents that share a system prompt
        while the first one is still hot reuse its KV in memory, as the prefix cache would from disk once
        it slept. At least `engine.min_partial` tokens (below that the match is the chat template's
        opening). Returns (cache, tokens) or (None, 0); a source taken meanwhile is skipped, not waited for.
        Only the sessions holding the deepest chain key the prompt shares are compared (`entries.keys`).
        """
        want, best, source, model = held, 0, None, self.model_name()
        for known, level in self.entries.keys.levels(want):  # by chain key (sessions/hotkeys.py), deepest first
            for entry in level:
                s = entry.session
                if s is None or s is session or entry.busy or s.cache is None or not s.processed:
                    continue
                if self.model_of(entry) != model:  # another model's KV is no prefix of this one's
                    continue
                shared = min(s.restored if restored_only else s.processed, shared_from(s.tokens, want, known))
                shared -= shared % align
                if shared > best:
                    best, source = shared, entry
            if best >= known:  # a later level shares fewer than `known` tokens
                break
        if source is None or best < self.engine.min_partial:
            return None, 0
        try:
            async with self.claim(source.id, "copy"):
                src = source.session
                if src is None or src.cache is None or (src.restored if restored_only else src.processed) < best:
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
        # A turn on an asleep session whose model is not loaded (or going) waits for its claim to load it: its
        # params are checked then, against its model (the default model's were asked: with none loaded the turn
        # was refused, with another loaded it was checked against another vocabulary), and no engine thread of
        # another model is told it comes
        own = None if isinstance(inputs, Prepared) else self._staying_model(session_id)
        if own is not None:
            with self.scoped(own):
                self.check_params(params, (inputs or {}).get("tools"))
        arrival = inputs.arrival if isinstance(inputs, Prepared) else \
            self.models.get(own).thread.arrive() if own is not None and inputs else None
        try:
            return await self._generate(session_id, params, on_event, cancelled, inputs, on_claim, on_append,
                                        phases, arrival, checked=own is not None or isinstance(inputs, Prepared))
        finally:
            if arrival is not None:
                arrival.land()

    def _staying_model(self, session_id: Any) -> str | None:
        """The model of known session `session_id` where it is loaded and staying (not being unloaded); None for
        an unknown id (its claim says so) or a model not loaded or going."""
        try:
            entry = self.entries.get(check_session_id(session_id))
        except InvalidParamsError:
            return None
        name = self.model_of(entry) if entry is not None else None
        return name if name is not None and self.staying(name) else None

    async def _generate(self, session_id: Any, params: GenerateParams, on_event: OnEvent | None,
                        cancelled: Callable[[], bool], inputs: dict[str, Any] | Prepared | None,
                        on_claim: Callable[[], None] | None, on_append: Callable[[dict[str, Any]], None] | None,
                        phases: dict[str, Any] | None, arrival: Arrival | None,
                        checked: bool = True) -> dict[str, Any]:
        """`generate`, its turn's arrival (landed by the caller) given; `checked`: its params were checked."""
        called = time.perf_counter()
        async with self.claim(session_id, "chat" if inputs else "generate") as entry:
            if not checked:  # its model loaded by the claim, the operation's model now
                self.check_params(params, (inputs or {}).get("tools"))
            if on_claim is not None:
                on_claim()
            woke, entry.woke = entry.session is None, None
            with arrival.wake() if woke and arrival is not None else contextlib.nullcontext():
                session = await self.awake(  # woken: its pack waits for turns waking with it (scheduler)
                    entry, inputs.plan.target if isinstance(inputs, Prepared) else None)
            stop = lambda: cancelled() or self.stopping  # noqa: E731
            started = time.perf_counter()
            appended, call = await self._append(session, inputs, stop, entry, arrival,
                                                then=lambda: self._call_for(session, params, on_event, stop)) \
                if inputs else ({"prefilled": 0, "reused": 0}, None)
            append_ms = (time.perf_counter() - started) * 1000
            if on_append is not None and inputs:  # a call starts from one pending token at least
                on_append({**appended, "computed": appended["prefilled"] + max(len(session.pending), 1)})
            result = await self._decode(session, params, on_event, stop, call, arrival)
            self.engine.persist(session, self.thread.call, turn=True)  # the reply, in the background
            self.engine.reply_points.offer(session, session.reply_start, self.thread)  # a point in it
            # A chat's prompt is the appended input too: its prefill counts in prompt tokens and time to first token.
            usage = {**result.usage, "prompt_tokens": result.usage["prompt_tokens"] + appended["prefilled"],
                     "ttft_ms": round(result.usage["ttft_ms"] + append_ms, 3),
                     "reused_tokens": appended["reused"], "prefilled_tokens": appended["prefilled"]}
            self.counters["generations"] += 1
            self.latency["generate_ttft"].add(usage["ttft_ms"])
            self.turns.append({"session": session.id, "at": round(time.time() - (time.perf_counter() - called), 4),
                               **(phases or {}), "claim_ms": round((started - called) * 1000, 2),
                               "append_ms": round(append_ms, 2), "first_token_ms": round(result.usage["ttft_ms"], 2),
                               "prefilled": appended["prefilled"],
                               **({"wake_ms": entry.woke["ms"], "wake_phases_ms": entry.woke["phases_ms"],
                                   "wake_tokens": entry.woke["tokens"],
                                   "wake_blocks_from_memory": entry.woke.get("blocks_from_memory"),
                                   "wake_blocks_from_disk": entry.woke.get("blocks_from_disk")}
                                  if woke and entry.woke else {})})
            return {"text": result.text, "content": result.content, "reasoning": result.reasoning,
                    "tool_calls": result.tool_calls,
                    "tool_call_errors": result.tool_call_errors, "tokens": result.tokens,
                    "finish_reason": result.finish_reason, "stop_sequence": result.stop_sequence, "usage": usage,
                    **({"append": appended} if inputs else {})}

    def _call_for(self, session: Session, params: GenerateParams, on_event: OnEvent | None,
               stop: Callable[[], bool]) -> Call:
        """A turn's call, its reply starting after the session's tokens now (a worker thread: the pending
        tokens are prefilled through the engine thread)."""
        session.reply_start = len(session.tokens)
        return self.engine.start_call(session, params, on_event, stop, self.thread.call)

    async def _decode(self, session: Session, params: GenerateParams, on_event: OnEvent | None,
                      stop: Callable[[], bool], call: Call | None = None,
                      arrival: Arrival | None = None) -> GenerateResult:
        """Prefill the pending tokens (chunked), then decode in the engine's decoder, batched with other calls;
        `call`: made already (`_call_for`, after the append); `arrival`: the turn's, landed once its call
        joined (where turns go one at a time, the next turn's prefill starts then: scheduler/turns.py)."""
        engine, loop = self.engine, asyncio.get_running_loop()
        if call is None:
            call = await to_thread.run_sync(lambda: self._call_for(session, params, on_event, stop))
        # The result comes through `post`, after the output the same step posted (streamed pieces first).
        ended: asyncio.Future[GenerateResult] = loop.create_future()
        call.future.add_done_callback(lambda f: self.thread.post(loop, _settle, ended, f))
        await self.thread.run(lambda: engine.decoder.join(call), quick=True)  # calls that come together join together
        if arrival is not None:  # its first token comes with the step that admits it, before any turn's next job
            arrival.land()
        # The session's cache belongs to the decoder until the call ends: the claim must outlive it,
        # so this wait is not cancelled (a client that leaves stops the call through `stop`).
        with anyio.CancelScope(shield=True):
            return await ended

    def post(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on `loop`; for fronts' streamed output, called on the engine thread: every call's
        output of one decode step reaches the loop in one hop, before the calls that step ended return."""
        self.thread.post(loop, fn, *args)


    async def warm(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Prefill a shared prompt once and pin it in the prefix cache (the engine's warm), from a hot
        session's copy of it or stored blocks where they hold some of it."""
        engine, scratch = self.engine, Session("prefix-warm")
        engine.check_warmable()
        plan = await to_thread.run_sync(lambda: engine.plan(scratch, **inputs))
        engine.check_fits(len(plan.target))
        async with self._shared_prefix(scratch, plan.target) as (prefix, _):
            info = await to_thread.run_sync(lambda: engine.warm(mlx=self.thread.call, scratch=scratch, prompt=plan,
                                                                prefix=prefix))
        if self.remote is not None:  # a warmed prompt serves every daemon sharing the remote
            self.remote.enqueue_prefix(scratch.tokens[: scratch.processed], engine.bundle.hash)
        return info


def _and_then(result: Any, then: Callable[[], T] | None) -> tuple[Any, T | None]:
    return result, then() if then is not None else None


def _settle(ended: asyncio.Future, done: Any) -> None:
    """On the loop: `ended` takes the outcome of the call's `done` (a concurrent future)."""
    if ended.cancelled():
        return
    exc = done.exception()
    if exc is not None:
        ended.set_exception(exc)
    else:
        ended.set_result(done.result())


