"""The engine thread: the one thread that runs MLX, fed by a queue.

MLX work (prefill chunks, capture, restore) is submitted from the event loop
or a worker thread and awaited without blocking it; each submission gets its
own future (the response channel). Jobs run one at a time, in order (quick
ones, below, before the others), and are short: a long prefill or a sleep is
many jobs.

While generate calls are decoding, the thread alternates: one job, then one
decode step for every running call (the attached `Decoder`). So a session's
8k-token prefill delays other sessions' next tokens by about one slice of a
chunk (model/prefillslices.py), not by the whole prompt, and a decoding session
never waits for a sleep or wake. A `quick` job (bookkeeping with no MLX work: a
call joining the decoder) does not wait its turn: every quick job queued runs
before the next job, so 16 calls that come at once join the batch at one step,
not over 16. A `Packed` job (kv/context.py) runs with every job of its pack queued
by its turn, as one: 16 turns' prefill chunks that come at once are one forward pass
(model/packing.py) and one job, not 16 of each.

Output for the event loop (streamed pieces, finished calls) is `post`ed: what a
job or a decode step posts reaches each loop in one `call_soon_threadsafe`
after it, in order, so a step of 32 rows wakes the loop once, not 32 times.

What the thread spends its time on is kept for `status` (`timing`): seconds in
jobs, in decode steps and in handing output over, and the last `SLOW_KEPT` jobs
or steps that took over `SLOW_S`, by name: what a decoding neighbour waited for.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kvwake.daemon.kv.context import serve_later, unframed
from kvwake.daemon.model.decoder import Decoder
from kvwake.daemon.phases import Latency
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
Job = tuple[Callable[[], Any], Future]


class _PackDue:
    """In the job queue: a Packed job of `pack` was queued here; the first of these runs all of its jobs
    queued by then, the others find none (a wake-up, not a turn)."""

    __slots__ = ("pack",)

    def __init__(self, pack: Callable[[list[Any]], list[Any]]) -> None:
        self.pack = pack


class _Taken:
    """A pack's jobs taken from the queue, to run as one."""

    __slots__ = ("jobs",)

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs
Posted = tuple[Callable[..., Any], tuple[Any, ...]]
# a job or step this long is named in `timing` (a decode step on the H100 takes ~7-20 ms); KVWAKE_SLOW_JOB_MS
# lowers it to see what a neighbour's shorter gaps are made of
SLOW_S = float(os.environ.get("KVWAKE_SLOW_JOB_MS", "50")) / 1000
SLOW_KEPT = int(os.environ.get("KVWAKE_SLOW_JOBS_KEPT", "64"))  # the latest slow ones `timing` keeps
# `idle` jobs wait for the queue to stay empty this long: on the H100 a client that sent its next turn at
# once (bench/http_turns.py) left the engine quiet for more than 50 ms between turns, and its turn waited
# for the idle job (a cuDNN graph build, 90-135 ms) that started there.
IDLE_AFTER_S = 0.25
GAPS_KEPT = 512  # the latest intervals between decode steps' hand-overs that `timing` keeps (its step_gaps)


