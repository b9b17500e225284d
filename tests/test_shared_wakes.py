"""Sessions woken together read their shared prompt's blocks once: the first wake leads, the others wait for it
and copy its first blocks on the device (sessions/conversations.py `_wake_prefix`, kv/pipeline.py `wake`'s
prefix), exactly as reading them would give; in-process (real engine thread, real store)."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from kvwake.daemon.kv import restore_buffers
from kvwake.daemon.kv.cache_blocks import StateMismatchError
from tests.test_manager import either, manager, model_dir  # noqa: F401 - the in-process manager (16-token blocks)
from tests.test_shared_prefill import lead_then_wait

SHARED = [(i * 37 + 11) % 200 + 20 for i in range(300)]  # 18 whole blocks of 16, and 12 tokens
OWN = {f"agent{i}": [(i * 7 + k) % 90 + 5 for k in range(40)] for i in range(4)}  # 340 tokens: 21 blocks
BLOCKS, SHARED_BLOCKS = 340 // 16, 300 // 16


async def slept(manager) -> None:
    for sid in OWN:
        await manager.create(sid)
        await manager.append(sid, tokens=SHARED + OWN[sid])
        await manager.sleep(sid)


def kv_bytes(manager, sid: str) -> list[bytes]:
    session = manager.entries[sid].session
    return [np.asarray(a[..., : c.offset, :].view(mx.uint16) if a.dtype == mx.bfloat16 else a[..., : c.offset, :]).tobytes()
            for c in session.cache for a in (c.keys, c.values)]


def hold_the_leader(manager, monkeypatch, leader: str, fail: bool = False) -> threading.Event:
    """The leader's wake waits for the returned event (the others are sure to come while it reads); `fail`:
    then it raises instead of waking."""
    go, real = threading.Event(), manager.engine.wake

    def wake(session_id, *args, **kwargs):
        if session_id == leader:
            assert go.wait(30)
            if fail:
                raise OSError("the leader's disk went away")
        return real(session_id, *args, **kwargs)

    monkeypatch.setattr(manager.engine, "wake", wake)
    return go


async def wake_together(manager, monkeypatch, fail: bool = False) -> dict[str, dict]:
    go, results = hold_the_leader(manager, monkeypatch, "agent0", fail), {}

    async def wake(sid: str) -> None:
        try:
            results[sid] = await manager.wake(sid)
        except OSError as exc:
            results[sid] = {"error": repr(exc)}

    await lead_then_wait(manager, go, lambda: wake("agent0"), [lambda sid=sid: wake(sid) for sid in list(OWN)[1:]])
    monkeypatch.undo()
    return results


async def test_sessions_woken_together_read_their_shared_blocks_once_and_wake_exactly(either, monkeypatch):
    manager = either  # over buffers, then over pages (the default on CUDA)
    await slept(manager)
    got = await wake_together(manager, monkeypatch)
    read = {sid: info["blocks_from_disk"] + info["blocks_from_memory"] for sid, info in got.items()}
    assert read["agent0"] == BLOCKS and got["agent0"]["blocks_shared"] == 0, got["agent0"]
    for sid in ("agent1", "agent2", "agent3"):  # their prompt's blocks copied from agent0's, their own read
        assert (got[sid]["blocks_shared"], read[sid]) == (SHARED_BLOCKS, BLOCKS - SHARED_BLOCKS), (sid, got[sid])
    assert manager.counters["wake_waits"] == 3 and len(manager.shared) == 0
    together = {sid: kv_bytes(manager, sid) for sid in OWN}
    for sid in OWN:  # each woken alone (nothing to share with): every block read, the same bytes
        await manager.sleep(sid)
    for sid in OWN:
        # a sleep frees its KV after it replies: over pages a wake before that maps the pages still there (the
        # store's bytes, so as exact) and would not be alone
        await manager.released()
        info = await manager.wake(sid)
        assert info["blocks_shared"] == 0 and kv_bytes(manager, sid) == together[sid], sid
        await manager.sleep(sid)


async def behind_a_held_leader(manager, meanwhile, release) -> dict[str, dict]:
    """agent0's wake leads (held by the caller until `release()`); agent1-3 wake once its flight is up;
    `meanwhile()` is awaited before the release. Returns each wake's result."""
    import anyio

    results: dict[str, dict] = {}

    async def wake(sid: str) -> None:
        results[sid] = await manager.wake(sid)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wake, "agent0")
        while len(manager.shared) == 0:
            await anyio.sleep(0.005)
        for sid in list(OWN)[1:]:
            tg.start_soon(wake, sid)
        await meanwhile()
        release()
    return results


