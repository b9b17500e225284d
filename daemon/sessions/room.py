"""The memory the hot sessions' KV may take: sessions slept when idle, over the budget, or to make room.

Part of the session manager (`SessionManager` in sessions/manager.py takes these methods). KV let go
(a sleep, a delete, a wake from another snapshot) is freed on the engine thread in short jobs, in the
background, and counts as held until it is gone. Before a session grows (a wake, a long prompt), the
least recently used idle sessions sleep while the hot KV and that growth would not fit the memory left
for KV beside the weights; the lifecycle task sleeps idle ones and those over the hot budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from anyio import to_thread

from kvwake.daemon.session_state import Session
from kvwake.daemon.sessions.entries import Entry
from kvwake.errors import BusyError

__all__ = ["RoomKeeping"]

log = logging.getLogger("kvwake.sessions")


class RoomKeeping:
    """The session manager's memory policy (see the module docstring); `SessionManager` holds its state."""

    def _release(self, session: Session) -> None:
        """Free a session's KV (no entry holds it any more) on the engine thread, in short jobs
        (pipeline.release), not where its last reference happens to drop (the event loop: MLX memory off the
        engine thread, and a stall of every connection while a big cache is unmapped). In the background: the
        call that let it go (a sleep, a delete, a wake from another snapshot) replies first; its bytes count
        in hot_bytes until they are freed, and `released` waits for them. Its pages are not counted here: the
        page pool counts them (hot_bytes) until the release drains its table, so counting them here too would
        count them twice while they go."""
        nbytes = self.engine.unpaged_bytes(session)
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

    # -- automatic sleep and shutdown -----------------------------------------

    def hot_bytes(self) -> int:
        """KV in memory, every loaded model's: the hot sessions' (each measured once per claim:
        Entries.kv_bytes), the page pools' as they hold them now, and what is being freed. Pages are counted
        from the pools, not from the sessions' shares: when a session sharing pages sleeps, the others'
        shares grow without a claim of theirs. One sum for every model, held against one room (model/budget.py)."""
        loaded = list(self.models)
        if not loaded:  # no model, no hot session
            return self.freeing_bytes()
        # a session's unpaged bytes are its own cache's: any engine measures them alike
        return (self.freeing_bytes() + self.entries.kv_bytes.total(loaded[0].engine.unpaged_bytes)
                + sum(m.engine.page_bytes() for m in loaded))

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
        s = entry.session
        held = self.engine.cache_bytes(s) - self.engine.held_point_bytes(s) if s is not None else 0  # its KV alone
        return max(0, self.engine.kv_bytes(tokens) - held)

    async def make_room(self, keep: Entry, tokens: int, added: Callable[[], int | None] | None = None) -> int:
        """Before `keep`'s session grows to `tokens` tokens (a wake, a long prompt): sleep the least recently
        used idle sessions while the hot KV and that growth would not fit the memory left for KV beside the
        weights (`Engine.kv_room_bytes`); returns how many slept. The budget lets hot sessions hold half of
        that room, and one session may take all of it (Engine.check_fits), so a big one beside a full budget
        needs this; without it MLX would go past its limit (on CUDA it spills to host memory). `added`: the
        engine's count of the bytes the growth adds (paged, the pages it adds, not those it lists or maps:
        `Engine.wake_bytes`, `append_bytes`), None where it has none (a buffer's growth, counted here), taken
        again after each sleep: the last session listing a prompt's pages frees them by sleeping, and the wake
        then reads them."""
        room = self.engine.kv_room_bytes
        if room is None or tokens <= 0:
            return 0

        def growth() -> int:
            counted = added() if added is not None else None
            return counted if counted is not None else self._growth(keep, tokens)

        first = growth()
        if first == 0 or self.hot_bytes() + first <= room:  # the common case: nothing to sort
            return 0
        return await self._sleep_lru(lambda e: self.hot_bytes() + growth() > room, "room_sleeps", keep,
                                     by_freed=True)

    async def enforce_limits(self) -> int:
        """Sleep idle sessions, then, while hot KV exceeds its budget, those whose sleep frees most of what they
        hold, least recently used first (`_sleep_lru`); returns how many slept."""
        now = time.monotonic()
        idle = await self._sleep_lru(lambda e: now - e.last_used > self.settings.idle_timeout_s, "auto_sleeps")
        return idle + await self._sleep_lru(lambda e: self.hot_bytes() > self.hot_budget(), "auto_sleeps",
                                            by_freed=True)

    def _frees_little(self, e: Entry) -> bool:
        """Whether a sleep of `e`'s session frees less than half of what it holds: most of its pages are listed
        by other sessions too, and stay (Engine.sleep_frees)."""
        engine = next((m.engine for m in self.models if m.name == self.model_of(e)), None)
        if engine is None or e.session is None or engine.pages is None:  # no pages: a sleep frees what it holds
            return False
        freed, held = engine.sleep_frees(e.session)
        return 2 * freed < held

    async def _sleep_lru(self, needed: Callable[[Entry], bool], counter: str, keep: Entry | None = None,
                         by_freed: bool = False) -> int:
        """Sleep idle hot sessions (not `keep`), least recently used first, while `needed(entry)` says so;
        each one's KV is freed before the next is looked at. `by_freed` (a sleep for memory): sessions whose
        sleep frees little (`_frees_little`: their pages shared) go after the others, looked at again after
        each sleep (the last session listing shared pages frees them). Returns how many slept (counted in
        `counter`). A failed sleep is logged (in _sleep too) and the session stays hot: a later pass retries it."""
        slept, tried = 0, set()
        while True:
            candidates = [e for e in self.entries.hot.values() if not e.busy and e is not keep and e.id not in tried]
            if not candidates:
                break
            e = min(candidates, key=lambda e: (by_freed and self._frees_little(e), e.last_used))
            tried.add(e.id)
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
