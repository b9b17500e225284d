"""A model's load on demand reads the blocks of the sessions waiting for it beside the weights
(sessions/read_ahead.py, with the hot set's reader: kv/hot_set.py): the turn after an unload wakes its session
from memory, exactly as its never-slept twin continues; what is not used (a load that failed, a session deleted
meanwhile) is let go; the budget bounds it. Two tiny models: a real daemon, and a session manager alone."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
import time
import warnings

import pytest

from kvwake.daemon.config import Tuning
from kvwake.daemon.kv.hot_set import HotSet
from kvwake.daemon.kv.ram_tier import RamTier
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.sessions.models import ModelLoadError
from kvwake.errors import NotFoundError
from testkit.daemon import Daemon
from testkit.kvdata import write_snapshot
from testkit.models import manager_on, stop_manager, two_tiny_models

SYSTEM = "You are a careful agent. Answer briefly. " * 3
QUESTION = "which files changed, in which order, and why did each change? " * 8  # several blocks of 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # The manager-level tests stop models as the daemon does, with a full collection (model/loader.py): it
    # would collect what earlier modules left in reference cycles and report their ResourceWarnings here, as
    # errors (a load test's unclosed clients' sockets, once: testkit/load.py closes them now); collected before
    # this module instead
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    return two_tiny_models(tmp_path_factory.mktemp("models"))


def chat(c, sid: str, text: str) -> list[int]:
    return c.call("session.chat", session_id=sid, messages=[{"role": "user", "content": text}], max_tokens=8)["tokens"]


@pytest.mark.parametrize("model, mode, prefetch", [("small", "direct", True), ("main", "staged", True),
                                                   ("main", "direct+paged", True), ("small", "direct", False)])
def test_the_turn_after_an_unload_wakes_its_blocks_from_memory_read_beside_the_load(tmp_path, models, model, mode,
                                                                                    prefetch):
    main, small = models
    (tmp_path / "none.toml").write_text(f'[models]\nmain = {{path = "{main}"}}\nsmall = {{path = "{small}"}}\n')
    env = {"KVWAKE_LOAD_PREFETCH": str(prefetch).lower(), "KVWAKE_RESTORE_MODE": mode.split("+")[0],
           "KVWAKE_PAGED_KV": str(mode.endswith("paged"))}
    d = Daemon(tmp_path, main, env=env).start()
    with d.client() as c:
        for sid in ("s", "twin"):
            c.call("session.create", session_id=sid, system=SYSTEM, model=model)
            chat(c, sid, QUESTION)
        expected = chat(c, "twin", "and then?")  # never slept
        assert c.call("model.unload", name=model)["slept"] == 2
        assert chat(c, "s", "and then?") == expected  # loads the model again, wakes s: exact
        turn = c.call("status")["turns"][-1]
        read = next(m for m in c.call("model.list")["models"] if m["name"] == model).get("read_ahead")
        assert turn["session"] == "s" and turn["wake_tokens"] > 4 * 16
        if not prefetch:  # each wake reads its own blocks
            assert turn["wake_blocks_from_memory"] == 0 and turn["wake_blocks_from_disk"] > 4 and read is None
        else:  # read beside the load, each once, the wake taking them from memory, then letting them go (a
            # block the reader, below the daemon's priority, had not begun when the wake came is the wake's to
            # read: the manager-level tests hold the load back until the reader is done and see none of those)
            assert turn["wake_blocks_from_memory"] > 0, turn
            assert read["sessions"] == 1 and read["blocks_failed"] == 0
            assert read["blocks_read"] == turn["wake_blocks_from_memory"], read
            assert read["held_bytes"] == 0 and read["wakes_left"] == 0
    assert d.stop() == 0 and d.log_problems() == []


# -- a session manager alone --------------------------------------------------------------------------


async def turn(manager, sid: str, text: str) -> list[int]:
    reply = await manager.generate(sid, GenerateParams(max_tokens=8), None, lambda: False,
                                   inputs={"messages": [{"role": "user", "content": text}]})
    return reply["tokens"]


async def asleep_on_small(manager, twin: bool = False) -> list[int] | None:
    """Session "s" (and its twin) of small with a few blocks, small unloaded: "s" asleep. The twin's next turn
    (never slept), or None."""
    async with manager.use("small"):
        for sid in ("s", "twin") if twin else ("s",):
            await manager.create(sid, SYSTEM)
    for sid in ("s", "twin") if twin else ("s",):
        await turn(manager, sid, QUESTION)
    expected = await turn(manager, "twin", "and then?") if twin else None
    await manager.unload("small")
    return expected


def readers_of(manager) -> list[HotSet]:
    """Every reader the manager's loads start, kept (a failed load's is taken away)."""
    started, begin = [], manager.read_ahead.begin

    def kept(model: str, settings) -> HotSet | None:
        reader = begin(model, settings)
        if reader is not None:
            started.append(reader)
        return reader

    manager.read_ahead.begin = kept
    return started


def done_reading(manager, readers: list[HotSet], start):
    """`start` once the latest load's reader is done (its blocks held): a tiny model's load is shorter than the
    reading, which runs below the daemon's priority, so a wake could otherwise come before a block is read."""
    def waits(spec, **kwargs):
        deadline = time.monotonic() + 30
        while not (readers and readers[-1].state in ("held", "stopped", "dropped")) and time.monotonic() < deadline:
            time.sleep(0.01)
        return start(spec, **kwargs)
    return waits


