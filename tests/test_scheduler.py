"""The scheduler's step (model/scheduler/steps.py): what the engine thread runs each turn, in which order."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvwake.daemon.jobs import Packed, quick
from kvwake.daemon.model.scheduler import steps, turns
from kvwake.daemon.model.scheduler.steps import Scheduler, Step
from kvwake.daemon.model.scheduler.turns import TurnOrder
from kvwake.daemon.model.thread import EngineThread
from testkit.models import Served
from kvwake.errors import CancelledError


class Decoding:
    """A decoder's face as the scheduler sees it: whether calls are decoding, whether some wait for a first token."""

    def __init__(self, active: bool) -> None:
        self.active, self.aborted, self.starting = active, None, False

    def abort(self, exc: BaseException) -> None:  # the engine thread's stop fails the calls in flight
        self.aborted = exc


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


def idle_behind_a_turn(monkeypatch) -> tuple[Scheduler, Any, Any]:
    """A scheduler with nothing decoding, an idle job queued and one turn on its way: (it, the job, the turn)."""
    monkeypatch.setattr(steps, "IDLE_AFTER_S", 0.02)
    s = Scheduler(decoder=Decoding(active=False))
    built = lambda: "built"  # noqa: E731
    s.idle(built)
    return s, built, s.arrive()


def first_idle_step(s: Scheduler, within_s: float = 5.0) -> Step:
    """The first step that runs the idle job; fails (not hangs) when none comes within `within_s` (the
    scheduler's look waits on, inside next_step, while it holds the job back)."""
    steps_seen: list[Step] = []

    def look() -> None:
        steps_seen.append(s.next_step())
        while steps_seen[-1].idle is None:  # empty steps (a landing's wake-up) until the idle job is due
            steps_seen.append(s.next_step())
    looking = threading.Thread(target=look, daemon=True)
    looking.start()
    looking.join(within_s)
    assert steps_seen and steps_seen[-1].idle is not None, "the idle job never ran: a turn on its way held it"
    assert not any(step.job or step.pack or step.decode for step in steps_seen)
    return steps_seen[-1]


def test_an_idle_job_waits_while_turns_are_on_their_way(monkeypatch):
    # Was: a restart's first round, rendered and matched but not yet queued, found the warm-up's idle job
    # started just before it and waited for it (docs/benchmarks.md, "fleet").
    s, built, arrival = idle_behind_a_turn(monkeypatch)
    threading.Timer(0.15, arrival.land).start()
    started = time.monotonic()
    assert first_idle_step(s).idle is built and time.monotonic() - started >= 0.14  # once the turn landed


def test_a_turn_on_its_way_too_long_is_let_go(monkeypatch):
    # A turn dropped between its prepare and its generate never lands: it must not hold idle jobs for good.
    s, built, lost = idle_behind_a_turn(monkeypatch)
    lost.at -= steps.ARRIVING_AT_MOST_S + 1
    assert first_idle_step(s).idle is built


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


def test_a_job_submitted_after_the_engine_stopped_is_refused_not_left_waiting():
    # A model unloaded while a slept session's KV was still being released: the release's next job came after
    # the thread had refused what was queued, and its caller (a worker thread) waited for ever, which held
    # the process's exit.
    s = Scheduler()
    s.stop()
    assert s.next_step().stop
    s.refuse_left()
    for job in (s.submit(lambda: "late"), s.submit(quick(lambda: "late")),
                s.submit(Packed(lambda: None, lambda jobs: [None] * len(jobs)))):
        with pytest.raises(CancelledError, match="engine stopped"):
            job.result(timeout=1)
    thread = EngineThread("kvwake-engine-test")
    thread.stop()
    with pytest.raises(CancelledError, match="engine stopped"):
        thread.call(lambda: "late")


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
        name, engine, warmed = "tiny", Engine(), threading.Event()

    Model.thread = thread
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve._warm, Served(tiny=Model()), None)  # no hot set: at once
            await anyio.sleep(0.05)  # the warm-up has queued its first job (an idle job: not yet run)
            await thread.run(lambda: order.append("request"))
            for _ in range(200):
                await anyio.sleep(0.05)
                if len(order) == 4:
                    break
        assert order == ["request", "warm0", "warm1", "warm2"] and Model.warmed.is_set()
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


