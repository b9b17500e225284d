"""The engine thread: the one thread that runs MLX, executing what its scheduler decides.

MLX work (prefill chunks, capture, restore) is submitted from the event loop
or a worker thread and awaited without blocking it; each submission gets its
own future (the response channel). Each turn the thread asks its `Scheduler`
(model/scheduler/steps.py) for one `Step` (quick jobs, then one job or pack or
idle job, then a decode step of every running call) and runs it; it knows no
policy. So a session's long prefill delays other sessions' next tokens by about
one slice of a chunk (model/scheduler/slices.py), not by the whole prompt, and
a decoding session never waits for a sleep or wake.

Output for the event loop (streamed pieces, finished calls) is `post`ed: what a
job or a decode step posts reaches each loop in one `call_soon_threadsafe`
after it, in order, so a step of many rows wakes the loop once, not once a row.

What the thread spends its time on is kept for `status` (`timing`): seconds in
jobs, in decode steps and in handing output over, and the latest jobs or steps
that took over the slow mark (Tuning.slow_job_ms), by name: what a decoding
neighbour waited for.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kvwake.daemon.jobs import Mlx, unframed
from kvwake.daemon.model.decoder import Decoder
from kvwake.daemon.model.scheduler.prefill import PrefillPlanner
from kvwake.daemon.model.scheduler.steps import Arrival, Job, Scheduler
from kvwake.daemon.model.scheduler.turns import TurnOrder
from kvwake.daemon.timing import Latency
from kvwake.errors import CancelledError

__all__ = ["EngineThread", "process_age_s"]

log = logging.getLogger("kvwake.engine")


def process_age_s() -> float | None:
    """Seconds since this process was started (exec), from /proc on Linux; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


T = TypeVar("T")
Posted = tuple[Callable[..., Any], tuple[Any, ...]]
SLOW_MS = 50.0  # a job or step this long is named in `timing` (Tuning.slow_job_ms)
SLOW_KEPT = 64  # the latest slow ones `timing` keeps (Tuning.slow_jobs_kept)
GAPS_KEPT = 512  # the latest intervals between decode steps' hand-overs that `timing` keeps (its step_gaps)


