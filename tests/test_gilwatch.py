"""The GIL watch (status.gil): a wait for the GIL is kept with the stack of the thread that held it."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from kvwake.daemon.gilwatch import GilWatch
from testkit.daemon import Daemon
from testkit.tinymodel import make_model_dir


def hold_the_gil(seconds: float) -> None:
    """Python that keeps the GIL: the switch interval is longer than the loop (set by the caller)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_thread_holding_the_gil_is_named_with_its_line_in_the_wait():
    watch = GilWatch(over_ms=20).start()
    interval = sys.getswitchinterval()
    try:
        time.sleep(0.05)  # the watch ticks
        sys.setswitchinterval(1.0)  # no forced hand-over: the holder keeps the GIL until it waits
        def holds_then_sleeps() -> None:
            hold_the_gil(0.15)
            time.sleep(0.05)  # lets the GIL go here

        holder = threading.Thread(target=holds_then_sleeps, name="holder")
        holder.start()
        holder.join()
    finally:
        sys.setswitchinterval(interval)
        time.sleep(0.02)
        watch.stop()
    summary = watch.summary()
    assert summary["ticks"] > 10 and summary["late"]["count"] == min(summary["ticks"], 4096)
    waits = [w for w in summary["waits"] if "holder" in w["threads"]]
    assert waits, summary["waits"]
    wait = max(waits, key=lambda w: w["late_ms"])
    assert wait["late_ms"] >= 100, wait  # ~150 ms held; the watch waited nearly all of it
    assert "holds_then_sleeps" in wait["threads"]["holder"][0], wait["threads"]["holder"]  # where it let go


def test_the_daemon_reports_gil_waits_only_when_asked(tmp_path):
    model = make_model_dir(tmp_path / "tiny")
    for env, watched in (({}, False), ({"KVWAKE_GIL_WATCH_MS": "50"}, True)):
        root = tmp_path / ("on" if watched else "off")
        root.mkdir()
        d = Daemon(root, model, env=env).start()
        try:
            with d.client() as c:
                time.sleep(0.1)
                gil = c.call("status")["gil"]
        finally:
            assert d.stop() == 0
        if watched:
            assert gil["over_ms"] == 50 and gil["ticks"] > 0 and gil["late"]["count"] > 0, gil
        else:
            assert gil is None


def test_a_watch_asked_for_with_a_bad_value_is_refused_naming_it(monkeypatch, tmp_path):
    from kvwake.daemon import gilwatch
    from kvwake.daemon.config import load_settings

    def tuning():
        return load_settings({}, tmp_path / "absent.toml").tuning

    for over, kept in (("lots", "64"), ("0", "64"), ("5", "none"), ("5", "0")):
        monkeypatch.setenv("KVWAKE_GIL_WATCH_MS", over)
        monkeypatch.setenv("KVWAKE_GIL_WATCH_KEPT", kept)
        with pytest.raises(ValueError, match="KVWAKE_GIL_WATCH_(MS|KEPT): bad tuning"):
            tuning()
    monkeypatch.setenv("KVWAKE_GIL_WATCH_MS", "2.5")
    monkeypatch.delenv("KVWAKE_GIL_WATCH_KEPT")
    watch = gilwatch.from_tuning(tuning())
    assert watch is not None and watch.over_ms == 2.5 and watch.over.maxlen == 64
    monkeypatch.delenv("KVWAKE_GIL_WATCH_MS")
    assert gilwatch.from_tuning(tuning()) is None


def test_threads_of_one_name_are_told_apart_by_their_ids(tmp_path):
    # anyio's workers (where prompts are rendered) all bear one name: each keeps its own stack
    from kvwake.daemon.gilwatch import stacks

    started, release = threading.Barrier(4), threading.Event()

    def parked() -> None:
        started.wait()
        release.wait(10)

    workers = [threading.Thread(target=parked, name="AnyIO worker thread") for _ in range(3)]
    for w in workers:
        w.start()
    started.wait()
    try:
        with open(tmp_path / "dump", "w+b") as dump:
            deadline = time.monotonic() + 5
            while True:  # a worker leaving the barrier is still in its frames (deeper than the four kept)
                seen = stacks(dump)
                parked_now = [k for k, frames in seen.items() if any("parked" in f for f in frames)]
                if len(parked_now) == 3 or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
    finally:
        release.set()
        for w in workers:
            w.join()
    named = {k: v for k, v in seen.items() if k.startswith("AnyIO worker thread ")}
    assert len(named) == 3 and all(any("parked" in f for f in frames) for frames in named.values()), seen
    assert threading.current_thread().name not in seen  # the thread that asked is not in its own dump


def test_a_wait_whose_stacks_cannot_be_dumped_is_kept_and_the_watch_goes_on(monkeypatch):
    # Was: the exception ended the watch's thread, and status showed its last counts for ever.
    from kvwake.daemon import gilwatch

    def full(dump):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gilwatch, "stacks", full)
    watch = GilWatch(over_ms=0.0).start()  # every wake is a wait
    try:
        time.sleep(0.05)
        ticks = watch.ticks
        time.sleep(0.05)
    finally:
        watch.stop()
    assert watch.ticks > ticks > 0
    assert watch.over and all(w["threads"] == {"(stacks unavailable)": ["OSError: [Errno 28] No space left on device"]}
                              for w in watch.over)
