"""The hot set read during start-up (kv/hot_set.py): after a restart, the sessions touched last wake from
memory, exactly, each block read once; a stop while it reads is clean; switched off, nothing is read ahead."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from kvwake.daemon.kv.hot_set import WINDOW_S, HotSet, StagedImage, read_image
from kvwake.daemon.kv.ram_tier import RamTier
from kvwake.store import Store, Tensor
from kvwake.store.format.codec import DTYPES
from testkit.daemon import Daemon, RawClient, RpcError, hot_set_read
from testkit.kvdata import OTHER_BUNDLE, write_snapshot
from testkit.models import Served
from testkit.tinymodel import make_model_dir

SYSTEM = "You are a terse agent that uses tools; answer in one line. " * 4
SESSIONS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "tiny")


def chat(c: RawClient, sid: str, text: str) -> list[int]:
    return c.call("session.chat", session_id=sid, messages=[{"role": "user", "content": text}], max_tokens=8)["tokens"]


def sessions_then_restart(d: Daemon) -> tuple[dict[str, list[int]], int]:
    """SESSIONS sessions over one system prompt, each with a never-slept twin whose follow-up is the reference;
    then a stop (every hot session slept) and a start. Returns the twins' follow-ups by session, and how many
    distinct blocks the stopped daemon's hot set holds (its sessions' heads)."""
    expected = {}
    with d.client() as c:
        for i in range(SESSIONS):
            for sid in (f"s{i}", f"twin{i}"):
                c.call("session.create", session_id=sid, system=SYSTEM)
                chat(c, sid, f"question {i}: which files changed?")
            expected[f"s{i}"] = chat(c, f"twin{i}", "and then?")
    assert d.stop() == 0
    store = Store(d.data_dir / "store", block_tokens=16)
    try:
        heads = store.recent_heads(WINDOW_S)
        assert len(heads) == 2 * SESSIONS  # every session slept at the stop
        blocks = len({ref.key for h in heads for ref in store.snapshot(h).blocks})
    finally:
        store.close()
    d.start()
    return expected, blocks


@pytest.mark.parametrize("mode", ["direct", "staged", "direct+paged", "staged+paged"])
def test_after_a_restart_the_hot_sessions_wake_from_memory_exactly_each_block_read_once(tmp_path, model_dir, mode):
    env = {"KVWAKE_RESTORE_MODE": mode.split("+")[0], "KVWAKE_PAGED_KV": str(mode.endswith("paged"))}
    d = Daemon(tmp_path, model_dir, env=env).start()
    expected, blocks = sessions_then_restart(d)
    with d.client() as c:
        read = hot_set_read(c)
        assert read is not None, "nothing was read ahead"
        assert read["state"] == "held" and read["staged"] == mode.startswith("staged"), read
        # each block of the hot set read once: as many reads as distinct blocks, none skipped or failed
        assert (read["blocks_read"], read["blocks_planned"], read["blocks_failed"]) == (blocks, blocks, 0), read
        assert read["wakes_left"] == 2 * SESSIONS  # the sessions and their twins: the warm-up waits for them
        for i in range(SESSIONS):  # and the wakes read none of them again
            woken = c.call("session.wake", session_id=f"s{i}")
            assert woken["blocks_from_disk"] == 0 and woken["blocks_from_memory"] > 0, woken
            # the joins on the device are a part of the blocks' phase (none where restores decode in place)
            phases = woken["phases_ms"]
            assert 0 <= phases["joins_eval"] <= phases["joins"] <= phases["blocks"], phases
            assert (phases["joins"] > 0) == mode.startswith("staged"), phases
        assert c.call("status")["restart_prefetch"]["wakes_left"] == SESSIONS
        for i in range(SESSIONS):
            assert chat(c, f"s{i}", "and then?") == expected[f"s{i}"]
        after = c.call("status")["restart_prefetch"]
        assert after["blocks_read"] == read["blocks_read"]  # read once: never again after the wakes
    assert d.stop() == 0
    assert d.log_problems() == []


def test_switched_off_nothing_is_read_ahead_and_wakes_read_the_store(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir, env={"KVWAKE_RESTART_PREFETCH": "false"}).start()
    expected, _ = sessions_then_restart(d)
    with d.client() as c:
        status = c.call("status")
        assert status["restart_prefetch"] is None and status["tuning"]["restart_prefetch"] is False
        woken = c.call("session.wake", session_id="s0")
        assert woken["blocks_from_memory"] == 0 and woken["blocks_from_disk"] > 0, woken
        assert chat(c, "s0", "and then?") == expected["s0"]
    assert d.stop() == 0


def test_a_stop_soon_after_a_restart_is_clean(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir).start()
    sessions_then_restart(d)
    assert d.stop() == 0  # at once: the reader may still be reading
    assert d.log_problems() == []
    d.start()
    with d.client() as c:
        assert c.call("store.fsck")["ok"]
    assert d.stop() == 0


def test_a_wake_refused_for_another_sessions_snapshot_leaves_that_sessions_blocks_held(tmp_path, model_dir):
    # staged: a block let go is dropped, not kept in the LRU (which would hide it)
    d = Daemon(tmp_path, model_dir, env={"KVWAKE_RESTORE_MODE": "staged"}).start()
    with d.client() as c:
        for sid in ("a", "b"):  # each with blocks of its own after the shared system prompt
            c.call("session.create", session_id=sid, system=SYSTEM)
            chat(c, sid, f"{sid}: " + "which files changed, and in which order, and why? " * 6)
    assert d.stop() == 0
    d.start()
    with d.client() as c:
        assert hot_set_read(c)["state"] == "held"
        b_head = c.call("session.info", session_id="b")["head"]
        with pytest.raises(RpcError) as err:  # b's snapshot named for a's wake: refused, and b not woken by it
            c.call("session.wake", session_id="a", snapshot_id=b_head)
        assert err.value.code == "INVALID_PARAMS"
        woken = c.call("session.wake", session_id="b")
        assert woken["blocks_from_disk"] == 0 and woken["blocks_from_memory"] > 0, woken
    assert d.stop() == 0


def test_a_restart_lets_go_what_it_read_for_a_snapshot_its_engine_cannot_wake(tmp_path, model_dir):
    """A session of the model's own name whose last snapshot another bundle made (as after the model's weights
    changed): read ahead as any other while the model loads, let go once its bundle is known. Was: held until
    KEEP_S, the warm-up waiting for its wake."""
    d = Daemon(tmp_path, model_dir).start()
    with d.client() as c:
        c.call("session.create", session_id="a", system=SYSTEM)
        chat(c, "a", "which files changed?")
    assert d.stop() == 0
    store = Store(d.data_dir / "store", block_tokens=16)
    try:
        store.register_bundle(OTHER_BUNDLE, {"model": "the same name, other weights"})
        write_snapshot(store, "stale", list(range(3 * 16 + 1)), bundle=OTHER_BUNDLE)
    finally:
        store.close()
    d.start()
    with d.client() as c:
        read = hot_set_read(c)
        assert read["other_bundles"] == 1 and read["wakes_left"] == 1, read  # a's wake only
        woken = c.call("session.wake", session_id="a")
        assert woken["blocks_from_disk"] == 0, woken
        assert c.call("status")["restart_prefetch"]["wakes_left"] == 0
    assert d.stop() == 0 and d.log_problems() == []


def test_after_a_kill_9_the_sessions_persisted_wake_from_memory(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir).start()
    with d.client() as c:
        for i in range(SESSIONS):
            c.call("session.create", session_id=f"k{i}", system=SYSTEM)
            chat(c, f"k{i}", f"question {i}: which files changed?")
        deadline = time.monotonic() + 30
        while (p := c.call("status")["persistence"])["queued"] or p["running"]:  # their full blocks committed
            assert time.monotonic() < deadline, p
            time.sleep(0.05)
    d.stop(signal.SIGKILL)  # no stop's sleeps: the heads are persistence's checkpoints
    d.start()
    with d.client() as c:
        read = hot_set_read(c)
        assert read is not None and read["blocks_read"] > 0 and read["blocks_failed"] == 0, read
        for i in range(SESSIONS):
            woken = c.call("session.wake", session_id=f"k{i}")
            assert woken["blocks_from_disk"] == 0 and woken["blocks_from_memory"] > 0, woken
    assert d.stop() == 0


# -- the reader alone, on a store with no model ---------------------------------------------------------


def shared_sessions(store, n: int = 4, blocks: int = 6) -> list:
    """n sessions whose snapshots share their first half; their SnapshotInfos."""
    b = store.block_tokens
    shared = list(range(blocks // 2 * b))
    return [write_snapshot(store, f"a{i}", shared + [1000 + 100 * i + t for t in range(blocks // 2 * b + 1)])
            for i in range(n)]


def wait_done(hot: HotSet, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while hot.state not in ("held", "stopped", "dropped") and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("staged", [False, True])
def test_the_reader_reads_each_block_once_and_holds_it_until_its_snapshots_wake(store, staged):
    infos = shared_sessions(store)
    records = [store.snapshot(i.id) for i in infos]
    keys = {ref.key for r in records for ref in r.blocks}
    tier = RamTier(0)  # no LRU room: what is held is what was read ahead
    hot = HotSet(store, tier, staged=staged, budget_bytes=1 << 30, workers=3).start()
    wait_done(hot)
    assert hot.state == "held" and sorted(hot.read_keys) == sorted(keys)  # each once
    for ref in records[0].blocks:
        entry = tier.get(ref.key)
        assert isinstance(entry, StagedImage if staged else dict)
        if not staged:  # the store's own arrays
            got = store.read_block(ref)
            assert all(np.array_equal(entry[n].array, t.array) for n, t in got.items())
    for r in records[:-1]:
        tier.woken(r.id)
    assert all(tier.get(ref.key) is not None for ref in records[-1].blocks)  # the last one's still held
    tier.woken(records[-1].id)
    assert tier.prefetched_bytes == 0 and all(tier.get(k) is None for k in keys)
    hot.stop()
    assert hot.state == "stopped"  # it said "held" after a stop that came once the reading had ended


def test_the_wakes_ahead_are_the_sessions_the_reader_planned(store):
    """The model's load makes a staging slot for each session the hot set will wake (devplanes.warm's `wakes`):
    the count is the plan's, and an empty store's is 0."""
    empty = HotSet(store, RamTier(0), staged=True, budget_bytes=1 << 30, workers=1).start()
    assert empty.wakes_ahead() == 0
    empty.stop()
    shared_sessions(store, n=5)
    hot = HotSet(store, RamTier(0), staged=True, budget_bytes=1 << 30, workers=1).start()
    assert hot.wakes_ahead() == 5
    hot.stop()


def test_the_sessions_of_another_models_bundle_are_not_read(store):
    """A daemon of several models reads only its default model's sessions at start: another's wake on that
    model, loaded later if ever, and its blocks held here would take this one's memory for nothing."""
    ours = shared_sessions(store, n=2)
    b = store.block_tokens
    theirs = write_snapshot(store, "other-model", [7000 + t for t in range(2 * b + 1)], bundle=OTHER_BUNDLE)
    tier = RamTier(0)
    hot = HotSet(store, tier, staged=False, budget_bytes=1 << 30, workers=1,
                 other_bundles=frozenset({OTHER_BUNDLE})).start()
    wait_done(hot)
    assert hot.counts["sessions"] == 2 and hot.counts["other_models"] == 1
    mine = {ref.key for i in ours for ref in store.snapshot(i.id).blocks}
    assert sorted(hot.read_keys) == sorted(mine)
    assert not {ref.key for ref in store.snapshot(theirs.id).blocks} & set(hot.read_keys)
    hot.stop()


