"""The scheduler's step: what the engine thread runs next.

Every turn of the engine thread asks `Scheduler.next_step` once and gets one
`Step`: the quick jobs to run first, then at most one unit of work (a job, a
pack's jobs taken together, or an idle job), then whether the decoder takes a
step. The thread executes it and knows no policy (model/thread.py).

The order, and why:
- `quick` jobs (bookkeeping with no MLX work: a call joining the decoder) all
  run before the next job, not one per step: calls that come at once join the
  batch at one step.
- While calls decode, a step runs one job (or one pack), then more plain jobs
  queued next while the step's jobs have taken less than the last decode step
  did (`another`): a decoding neighbour waits at most about one decode step of
  jobs plus the job that crossed it. A prefill chunk is many slice jobs, each
  about a step (scheduler/prefill.py): one a step. A wake is many short jobs
  (buffers, spans, upload slices): several a step, so wakes beside a decoding
  session do not each wait a decode step per job (docs/decisions.md, "A fleet
  of agents (issue 50)").
- A `Packed` job runs with every job of its pack queued by its turn, as one:
  turns that come at once are one forward pass (model/packing.py) and one job.
- A pack that starts turns (a job queued with its turn's `Arrival`) is held while
  the decoder is idle and other turns are still arriving (rendered, matched, not
  yet queued), until none is or `gather_s` has passed since it was queued: turns
  sent at once reach the engine milliseconds apart, and the first one taken alone
  would leave the others a pack of their own after it. Never while calls decode:
  a decode step between two jobs gathers them already. Other jobs queued
  meanwhile run while it waits (a turn's wake, another session's chunk): the
  engine does not idle for it (docs/decisions.md, "A fleet of agents (issue 50)").
  A turn whose session woke (`Arrival.waking`) waits longer for turns still
  waking or woken: as long as its own wake took, at most WOKEN_GATHER_AT_MOST_S.
  Sessions woken together (a restart's round) land hundreds of milliseconds
  apart; the first one's prefill and decode steps taken alone would sit between
  the others' wake jobs, and their appends would come in passes of their own.
- Where turns do not pack (`turns` set: a pass costs what its tokens cost, the
  CPU), a turn's jobs (queued with its `Arrival`) run one turn at a time
  (scheduler/turns.py): the current turn's first, the next turn's once its call
  joined the decoder, and a call that joined gets its first token before any
  turn's next job. While turns' jobs wait, other calls' decode steps wait for
  them, one step at least every `TurnOrder.first_s` (Tuning.prefill_first_ms);
  plain jobs run while the current turn is between two jobs (docs/decisions.md,
  "Turns one at a time where a pass costs its tokens").
- An `idle` job (a graph built ahead) runs only when nothing has been queued for
  IDLE_AFTER_S, nothing decodes and no turn is on its way (an `Arrival` not yet
  landed: a restart's first round being rendered, matched and woken): a client's
  next turn, sent at once, must not wait for it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from kvwake.daemon.model.decoder import Decoder
from kvwake.daemon.model.scheduler.turns import TurnOrder
from kvwake.daemon.timing import Latency
from kvwake.errors import CancelledError

log = logging.getLogger("kvwake.scheduler")

__all__ = ["Arrival", "IDLE_AFTER_S", "Job", "Scheduler", "Step"]

T = TypeVar("T")
Job = tuple[Callable[[], Any], Future]
# An idle job waits for the queue to stay empty this long: a client that sends its next turn at once leaves
# the engine quiet for tens of milliseconds between turns (docs/decisions.md, "Many agents at once (issue 24)").
IDLE_AFTER_S = 0.25
HOLDS_KEPT = 256  # the latest packs held for arriving turns whose wait `holds` keeps
# A turn on its way longer than this is let go (logged): one dropped without landing (a task cancelled between
# its prepare and its generate) must not hold idle jobs back, and packs gathering, for good
ARRIVING_AT_MOST_S = 60.0
# The longest a woken turn's pack waits for turns still waking with it: a wake that reads from a slow disk
# must not keep a woken neighbour from its first token for long.
WOKEN_GATHER_AT_MOST_S = 1.0


class _PackDue:
    """In the job queue: a Packed job of `pack` was queued here (at `at`, monotonic seconds); the first of
    these takes all of its jobs queued by then, the others find none (a wake-up, not a turn). `starts`: the
    job was its turn's first (it landed an `Arrival`), so the pack may be held for the turns still arriving."""

    __slots__ = ("at", "pack", "starts", "woken_s")

    def __init__(self, pack: Callable[[list[Any]], list[Any]], starts: bool = False, woken_s: float = 0.0) -> None:
        self.pack, self.starts, self.at = pack, starts, time.monotonic()
        self.woken_s = woken_s  # its turn's session woke, taking this long: it waits so long for others waking


