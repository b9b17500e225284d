"""The engine thread: the one thread that runs MLX, fed by a queue.

MLX work (prefill, generation, capture, restore) is submitted from the event
loop and awaited without blocking it; each submission gets its own future
(the response channel). Jobs run one at a time, in order.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["EngineThread"]

T = TypeVar("T")


class EngineThread:
    """A single worker thread with a FIFO of jobs."""

    def __init__(self, name: str = "kvwake-engine", on_exit: Callable[[], None] | None = None) -> None:
        self._on_exit = on_exit
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.busy_s = 0.0

    def _run(self) -> None:
        import time

        while (job := self._jobs.get()) is not None:
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            start = time.perf_counter()
            try:
                future.set_result(fn())
            except BaseException as exc:  # delivered to the awaiting caller
                future.set_exception(exc)
            finally:
                self.busy_s += time.perf_counter() - start
        if self._on_exit is not None:
            self._on_exit()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return future

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread and wait for it from another thread (the pipeline's `mlx`)."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.submit(fn).result()

    async def run(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread and await its result from the event loop.

        Cancelling the awaiting task does not interrupt a job already running
        (MLX work cannot be interrupted); a job not yet started is dropped.
        """
        return await asyncio.wrap_future(self.submit(fn))

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)