def test_once_the_engines_bundle_is_known_the_snapshots_of_another_go_and_none_is_planned(store):
    """Sessions of the model's own name whose snapshots another bundle made (its weights changed since) cannot
    wake on the loaded engine. Was: their blocks were read and held until KEEP_S, and the warm-up waited for
    their wakes (up to WARM_HOLD_S) before it ran."""
    from testkit.kvdata import BUNDLE

    ours = shared_sessions(store, n=2)
    b = store.block_tokens
    stale = write_snapshot(store, "stale", [7000 + t for t in range(2 * b + 1)], bundle=OTHER_BUNDLE)
    tier = RamTier(0)
    hot = HotSet(store, tier, staged=False, budget_bytes=1 << 30, workers=1).start()
    wait_done(hot)
    assert hot.counts["sessions"] == 3 and hot.wakes_left() == 3  # read as any other: its model's name is ours
    held = tier.prefetched_bytes
    hot.keep_bundle(BUNDLE)
    assert hot.wakes_left() == 2 and hot.counts["other_bundles"] == 1
    assert 0 < tier.prefetched_bytes < held  # its blocks let go, ours held
    assert not any(tier.claimed(r.key) for r in store.snapshot(stale.id).blocks)
    assert all(tier.claimed(r.key) for i in ours for r in store.snapshot(i.id).blocks)
    assert hot.add("stale") is False  # the reading has ended
    hot.stop()
    # told before it plans (a load's reader, sessions given): a stale one is never claimed
    reader = HotSet(store, RamTier(0), staged=False, budget_bytes=1 << 30, workers=1, sessions=["stale", "a0"])
    reader.keep_bundle(BUNDLE)
    reader.start()
    wait_done(reader)
    assert reader.counts["sessions"] == 1 and reader.counts["other_bundles"] == 1 and reader.wakes_left() == 1
    reader.stop()