async def test_idle_jobs_a_stopped_thread_never_ran_fail_their_awaiters_and_later_ones_at_once():
    # Was: an idle job queued when the thread stopped was never answered, and its awaiter (a model's warm-up,
    # holding the model) waited for good
    import asyncio

    from kvwake.errors import CancelledError

    thread = EngineThread()
    running, release = threading.Event(), threading.Event()
    busy = asyncio.ensure_future(thread.run(lambda: (running.set(), release.wait(10))))
    while not running.is_set():
        await asyncio.sleep(0.01)
    queued = asyncio.ensure_future(thread.run_when_idle(lambda: 7))  # behind the running job
    await asyncio.sleep(0.05)
    stopping = asyncio.ensure_future(asyncio.to_thread(thread.stop))
    await asyncio.sleep(0.05)
    release.set()
    await busy
    await stopping
    with pytest.raises(CancelledError):
        await asyncio.wait_for(queued, 5)
    with pytest.raises(CancelledError):  # asked after the stop: refused at once, not queued for no one
        await asyncio.wait_for(thread.run_when_idle(lambda: 8), 5)


# -- turns that arrive together start as one pack --------------------------------------------------------

def _sizes(jobs: list[Packed]) -> list[None]:
    return [None] * len(jobs)


def test_turns_queued_20_ms_apart_start_as_one_pack():
    """Was: the idle engine thread took the first turn's Packed job the moment it was queued (a pack of one),
    and the turns queued after it a pack of their own."""
    thread = EngineThread(scheduler=Scheduler(gather_s=0.5))  # no decoder: nothing decodes
    packs: list[int] = []
    pack = lambda jobs: packs.append(len(jobs)) or _sizes(jobs)  # noqa: E731
    arrivals = [thread.arrive() for _ in range(4)]  # all four rendered at once, queued 20 ms apart

    def turn(i: int) -> None:
        time.sleep(0.02 * i)
        thread.calls_of(arrivals[i])(Packed(lambda: None, pack, (i,)))

    try:
        turns = [threading.Thread(target=turn, args=(i,)) for i in range(4)]
        for t in turns:
            t.start()
        for t in turns:
            t.join(timeout=10)
        assert packs == [4]
        assert thread.scheduler.arriving() == 0
    finally:
        thread.stop()


def test_a_lone_turn_waits_for_one_still_arriving_at_most_the_gathering_time():
    s = Scheduler(decoder=Decoding(active=False), gather_s=0.1)
    s.arrive()  # another turn on its way that never comes
    mine = s.arrive()
    queued = time.monotonic()
    future = s.submit(Packed(lambda: None, _sizes), arrival=mine)
    step = s.next_step()
    waited = time.monotonic() - queued
    assert [f for _, f in step.pack] == [future]
    assert 0.09 <= waited < 0.5  # the gathering time, and scheduling slack on a loaded machine


def test_a_lone_turn_with_nothing_arriving_is_taken_at_once():
    s = Scheduler(decoder=Decoding(active=False), gather_s=5.0)
    future = s.submit(Packed(lambda: None, _sizes), arrival=s.arrive())
    queued = time.monotonic()
    assert [f for _, f in s.next_step().pack] == [future]
    assert time.monotonic() - queued < 1.0  # far below the gathering time


def test_a_turn_that_lands_without_queuing_lets_the_held_pack_go():
    """A turn that fails (or queues no Packed job) is landed by its caller: the pack waits no longer."""
    s = Scheduler(decoder=Decoding(active=False), gather_s=5.0)
    failing = s.arrive()
    future = s.submit(Packed(lambda: None, _sizes), arrival=s.arrive())
    threading.Timer(0.05, failing.land).start()
    queued = time.monotonic()
    assert [f for _, f in s.next_step().pack] == [future]
    assert time.monotonic() - queued < 1.0
    failing.land()  # again: nothing changes
    assert s.arriving() == 0


def test_no_pack_is_held_while_calls_decode():
    s = Scheduler(decoder=Decoding(active=True), gather_s=5.0)
    s.arrive()  # arriving, but a decode step between jobs gathers them already
    future = s.submit(Packed(lambda: None, _sizes), arrival=s.arrive())
    queued = time.monotonic()
    step = s.next_step()
    assert [f for _, f in step.pack] == [future] and step.decode
    assert time.monotonic() - queued < 1.0