async def test_the_waiting_wakes_read_their_own_blocks_while_the_leader_still_wakes(manager, monkeypatch):
    """Was: a wake waiting on another's started once that one had woken, so a restart's agents woke one after
    the other (docs/benchmarks.md, "fleet"): now each reads its own blocks meanwhile."""
    import anyio

    from kvwake.daemon.kv import pipeline

    await slept(manager)
    go, read, real = hold_the_leader(manager, monkeypatch, "agent0"), [], pipeline.fill_block
    monkeypatch.setattr(pipeline, "fill_block", lambda *a, **k: read.append(1) or real(*a, **k))
    own, seen = 3 * (BLOCKS - SHARED_BLOCKS), []

    async def own_blocks_read() -> None:
        with anyio.move_on_after(20):
            while len(read) < own:
                await anyio.sleep(0.01)
        seen.append(len(read))

    results = await behind_a_held_leader(manager, own_blocks_read, go.set)
    assert seen == [own]  # every waiter's own blocks, none of the leader's, before it woke
    for sid in ("agent1", "agent2", "agent3"):
        assert results[sid]["blocks_shared"] == SHARED_BLOCKS, results[sid]
    assert manager.counters["wake_waits"] == 3


async def test_waiting_wakes_leave_the_worker_threads_to_their_leader(manager, monkeypatch):
    """Was: a waiting wake held a default worker thread while it waited for its
    leader, so waiters that came before the leader took its thread (one thread here) and it could not wake."""
    import anyio

    from kvwake.daemon.kv import pipeline

    await slept(manager)
    monkeypatch.setattr(pipeline, "PREFIX_WAIT_S", 5.0)  # a waiter that gives up reads every block itself
    limiter = anyio.to_thread.current_default_thread_limiter()
    monkeypatch.setattr(limiter, "total_tokens", 1)
    go, real = anyio.Event(), manager._hot_prefix

    async def held(session, *args, **kwargs):  # the leader awaits before it asks for a thread
        if session.id == "agent0":
            await go.wait()
        return await real(session, *args, **kwargs)

    monkeypatch.setattr(manager, "_hot_prefix", held)

    async def waiters_started() -> None:
        while sum(len(f.waiters) for f in manager.shared._flights) < 3:
            await anyio.sleep(0.005)
        await anyio.sleep(0.2)  # the waiters take their threads

    results = await behind_a_held_leader(manager, waiters_started, go.set)
    assert [results[sid]["blocks_shared"] for sid in ("agent1", "agent2", "agent3")] == [SHARED_BLOCKS] * 3
    assert manager.counters["wake_waits"] == 3


async def test_a_leader_that_fails_leaves_the_others_to_read_their_own_blocks(manager, monkeypatch):
    await slept(manager)
    got = await wake_together(manager, monkeypatch, fail=True)
    assert "disk went away" in got["agent0"]["error"]
    for sid in ("agent1", "agent2", "agent3"):
        info = got[sid]
        assert info["blocks_shared"] == 0 and info["blocks_from_disk"] + info["blocks_from_memory"] == BLOCKS, info
    assert manager.counters["wake_waits"] == 0 and len(manager.shared) == 0
    assert (await manager.wake("agent0"))["tokens"] == 340  # its own wake, tried again, reads it


async def test_a_prefix_that_is_not_whole_blocks_of_the_restores_kv_is_refused(manager):
    await slept(manager)
    await manager.wake("agent0")
    source = manager.entries["agent0"].session.cache
    engine = manager.engine

    def buffers():
        sample = engine.store.block_specs(engine.record(engine.store.latest_snapshot("agent1")).blocks[0])
        return restore_buffers.Buffers(engine.model, sample, 16, 340, 16)

    with pytest.raises(StateMismatchError, match="not whole blocks of 16"):
        manager.thread.call(lambda: buffers().take_prefix(source, 40))
    with pytest.raises(StateMismatchError, match="is not 64 tokens"):
        manager.thread.call(lambda: buffers().take_prefix(source[:1], 64))