def test_the_daemon_leaves_out_the_bundles_its_other_models_had(store, tmp_path):
    import json

    from kvwake.daemon.config import Settings
    from kvwake.daemon.serve import read_hot_set
    from kvwake.daemon.sessions.models import BUNDLES_FILE
    from testkit.kvdata import BUNDLE

    (tmp_path / BUNDLES_FILE).write_text(json.dumps({BUNDLE: "main", OTHER_BUNDLE: "small"}))
    hot = read_hot_set(Settings(socket=tmp_path / "s.sock", data_dir=tmp_path), store, "main")
    assert hot is not None and hot.other_bundles == {OTHER_BUNDLE}
    hot.stop()


def test_a_model_that_does_not_load_ends_the_reading(tmp_path, model_dir, monkeypatch):
    """Was: a first model's load that raised left the reader's threads reading the store as the daemon ended."""
    from kvwake.daemon import serve
    from kvwake.daemon.config import Settings

    readers = []

    def reading(*args):
        readers.append(real(*args))
        return readers[-1]

    def refused(*args, **kwargs):
        raise RuntimeError("the weights do not load")

    real = serve.read_hot_set
    monkeypatch.setattr(serve, "read_hot_set", reading)
    monkeypatch.setattr(serve, "start_model", refused)
    with pytest.raises(RuntimeError, match="do not load"):
        serve.run(Settings(socket=tmp_path / "s.sock", data_dir=tmp_path, model=str(model_dir)))
    assert len(readers) == 1 and readers[0]._stop.is_set()
    assert not any(t.is_alive() for t in readers[0]._threads)


