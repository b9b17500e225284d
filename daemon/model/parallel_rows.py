"""Several sessions' prefill chunks at once on the CPU, each on a thread of its own: where a pass costs its tokens.

MLX on the CPU runs a forward pass's ops on one core, its stream's (two threads, each on a CPU stream of its
own, keep two busy: docs/decisions.md, "Turns apart on the CPU's cores"), so a pack of N turns in one pass costs
what N passes apart cost (bench/pack_cost.py) and the CPU took its turns one at a time (docs/decisions.md,
"Turns one at a time where a pass costs its tokens"). Run apart on threads of their own, N turns' chunks cost
what N / cores passes cost: four agents' turns on two cores reach their first tokens after two passes, not
four (one at a time, after one, two, three and four).

`ParallelRows` keeps `workers` threads, each with a CPU stream it made (streams belong to their thread: MLX
must destroy them on it, as model/loader.py `release_mlx_streams` says). `run` feeds each row's tokens to its
cache in the model, as the chunk alone would be fed (the same call, shapes and kind of stream: bit-exact against it),
the rows taken in turn by the workers and the calling thread (the engine's), and returns once every row's
cache is evaluated. Only the CPU: a GPU's pass is bound by reading the weights, and packs share them
(model/packing.py).

Off by default (tuning prefill_threads = 1): on two cores the fleet's turns came no sooner (two rows at once
each ran slower than one alone: docs/decisions.md, "Turns apart on the CPU's cores"); a host with many cores
is where it is meant to pay, not measured yet.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

__all__ = ["ParallelRows", "cores", "threads_wanted"]


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def threads_wanted(configured: int = 1) -> int:
    """Threads that run a pack's rows where MLX computes on the CPU (the engine thread among them): `configured`
    (the tuning knob prefill_threads); 1 (one pass for a pack) where a GPU computes, whatever is configured."""
    return max(1, configured) if mx.default_device() == mx.cpu else 1


class ParallelRows:
    """`threads - 1` worker threads (the caller's is the last) that feed rows of a pack to the model at once,
    started at the first `run` (an engine whose start fails later leaves none behind)."""

    def __init__(self, threads: int, name: str = "kvwake-rows") -> None:
        self.threads, self.name = threads, name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def _work(self) -> None:
        try:  # its own: ops of two threads on one stream would queue one behind the other
            stream = mx.new_stream(mx.cpu)
            # this thread's default stream, not `with mx.stream(...)`: that sets MLX's default device, which
            # is the process's, and workers that end in another order than they began leave it on the CPU
            mx.set_default_stream(stream)
        except Exception:  # noqa: BLE001 - the default stream still computes; never a worker that takes no job
            stream = None
        try:
            while (job := self._jobs.get()) is not None:
                job()
        finally:  # as model/loader.py's release_mlx_streams (not imported: the loader imports the engine)
            mx.synchronize(stream) if stream is not None else mx.synchronize()
            mx.clear_streams()

    def _helpers(self, rows: int) -> int:
        """How many workers take rows of a pack of `rows` (started now if none were): 0 once closed."""
        with self._lock:
            if self._closed:
                return 0
            if not self._workers:
                self._workers = [threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                                 for i in range(self.threads - 1)]
                for worker in self._workers:
                    worker.start()
            return min(len(self._workers), rows - 1)

    def run(self, model: Any, rows: Sequence[tuple[Sequence[int], list]]) -> None:
        """Feed each row's tokens to its cache (`model(tokens, cache=cache)`), the rows at once, and evaluate the
        caches. Raises what a row raised, once every row is done (no thread still writes a cache then)."""
        todo: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(len(rows)):
            todo.put(i)
        failed: list[BaseException] = []
        done = threading.Semaphore(0)

        def feed() -> None:  # rows taken in turn until none is left: a long row does not hold the others
            try:
                while True:
                    try:
                        i = todo.get_nowait()
                    except queue.Empty:
                        return
                    tokens, cache = rows[i]
                    model(mx.array(tokens, dtype=mx.uint32)[None], cache=cache)
                    mx.eval([c.state for c in cache])
            except BaseException as exc:  # noqa: BLE001 - carried to the caller
                failed.append(exc)
            finally:
                done.release()

        helpers = self._helpers(len(rows))
        for _ in range(helpers):
            self._jobs.put(feed)
        feed()
        for _ in range(helpers + 1):  # each helper's feed and the caller's own
            done.acquire()
        if failed:
            raise failed[0]

    def close(self) -> None:
        """Stop the workers (each lets its stream go on its own thread); a later `run` feeds every row itself."""
        with self._lock:
            self._closed, workers, self._workers = True, self._workers, []
        for _ in workers:
            self._jobs.put(None)
        for worker in workers:
            worker.join()