class EngineThread:
    """A single worker thread with a FIFO of jobs and, once attached, a decoder stepped between them."""

    def __init__(self, name: str = "kvwake-engine", on_exit: Callable[[], None] | None = None) -> None:
        self._on_exit = on_exit
        self._jobs: queue.SimpleQueue[Job | tuple[()] | None] = queue.SimpleQueue()  # (): a wake-up, no job
        self._quick: queue.SimpleQueue[Job] = queue.SimpleQueue()  # `quick` jobs: all run before the next job
        self._idle: deque[Callable[[], Any]] = deque()  # `idle` jobs: run only when nothing else waits
        self._packs: dict[Any, list[Job]] = {}  # Packed jobs by pack, queued (a _PackDue each in _jobs)
        self._packs_lock = threading.Lock()
        self._decoder: Decoder | None = None
        self._outbox: list[tuple[asyncio.AbstractEventLoop, Callable[..., Any], tuple[Any, ...]]] = []
        self.hops = 0  # loop wake-ups made by `post`ed output (one per loop per job or step that posted)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.busy_s = 0.0
        self._spent = {"jobs": 0, "job_s": 0.0, "steps": 0, "step_s": 0.0, "flush_s": 0.0}
        self._slow: deque[dict[str, Any]] = deque(maxlen=SLOW_KEPT)
        # seconds between one decode step's output handed over and the next's, while decoding without a pause:
        # the engine's side of the gap a streaming client sees (a job between two steps is in it)
        self._gaps = Latency(GAPS_KEPT)
        self._handed: float | None = None
        self._thread.start()

    def attach(self, decoder: Decoder) -> None:
        """Step `decoder` between jobs from now on (takes effect on the engine thread, in order)."""
        self.submit(lambda: setattr(self, "_decoder", decoder)).result()

    def _run(self) -> None:
        serve_later(self.submit)
        while True:
            decoder = self._decoder
            decoding = decoder is not None and decoder.active
            idle = None
            try:
                if decoding:
                    job = self._take(self._jobs.get_nowait())
                elif self._idle:  # an idle job once the queue stays empty a while (a caller's next job is
                    job = self._take(self._jobs.get(timeout=IDLE_AFTER_S))  # typically microseconds behind its last)
                else:
                    job = self._take(self._jobs.get())
            except queue.Empty:
                job = ()  # nothing queued: decode, or (not decoding) one idle job
                idle = None if decoding else self._idle.popleft()
            while job == () and idle is None:  # quick jobs' wake-ups (they all run below): not a turn each
                try:
                    job = self._take(self._jobs.get_nowait())
                except queue.Empty:
                    break
            if job is None:
                break
            start = time.perf_counter()
            self._run_quick()
            began = time.perf_counter()  # the quick jobs counted apart
            if isinstance(job, _Taken):
                self._do_pack(job.jobs)
                self._spend("job", getattr(job.jobs[0][0], "fn", job.jobs[0][0]), began, len(job.jobs))
            elif job:
                self._do(job)
                self._spend("job", job[0], began)
            elif idle is not None:
                self._do_idle(idle)
                self._spend("job", "idle " + _name(idle), began)
            if decoding:
                stepped = time.perf_counter()
                try:
                    decoder.step()
                except Exception as exc:  # a bug, not a model error (those fail only their calls)
                    log.exception("decode step failed; failing every call in flight")
                    decoder.abort(unframed(exc))
                self._spend("step", decoder.step, stepped)
            flushed = time.perf_counter()
            self._flush()
            end = time.perf_counter()
            self._spent["flush_s"] += end - flushed
            self.busy_s += end - start
            if decoding and self._handed is not None:
                self._gaps.add((end - self._handed) * 1000)
            self._handed = end if decoding else None
            # Not kept while the queue is waited on: a job's closure and result (a session, its cache, a
            # prefill chunk's layers) would live on until the next job came, and be freed then, all at once.
            job = idle = None
        if self._decoder is not None:
            self._decoder.abort(CancelledError("the engine stopped"))
            self._flush()  # the calls' failures reach their waiters
        self._refuse_left()
        if self._on_exit is not None:
            self._on_exit()

    def _take(self, job: Any) -> Any:
        """A queued item as the loop runs it: a pack's marker becomes the pack's queued jobs (_Taken), or a
        wake-up () when an earlier marker took them."""
        if not isinstance(job, _PackDue):
            return job
        with self._packs_lock:
            jobs = self._packs.pop(job.pack, None)
        return _Taken(jobs) if jobs else ()

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

    def _run_quick(self) -> None:
        """Every quick job queued now (its caller waits for it, so none queues another behind it)."""
        while True:
            try:
                job = self._quick.get_nowait()
            except queue.Empty:
                return
            start = time.perf_counter()
            self._do(job)
            self._spend("job", job[0], start)

    def _refuse_left(self) -> None:
        """Fail the jobs queued behind the stop (one a job queued for later, `later`, among them): their
        waiters get CancelledError instead of waiting for ever."""
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

    def _spend(self, kind: str, what: str | Callable[..., Any], start: float, packed: int = 1) -> None:
        """Count a job or step that began at `start`; one over SLOW_S is kept by name (`what`, or its
        function's name, with what its object says of the work when it can: `trace()`, a prefill slice's
        layers, a decode step's admitted calls; "x N" for a pack of N jobs). A decode step is named "decode step"."""
        took = time.perf_counter() - start
        self._spent[kind + "s"] += 1
        self._spent[kind + "_s"] += took
        if took > SLOW_S:
            name = what if isinstance(what, str) else "decode step" if kind == "step" else _name(what)
            trace = getattr(getattr(what, "__self__", None), "trace", None)
            said = trace() if callable(trace) else ""
            if said:
                name = f"{name} {said}"
            if packed > 1:
                name = f"{name} x {packed}"
            self._slow.append({"what": name, "ms": round(took * 1000, 1), "at": round(time.time() - took, 4)})

    def timing(self) -> dict[str, Any]:
        """Seconds spent in jobs, decode steps and handing output over, their counts, and the slow ones
        (`at`: wall-clock start, seconds since the epoch), oldest first."""
        spent = {k: round(v, 4) if isinstance(v, float) else v for k, v in self._spent.items()}
        return {**spent, "step_gaps": self._gaps.summary(), "slow_over_ms": SLOW_S * 1000,
                "slow": list(self._slow)}

    def idle(self, fn: Callable[[], Any]) -> None:
        """Run fn on the engine thread once nothing else waits (no job queued for IDLE_AFTER_S, no call
        decoding), one such job between two looks at the queue: a request that comes meanwhile waits for
        one, not all. For what only speeds later requests up (a graph built ahead); a failure is logged,
        never raised."""
        self._idle.append(fn)
        self._jobs.put(())  # a thread blocked on an empty queue looks again

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
        """Queue fn; `quick`: it does no MLX work to speak of (microseconds), so it runs before the next
        job, with every other quick job queued, instead of one job per decode step."""
        future: Future[T] = Future()
        pack = getattr(fn, "engine_pack", None)  # kv/context.Packed
        if quick or getattr(fn, "engine_quick", False):  # kv/context.quick
            self._quick.put((fn, future))
            self._jobs.put(())  # a thread blocked on an empty queue looks again
        elif pack is not None:
            with self._packs_lock:
                self._packs.setdefault(pack, []).append((fn, future))
            self._jobs.put(_PackDue(pack))
        else:
            self._jobs.put((fn, future))
        return future

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread and wait for it from another thread (the pipeline's `mlx`)."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.submit(fn).result()

    async def run(self, fn: Callable[[], T], quick: bool = False) -> T:
        """Run fn on the engine thread and await its result from the event loop (`quick`: see `submit`).

        Cancelling the awaiting task does not interrupt a job already running
        (MLX work cannot be interrupted); a job not yet started is dropped.
        """
        return await asyncio.wrap_future(self.submit(fn, quick))

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)


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