def test_the_budget_bounds_what_is_read_ahead(store):
    infos = shared_sessions(store)
    one = store.snapshot(infos[0].id).blocks[0].raw_bytes
    tier = RamTier(0)
    hot = HotSet(store, tier, staged=False, budget_bytes=4 * one, workers=1).start()
    wait_done(hot)
    assert hot.counts["blocks_read"] == 4 and tier.prefetched_bytes <= 4 * one
    hot.stop()


def test_a_block_a_wake_read_itself_is_not_read_ahead_after_it():
    """A wake that comes before the reader reaches a claimed block reads it itself; the reader, coming to it after,
    skips it where no other snapshot claims it. Was: read a second time and held until the snapshot's wake ended
    (seen as a flaky count in test_load_read_ahead: a block read ahead that no wake took)."""
    tier = RamTier(0)
    tier.claim("snap", ["k", "j"])
    tier.claim("other", ["j", "i"])
    cached, flight = tier.take("k")  # the wake's own read
    assert cached is None and flight is not None
    tier.land("k", flight, None, read_for="snap")  # staged or placed: nothing kept
    assert tier.begin("k") is None  # the reader skips it
    for key, read_for in (("j", "snap"), ("i", None)):  # claimed by another snapshot too; read by no wake of its
        _, flight = tier.take(key)
        tier.land(key, flight, None, read_for=read_for)
    assert tier.begin("i") is not None  # a restore that is not a claiming snapshot's wake (a prefix hit) stops nothing
    ahead = tier.begin("j")  # still read ahead for "other", which claims it too
    assert ahead is not None
    tier.land_prefetched("j", ahead, {"x": Tensor("U8", np.zeros(4, np.uint8))})
    tier.woken("snap")
    tier.woken("other")
    assert tier.claims_left() == 0 and tier.begin("k") is not None  # its claim gone, the mark with it


def test_a_wake_needing_a_block_being_read_ahead_waits_for_that_read():
    tier, entry = RamTier(0), {"layers.0.keys": Tensor("U16", np.ones((1, 2, 4, 8), np.uint16))}
    tier.claim("snap", ["k"])
    flight = tier.begin("k")
    assert flight is not None and tier.begin("k") is None  # being read: not read again
    got = {}
    waiter = threading.Thread(target=lambda: got.update(taken=tier.take("k")))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()  # waiting for the read, not reading it
    tier.land_prefetched("k", flight, entry)
    waiter.join(5)
    assert got["taken"] == (entry, None) and tier.begin("k") is None  # resident now