def held(reader: HotSet) -> tuple[int, int]:
    """(snapshots still claiming blocks, bytes held for them) in the reader's RAM tier."""
    return reader.tier.claims_left(), reader.tier.prefetched_bytes


async def test_a_load_that_fails_lets_go_what_it_read_and_the_next_load_reads_again(tmp_path, models):
    manager, store = manager_on(tmp_path, models)
    try:
        await asleep_on_small(manager)
        readers, start = readers_of(manager), manager._start

        def fails(spec, **kwargs):  # once the blocks are read: they are held for "s" when it fails
            deadline = time.monotonic() + 30
            while readers[-1].state != "held" and time.monotonic() < deadline:
                time.sleep(0.01)
            raise RuntimeError("the weights do not load")

        manager._start = fails
        with pytest.raises(ModelLoadError, match="do not load"):
            await turn(manager, "s", "and then?")
        (failed,) = readers
        assert failed.counts["blocks_read"] > 4 and not any(t.is_alive() for t in failed._threads)
        assert held(failed) == (0, 0) and manager.read_ahead.status("small") is None
        manager._start = done_reading(manager, readers, start)
        await turn(manager, "s", "and then?")
        assert manager.turns[-1]["wake_blocks_from_disk"] == 0
        assert manager.turns[-1]["wake_blocks_from_memory"] == failed.counts["blocks_read"]
        assert held(readers[-1]) == (0, 0)
    finally:
        stop_manager(manager, store)


async def test_a_session_deleted_while_its_model_loads_lets_its_blocks_go(tmp_path, models):
    manager, store = manager_on(tmp_path, models)
    try:
        await asleep_on_small(manager)
        readers, start, go = readers_of(manager), manager._start, threading.Event()

        def held_back(spec, **kwargs):
            go.wait(30)
            return start(spec, **kwargs)

        manager._start = held_back
        waiting = asyncio.create_task(turn(manager, "s", "and then?"))
        deadline = time.monotonic() + 30
        while not (readers and readers[0].state == "held") and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert held(readers[0])[0] == 1 and held(readers[0])[1] > 0  # read for "s", held while it waits
        await manager.delete("s")
        go.set()
        with pytest.raises(NotFoundError):
            await waiting
        assert held(readers[0]) == (0, 0)  # its operation ended: nothing is held for it
        assert manager.models.get("small").engine.ram_tier is readers[0].tier  # the load's engine took the tier
    finally:
        stop_manager(manager, store)


async def test_a_turn_refused_busy_meanwhile_leaves_the_blocks_to_the_turn_that_wakes_the_session(tmp_path, models):
    """Two turns on the asleep session wait for its model's load; one is refused BUSY once it is loaded. Its end
    let the session's read-ahead go before the other's wake took it, which then read every block from disk
    (with no RAM tier to keep them in)."""
    manager, store = manager_on(tmp_path, models)
    try:
        expected = await asleep_on_small(manager, twin=True)
        manager.settings = dataclasses.replace(manager.settings, ram_tier_bytes=0)  # a block let go is gone
        readers, start, go = readers_of(manager), manager._start, threading.Event()

        def held_back(spec, **kwargs):  # until both turns wait and the blocks are read
            go.wait(30)
            return start(spec, **kwargs)

        manager._start = held_back
        turns = [asyncio.create_task(turn(manager, "s", "and then?")) for _ in range(2)]
        deadline = time.monotonic() + 30
        while not (readers and readers[0].state == "held") and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        go.set()
        results = await asyncio.gather(*turns, return_exceptions=True)
        assert sorted(type(r).__name__ for r in results) == ["BusyError", "list"], results
        assert next(r for r in results if isinstance(r, list)) == expected
        woke = manager.turns[-1]
        assert woke["wake_blocks_from_disk"] == 0
        assert woke["wake_blocks_from_memory"] == readers[0].counts["blocks_read"]
    finally:
        stop_manager(manager, store)


