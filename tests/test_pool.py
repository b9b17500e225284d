"""The pool's workers at a lower CPU priority when the tuning knob pool_nice asks (KVWAKE_POOL_NICE; a knob for
measuring, off by default)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from kvwake.daemon.config import load_settings
from kvwake.daemon.kv.pool import Pool, lower_priority
from testkit.daemon import Daemon
from testkit.tinymodel import make_model_dir

linux = pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")


def own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux
def test_workers_run_nice_levels_below_their_maker_only_when_asked():
    mine = own_nice()
    for nice, expected in ((0, mine), (5, min(19, mine + 5))):
        pool = Pool(workers=2, nice=nice)
        try:
            batch = pool.batch()
            futures = [batch.submit(1, own_nice) for _ in range(4)]
            batch.join()
            assert {f.result() for f in futures} == {expected}, nice
        finally:
            pool.close()
    assert own_nice() == mine  # the caller's own priority is left alone


def test_elsewhere_than_linux_a_worker_asks_the_os_nothing(monkeypatch, caplog):
    # there a thread's id is no process id: setpriority would refuse it (a warning each start: the hot set's
    # readers lower theirs by default) or renice whatever process has that number
    asked = []
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(os, "getpriority", lambda *a: asked.append(("get", *a)) or 0)
    monkeypatch.setattr(os, "setpriority", lambda *a: asked.append(("set", *a)))
    lower_priority(10)
    assert asked == [] and not [r for r in caplog.records if r.name == "kvwake.pool"]


def test_the_knob_reads_whole_levels_and_refuses_the_rest_naming_it(monkeypatch, tmp_path):
    def niceness() -> int:
        return load_settings({}, tmp_path / "absent.toml").tuning.pool_nice

    for raw, levels in (("", 0), ("0", 0), ("7", 7), ("19", 19)):
        monkeypatch.setenv("KVWAKE_POOL_NICE", raw)
        assert niceness() == levels, raw
    for raw in ("40", "-3", "low"):  # a daemon asked for these no longer starts at its own priority unsaid
        monkeypatch.setenv("KVWAKE_POOL_NICE", raw)
        with pytest.raises(ValueError, match=f"KVWAKE_POOL_NICE: bad tuning pool_nice='{raw}'"):
            niceness()
    monkeypatch.delenv("KVWAKE_POOL_NICE")
    assert niceness() == 0


def threads_nice(pid: int) -> list[int]:
    """Every thread of the process and its nice value, from /proc (Python 3.11 does not give the OS its
    threads' names, so the pool's are told apart by their nice value alone)."""
    return [int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])  # stat's 19th field: nice
            for task in Path(f"/proc/{pid}/task").iterdir()]


@linux
def test_a_daemon_asked_runs_its_pool_workers_nicer_and_one_not_asked_does_not(tmp_path):
    model = make_model_dir(tmp_path / "tiny")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    for env, nice in (({}, 0), ({"KVWAKE_POOL_NICE": "6"}, 6)):
        root = tmp_path / f"nice{nice}"
        root.mkdir()
        d = Daemon(root, model, env=env).start()
        try:
            with d.client() as c:  # a sleep and a wake put the pool's workers to work
                c.call("session.create", session_id="s")
                c.call("session.append", session_id="s", text="the pool's workers encode this " * 20)
                c.call("session.sleep", session_id="s")
                c.call("session.wake", session_id="s")
            seen = threads_nice(d.proc.pid)
        finally:
            assert d.stop() == 0
        nicer = [n for n in seen if n != base]
        if nice:  # the pool's workers, started by the sleep, and no other thread
            assert set(nicer) == {min(19, base + nice)} and 1 <= len(nicer) <= os.cpu_count(), seen
        else:
            assert nicer == [], seen


def test_a_yielding_batch_submits_only_once_the_other_batches_tasks_are_done():
    # A wake waiting for its leader's shared blocks reads its own after the leader's reads, not among them.
    pool = Pool(workers=4)
    try:
        release, order = threading.Event(), []
        first = pool.batch()
        first.submit(0, lambda: (release.wait(10), order.append("first")))
        waiting = pool.batch(yields=True)
        submitted = threading.Event()
        waiter = threading.Thread(target=lambda: (waiting.submit(0, lambda: order.append("yielded")),
                                                  submitted.set()))
        waiter.start()
        assert not submitted.wait(0.2), "the yielding batch submitted while another batch's task ran"
        release.set()
        waiter.join(5)
        first.join()
        waiting.join()
        assert order == ["first", "yielded"]
    finally:
        pool.close()


def test_a_yielding_batch_waits_its_yield_time_at_most_in_all(monkeypatch):
    import time

    from kvwake.daemon.kv import pool as pool_module

    monkeypatch.setattr(pool_module, "YIELD_S", 0.2)
    pool = Pool(workers=2)
    try:
        release = threading.Event()
        busy = pool.batch()
        busy.submit(0, lambda: release.wait(10))  # a neighbour's writes that outlast the yield
        waiting = pool.batch(yields=True)
        started = time.monotonic()
        for _ in range(3):
            waiting.submit(0, lambda: None)
        waiting.join()
        took = time.monotonic() - started
        assert 0.15 < took < 2.0, f"three tasks of a yielding batch took {took:.2f} s against a yield of 0.2 s"
        release.set()
        busy.join()
    finally:
        pool.close()