def test_a_stop_while_reading_ends_it_between_blocks_and_drops_what_it_read(store, monkeypatch):
    for i in range(6):
        write_snapshot(store, f"many{i}", [5000 * i + t for t in range(10 * store.block_tokens)])
    read_block = store.read_block

    def slow(*args, **kwargs):  # a disk slower than the stop
        time.sleep(0.02)
        return read_block(*args, **kwargs)
    monkeypatch.setattr(store, "read_block", slow)
    tier = RamTier(0)
    hot = HotSet(store, tier, staged=True, budget_bytes=1 << 30, workers=2).start()
    deadline = time.monotonic() + 10
    while not hot.counts["blocks_read"] and time.monotonic() < deadline:
        time.sleep(0.005)
    hot.stop()
    assert hot.state == "stopped" and not any(t.is_alive() for t in hot._threads)
    assert 0 < hot.counts["blocks_read"] < hot.counts["blocks_planned"] == 60
    assert tier.prefetched_bytes == 0 and not tier._flights and not tier._prefetched  # no flight left hanging
    assert len(set(hot.read_keys)) == len(hot.read_keys)
    store.close()  # nothing of the reader still reads it


@pytest.mark.parametrize("staged", [False, True])
def test_a_damaged_block_is_not_read_ahead_and_a_wake_then_meets_it_itself(store, staged):
    (info,) = shared_sessions(store, n=1)
    record = store.snapshot(info.id)
    bad = record.blocks[2]
    path = store.files.absolute(bad.file)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    tier = RamTier(0)
    hot = HotSet(store, tier, staged=staged, budget_bytes=1 << 30, workers=2).start()
    wait_done(hot)
    assert hot.counts["blocks_failed"] == 1 and hot.counts["blocks_read"] == len(record.blocks) - 1
    arrays, flight = tier.take(bad.key)  # nothing held: the wake reads it (and fails with its own facts)
    assert arrays is None and flight is not None
    tier.land(bad.key, flight, None)
    hot.stop()


def test_a_staged_image_fills_staging_as_the_decoder_would(store):
    (info,) = shared_sessions(store, n=1)
    record = store.snapshot(info.id)
    ref = record.blocks[0]
    image = read_image(store, ref, record)
    assert isinstance(image, StagedImage) and image.runs

    def rows_into(out: list):  # a ring's rows for each run, as Buffers.stage hands them out
        def stage(names, dtype, values, planes):
            size = DTYPES[dtype][0].itemsize
            rows = [np.full(values, 0xAA, np.uint8) for _ in range(size)] if planes else \
                [np.full(values * size, 0xAA, np.uint8)]
            out.extend(rows)
            return rows
        return stage

    decoded, copied = [], []
    store.read_block(ref, stage=rows_into(decoded))
    assert image.stage_into(rows_into(copied))
    assert len(copied) == len(decoded) and all(np.array_equal(a, b) for a, b in zip(copied, decoded))
    assert not image.stage_into(None) and not image.stage_into(lambda *run: None)  # no ring: read instead


def test_a_gc_during_the_reading_waits_for_a_block_not_for_the_whole_read(store, monkeypatch):
    # gc takes the store lock exclusively, and every wake and sleep queues behind it: held shared for the whole
    # read, the reader would stall them all until it had read everything
    for i in range(6):
        write_snapshot(store, f"many{i}", [5000 * i + t for t in range(10 * store.block_tokens)])
    read_block = store.read_block

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return read_block(*args, **kwargs)
    monkeypatch.setattr(store, "read_block", slow)
    hot = HotSet(store, RamTier(0), staged=False, budget_bytes=1 << 30, workers=1).start()
    deadline = time.monotonic() + 10
    while not hot.counts["blocks_read"] and time.monotonic() < deadline:
        time.sleep(0.005)
    store.gc()
    assert hot.state == "reading" and hot.counts["blocks_read"] < hot.counts["blocks_planned"], hot.status()
    hot.stop()


def test_a_fault_in_the_reader_itself_is_logged_as_an_error_not_taken_for_a_damaged_block(store, monkeypatch,
                                                                                            caplog):
    (info,) = shared_sessions(store, n=1)

    def broken(*args, **kwargs):  # not the store's verdict on a block: a fault of the reader's own
        raise TypeError("read_block() got an unexpected keyword argument")
    monkeypatch.setattr(store, "read_block", broken)
    hot = HotSet(store, RamTier(0), staged=False, budget_bytes=1 << 30, workers=1).start()
    wait_done(hot)
    assert hot.counts["blocks_failed"] == len(store.snapshot(info.id).blocks)
    assert any(r.levelname == "ERROR" and r.exc_info for r in caplog.records if r.name == "kvwake.hot_set")
    hot.stop()