async def test_the_budget_bounds_what_a_load_reads_and_the_wake_reads_the_rest_exactly(tmp_path, models):
    manager, store = manager_on(tmp_path, models)
    try:
        expected = await asleep_on_small(manager, twin=True)
        blocks = store.snapshot(store.session("s")["head"]).blocks
        budget = blocks[0].raw_bytes + blocks[1].raw_bytes  # two blocks of the session's
        manager.settings = dataclasses.replace(manager.settings, tuning=Tuning(restart_prefetch_bytes=budget))
        readers = readers_of(manager)
        manager._start = done_reading(manager, readers, manager._start)
        assert await turn(manager, "s", "and then?") == expected  # as the never-slept twin
        assert readers[0].counts["blocks_read"] == 2 and readers[0].counts["bytes_read"] <= budget
        woke = manager.turns[-1]
        assert (woke["wake_blocks_from_memory"], woke["wake_blocks_from_disk"]) == (2, len(blocks) - 2)
        assert held(readers[0]) == (0, 0)
    finally:
        stop_manager(manager, store)


# -- the reader alone, on a store with no model ---------------------------------------------------------


def test_a_loads_reader_reads_its_sessions_those_added_while_it_reads_and_none_let_go(store, monkeypatch):
    b = store.block_tokens
    heads = {sid: write_snapshot(store, sid, [5000 * i + t for t in range(3 * b + 1)]).id
             for i, sid in enumerate(("a", "b", "c", "d"))}
    gate, read_block = threading.Event(), store.read_block

    def gated(*args, **kwargs):  # a's blocks read only once "b" was added
        gate.wait(10)
        return read_block(*args, **kwargs)

    monkeypatch.setattr(store, "read_block", gated)
    tier = RamTier(0)  # no LRU room: what is held is what was read ahead
    reader = HotSet(store, tier, staged=False, budget_bytes=1 << 30, workers=1, sessions=["a", "c"])
    reader.let_go("c")  # its operation ended before the plan: not read
    reader.start()
    assert reader.add("b")  # while it reads: read too
    gate.set()
    deadline = time.monotonic() + 10
    while reader.state != "held" and time.monotonic() < deadline:
        time.sleep(0.01)
    keys = {sid: [ref.key for ref in store.snapshot(h).blocks] for sid, h in heads.items()}
    assert sorted(reader.read_keys) == sorted(keys["a"] + keys["b"]) and reader.counts["sessions"] == 2
    assert not reader.add("d")  # the reading ended: its wake reads its own
    assert tier.claims_left() == 2 and all(tier.get(k) is not None for k in keys["a"] + keys["b"])
    reader.let_go("a")  # its operation ended (woken, or not): its blocks go, b's stay held
    assert tier.claims_left() == 1 and all(tier.get(k) is None for k in keys["a"])
    assert all(tier.get(k) is not None for k in keys["b"])
    reader.stop()
    assert tier.prefetched_bytes == 0


async def test_a_models_warm_up_after_a_load_on_demand_waits_for_the_turn_that_loaded_it(tmp_path, models,
                                                                                       monkeypatch):
    """A job of the warm-up is not cut: one that began as the load ended held the reloaded model's first wake
    (docs/benchmarks.md, "Several models"). The warm-up now waits while
    operations on the model run or wait for it (model/loader.py `warm_model`'s `until_idle`)."""
    from kvwake.daemon.sessions import models as keeping

    asked, began = [], []

    async def warm(model, until_idle=None):
        asked.append(until_idle is not None and bool(until_idle()))
        while until_idle is not None and until_idle():
            await asyncio.sleep(0.005)
        began.append(time.monotonic())

    manager, store = manager_on(tmp_path, models)
    try:
        await asleep_on_small(manager)
        monkeypatch.setattr(keeping, "warm_model", warm)
        await turn(manager, "s", "and then?")
        ended = time.monotonic()
        for _ in range(200):
            if began:
                break
            await asyncio.sleep(0.01)
        assert asked == [True], "the turn that waited for the load was in use as the warm-up began"
        assert began and began[0] >= ended - 0.05, "the warm-up went on before the turn was done"
    finally:
        stop_manager(manager, store)