class Arrival:
    """A turn on its way to the engine (`Scheduler.arrive`): counted as arriving from then until its first
    Packed job is queued with it (`submit(fn, arrival=...)`) or it is `land`ed (the turn failed, or queues
    no such job), and not while it is `aside`. Landing twice is landing once. Where turns go one at a time
    (`Scheduler.turns`), a landed turn is `over`: the next turn's jobs run."""

    __slots__ = ("_scheduler", "at", "over", "waking", "woken_s")

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self.at = time.monotonic()  # when it set out (ARRIVING_AT_MOST_S)
        self.waking = False  # its session is waking now
        self.woken_s = 0.0  # how long its session's wake took (0: it did not wake)
        self.over = False  # landed where turns go one at a time (TurnOrder): its later jobs are plain ones

    def land(self) -> None:
        """No longer arriving: packs stop waiting for this turn; where turns go one at a time, the next turn's
        jobs run (its call joined the decoder, or it failed)."""
        self._scheduler._land(self, over=True)

    @contextlib.contextmanager
    def wake(self) -> Iterator[None]:
        """Inside this block the turn's session wakes: a woken turn's pack waits for it (module docstring)."""
        started, self.waking = time.monotonic(), True
        try:
            yield
        finally:
            self.waking, self.woken_s = False, max(time.monotonic() - started, 1e-6)
            self._scheduler._jobs.put(())  # a held pack waiting for this wake looks again

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Not arriving inside this block, arriving again after it (unless it landed): for a turn that waits
        for another turn's prefill (a shared prompt's flight) before it can queue anything. Counted meanwhile,
        it would hold the very pack it waits for up to the gathering time."""
        was = self._scheduler._land(self)
        try:
            yield
        finally:
            if was:
                self._scheduler._add(self)


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

    def __init__(self, decoder: Decoder | None = None, gather_s: float = 0.0) -> None:
        self.decoder = decoder
        self.gather_s = gather_s  # how long a pack that starts turns waits for turns arriving (0: never)
        self.turns: TurnOrder | None = None  # set where turns go one at a time (they do not pack)
        self._decoded_at = 0.0  # when the last step with a decode step was handed out (monotonic)
        self._jobs: queue.SimpleQueue[Job | _PackDue | tuple[()] | None] = queue.SimpleQueue()  # (): a wake-up
        self._quick: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._idle: deque[Callable[[], Any]] = deque()
        self._packs: dict[Any, list[Job]] = {}  # Packed jobs by pack, queued (a _PackDue each in _jobs)
        self._arriving: set[Arrival] = set()  # turns arrived and not landed
        self._packs_lock = threading.Lock()  # over _packs and _arriving
        self._held: _PackDue | None = None  # a pack that starts turns, waiting for those arriving
        # An item `another` took off the queue and did not run (not a plain job): the next look takes it first.
        self._ahead: list[Any] = []
        self.holds = Latency(HOLDS_KEPT)  # ms each held pack waited, from its first job queued to taken
        # Set once the thread refused what was left (`refuse_left`): a job submitted after it would wait for
        # ever, so it is refused at once. The lock keeps a submit from queueing between the flag and the drain.
        self._closed = False
        self._open_lock = threading.Lock()

    # -- what callers queue ---------------------------------------------------

    def submit(self, fn: Callable[[], T], quick: bool = False, arrival: Arrival | None = None) -> Future[T]:
        """Queue fn; `quick` (or fn marked `jobs.quick`): it does no MLX work to speak of, so it runs before
        the next job with every other quick job queued; a `jobs.Packed` fn waits for its pack's turn, and
        lands `arrival` (its turn's, still arriving) as it is queued: its pack starts turns. Where turns go one
        at a time (`turns`), a job with `arrival` (Packed too: a pack of one) waits for its turn instead."""
        future: Future[T] = Future()
        with self._open_lock:
            if self._closed:
                future.set_exception(CancelledError("the engine stopped before this job ran"))
                return future
            self._queue(fn, future, quick, arrival)
        return future

    def _queue(self, fn: Callable[[], T], future: Future[T], quick: bool, arrival: Arrival | None) -> None:
        pack = getattr(fn, "engine_pack", None)
        if arrival is not None and self.turns is not None and not quick and self.turns.put(arrival, (fn, future)):
            self._jobs.put(())  # a turn's job, a Packed one as a pack of one: a thread blocked on the queue looks again
        elif quick or getattr(fn, "engine_quick", False):
            self._quick.put((fn, future))
            self._jobs.put(())  # a thread blocked on an empty queue looks again
        elif pack is not None:
            with self._packs_lock:  # one change: a look never sees the job queued and its turn arriving
                self._packs.setdefault(pack, []).append((fn, future))
                starts = arrival in self._arriving
                self._arriving.discard(arrival)
            self._jobs.put(_PackDue(pack, starts, arrival.woken_s if starts and arrival is not None else 0.0))
        else:
            self._jobs.put((fn, future))

    def arrive(self) -> Arrival:
        """A turn on its way: packs that start turns wait for it (up to `gather_s`) until it lands."""
        arrival = Arrival(self)
        self._add(arrival)
        return arrival

    def _add(self, arrival: Arrival) -> None:
        with self._packs_lock:
            self._arriving.add(arrival)

    def _land(self, arrival: Arrival, over: bool = False) -> bool:
        """Whether `arrival` was arriving (it is not now); `over`: its turn is over (TurnOrder.end)."""
        if over and self.turns is not None:
            for job in self.turns.end(arrival):  # none normally: a turn ends after its last job
                self._jobs.put(job)
            self._jobs.put(())  # the next turn's jobs: a thread waiting for this one looks again
        with self._packs_lock:
            if arrival not in self._arriving:
                return False
            self._arriving.discard(arrival)
        self._jobs.put(())  # a held pack looks again
        return True

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
        turns = self.turns.count() if self.turns is not None else 0
        return self._jobs.qsize() + len(self._ahead) + turns, packed

    def arriving(self) -> int:
        """Turns arrived and not landed (`arrive`): what a held pack waits for."""
        with self._packs_lock:
            return len(self._arriving)

    # -- what the engine thread runs ------------------------------------------

    def next_step(self) -> Step:
        """The next step; blocks while there is nothing to do (no job, nothing decoding, no idle job due, a
        held pack still gathering its turns)."""
        while True:
            decoding = self.decoder is not None and self.decoder.active
            if self._held is not None and (decoding or not self._gathering()):
                return self._step(self._release(), decoding)
            turn_wait = None
            if self.turns is not None:
                if (step := self._turn_step(decoding)) is not None:
                    return step
                turn_wait = self._turn_wait(decoding)
                decoding = decoding and turn_wait is None  # waiting for the current turn's next job
            idle = None
            try:
                item = self._take(self._get(**self._wait(decoding, turn_wait)), decoding)
            except queue.Empty:
                if self._held is not None or turn_wait is not None:
                    continue  # its gathering time is up: released above; a turn's wait is up: looked at again
                if not decoding and self._arrivals():
                    continue  # an idle job would hold up turns on their way (a restart's first round): look again
                item = ()  # nothing queued: decode, or (not decoding) one idle job
                idle = None if decoding else self._idle.popleft()
            while item == () and idle is None:  # wake-ups (quick jobs', landings'): not a turn each
                try:
                    item = self._take(self._get(block=False), decoding)
                except queue.Empty:
                    break
            if item is None:
                return Step([], stop=True)
            if item == () and idle is None and self._quick.empty() and \
                    (self._held is not None or (not decoding and self.turns is not None)):
                continue  # a wake-up while a pack gathers, or a turn's job queued: look again
            return self._step(item, decoding, idle)

    def _turn_step(self, decoding: bool) -> Step | None:
        """Where turns go one at a time and turns' jobs are queued: the quick jobs queued (a call joining), else
        a decode step while calls that joined have no first token yet (it comes before any turn's next job),
        else the next turn's job (TurnOrder.take); None when no turn's job is due."""
        if self.turns.count():
            quick = self.quick_jobs()
            if quick:
                return Step(quick, decode=decoding)
            if self.decoder is not None and self.decoder.starting:
                return self._decoded(Step([], decode=True))
        job = self.turns.take()  # none: the current turn's quiet time starts
        if job is None:
            return None
        # other calls' decode steps wait for the turns' prefill, one step at least every `first_s`
        decode = decoding and time.monotonic() - self._decoded_at >= self.turns.first_s
        return self._decoded(Step([], job=job, decode=decode))

    def _decoded(self, step: Step) -> Step:
        """`step`, its decode step's time kept when it takes one (TurnOrder.first_s)."""
        if step.decode:
            self._decoded_at = time.monotonic()
        return step

    def _turn_wait(self, decoding: bool) -> float | None:
        """Where turns go one at a time and no turn's job is due: how long to wait for the current turn's next
        job (or its end) before looking again, or None (do as without turns). Other turns' jobs wait for its
        quiet time (TurnOrder.wait_s); decoding calls, for their next step until `first_s` is up or the turn
        has been between two jobs for its hop (HOP_S), and a call that has no first token yet not at all."""
        quiet = self.turns.wait_s()
        if not decoding or self.turns.current is None:
            return quiet
        if self.decoder.starting:  # a call that joined: its first token now
            return None
        due = min(self.turns.first_s - (time.monotonic() - self._decoded_at), self.turns.hop_left_s())
        if due <= 0:
            return None
        return due if quiet is None else min(due, quiet)

    def _get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next queued item: the one `another` put back first (raises queue.Empty as the queue does)."""
        if self._ahead:
            return self._ahead.pop()
        return self._jobs.get(block=block, timeout=timeout)

    def another(self) -> Job | None:
        """A plain job queued next, for the engine thread to run in the step it is in (while the step's jobs are
        within their time: module docstring); None when nothing is queued or the next item is not a plain job
        (a pack, a wake-up, the stop: kept for the next step, in order)."""
        try:
            item = self._get(block=False)
        except queue.Empty:
            return None
        if isinstance(item, tuple) and item:
            return item
        self._ahead.append(item)
        return None

    def _wait(self, decoding: bool, turn_wait: float | None = None) -> dict[str, Any]:
        """How the next look at the job queue waits: `turn_wait` (seconds, Scheduler._turn_wait) when given, not
        at all beside decoding calls, until a held pack's gathering time is up, IDLE_AFTER_S with an idle job
        queued, else until something comes."""
        if turn_wait is not None:
            return {"timeout": turn_wait}
        if decoding:
            return {"block": False}
        if self._held is not None:
            waited = time.monotonic() - self._held.at  # up to the gathering time, then (woken) up to its own wake's
            until = self.gather_s if waited < self.gather_s else self._holds_for(self._held)
            return {"timeout": max(0.0, until - waited)}
        return {"timeout": IDLE_AFTER_S} if self._idle else {}

    def _step(self, item: Any, decoding: bool, idle: Callable[[], Any] | None = None) -> Step:
        step = Step(self.quick_jobs(), idle=idle, decode=decoding)
        if isinstance(item, list):
            step.pack = item
        elif item:
            step.job = item
        return self._decoded(step)

    def quick_jobs(self) -> list[Job]:
        """Every quick job queued now: a step's first, then those queued while they ran (the thread asks until
        none is left, before the step's work)."""
        jobs = []
        while True:
            try:
                jobs.append(self._quick.get_nowait())
            except queue.Empty:
                return jobs

    def _take(self, item: Any, decoding: bool) -> Any:
        """A queued item as a step takes it: a pack's marker becomes the pack's queued jobs (a list), or a
        wake-up () when an earlier marker took them, when its pack is held, or when it is held now (it
        starts turns, the decoder is idle and other turns are arriving)."""
        if not isinstance(item, _PackDue):
            return item
        if self._held is not None and item.pack == self._held.pack:
            return ()  # queued with the held one: taken with it
        if item.starts and not decoding and self._held is None and self.gather_s > 0 and self._gathering(item):
            self._held = item
            return ()
        return self._pop(item.pack)

    def _arrivals(self, woken: bool = False) -> bool:
        """Whether turns are on their way (rendered, matched, waking: Arrival; see ARRIVING_AT_MOST_S); with
        `woken`, turns whose session is waking or woke."""
        now = time.monotonic()
        with self._packs_lock:
            stale = [a for a in self._arriving if now - a.at > ARRIVING_AT_MOST_S]
            self._arriving.difference_update(stale)
            arriving = any(a.waking or a.woken_s for a in self._arriving) if woken else bool(self._arriving)
        if stale:
            log.warning("turns on their way too long, let go", extra={"turns": len(stale), "after_s": ARRIVING_AT_MOST_S})
        return arriving

    def _holds_for(self, due: _PackDue) -> float:
        """The longest `due` may be held: the gathering time, or for a woken turn its own wake's time."""
        return max(self.gather_s, min(due.woken_s, WOKEN_GATHER_AT_MOST_S))

    def _gathering(self, due: _PackDue | None = None) -> bool:
        """Whether `due` (the held pack) waits on: turns are arriving and its gathering time is not up; past
        it, a woken turn's pack while turns waking or woken are (up to its own wake's time)."""
        due = due or self._held
        if due is None:
            return False
        waited = time.monotonic() - due.at
        if waited < self.gather_s:
            return self._arrivals()
        return waited < self._holds_for(due) and self._arrivals(woken=True)

    def _release(self) -> Any:
        """The held pack's jobs (all of them queued by now), no longer held."""
        held, self._held = self._held, None
        if held is None:
            return ()
        self.holds.add((time.monotonic() - held.at) * 1000)
        return self._pop(held.pack)

    def _pop(self, pack: Any) -> Any:
        with self._packs_lock:
            jobs = self._packs.pop(pack, None)
        return jobs or ()

    def refuse_left(self) -> None:
        """Fail the jobs queued behind the stop, and any submitted later: their waiters get CancelledError
        instead of waiting for ever."""
        with self._open_lock:
            self._closed = True
        for job in self._ahead:
            if isinstance(job, tuple) and job:
                job[1].set_exception(CancelledError("the engine stopped before this job ran"))
        self._ahead = []
        for job in self.turns.drain() if self.turns is not None else ():
            job[1].set_exception(CancelledError("the engine stopped before this job ran"))
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
