"""The scheduler's step: what the engine thread runs next.

Every turn of the engine thread asks `Scheduler.next_step` once and gets one
`Step`: the quick jobs to run first, then at most one unit of work (a job, a
pack's jobs taken together, or an idle job), then whether the decoder takes a
step. The thread executes it and knows no policy (model/thread.py).

The order, and why:
- `quick` jobs (bookkeeping with no MLX work: a call joining the decoder) all
  run before the next job, not one per step: calls that come at once join the
  batch at one step.
- One job (or one pack) per step while calls decode: a decoding neighbour waits
  one job, a short one (a prefill chunk is many slice jobs: scheduler/prefill.py).
- A `Packed` job runs with every job of its pack queued by its turn, as one:
  turns that come at once are one forward pass (model/packing.py) and one job.
- An `idle` job (a graph built ahead) runs only when nothing has been queued for
  IDLE_AFTER_S and nothing decodes: a client's next turn, sent at once, must not
  wait for it.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from kvwake.daemon.model.decoder import Decoder
from kvwake.errors import CancelledError

__all__ = ["IDLE_AFTER_S", "Job", "Scheduler", "Step"]

T = TypeVar("T")
Job = tuple[Callable[[], Any], Future]
# An idle job waits for the queue to stay empty this long: a client that sends its next turn at once leaves
# the engine quiet for tens of milliseconds between turns (docs/decisions.md, "Many agents at once (issue 24)").
IDLE_AFTER_S = 0.25


class _PackDue:
    """In the job queue: a Packed job of `pack` was queued here; the first of these takes all of its jobs
    queued by then, the others find none (a wake-up, not a turn)."""

    __slots__ = ("pack",)

    def __init__(self, pack: Callable[[list[Any]], list[Any]]) -> None:
        self.pack = pack


@dataclass
class Step:
    """One turn of the engine thread. quick: jobs to run first, in order. job: one job, or None. pack: the
    jobs of one pack to run as one (`pack(fns)`), or None. idle: a job for when nothing else waits, or None.
    decode: the decoder takes one step after them. stop: the thread ends (nothing else is set)."""

    quick: list[Job]
    job: Job | None = None
    pack: list[Job] | None = None
    idle: Callable[[], Any] | None = None
    decode: bool = False
    stop: bool = False


class Scheduler:
    """Decides each step what the engine thread runs: the queued jobs (quick, plain, packed, idle), then a step
    of the attached decoder's calls. How a prefill is cut into those jobs is each model's `PrefillPlanner`
    (scheduler/prefill.py)."""

    def __init__(self, decoder: Decoder | None = None) -> None:
        self.decoder = decoder
        self._jobs: queue.SimpleQueue[Job | _PackDue | tuple[()] | None] = queue.SimpleQueue()  # (): a wake-up
        self._quick: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._idle: deque[Callable[[], Any]] = deque()
        self._packs: dict[Any, list[Job]] = {}  # Packed jobs by pack, queued (a _PackDue each in _jobs)
        self._packs_lock = threading.Lock()

    # -- what callers queue ---------------------------------------------------

    def submit(self, fn: Callable[[], T], quick: bool = False) -> Future[T]:
        """Queue fn; `quick` (or fn marked `jobs.quick`): it does no MLX work to speak of, so it runs before
        the next job with every other quick job queued; a `jobs.Packed` fn waits for its pack's turn."""
        future: Future[T] = Future()
        pack = getattr(fn, "engine_pack", None)
        if quick or getattr(fn, "engine_quick", False):
            self._quick.put((fn, future))
            self._jobs.put(())  # a thread blocked on an empty queue looks again
        elif pack is not None:
            with self._packs_lock:
                self._packs.setdefault(pack, []).append((fn, future))
            self._jobs.put(_PackDue(pack))
        else:
            self._jobs.put((fn, future))
        return future

    def idle(self, fn: Callable[[], Any]) -> None:
        """Run fn once nothing else waits (see the module docstring); one such job between two looks at the
        queue, so a request that comes meanwhile waits for one, not all."""
        self._idle.append(fn)
        self._jobs.put(())

    def stop(self) -> None:
        """The thread ends after the work queued before this."""
        self._jobs.put(None)

    def waiting(self) -> tuple[int, int]:
        """(items in the job queue, jobs waiting for their pack's turn): what a look from outside sees."""
        with self._packs_lock:
            packed = sum(len(jobs) for jobs in self._packs.values())
        return self._jobs.qsize(), packed

    # -- what the engine thread runs ------------------------------------------

    def next_step(self) -> Step:
        """The next step; blocks while there is nothing to do (no job, nothing decoding, no idle job due)."""
        decoding = self.decoder is not None and self.decoder.active
        idle = None
        try:
            if decoding:
                item = self._take(self._jobs.get_nowait())
            elif self._idle:  # an idle job once the queue stays empty a while
                item = self._take(self._jobs.get(timeout=IDLE_AFTER_S))
            else:
                item = self._take(self._jobs.get())
        except queue.Empty:
            item = ()  # nothing queued: decode, or (not decoding) one idle job
            idle = None if decoding else self._idle.popleft()
        while item == () and idle is None:  # quick jobs' wake-ups (they all run first): not a turn each
            try:
                item = self._take(self._jobs.get_nowait())
            except queue.Empty:
                break
        if item is None:
            return Step([], stop=True)
        step = Step(self.quick_jobs(), idle=idle, decode=decoding)
        if isinstance(item, list):
            step.pack = item
        elif item:
            step.job = item
        return step

    def quick_jobs(self) -> list[Job]:
        """Every quick job queued now: a step's first, then those queued while they ran (the thread asks until
        none is left, before the step's work)."""
        jobs = []
        while True:
            try:
                jobs.append(self._quick.get_nowait())
            except queue.Empty:
                return jobs

    def _take(self, item: Any) -> Any:
        """A queued item as a step takes it: a pack's marker becomes the pack's queued jobs (a list), or a
        wake-up () when an earlier marker took them."""
        if not isinstance(item, _PackDue):
            return item
        with self._packs_lock:
            jobs = self._packs.pop(item.pack, None)
        return jobs or ()

    def refuse_left(self) -> None:
        """Fail the jobs queued behind the stop: their waiters get CancelledError instead of waiting for ever."""
        for jobs in (self._quick, self._jobs):
            while True:
                try:
                    job = jobs.get_nowait()
                except queue.Empty:
                    break
                if isinstance(job, tuple) and job:
                    job[1].set_exception(CancelledError("the engine stopped before this job ran"))
        with self._packs_lock:
            packs, self._packs = self._packs, {}
        for pack in packs.values():
            for _, future in pack:
                future.set_exception(CancelledError("the engine stopped before this job ran"))