class EngineThread:
    """A single worker thread with a FIFO of jobs and, once attached, a decoder stepped between them."""

    def __init__(self, name: str = "kvwake-engine", on_exit: Callable[[], None] | None = None, *,
                 scheduler: Scheduler | None = None, slow_job_ms: float = SLOW_MS,
                 slow_jobs_kept: int = SLOW_KEPT) -> None:
        self._on_exit = on_exit
        self.scheduler = scheduler if scheduler is not None else Scheduler()
        self._outbox: list[tuple[asyncio.AbstractEventLoop, Callable[..., Any], tuple[Any, ...]]] = []
        self.hops = 0  # loop wake-ups made by `post`ed output (one per loop per job or step that posted)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.busy_s = 0.0
        self.slow_s = slow_job_ms / 1000
        self._spent = {"jobs": 0, "job_s": 0.0, "steps": 0, "step_s": 0.0, "flush_s": 0.0}
        self._slow: deque[dict[str, Any]] = deque(maxlen=slow_jobs_kept)
        self._idle_waits: set[Future] = set()  # `run_when_idle`'s futures not yet resolved (failed by `stop`)
        # seconds between one decode step's output handed over and the next's, while decoding without a pause:
        # the engine's side of the gap a streaming client sees (a job between two steps is in it)
        self._gaps = Latency(GAPS_KEPT)
        self._handed: float | None = None
        self._step_s = 0.0  # the last decode step's seconds: what a step's jobs may take (_more_jobs)
        self._thread.start()

    def attach(self, decoder: Decoder, prefill: PrefillPlanner | None = None) -> None:
        """Step `decoder` between jobs from now on, and let `prefill` queue its jobs here (its idle builds,
        the jobs that waited for a chunk's end) and say how long a pack of turns gathers (its `gather_s`,
        where it packs), or that turns go one at a time (where it does not); takes effect on the engine
        thread, in order."""
        def attach() -> None:
            self.scheduler.decoder = decoder
            if prefill is not None:
                prefill.idle, prefill.later = self.idle, self.later
                self.scheduler.gather_s = prefill.gather_s if prefill.pack_prefill else 0.0
                # turns one at a time where packing would not pay (scheduler/turns.py)
                self.scheduler.turns = TurnOrder(prefill.first_s) if prefill.one_at_a_time else None
        self.submit(attach).result()

    def attached(self, decoder: Decoder) -> bool:
        """Whether `decoder` is the one this thread steps (attached and taken effect)."""
        return self.scheduler.decoder is decoder

    def _run(self) -> None:
        while True:
            step = self.scheduler.next_step()
            if step.stop:
                break
            start = time.perf_counter()
            quick = step.quick
            while quick:  # until none is left: a call that joins meanwhile joins at this step
                for job in quick:
                    began = time.perf_counter()
                    self._do(job)
                    self._spend("job", job[0], began)
                quick = self.scheduler.quick_jobs()
            began = time.perf_counter()  # the quick jobs counted apart
            if step.pack is not None:
                self._do_pack(step.pack)
                self._spend("job", getattr(step.pack[0][0], "fn", step.pack[0][0]), began, len(step.pack))
            elif step.job is not None:
                self._do(step.job)
                self._spend("job", getattr(step.job[0], "fn", step.job[0]), began)  # a Packed job: by its fn
                self._more_jobs(step, began)
            elif step.idle is not None:
                self._do_idle(step.idle)
                self._spend("job", "idle " + _name(step.idle), began)
            decoder = self.scheduler.decoder
            if step.decode and decoder is not None:
                stepped = time.perf_counter()
                try:
                    decoder.step()
                except Exception as exc:  # a bug, not a model error (those fail only their calls)
                    log.exception("decode step failed; failing every call in flight")
                    decoder.abort(unframed(exc))
                self._spend("step", decoder.step, stepped)
                self._step_s = time.perf_counter() - stepped
            flushed = time.perf_counter()
            self._flush()
            end = time.perf_counter()
            self._spent["flush_s"] += end - flushed
            self.busy_s += end - start
            if step.decode and self._handed is not None:
                self._gaps.add((end - self._handed) * 1000)
            self._handed = end if step.decode else None
            # Not kept while the queue is waited on: a job's closure and result (a session, its cache, a
            # prefill chunk's layers) would live on until the next job came, and be freed then, all at once.
            step = None
        if self.scheduler.decoder is not None:
            self.scheduler.decoder.abort(CancelledError("the engine stopped"))
            self._flush()  # the calls' failures reach their waiters
        self.scheduler.refuse_left()
        if self._on_exit is not None:
            self._on_exit()

    def _more_jobs(self, step: Any, began: float) -> None:
        """Beside decoding calls: plain jobs queued next, while the step's jobs have taken less than the last
        decode step (at most the slow mark), so short jobs do not each wait for a decode step
        (scheduler/steps.py)."""
        budget = min(self._step_s, self.slow_s)
        while step.decode and time.perf_counter() - began < budget:
            job = self.scheduler.another()
            if job is None:
                return
            more = time.perf_counter()
            self._do(job)
            self._spend("job", job[0], more)

    @staticmethod
    def _do_pack(jobs: list[Job]) -> None:
        """Run a pack's jobs as one: `pack` once over those still wanted, each future its item."""
        live = [(fn, future) for fn, future in jobs if future.set_running_or_notify_cancel()]
        if not live:
            return
        try:
            results = live[0][0].engine_pack([fn for fn, _ in live])  # type: ignore[attr-defined]
            if len(results) != len(live):  # a pack's bug: fails its callers, not the engine thread
                raise RuntimeError(f"a pack of {len(live)} jobs gave {len(results)} results")
        except BaseException as exc:  # every caller of the pack gets it
            for _, future in live:
                future.set_exception(unframed(exc))
            return
        for (_, future), result in zip(live, results):
            if isinstance(result, BaseException):
                future.set_exception(unframed(result))
            else:
                future.set_result(result)

    def _spend(self, kind: str, what: str | Callable[..., Any], start: float, packed: int = 1) -> None:
        """Count a job or step that began at `start`; one over the slow mark is kept by name (`what`, or its
        function's name, with what its object says of the work when it can: `trace()`, a prefill slice's
        layers, a decode step's admitted calls; "x N" for a pack of N jobs). A decode step is named "decode step"."""
        took = time.perf_counter() - start
        self._spent[kind + "s"] += 1
        self._spent[kind + "_s"] += took
        if took > self.slow_s:
            name = what if isinstance(what, str) else "decode step" if kind == "step" else _name(what)
            trace = getattr(getattr(what, "__self__", None), "trace", None)
            said = trace() if callable(trace) else ""
            if said:
                name = f"{name} {said}"
            if packed > 1:
                name = f"{name} x {packed}"
            self._slow.append({"what": name, "ms": round(took * 1000, 1), "at": round(time.time() - took, 4)})

    def timing(self) -> dict[str, Any]:
        """Seconds spent in jobs, decode steps and handing output over, their counts, the waits of packs held
        for arriving turns (`pack_holds`, ms), where turns go one at a time their quiet times (`turns`:
        TurnOrder.status), and the slow ones (`at`: wall-clock start, seconds since the
        epoch), oldest first."""
        spent = {k: round(v, 4) if isinstance(v, float) else v for k, v in self._spent.items()}
        turns = self.scheduler.turns
        return {**spent, "step_gaps": self._gaps.summary(), "pack_holds": self.scheduler.holds.summary(),
                **({"turns": turns.status()} if turns is not None else {}),
                "slow_over_ms": self.slow_s * 1000, "slow": list(self._slow)}

    def idle(self, fn: Callable[[], Any]) -> None:
        """Run fn on the engine thread once nothing else waits (Scheduler.idle). For what only speeds later
        requests up (a graph built ahead); a failure is logged, never raised."""
        self.scheduler.idle(fn)

    @staticmethod
    def _do_idle(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - only speed was at stake
            log.warning("idle job failed", extra={"job": _name(fn), "error": repr(unframed(exc))})

    @staticmethod
    def _do(job: Job) -> None:
        fn, future = job
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # delivered to the awaiting caller
            future.set_exception(unframed(exc))

    def post(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on `loop`: from the engine thread, with everything else the current job or decode
        step posts, in one hop after it; from another thread, at once. In the order posted, either way."""
        if threading.current_thread() is self._thread:
            self._outbox.append((loop, fn, args))
        else:
            loop.call_soon_threadsafe(fn, *args)

    def _flush(self) -> None:
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[Posted]] = {}
        for loop, fn, args in self._outbox:
            by_loop.setdefault(loop, []).append((fn, args))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
                self.hops += 1
            except RuntimeError:  # the loop is closed: nobody is left to tell
                pass

    def submit(self, fn: Callable[[], T], quick: bool = False) -> Future[T]:
        """Queue fn (Scheduler.submit; `quick`: it does no MLX work to speak of, so it runs before the next
        job, with every other quick job queued, instead of one job per decode step)."""
        return self.scheduler.submit(fn, quick)

    def later(self, fn: Callable[[], Any]) -> Future | None:
        """From a job on this engine thread: queue `fn` as a job of its own behind those waiting (a decode step
        may run between: Scheduler.another), and return its Future (failed if the engine stops first); None on any other thread,
        whose caller runs it itself (as in process, with `direct`)."""
        return self.submit(fn) if threading.current_thread() is self._thread else None

    def call(self, fn: Callable[[], T], arrival: Arrival | None = None) -> T:
        """Run fn on the engine thread and wait for it from another thread (the pipeline's `mlx`); `arrival`:
        the turn fn belongs to, landed if fn is its first Packed job (Scheduler.submit)."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.scheduler.submit(fn, arrival=arrival).result()

    def arrive(self) -> Arrival:
        """A turn on its way to this thread (rendered, matched, not yet queued): the first Packed jobs of the
        turns before it wait for it while nothing decodes (Scheduler.arrive). Its caller lands it when the
        turn ends, and runs the turn's MLX steps through `calls_of(arrival)`."""
        return self.scheduler.arrive()

    def calls_of(self, arrival: Arrival) -> Mlx:
        """The `mlx` runner of a turn on its way: `call`, its first Packed job landing `arrival`."""
        return lambda fn: self.call(fn, arrival)

    async def run(self, fn: Callable[[], T], quick: bool = False) -> T:
        """Run fn on the engine thread and await its result from the event loop (`quick`: see `submit`).

        Cancelling the awaiting task does not interrupt a job already running
        (MLX work cannot be interrupted); a job not yet started is dropped.
        """
        return await asyncio.wrap_future(self.submit(fn, quick))

    async def run_when_idle(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread as an idle job (once nothing else waits and nothing decodes: Scheduler.idle)
        and await its result. For work no request may wait behind (the warm-up): a request that comes while
        such jobs are queued waits for the one running at most."""
        future: Future[T] = Future()
        self._idle_waits.add(future)
        future.add_done_callback(self._idle_waits.discard)
        self.idle(lambda: self._do((fn, future)))
        if not self.alive and self._thread.ident is not None:  # stopped meanwhile: no thread will run it
            self._refuse_idle()
        return await asyncio.wrap_future(future)

    def stop(self) -> None:
        self.scheduler.stop()
        self._thread.join(timeout=60)
        if not self.alive:
            self._refuse_idle()

    def _refuse_idle(self) -> None:
        """Fail the idle jobs the stopped thread never ran: their waiters (a model's warm-up) get CancelledError
        instead of waiting for ever, holding the model (its weights were never freed after an unload)."""
        for future in list(self._idle_waits):
            if not future.done():
                future.set_exception(CancelledError("the engine stopped before this idle job ran"))

    @property
    def alive(self) -> bool:
        """Whether the thread still runs jobs (not stopped: its model not unloaded)."""
        return self._thread.is_alive()


def _name(fn: Callable[..., Any]) -> str:
    """A job's name from its function: `Engine.prefill` for a lambda made in Engine.prefill."""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return name.replace(".<locals>.<lambda>", "").replace(".<locals>", "")


def _deliver(items: list[Posted]) -> None:
    """On the loop: run what one job or step posted, in order; one that raises does not stop the rest."""
    for fn, args in items:
        try:
            fn(*args)
        except Exception:
            log.exception("posted output failed on the event loop")
