"""Restore points cut from the prefill chunks that passed them (kv/points.py `cut_at`, `_take_later`, `hurry`): the
points a long prompt's chunks take are the prefill's, a sleep or a model's stop waits for no idle time it cannot
get, a hurried copy lets its cut go, and an engine closes while a point still waits."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import pytest

from kvwake.daemon.config import Tuning
from kvwake.daemon.kv import points
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.session_state import Session
from kvwake.store import Store
from tests.test_engine_archs import folders, open_engine  # noqa: F401
from tests.test_restore_points import SYSTEM, B

LONG = [{"role": "system", "content": SYSTEM}] + [
    {"role": r, "content": f"message {i}: " + "tool output, lines of it. " * 3}
    for i, r in zip(range(9), ["user", "assistant"] * 5)]


def test_cut_points_of_a_prompt_longer_than_a_chunk_are_those_a_stopping_engine_takes(folders, tmp_path):
    """A prompt of several chunks: a stopping engine takes the points `stops` names for the whole prefill (its
    last boundary, its last two marks, every POINT_EVERY blocks). With cuts, `take` asked `stops` with the
    chunk's end as `upto`: each chunk's last boundary and the last two marks before the chunk's end too."""
    made, taken = [], []
    try:
        for name, cut in (("stopped", False), ("cut", True)):
            store = Store(tmp_path / name, block_tokens=B)
            e = Engine(store, tmp_path / f"{name}-state", folders("gemma3_text"), prefill_step=64,
                       tuning=Tuning(cut_points=cut))
            made.append((store, e))
            s = Session("s")
            e.append(s, messages=LONG)
            e.points.flush()
            taken.append(e.points.counters["points_written"])
        want = points.stops(s.tokens, 0, len(s.tokens) - 1, B, made[0][1].points.marks)
        assert len(s.tokens) > 3 * 64 and taken[0] == len(want)
        assert taken[1] == taken[0], (taken, want, len(s.tokens))
    finally:
        for store, e in made:
            e.close()
            store.close()


def run(fn):  # an `mlx` that is not `direct`: the daemon's path (cut points deferred)
    return fn()


def _deferring(engine):
    """The engine's taker with idle jobs held back (as while a turn is on its way): they go to `sink`."""
    sink: list = []
    engine.points.idle_of = lambda: sink.append
    return sink


def _append(engine, sid: str, text: str) -> Session:
    s = Session(sid)
    engine.append(s, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}], mlx=run)
    return s


def test_hurry_returns_when_a_chunk_defers_a_point_between_its_last_look_and_its_flush(open_engine):
    """hurry ran the jobs it saw, then `flush`: a point another turn deferred between its last look and the
    flush is on the driver ahead of flush's marker, and its `_later` waits for an idle job that is held back
    (a turn on its way: up to 60 s) or never comes (decoding goes on)."""
    engine = open_engine("gemma3_text")
    _deferring(engine)
    _append(engine, "a", "Name the tools you would use, and in which order.")
    assert engine.points.status()["points_waiting"] >= 1
    real, fired = engine.points.flush, []

    def flush():  # a turn's chunk lands now (only the first time)
        if not fired:
            fired.append(_append(engine, "b", "List the files you would read first, and why."))
        real()

    engine.points.flush = flush
    worker = threading.Thread(target=engine.points.hurry, args=(run,), daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "hurry waits for an idle job it did not run"


def test_an_empty_session_s_sleep_does_not_make_every_waiting_point_s_copies_and_wait_for_their_writes(open_engine):
    """Every new session's `create` sleeps it empty (manager.create; a stateless conversation's Matcher._new), on
    its first turn's path: Engine.sleep hurried every waiting point of every session and waited for their
    writes (copies and fsyncs), though an empty snapshot goes with none."""
    engine = open_engine("gemma3_text")
    _deferring(engine)
    _append(engine, "a", "Name the tools you would use, and in which order.")
    waiting = engine.points.status()["points_waiting"]
    real = engine.points._write
    engine.points._write = lambda *a: (time.sleep(1.0), real(*a))[1]  # a slow disk
    started = time.monotonic()
    engine.sleep(Session("new"), free=False, mlx=run)
    assert time.monotonic() - started < 0.5 and engine.points.status()["points_waiting"] == waiting >= 1


def test_a_hurried_point_s_cut_is_not_kept_alive_by_its_idle_job(open_engine):
    """A point's copies made by `hurry` (a sleep, a waiter): its idle job stays in the engine thread's idle queue
    until idle time (never, while rounds come back to back), and its closure held the cut, so the session's
    arrays the cut read stayed alive after the point was written."""
    import gc

    engine = open_engine("gemma3_text")
    sink = _deferring(engine)
    s = _append(engine, "a", "Name the tools you would use, and in which order. " * 4)
    engine.points.hurry(run)
    assert engine.points.status()["points_waiting"] == 0 and sink
    s.cache = s.held_point = s.point_trail = None
    gc.collect()
    mx.clear_cache()
    kept = mx.get_active_memory()
    sink.clear()
    gc.collect()
    assert mx.get_active_memory() == kept, f"{kept - mx.get_active_memory()} bytes freed only with the idle jobs"


def test_an_engine_closes_while_a_reply_point_waits_for_a_point_whose_idle_job_never_runs(folders, tmp_path):
    """The engine thread stopped (stop_model) with a cut point still waiting for its idle job (a reply point's
    prefill cut it after the stop's flush) and the reply points' thread waiting in `points.flush` for its write
    (ReplyPoints.take). Engine.close closed the reply points first, waiting for that thread; the point's
    `_later` gives up only once the points are closed, after: neither ever returned."""
    store = Store(tmp_path / "store", block_tokens=B)
    engine = Engine(store, tmp_path, folders("gemma3_text"))
    _deferring(engine)  # the engine thread stopped: no idle job runs any more
    _append(engine, "a", "Name the tools you would use, and in which order.")
    assert engine.points.status()["points_waiting"] >= 1
    engine.reply_points._thread.submit(engine.points.flush)  # ReplyPoints.take's flush
    closing = threading.Thread(target=engine.close, daemon=True)
    closing.start()
    closing.join(5)
    assert not closing.is_alive(), "Engine.close waits for ever"
    store.close()


@pytest.mark.parametrize("leading", [False, True], ids=["alone", "leading a shared prefill"])
def test_a_chunk_that_passes_several_points_holds_only_its_deepest_unless_it_leads(open_engine, monkeypatch, leading):
    """A session goes back to its latest point alone: a chunk that passes several holds one copy of the rings, its
    deepest point's; a session leading a shared prefill holds each (its waiters copy whichever lies within their
    tokens). Was: every point of the chunk copied the rings on the device, each replaced by the next."""
    engine = open_engine("gemma3_text")
    held: list[int] = []
    real = points.hold
    monkeypatch.setattr(points, "hold", lambda session, position, cache=None: (held.append(position),
                                                                               real(session, position, cache)))
    s = Session("s")
    s.point_trail = [] if leading else None
    engine.append(s, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Go."}])
    taken = points.stops(s.tokens, 0, len(s.tokens) - 1, B, engine.points.marks)
    assert len(taken) >= 2 and engine.points.cuts
    assert held == (taken if leading else taken[-1:]) and s.held_point[0] == taken[-1]
    assert [p for p, _ in s.point_trail] == taken if leading else s.point_trail is None