def test_a_held_pack_goes_once_a_call_starts_decoding():
    """A call that joins the decoder (a quick job) while a pack gathers: the pack runs at that step."""
    s = Scheduler(decoder=Decoding(active=False), gather_s=5.0)
    s.arrive()
    future = s.submit(Packed(lambda: None, _sizes), arrival=s.arrive())
    joined = s.submit(lambda: setattr(s.decoder, "active", True), quick=True)
    step = s.next_step()  # the join runs first; the pack still gathers (nothing decodes yet)
    assert [f for _, f in step.quick] == [joined] and step.pack is None
    step.quick[0][0]()
    step = s.next_step()
    assert [f for _, f in step.pack] == [future] and step.decode


def test_a_packed_job_that_starts_no_turn_is_not_held():
    """A later chunk of a long prefill (queued without an arrival) runs at once while turns arrive."""
    s = Scheduler(decoder=Decoding(active=False), gather_s=5.0)
    s.arrive()
    future = s.submit(Packed(lambda: None, _sizes))
    queued = time.monotonic()
    assert [f for _, f in s.next_step().pack] == [future]
    assert time.monotonic() - queued < 1.0


def test_the_stop_refuses_a_held_pack():
    s = Scheduler(decoder=Decoding(active=False), gather_s=5.0)
    s.arrive()
    held = s.submit(Packed(lambda: None, _sizes), arrival=s.arrive())
    s.stop()
    assert s.next_step().stop
    s.refuse_left()
    with pytest.raises(CancelledError, match="engine stopped"):
        held.result(timeout=1)


def test_attach_takes_the_gathering_time_where_the_planner_packs():
    class Planner:  # a prefill planner's face as the engine thread sees it
        def __init__(self, pack_prefill: bool) -> None:
            self.gather_s, self.pack_prefill, self.idle, self.later, self.first_s = 0.03, pack_prefill, None, None, 1.0
            self.one_at_a_time = not pack_prefill  # where packing would not pay (PrefillPlanner)

    for packs, want in ((True, 0.03), (False, 0.0)):
        thread, decoder = EngineThread(), Decoding(active=False)
        try:
            thread.attach(decoder, Planner(packs))
            assert thread.scheduler.gather_s == want
            assert (thread.scheduler.turns is None) == packs  # turns that do not pack go one at a time
        finally:
            thread.stop()
        assert isinstance(decoder.aborted, CancelledError)


def test_other_jobs_run_while_a_pack_gathers():
    """The engine does not idle for a held pack: a job queued meanwhile (a turn's wake, a copy) runs."""
    s = Scheduler(decoder=Decoding(active=False), gather_s=5.0)
    arriving = s.arrive()
    held = s.submit(Packed(lambda: None, _sizes), arrival=s.arrive())
    plain = s.submit(lambda: "wake")
    step = s.next_step()
    assert step.job[1] is plain and step.pack is None
    arriving.land()
    assert [f for _, f in s.next_step().pack] == [held]


def test_a_turn_set_aside_is_not_waited_for_and_arrives_again_after():
    s = Scheduler(decoder=Decoding(active=False), gather_s=5.0)
    waiter = s.arrive()  # waits for the other turn's prefill: it cannot queue before that ran
    with waiter.aside():
        assert s.arriving() == 0
        leader = s.submit(Packed(lambda: None, _sizes), arrival=s.arrive())
        queued = time.monotonic()
        assert [f for _, f in s.next_step().pack] == [leader]
        assert time.monotonic() - queued < 1.0
    assert s.arriving() == 1  # on its way again: its own first job is next
    waiter.land()
    with waiter.aside():  # landed: stays landed
        pass
    assert s.arriving() == 0


def _woken(s: Scheduler, wake_s: float) -> Any:
    """A turn whose session woke, its wake taking `wake_s` (the clock moved back instead of waiting)."""
    arrival = s.arrive()
    with arrival.wake():
        pass
    arrival.woken_s = wake_s
    return arrival


def _pack_after(s: Scheduler) -> tuple[list, float]:
    """The next step's pack (steps without one taken meanwhile) and the seconds until it came."""
    queued = time.monotonic()
    step = s.next_step()
    while step.pack is None:
        step = s.next_step()
    return step.pack, time.monotonic() - queued


def test_a_woken_turn_waits_past_the_gathering_time_for_turns_waking_with_it():
    """A restart's round: the first session woken does not start its turn alone while the others still wake."""
    s = Scheduler(decoder=Decoding(active=False), gather_s=0.05)
    other = s.arrive()
    waking = other.wake()
    waking.__enter__()  # its session is waking
    held = s.submit(Packed(lambda: None, _sizes), arrival=_woken(s, 5.0))

    def woke_then_queued() -> None:
        waking.__exit__(None, None, None)
        s.submit(Packed(lambda: None, _sizes), arrival=other)

    threading.Timer(0.3, woke_then_queued).start()
    pack, waited = _pack_after(s)
    assert len(pack) == 2 and pack[0][1] is held  # one pack: the two turns' first jobs
    assert 0.25 <= waited < 2.0  # past the 50 ms gathering time, until the other woke and queued


