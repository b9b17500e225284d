"""The scheduler's step (model/scheduler/steps.py): what the engine thread runs each turn, in which order."""

from __future__ import annotations

import threading

import pytest

from kvwake.daemon.jobs import Packed, quick
from kvwake.daemon.model.scheduler import steps
from kvwake.daemon.model.scheduler.steps import Scheduler
from kvwake.daemon.model.thread import EngineThread
from kvwake.errors import CancelledError


class Decoding:
    """A decoder's face as the scheduler sees it: whether calls are decoding."""

    def __init__(self, active: bool) -> None:
        self.active = active


def test_quick_jobs_all_come_first_in_one_step_then_one_job():
    s = Scheduler()
    first = s.submit(lambda: "a")
    q1, q2 = s.submit(lambda: "q1", quick=True), s.submit(quick(lambda: "q2"))
    second = s.submit(lambda: "b")
    step = s.next_step()
    assert [job[1] for job in step.quick] == [q1, q2]
    assert step.job[1] is first and step.pack is None and not step.decode
    step = s.next_step()
    assert step.quick == [] and step.job[1] is second


def test_packed_jobs_queued_by_their_turn_come_as_one_pack():
    s = Scheduler()
    ran: list[list] = []
    pack = lambda jobs: ran.append(jobs) or [job.args[0] for job in jobs]  # noqa: E731
    futures = [s.submit(Packed(lambda: None, pack, (i,))) for i in range(3)]
    step = s.next_step()
    assert [future for _, future in step.pack] == futures and step.job is None
    # The two markers left find their jobs taken: wake-ups, not turns (nothing else is queued: no block).
    s.submit(lambda: "after")
    assert s.next_step().job is not None


def test_while_calls_decode_a_step_never_waits_for_a_job():
    s = Scheduler(decoder=Decoding(active=True))
    step = s.next_step()  # nothing queued: returns at once, a decode step alone
    assert step.decode and step.job is None and step.pack is None and step.idle is None
    s.submit(lambda: "x")
    step = s.next_step()
    assert step.decode and step.job is not None


def test_an_idle_job_runs_only_once_nothing_is_queued_for_a_while(monkeypatch):
    monkeypatch.setattr(steps, "IDLE_AFTER_S", 0.05)
    s = Scheduler(decoder=Decoding(active=False))
    built = lambda: "built"  # noqa: E731
    s.idle(built)
    queued = s.submit(lambda: "request")
    step = s.next_step()
    assert step.job[1] is queued and step.idle is None  # the request first
    step = s.next_step()  # then quiet for IDLE_AFTER_S: the idle job
    assert step.idle is built and step.job is None and not step.decode
    s.decoder.active = True
    s.idle(built)
    assert s.next_step().idle is None  # never beside decoding calls


def test_the_stop_ends_the_steps_and_the_jobs_behind_it_are_refused():
    s = Scheduler()
    s.stop()
    behind = s.submit(lambda: "late")
    packed = s.submit(Packed(lambda: None, lambda jobs: [None] * len(jobs)))
    assert s.next_step().stop
    s.refuse_left()
    for future in (behind, packed):
        with pytest.raises(CancelledError, match="engine stopped"):
            future.result(timeout=1)


def test_the_engine_thread_runs_each_step_in_the_schedulers_order():
    """The thread executes: quick jobs queued behind a running job all run before the next plain job."""
    thread = EngineThread()
    gate, order = threading.Event(), []
    try:
        thread.submit(gate.wait)
        later = thread.submit(lambda: order.append("job"))
        quicks = [thread.submit(lambda i=i: order.append(f"quick {i}"), quick=True) for i in range(3)]
        assert thread.scheduler.waiting()[0] >= 1
        gate.set()
        later.result(timeout=10)
        assert all(f.result(timeout=10) is None for f in quicks)
        assert order == ["quick 0", "quick 1", "quick 2", "job"]
    finally:
        thread.stop()


def test_a_quick_job_queued_while_quick_jobs_run_joins_at_the_same_step():
    """Was: the step's quick jobs were taken once, so a call joining meanwhile waited for the next job."""
    thread = EngineThread()
    gate, running, order = threading.Event(), threading.Event(), []
    try:
        thread.submit(lambda: (running.set(), gate.wait()))
        assert running.wait(10)  # the thread is in a job: what comes next is queued behind it
        job = thread.submit(lambda: order.append("job"))

        def first() -> None:
            order.append("quick 1")
            thread.submit(lambda: order.append("quick 2"), quick=True)

        thread.submit(first, quick=True)
        gate.set()
        job.result(timeout=10)
        assert order == ["quick 1", "quick 2", "job"]
    finally:
        thread.stop()


def test_later_queues_from_the_engine_thread_only():
    """What waits for a prefill chunk runs as a job of its own when the chunk ran on the engine thread; on any
    other thread (a caller running MLX itself) its caller runs it. Was: queued from any thread once attached."""
    thread = EngineThread()
    try:
        assert thread.later(lambda: None) is None
        queued = thread.call(lambda: thread.later(lambda: "ran"))
        assert queued.result(timeout=10) == "ran"
    finally:
        thread.stop()


async def test_the_warm_up_runs_as_idle_jobs_and_a_request_goes_first():
    # Was: the warm-up's jobs were plain jobs queued one after another, and a wake after a restart waited
    # one warm-up job per job of its own (it finished just after the warm-up).
    import anyio

    from kvwake.daemon import serve

    thread, order, running = EngineThread(), [], threading.Event()

    def warm_job(i: int) -> None:
        running.set()
        order.append(f"warm{i}")

    class Engine:  # a model's face as the warm-up sees it
        def warm_jobs(self):
            return [lambda i=i: warm_job(i) for i in range(3)]

    class Model:
        name, engine = "tiny", Engine()

    Model.thread = thread
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve._warm, [Model()])
            await anyio.sleep(0.05)  # the warm-up has queued its first job (an idle job: not yet run)
            await thread.run(lambda: order.append("request"))
            for _ in range(200):
                await anyio.sleep(0.05)
                if len(order) == 4:
                    break
        assert order == ["request", "warm0", "warm1", "warm2"]
    finally:
        thread.stop()


async def test_a_failing_idle_job_run_when_idle_raises_to_its_awaiter():
    thread = EngineThread()
    try:
        assert await thread.run_when_idle(lambda: 7) == 7
        with pytest.raises(ZeroDivisionError):
            await thread.run_when_idle(lambda: 1 / 0)
    finally:
        thread.stop()
