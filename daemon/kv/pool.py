"""The worker pool for codec and disk work, and the byte budget each batch of tasks gets.

Encoding, digesting, decoding, file I/O and fsync release the GIL (zstd,
BLAKE3, numpy, file I/O), so a pool of threads sized to the machine (all
cores by default) scales with cores. A batch is bounded by bytes in flight
rather than by a task count: a sleep or wake never holds more than its budget
of encoded or staged bytes, whatever the block size.

`nice` (the tuning knob pool_nice: Linux, 1-19; 0: off) runs the workers that
many nice levels below the daemon. It is a knob for a measurement, not a default. On a
GPU a decode step can be host-bound: the engine thread launching kernels
competes for the cores with as many workers encoding a persisting neighbour's
blocks. The knob asks whether yielding those cores to the engine thread keeps
the neighbour's p99 gap down, at the cost of sleeps and wakes where cores are
short (docs/decisions.md, "Continuous persistence (issue 23, point 1)").
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["YIELD_S", "Batch", "Pool", "lower_priority"]

log = logging.getLogger("kvwake.pool")

YIELD_S = 0.5  # the longest a yielding batch holds its tasks back, in all (a busy daemon's writes never end)


class Pool:
    """Worker threads for codec and disk work, and the byte budget each batch gets.

    workers: threads (default: every core). inflight_bytes: raw bytes a batch
    may have read, decoded or staged but not yet finished. nice: nice levels
    the workers run below their maker (Linux; 0: at its priority).
    """

    def __init__(self, workers: int | None = None, inflight_bytes: int = 512 << 20, nice: int = 0) -> None:
        self.workers = workers or os.cpu_count() or 1
        self.inflight_bytes = inflight_bytes
        self.nice = nice
        self._executor = cf.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="kvwake-io",
                                               initializer=lower_priority, initargs=(self.nice,))
        self._turns = _Turns()

    def batch(self, budget: int | None = None, yields: bool = False) -> Batch:
        """A batch bounded by `budget` bytes in flight (at most the pool's inflight_bytes). `yields`: its tasks
        are submitted only while no other batch's task is queued or running (waiting YIELD_S at most in all):
        a wake that waits for a leader's shared blocks reads its own after the leader's reads, not among
        them, since every waiter waits for the leader (docs/decisions.md, "A waiting wake reads its own
        blocks after its leader's")."""
        return Batch(self._executor, min(budget or self.inflight_bytes, self.inflight_bytes), self._turns, yields)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def lower_priority(nice: int) -> None:
    """A worker's first act: lower its own CPU priority by `nice` levels (Linux, where a thread is a task of
    its own; elsewhere, or when refused, it stays as it is)."""
    if nice <= 0 or not sys.platform.startswith("linux"):  # elsewhere a thread's id names no task of its own
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (AttributeError, OSError) as exc:
        log.warning("worker left at its priority: %r", exc)


class _Turns:
    """The tasks of batches that do not yield, queued or running; yielding batches wait for none to be."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._first = 0

    def enter(self) -> None:
        with self._cond:
            self._first += 1

    def leave(self) -> None:
        with self._cond:
            self._first -= 1
            if not self._first:
                self._cond.notify_all()

    def wait_none(self, until: float) -> None:
        """Until no task of a batch that does not yield is queued or running, or the monotonic time `until`."""
        with self._cond:
            self._cond.wait_for(lambda: not self._first or time.monotonic() >= until,
                                max(0.0, until - time.monotonic()))


class Batch:
    """Tasks on the pool, admitted while their bytes fit the budget; the first failure stops the rest.

    `reserve(n)` waits until n more bytes fit (or nothing is in flight); each
    task submitted with `submit(n, ...)` gives its n reserved bytes back when
    it ends. `join()` waits for every task; `raise_first()` re-raises the first
    failure as itself.
    """

    def __init__(self, executor: cf.Executor, budget: int, turns: _Turns | None = None, yields: bool = False) -> None:
        self._executor, self.budget = executor, budget
        self._turns, self._yields = turns, yields
        self._until = time.monotonic() + YIELD_S  # a yielding batch's tasks wait until then at most
        self._cond = threading.Condition()
        self._used = 0
        self._futures: list[cf.Future] = []
        self.error: BaseException | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def reserve(self, nbytes: int) -> None:
        with self._cond:
            while self._used and self._used + nbytes > self.budget and self.error is None:
                self._cond.wait()
            self._used += nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()

    def submit(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> cf.Future:
        """Run fn(*args) on the pool with `nbytes` already reserved (they are released when it ends).

        The task lets go of `args` before its future is done: whoever waits for it then holds the last
        references (the executor's work item would hold them a moment longer, on the pool's thread,
        where MLX memory must not be freed)."""
        counted = self._turns is not None and not self._yields
        if self._turns is not None and self._yields:
            self._turns.wait_none(self._until)
        elif counted:
            self._turns.enter()
        future = self._executor.submit(self._run, nbytes, fn, [args], counted)
        self._futures.append(future)
        return future

    def _run(self, nbytes: int, fn: Callable[..., Any], boxed: list[tuple], counted: bool = False) -> Any:
        args = boxed.pop()
        try:
            if self.error is None:  # after a failure, tasks not yet started do nothing
                return fn(*args)
        except BaseException as exc:
            with self._cond:
                if self.error is None:
                    self.error = exc
            raise
        finally:
            self.release(nbytes)
            if counted:
                self._turns.leave()
        return None

    def join(self) -> None:
        cf.wait(self._futures)

    def raise_first(self) -> None:
        if self.error is not None:
            raise self.error