def test_a_woken_turn_waits_for_others_waking_at_most_its_own_wake_time():
    s = Scheduler(decoder=Decoding(active=False), gather_s=0.05)
    other = s.arrive()
    with other.wake():
        held = s.submit(Packed(lambda: None, _sizes), arrival=_woken(s, 0.2))
        pack, waited = _pack_after(s)
    assert [f for _, f in pack] == [held]
    assert 0.18 <= waited < 1.0  # its own wake's 0.2 s, not the other's whole wake


def test_a_turn_that_did_not_wake_waits_only_the_gathering_time_for_a_waking_one():
    s = Scheduler(decoder=Decoding(active=False), gather_s=0.05)
    other = s.arrive()
    with other.wake():
        held = s.submit(Packed(lambda: None, _sizes), arrival=s.arrive())
        pack, waited = _pack_after(s)
    assert [f for _, f in pack] == [held]
    assert waited < 0.15


def test_a_woken_turn_waits_only_the_gathering_time_for_turns_not_waking():
    """Turns merely rendering (hot sessions) are no reason for a woken turn to wait past the gathering time."""
    s = Scheduler(decoder=Decoding(active=False), gather_s=0.05)
    s.arrive()
    held = s.submit(Packed(lambda: None, _sizes), arrival=_woken(s, 5.0))
    pack, waited = _pack_after(s)
    assert [f for _, f in pack] == [held]
    assert waited < 0.15


class Stepping(Decoding):
    """A decoder whose calls decode for `steps` steps of `step_s` seconds each, noted in `order`; its first step
    also waits for `gate` (the test queues its jobs meanwhile)."""

    def __init__(self, order: list, steps: int, step_s: float) -> None:
        super().__init__(active=True)
        self.order, self.left, self.step_s, self.gate = order, steps, step_s, threading.Event()

    def step(self) -> None:
        time.sleep(self.step_s)
        self.gate.wait()
        self.order.append("step")
        self.left -= 1
        self.active = self.left > 0


def test_the_next_plain_jobs_come_in_the_same_step_and_anything_else_waits_for_the_next():
    s = Scheduler(decoder=Decoding(active=True))
    first, second = s.submit(lambda: "a"), s.submit(lambda: "b")
    pack = lambda jobs: [None] * len(jobs)  # noqa: E731
    packed = s.submit(Packed(lambda: None, pack, (0,)))
    third = s.submit(lambda: "c")
    step = s.next_step()
    assert step.job[1] is first and s.another()[1] is second
    assert s.another() is None  # the pack is next: kept for the next step, not run in this one
    assert s.waiting() == (2, 1)
    step = s.next_step()
    assert [f for _, f in step.pack] == [packed] and s.another()[1] is third and s.another() is None


def test_short_jobs_queued_beside_decoding_calls_run_in_one_step_a_long_one_ends_it():
    """Was: one job a step while calls decoded, so a restart's wakes (a few ms a job) each waited a decode
    step per job behind a decoding session (docs/decisions.md, "A fleet of agents (issue 50)")."""
    thread, order = EngineThread(), []
    decoder = Stepping(order, steps=6, step_s=0.03)
    try:
        thread.attach(decoder)  # type: ignore[arg-type]
        # The thread is in its first decode step (waiting for the gate): these queue behind it.
        futures = [thread.submit(lambda i=i: order.append(f"short {i}")) for i in range(4)]
        futures.append(thread.submit(lambda: (order.append("long"), time.sleep(0.06))))
        futures.append(thread.submit(lambda: order.append("after")))
        decoder.gate.set()
        for f in futures:
            f.result(timeout=10)
        assert order[:6] == ["step", *(f"short {i}" for i in range(4)), "long"], order
        assert order[6] == "step" and order.index("after") > 6, order
    finally:
        thread.stop()


def turns_scheduler(decoding: bool = False, first_s: float = 0.0) -> Scheduler:
    """A scheduler whose turns go one at a time (where they do not pack: scheduler/turns.py)."""
    s = Scheduler(decoder=Decoding(active=decoding))
    s.turns = TurnOrder(first_s)
    return s