async def test_a_wake_copies_the_blocks_a_hot_woken_session_holds_but_never_a_prefilled_ones(either):
    manager = either  # over buffers, then over pages (the default on CUDA)
    await slept(manager)
    await manager.wake("agent0")  # hot, its prompt's KV the stored blocks' bytes
    info = await manager.wake("agent1")
    assert (info["blocks_shared"], info["blocks_from_disk"] + info["blocks_from_memory"]) == (
        SHARED_BLOCKS, BLOCKS - SHARED_BLOCKS), info
    copied = kv_bytes(manager, "agent1")
    await manager.sleep("agent1")
    await manager.sleep("agent0")
    await manager.released()  # over pages, a wake before the sleeps' frees would map their pages
    assert (await manager.wake("agent1"))["blocks_shared"] == 0 and kv_bytes(manager, "agent1") == copied
    # A session that took the prompt as a prefill's prefix is no source for a wake over buffers (its cache is not
    # counted restored). Over pages the prefix hit restored the store's blocks into pages published as the store's
    # bytes (kv/paged_wake.py), which a wake maps, as exact as reading them.
    await manager.sleep("agent1")
    await manager.released()
    await manager.create("fresh")
    assert (await manager.append("fresh", tokens=SHARED + [3, 4, 5]))["reused"] == 300
    assert manager.entries["fresh"].session.restored == 0
    paged = manager.engine.pages is not None
    assert (await manager.wake("agent2"))["blocks_shared"] == (SHARED_BLOCKS if paged else 0)
    # A woken session whose history was cut back below its blocks gives only what it still holds of them (fresh,
    # whose pages would give all 18, gone)
    await manager.delete("fresh")
    await manager.released()
    await manager.append("agent2", tokens=SHARED[:40] + [9] * 30, whole=True)  # the whole history, resent
    assert manager.entries["agent2"].session.restored == 40
    assert (await manager.wake("agent3"))["blocks_shared"] == 2  # its 2 whole blocks of them, not 18


@pytest.fixture
def staged_pair(model_dir, tmp_path, monkeypatch):
    """The discrete GPU's path, here (two blocks per span through a ring of two slots): an engine holding "a"
    and "b" asleep, 3 whole blocks in common, "a" awake; yields (engine, a's session, b's KV woken alone
    as bytes, the joins made from then on)."""
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store
    from tests.test_pipeline import restores_as, two_block_spans

    from kvwake.daemon.config import Tuning

    restores_as(monkeypatch, "staged")
    store = Store(tmp_path / "store", block_tokens=16)
    # out of pages whatever the default: a paged wake maps the blocks a hot session holds, and joins into pages
    # (docs/decisions.md, "Paged KV in the fleet, again")
    engine = Engine(store, tmp_path, model_dir, io_workers=3, warm=False, tuning=Tuning(paged_kv=False))
    rings, joined = two_block_spans(monkeypatch, engine)
    try:
        head = [(i * 7) % 256 for i in range(48)]
        for name, own in (("a", 11), ("b", 13)):
            s = Session(name)
            engine.append(s, tokens=head + [(i * own) % 250 + 3 for i in range(102)])
            engine.sleep(s)
        a, _ = engine.wake("a")
        b_alone, _ = engine.wake("b")
        joined.clear()
        yield engine, a, kv_of(b_alone), joined, rings
    finally:
        engine.close()
        store.close()


def kv_of(session) -> list[bytes]:
    return [np.asarray(x.view(mx.uint16)).tobytes() for c in session.cache for x in (c.keys, c.values)]


def test_a_staged_wake_taking_an_odd_number_of_blocks_stages_the_rest_exactly(staged_pair):
    # Was: the ring placed a block by its number from 0, so a restore whose first 3 blocks came from another
    # cache joined a span from rows its blocks had not been staged in.
    from kvwake.daemon.kv import cache_blocks

    engine, a, alone, joined, rings = staged_pair
    b, info = engine.wake("b", prefix=(cache_blocks.copy_prefix(a.cache, 48), 48))
    assert info["blocks_shared"] == 3 and info["blocks_from_disk"] + info["blocks_from_memory"] == 6, info
    assert joined == [(3, 2), (5, 2), (7, 2)] and rings[-1].span == 2
    assert kv_of(b) == alone


class Coming:
    """A prefix still coming (sessions/shared_prefill.Pending's face, its result ready at once)."""

    def __init__(self, cache, tokens: int) -> None:
        self.given = (cache, tokens)

    def result(self, timeout_s=None):
        return self.given


@pytest.mark.parametrize("given", [48, 32, None])
def test_a_staged_wake_takes_a_prefix_that_comes_after_its_own_blocks_exactly(staged_pair, given):
    # The prefix taken last (a restart's waiting wake): its pieces go first; given short (or nothing), the wake
    # reads every block itself, the same bytes.
    from kvwake.daemon.kv import cache_blocks

    engine, a, alone, joined, rings = staged_pair
    coming = Coming(cache_blocks.copy_prefix(a.cache, given) if given else None, given or 0)
    b, info = engine.wake("b", prefix=(coming, 48))
    if given == 48:
        assert info["blocks_shared"] == 3 and info["blocks_from_disk"] + info["blocks_from_memory"] == 6, info
        assert joined == [(3, 2), (5, 2), (7, 2)]
        assert rings[-1].slots == 1  # a waiting wake stages through one slot: its leader finds the rest idle
    else:
        assert info["blocks_shared"] == 0 and info["blocks_from_disk"] + info["blocks_from_memory"] == 9, info
    assert kv_of(b) == alone
