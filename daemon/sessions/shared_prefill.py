"""A shared prompt prefilled once: requests that start together wait for the one already prefilling it.

Agents of one host start together and share their opening (a system prompt and tool schemas of thousands of
tokens). Each new conversation needs a fresh cache; with nothing stored yet and no idle session holding the
prompt, each would prefill it in full, the same tokens N times in one pack. Instead the first such append
leads (a `Flight`: its session and the tokens its prefill will hold) and the others that share enough of its
tokens wait for it, then take a copy of its cache's first tokens (`land`) and prefill only their own part.

When a request waits: its tokens shared with a flight are at least `min_tokens` (below that the match is a
chat template's opening) and at least what the flight computes beyond them (a long unrelated tail of the
leader's would cost the waiter more than it saves). A leader whose client leaves keeps prefilling while anyone
waits on it (`Flight.waited`); a leader that fails hands out what its cache holds, and a waiter given nothing
prefills itself. Copies are token-granular here; with paged KV a landing maps the leader's full pages instead
(docs/decisions.md, "A fleet of agents (issue 50)").
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvwake.daemon.session_state import Session, common_prefix

__all__ = ["Flight", "Pending", "SharedPrefills"]

Prefix = tuple[Any, int]  # (a cache or None, the tokens it holds): what Engine.apply adopts
NO_PREFIX: Prefix = (None, 0)


@dataclass(eq=False)
class Flight:
    """An append prefilling a fresh cache (or a wake restoring one): its session (a wake's, once woken) and
    the tokens its cache will hold, and the waiters (tokens wanted, a future for their prefix) queued on it."""

    session: Session
    tokens: np.ndarray
    waiters: list[tuple[int, asyncio.Future[Prefix]]] = field(default_factory=list)
    woken: bool = False  # a wake's: its cache is the store's blocks' bytes, not a prefill's

    def waited(self) -> bool:
        """Whether anyone still waits on this flight (its prefill must not stop for its own client)."""
        return any(not future.done() for _, future in self.waiters)


class Pending:
    """A flight's prefix still to come, for a wake that reads its own blocks meanwhile (kv/pipeline.py):
    `result()`, which a worker thread blocks on while the leader lands on the event loop. Made on the loop,
    from the waiter's future."""

    def __init__(self, waiting: asyncio.Future[Prefix]) -> None:
        self._done: cf.Future[Prefix] = cf.Future()
        waiting.add_done_callback(self._landed)

    def _landed(self, waiting: asyncio.Future[Prefix]) -> None:
        if waiting.cancelled():
            self._done.set_result(NO_PREFIX)
        elif waiting.exception() is not None:
            self._done.set_exception(waiting.exception())
        else:
            self._done.set_result(waiting.result())

    def result(self, timeout_s: float | None = None) -> Prefix:
        """(cache, tokens) the leader handed out, or NO_PREFIX; waits for it to land (worker thread)."""
        return self._done.result(timeout_s)


class SharedPrefills:
    """The appends prefilling a fresh cache now (flights), and the requests waiting on them."""

    def __init__(self, min_tokens: int) -> None:
        self.min_tokens = max(min_tokens, 1)
        self._flights: list[Flight] = []
        self.waits = 0  # requests that took (or waited for) a flight's prefix: status counters

    def __len__(self) -> int:
        return len(self._flights)

    def wait_for(self, held: Sequence[int], align: int = 1, woken_only: bool = False) -> asyncio.Future[Prefix] | None:
        """A future for a prefix of `held` (the tokens a cache is wanted for) that a flight will hand out, or
        None when no flight shares enough of it (see the module docstring); `align`: the prefix wanted is a
        whole number of these (a wake's blocks); `woken_only`: only a wake's flight will do (a wake restores
        the stored blocks' bytes exactly; a prefill may compute them otherwise). Called on the event loop,
        with no await before `lead`."""
        found = self.waits_on(held, align, woken_only)
        return found[0] if found is not None else None

    def waits_on(self, held: Sequence[int], align: int = 1,
                 woken_only: bool = False) -> tuple[asyncio.Future[Prefix], int] | None:
        """`wait_for`'s future and the tokens it waits for (a whole number of `align`), or None."""
        want = np.asarray(held, dtype=np.int64)
        best, chosen = 0, None
        for flight in self._flights:
            if woken_only and not flight.woken:
                continue
            shared = common_prefix(flight.tokens, want)
            if shared > best and shared >= len(flight.tokens) - shared:
                best, chosen = shared, flight
        best -= best % align
        if chosen is None or best < self.min_tokens:
            return None
        future: asyncio.Future[Prefix] = asyncio.get_running_loop().create_future()
        chosen.waiters.append((best, future))
        self.waits += 1
        return future, best

    def lead(self, session: Session, held: Sequence[int], woken: bool = False) -> Flight:
        """Register an append that will prefill a fresh cache holding `held` (`woken`: a wake that will
        restore one; its session is set once woken); `land` it when its apply (its wake) ends."""
        flight = Flight(session, np.asarray(held, dtype=np.int64), woken=woken)
        self._flights.append(flight)
        return flight

    async def land(self, flight: Flight, copy: Callable[[list[int]], Awaitable[list[Prefix]]]) -> None:
        """The flight's prefill ended (or failed): every waiter gets a copy of the tokens it wants that the
        leader's cache holds (`copy(counts)`: one engine job for all, a (cache, tokens) each: as many tokens as
        counted, or fewer where the leader can give no more, as at a restore point), or NO_PREFIX; the flight
        is gone."""
        self._flights.remove(flight)
        session, waiting = flight.session, [(n, f) for n, f in flight.waiters if not f.done()]
        counts = [min(n, session.processed) if session.cache is not None else 0 for n, _ in waiting]
        usable = [(n, f) for n, (_, f) in zip(counts, waiting) if n >= self.min_tokens]
        try:
            caches = await copy([n for n, _ in usable]) if usable else []
        except BaseException:
            _settle(waiting, {})
            raise
        _settle(waiting, {id(f): prefix for (_, f), prefix in zip(usable, caches)})


def _settle(waiting: list[tuple[int, asyncio.Future[Prefix]]], given: dict[int, Prefix]) -> None:
    for _, future in waiting:
        if not future.done():
            future.set_result(given.get(id(future), NO_PREFIX))