def test_where_turns_do_not_pack_a_turns_next_job_runs_before_the_next_turns_first():
    """Was: jobs ran as they were queued, so four turns' first chunks ran back to back, then their second ones:
    every turn's first token waited for all four prefills."""
    s = turns_scheduler()
    a, b = s.arrive(), s.arrive()
    a1 = s.submit(lambda: "a1", arrival=a)
    b1 = s.submit(lambda: "b1", arrival=b)
    plain = s.submit(lambda: "plain")
    assert s.next_step().job[1] is a1
    assert s.next_step().job[1] is plain  # a's worker is between two jobs: a plain job runs meanwhile, not b's
    a2: list = []
    timer = threading.Timer(0.05, lambda: a2.append(s.submit(lambda: "a2", arrival=a)))
    timer.start()
    started = time.monotonic()
    step = s.next_step()  # waits for a's next job rather than take b's
    waited = time.monotonic() - started
    timer.join()  # the job can be taken before the timer's thread has kept its future
    assert a2 and step.job[1] is a2[0] and waited < turns.QUIET_S
    a.land()  # its call joined the decoder: over
    late = s.submit(lambda: "late", arrival=a)  # a job of a turn that is over (its blocks' capture): a plain one
    assert s.next_step().job[1] is b1
    assert s.next_step().job[1] is late
    assert s.turns.status()["let_go"] == 0


def test_a_turn_that_queues_nothing_for_the_quiet_time_loses_its_place(monkeypatch):
    monkeypatch.setattr(turns, "QUIET_S", 0.05)
    s = turns_scheduler()
    a, b = s.arrive(), s.arrive()
    s.submit(lambda: "a1", arrival=a)
    b1 = s.submit(lambda: "b1", arrival=b)
    s.next_step()
    started = time.monotonic()
    assert s.next_step().job[1] is b1 and time.monotonic() - started >= 0.04
    assert s.turns.status()["let_go"] == 1
    a2 = s.submit(lambda: "a2", arrival=a)  # it queues again, after the turn that took its place
    b.land()
    assert s.next_step().job[1] is a2


def test_a_call_that_joined_gets_its_first_token_before_the_next_turns_job():
    """A batch's new row gets its first token at the step after the one that admits it: both come before the
    next turn's prefill, not after it."""
    s = turns_scheduler(decoding=True, first_s=10.0)
    a, b = s.arrive(), s.arrive()
    s.submit(lambda: "a1", arrival=a)
    b1 = s.submit(lambda: "b1", arrival=b)
    s.next_step()
    joined = s.submit(lambda: "join", quick=True)
    step = s.next_step()
    assert [job[1] for job in step.quick] == [joined] and step.job is None  # the join alone
    a.land()
    s.decoder.starting = True  # admitted, no first token yet
    for _ in range(2):
        step = s.next_step()
        assert step.decode and step.job is None
    s.decoder.starting = False
    step = s.next_step()
    assert step.job[1] is b1 and not step.decode  # decoding calls wait for the turn's prefill (first_s)


def test_decoding_calls_wait_for_the_turns_prefill_one_step_at_least_every_first_s():
    s = turns_scheduler(decoding=True, first_s=0.3)
    a = s.arrive()
    s.submit(lambda: "a1", arrival=a)
    assert s.next_step().decode  # none for first_s before it
    s.submit(lambda: "a2", arrival=a)
    assert not s.next_step().decode
    started = time.monotonic()
    step = s.next_step()  # the turn between two jobs: waited for its hop, not for first_s (busy elsewhere)
    assert step.decode and step.job is None and turns.HOP_S * 0.9 <= time.monotonic() - started < 0.25
    s.submit(lambda: "a3", arrival=a)
    assert not s.next_step().decode
    time.sleep(0.3)
    s.submit(lambda: "a4", arrival=a)
    assert s.next_step().decode  # first_s since the last step: one now
    s.turns.first_s = 0.0  # Tuning.prefill_first_ms = 0: a step between every two jobs
    s.submit(lambda: "a5", arrival=a)
    assert s.next_step().decode


def test_a_quiet_turn_keeps_its_place_while_no_other_turn_waits(monkeypatch):
    monkeypatch.setattr(turns, "QUIET_S", 0.01)
    order, a = TurnOrder(), Scheduler().arrive()
    assert order.put(a, "a1") and order.take() == "a1"
    assert order.take() is None
    time.sleep(0.02)
    assert order.take() is None and order.current is a and order.status()["let_go"] == 0