def test_the_warm_up_waits_for_the_hot_sets_wakes_and_no_longer_than_warm_hold_s(monkeypatch):
    """After a restart a warm-up job that began just before the agents came back held their wakes
    (docs/benchmarks.md, "fleet"): the warm-up starts once the hot set's sessions woke, or after WARM_HOLD_S;
    with no hot set, at once. (The real warm-up, over a model whose engine thread notes when it is asked for
    the warm-up's jobs.)"""
    from types import SimpleNamespace

    import anyio

    from kvwake.daemon import serve
    from kvwake.daemon.model import loader

    started: list[float] = []

    class Thread:
        async def run(self, fn):
            started.append(time.monotonic())
            return []

    model = SimpleNamespace(name="m", thread=Thread(), engine=SimpleNamespace(warm_jobs=list), warmed=threading.Event())

    class Hot:
        def __init__(self, left: int) -> None:
            self.left = left

        def wakes_left(self) -> int:
            return self.left

    hot = Hot(2)

    async def wakes_come() -> float:
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve._warm, Served(m=model), hot)
            await anyio.sleep(0.3)
            assert started == []  # two sessions still to wake
            hot.left = 0
            return time.monotonic()

    woke = anyio.run(wakes_come)
    assert len(started) == 1 and started[0] >= woke
    started.clear()
    monkeypatch.setattr(loader, "WARM_HOLD_S", 0.2)
    began = time.monotonic()
    anyio.run(serve._warm, Served(m=model), Hot(1))  # a session that never wakes holds it WARM_HOLD_S at most
    assert len(started) == 1 and 0.2 <= started[0] - began < 5
    started.clear()
    anyio.run(serve._warm, Served(m=model), None)
    assert len(started) == 1
    started.clear()
    model.thread.alive = False  # a model unloaded while its warm-up waited: no job asked of its stopped thread
    anyio.run(serve._warm, Served(m=model), None)
    assert started == []


def test_a_wake_refused_for_its_snapshots_bundle_lets_its_blocks_read_ahead_go():
    """A session of another model's bundle (one model-bundles.json does not name) is read ahead like any other;
    its wake is refused before a record comes back. Was: its claim stayed, its blocks held outside the RAM
    tier's budget until the reader's time was up, and the warm-up waited for a wake that had ended."""
    import contextlib

    from kvwake.daemon.kv import pipeline
    from kvwake.errors import BundleMismatchError

    tier = RamTier(0)
    tier.claim("snap-1", ["k1", "k2"])

    class Store:
        def reading(self):
            return contextlib.nullcontext()

        def latest_snapshot(self, session_id: str) -> str:
            return "snap-1"

    class Ctx:
        store, ram_tier = Store(), tier

        def record(self, snapshot_id: str):
            raise BundleMismatchError("computed with another model", snapshot_id=snapshot_id)

    with pytest.raises(BundleMismatchError):
        pipeline.wake(Ctx(), "s", None, mlx=None)
    assert tier.claims_left() == 0 and not tier.claimed("k1")


def test_a_staged_image_that_fits_in_part_leaves_no_staging_recorded_for_its_block():
    """An image whose first run fits this restore's staging and a later one does not: it is refused and the
    block is read instead, whose check must not find the first run recorded as staged. Was: the record
    stayed, and the read's check (staged=True for a block decoded unstaged) failed the wake."""
    from kvwake.daemon.kv import pipeline

    first = np.arange(4, dtype=np.uint8)
    image = StagedImage(runs=[(("k",), "bf16", 2, False, [first]), (("v",), "bf16", 2, False, [first])])

    class Buffers:  # a restore's staging as pipeline._put_cached uses it: the first run fits, the second not
        def __init__(self) -> None:
            self.staged: dict[int, bool] = {}

        def stage(self, k: int):
            def where(names, dtype, values, planes):
                if names == ("v",):
                    return None
                self.staged[k] = planes
                return [np.empty(4, np.uint8)]
            return where

        def unstage(self, k: int) -> None:
            from kvwake.daemon.kv.restore_buffers import Buffers as Real

            Real.unstage(self, k)

    buffers = Buffers()
    buffers._window_runs = {}
    assert pipeline._put_cached(buffers, 3, 0, 16, image, "block 3") is False
    assert 3 not in buffers.staged
