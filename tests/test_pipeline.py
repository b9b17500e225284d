"""The sleep/wake pipeline: a pool bounded by bytes in flight, fail-fast batches, and what a failure leaves."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref

import mlx.core as mx
import numpy as np
import pytest

from kvwake.daemon.config import Tuning
from kvwake.daemon.kv import cache_blocks, capacity, cudart, devplanes
from kvwake.daemon.jobs import direct
from kvwake.daemon.kv.pool import Pool
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.session_state import Session
from kvwake.errors import CorruptBlockError
from kvwake.store import Store


def test_a_batch_keeps_bytes_in_flight_under_its_budget_and_order_of_admission():
    pool = Pool(workers=8, inflight_bytes=100)
    batch, lock, state = pool.batch(), threading.Lock(), {"now": 0, "peak": 0, "order": []}

    def task(i: int, n: int) -> None:
        with lock:
            state["now"] += n
            state["peak"] = max(state["peak"], state["now"])
            state["order"].append(i)
        time.sleep(0.01)
        with lock:
            state["now"] -= n

    for i in range(20):
        batch.reserve(40)
        batch.submit(40, task, i, 40)
    batch.join()
    batch.raise_first()
    pool.close()
    assert state["peak"] == 80  # two 40-byte tasks fit 100 bytes, a third never ran beside them
    assert state["order"] == list(range(20))


def test_a_task_larger_than_the_budget_still_runs_alone():
    pool = Pool(workers=4, inflight_bytes=10)
    batch, ran = pool.batch(), []
    batch.reserve(1000)
    batch.submit(1000, ran.append, 1)
    batch.join()
    pool.close()
    assert ran == [1]


def test_a_tasks_arguments_die_with_whoever_waited_for_it_not_on_the_pool_thread():
    # The pool's work item kept a task's arguments until after its future was done, on the pool's thread:
    # a caller that let its reference go once the future was done could leave the last one there, and
    # MLX memory must be freed on the engine thread. Deterministic: the future's done-callback (run on the
    # pool thread inside set_result) waits until the caller has let go.
    pool = Pool(workers=1, inflight_bytes=1 << 20)
    batch, died, let_go = pool.batch(), [], threading.Event()

    class Held:
        def __del__(self) -> None:
            died.append(threading.current_thread().name)

    held, watched = Held(), threading.Event()
    batch.reserve(1)
    future = batch.submit(1, lambda arg: watched.wait(10), held)
    future.add_done_callback(lambda _: let_go.wait(10))
    watched.set()  # the task ends once its future is watched
    while not future.done():
        time.sleep(0.001)
    del held  # the caller's reference: the last one, so it dies here, on this thread
    let_go.set()
    batch.join()
    pool.close()
    assert died == [threading.current_thread().name], died


def test_the_first_failure_stops_the_tasks_not_yet_started_and_is_raised_as_itself():
    pool = Pool(workers=1, inflight_bytes=1 << 20)
    batch, ran = pool.batch(), []

    def fail() -> None:
        raise OSError(28, "No space left on device")

    batch.reserve(1)
    batch.submit(1, fail)
    for i in range(5):
        batch.reserve(1)
        batch.submit(1, ran.append, i)
    batch.join()
    pool.close()
    assert ran == [] and batch.failed
    with pytest.raises(OSError, match="No space left"):
        batch.raise_first()




# The contiguous buffers' restore, direct and staged, whatever the default: a paged engine restores into pages
# (kv/page_restore.py, tested in test_paged_wakes.py) and maps blocks a hot session holds (docs/decisions.md, "Paged
# KV in the fleet, again")
UNPAGED = Tuning(paged_kv=False)


@pytest.fixture
def engine(model_dir, tmp_path):
    store = Store(tmp_path / "store", block_tokens=16)
    # A small budget: the sleep below is cut into many spans, the wake into many admissions.
    e = Engine(store, tmp_path, model_dir, io_workers=3, io_inflight_bytes=4096, tuning=UNPAGED)
    yield e
    e.close()
    store.close()


def test_sleep_and_wake_through_many_spans_and_workers_are_exact(engine):
    s = Session("s")
    engine.append(s, tokens=[(i * 7) % 256 for i in range(203)])
    before = [(np.array(c.keys[..., :202, :].view(mx.uint16)), np.array(c.values[..., :202, :].view(mx.uint16)))
              for c in s.cache]
    info = engine.sleep(s)
    assert info["new_blocks"] == 202 // 16 and s.cache is None
    woken, woke = engine.wake("s")
    assert woke["blocks_from_disk"] == 202 // 16
    for (k, v), c in zip(before, woken.cache):
        assert np.array_equal(k, np.array(c.keys[..., :202, :].view(mx.uint16)))
        assert np.array_equal(v, np.array(c.values[..., :202, :].view(mx.uint16)))
        assert c.keys.shape[2] == capacity.capacity(202)  # allocated once, as its growth would (kv/capacity.py)


@pytest.mark.parametrize("how", ["sleep", "checkpoint"])
def test_on_a_discrete_gpu_host_copies_go_back_to_the_driver_not_to_mlxs_cache(engine, monkeypatch, how):
    # On CUDA a host copy is managed memory the encoders read; in MLX's cache it would become a neighbour's
    # next kernel output, written through page faults. Every array a sleep or a checkpoint (its spans of
    # copies let go as their writes finish, span by span) hosted must die on the engine thread with the
    # cache closed (limit 0), and the limit must come back after.
    from kvwake.daemon.kv import pipeline

    monkeypatch.setattr(cache_blocks, "_discrete", lambda: True)
    deaths: list[tuple[int, str]] = []
    hosted = []

    def peek(thread: str) -> None:
        limit = mx.set_cache_limit(0)
        mx.set_cache_limit(limit)
        deaths.append((limit, thread))
    real_host = cache_blocks.Deferred.host

    def host(self):
        hosted.append(len(self.lazy))
        for a in self.lazy:
            weakref.finalize(a, lambda: peek(threading.current_thread().name))
        return real_host(self)
    monkeypatch.setattr(cache_blocks.Deferred, "host", host)
    limit = mx.set_cache_limit(1 << 30)
    try:
        s = Session("s")
        engine.append(s, tokens=[(i * 7) % 256 for i in range(203)])
        if how == "sleep":
            assert engine.sleep(s)["new_blocks"] == 202 // 16
        else:
            info = pipeline.checkpoint(engine.kv, s, direct, supersede=None, wanted=lambda *_: True)
            assert info.new_blocks == 202 // 16
        gc.collect()
        # a sleep's blocks in one span, then its tail; a checkpoint's in many (a sleep's too where the planes
        # are made on the device: CUDA). Each span's 4 tensors (2 layers' keys and values) come in one copy,
        # stacked, or in one per byte plane (the device's planes, bf16: 2), never one per tensor.
        assert len(hosted) >= (2 if how == "sleep" else 3) and set(hosted) <= {1, 2}
        assert len(deaths) == sum(hosted)
        assert {d for d, _ in deaths} == {0}, deaths
        assert {t for _, t in deaths} == {threading.current_thread().name}, deaths  # the engine's (direct here)
        assert mx.set_cache_limit(1 << 30) == 1 << 30
    finally:
        mx.set_cache_limit(limit)


def test_dropping_host_copies_frees_past_the_cache_only_on_a_discrete_gpu(monkeypatch):
    def dropped(discrete: bool, fail: bool = False) -> int:
        monkeypatch.setattr(cache_blocks, "_discrete", lambda: discrete)
        held = [mx.arange(1 << 16)]
        mx.eval(held)
        # On MLX-CUDA an array evaluated a moment ago is still held by MLX's worker thread until it runs the
        # stream's finished tasks: let go by it after the drop returned, it went to the cache (nothing cached
        # right after a drop, some a moment later; nothing once settled). drop_hosted frees what `drop` lets
        # go; the daemon drops a copy after encoding and writing it.
        mx.synchronize()
        time.sleep(0.05)
        mx.clear_cache()

        def drop() -> None:
            held.clear()
            if fail:
                raise OSError("the drop failed")
        limit = mx.set_cache_limit(1 << 30)
        try:
            with contextlib.suppress(OSError):
                cache_blocks.drop_hosted(drop)
            assert mx.set_cache_limit(1 << 30) == 1 << 30  # given back, even after a failure
        finally:
            mx.set_cache_limit(limit)
        return mx.get_cache_memory()
    assert dropped(False) >= 4 << 16  # unified memory: into the cache, as MLX does
    assert dropped(True) == 0
    assert dropped(True, fail=True) == 0


def test_restores_are_staged_where_a_gpu_computes_apple_silicon_included(monkeypatch):
    # Was "direct" on Metal: numpy joined the byte planes on the CPU there. The staged
    # path itself is exact on the CPU backend (the tests here run it both ways).
    import mlx.core as mx

    from kvwake.daemon.kv import restore_buffers as kvfill

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)  # Apple silicon: unified memory, a GPU
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert kvfill.unified_memory() and kvfill.restore_mode() == "staged"
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert kvfill.restore_mode() == "direct"
    assert kvfill.restore_mode("staged") == "staged"  # the tuning knob restore_mode still overrides


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_a_corrupt_block_fails_the_wake_with_facts_and_leaves_the_store_as_it_was(engine, mode, monkeypatch):
    from kvwake.daemon.kv import devplanes
    from kvwake.daemon.kv import restore_buffers as kvfill

    # staged: one block per span through a ring of two slots (the discrete-GPU path, on the CPU)
    restores_as(monkeypatch, mode, engine)
    monkeypatch.setattr(devplanes, "SPAN_BYTES", 1)
    monkeypatch.setattr(devplanes, "RING_SLOTS", 2)
    released, real_release = [], kvfill.Buffers.release
    monkeypatch.setattr(kvfill.Buffers, "release", lambda self: released.append(self) or real_release(self))
    s = Session("s")
    engine.append(s, tokens=list(range(100)))
    snapshot = engine.sleep(s)["snapshot_id"]
    record = engine.store.snapshot(snapshot)
    path = engine.store.files.absolute(record.blocks[3].file)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError) as caught:
        engine.wake("s")
    assert caught.value.data["block"] == record.blocks[3].key and caught.value.data["snapshot_id"] == snapshot
    assert len(released) == 1  # the failed wake's staging and joined spans went back through release
    assert caught.value.data["session_id"] == "s"
    path.write_bytes(bytes(data[:-5]) + bytes([data[-5] ^ 0x40]) + bytes(data[-4:]))
    woken, _ = engine.wake("s")  # nothing was changed by the failed wake
    assert woken.tokens == list(range(100))


def test_a_sleep_that_fails_in_a_worker_removes_what_it_wrote_and_stays_hot(engine, monkeypatch):
    s = Session("s")
    engine.append(s, tokens=list(range(150)))
    calls = []
    real = engine.store.writer

    def failing_writer(*args, **kwargs):
        w = real(*args, **kwargs)
        add = w.add_block

        def add_block(i, arrays):
            calls.append(i)
            if i == 5:
                raise OSError(5, "Input/output error")
            return add(i, arrays)
        w.add_block = add_block
        return w

    monkeypatch.setattr(engine.store, "writer", failing_writer)
    with pytest.raises(OSError, match="Input/output error"):
        engine.sleep(s)
    assert s.cache is not None and s.head is None
    assert engine.store.snapshots() == [] and not any(engine.store.files.walk())
    assert 5 in calls


def restores_as(monkeypatch, mode: str, engine=None) -> None:
    """Restores fill buffers in `mode` ("direct" or "staged") unless configured otherwise, whatever the backend;
    `engine`: one made already, which took its mode when it was made."""
    from kvwake.daemon.kv import restore_buffers as kvfill

    monkeypatch.setattr(kvfill, "restore_mode", lambda configured=None: configured or mode)
    if engine is not None:
        monkeypatch.setattr(engine, "restore_mode", mode)
        monkeypatch.setattr(engine.kv, "restore_mode", mode)


def slept_and_woken(engine, tokens: list[int], before: list | None = None) -> tuple[Session, Session]:
    """Two sessions fed `tokens`: "a" as it is, "b" put to sleep and woken; `before`, if given, gets b's KV as
    it was before the sleep (`kv_bytes`)."""
    a, b = Session("a"), Session("b")
    for s in (a, b):
        engine.append(s, tokens=tokens)
    if before is not None:
        before += kv_bytes(b, b.processed)
    engine.sleep(b)
    return a, engine.wake("b")[0]


def kv_bytes(session: Session, n: int) -> list[bytes]:
    """The first n tokens' keys and values of every layer, as bytes (a paged layer's gathered from its pages)."""
    import numpy as np

    return [np.asarray(a[..., :n, :].astype(mx.float32)).tobytes() for c in session.cache for a in (c.keys, c.values)]


def assert_same_kv_and_continuation(engine, a: Session, b: Session, n: int) -> None:
    """Sessions `a` (never slept) and `b` (woken): the first n tokens' KV bit for bit, and the same greedy reply."""
    from kvwake.daemon.model.generation import GenerateParams

    for x, y in zip(a.cache, b.cache):
        assert mx.array_equal(x.keys[..., :n, :], y.keys[..., :n, :]).item()
        assert mx.array_equal(x.values[..., :n, :], y.values[..., :n, :]).item()
    assert engine.generate(a, GenerateParams(max_tokens=6)).tokens == engine.generate(b, GenerateParams(max_tokens=6)).tokens


def test_the_discrete_gpu_path_makes_and_joins_planes_on_the_device_exactly(model_dir, tmp_path, monkeypatch):
    # What runs on CUDA (KV in device memory), run here on MLX's CPU device: sleep splits byte planes
    # with MLX ops, wake stages verified planes on the host and joins them with MLX ops.
    restores_as(monkeypatch, "staged")
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, io_workers=3, io_inflight_bytes=8192, warm=False, tuning=UNPAGED)
    calls = count_calls(monkeypatch, engine, split="split_span", join="join")
    try:
        a, b = slept_and_woken(engine, [(i * 11) % 256 for i in range(150)])
        # Once per span of blocks (here one span: the blocks are tiny) for every tensor at once, and once
        # for the tail's partial block: device ops per span, not per tensor.
        assert calls["split"] > 0 and calls["join"] == 2
        assert_same_kv_and_continuation(engine, a, b, 149)
    finally:
        engine.close()
        store.close()


def two_block_spans(monkeypatch, engine) -> tuple[list, list[tuple[int, int]]]:
    """`engine`'s restores staged (the discrete-GPU path, here on the CPU) through rings of two slots of two
    blocks each from now on (as count_calls): the rings made and the (first, count) of every span joined,
    recorded."""
    from kvwake.daemon.kv import devplanes
    from kvwake.daemon.kv import restore_buffers as kvfill

    assert_stages(engine)
    monkeypatch.setattr(devplanes, "RING_SLOTS", 2)
    rings, joined = [], []
    real_ring, real_join = devplanes.Ring.__init__, kvfill.Buffers.join_span

    def ring(self, blocks, size, plane_bytes, block_bytes, most=None, owner=None):
        monkeypatch.setattr(devplanes, "SPAN_BYTES", 2 * block_bytes)
        real_ring(self, blocks, size, plane_bytes, block_bytes, most, owner)
        rings.append(self)

    def join_span(self, first, count):
        joined.append((first, count))
        real_join(self, first, count)
    monkeypatch.setattr(devplanes.Ring, "__init__", ring)
    monkeypatch.setattr(kvfill.Buffers, "join_span", join_span)
    return rings, joined


def test_the_discrete_gpu_path_restores_span_by_span_through_a_ring_smaller_than_the_session(
        model_dir, tmp_path, monkeypatch):
    # Two blocks per span and two slots: nine blocks go through the ring in five spans, each slot
    # reused, a block from the RAM tier beside a staged one in one span; the KV must come back bit for bit.
    restores_as(monkeypatch, "staged")
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, io_workers=3, warm=False, tuning=UNPAGED)
    rings, joined = two_block_spans(monkeypatch, engine)
    try:
        a, b = Session("a"), Session("b")
        tokens = [(i * 7) % 256 for i in range(150)]
        for s in (a, b):
            engine.append(s, tokens=tokens)
        record = engine.store.snapshot(engine.sleep(b)["snapshot_id"])
        engine.ram_tier.__init__(engine.ram_tier.budget)
        engine.ram_tier.put(record.blocks[4].key, engine.store.read_block(record.blocks[4]))
        b, info = engine.wake("b")
        # where slots are kept (mapped for a discrete GPU) a ring's slots past its first are idle ones or none:
        # none of this test's span is idle, so it stages through one
        kept = devplanes.STAGING == "mapped" and cudart.active()
        assert [(r.span, r.slots) for r in rings] == [(2, 1 if kept else 2)]
        assert joined == [(0, 2), (2, 2), (4, 2), (6, 2), (8, 1)]
        assert info["blocks_from_memory"] == 1 and info["blocks_from_disk"] == 8
        assert_same_kv_and_continuation(engine, a, b, 149)
    finally:
        engine.close()
        store.close()


@pytest.fixture
def staged_engine(tmp_path, model_dir, monkeypatch):
    """An engine restoring as on a discrete GPU (staging, then joins on the device), here on MLX's CPU device."""
    restores_as(monkeypatch, "staged")
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir)
    yield engine
    engine.close()
    store.close()


def test_the_discrete_gpu_path_serves_a_prefix_hit_exactly(staged_engine):
    """A prefix hit fills host views only (no span is joined): finish must upload every block."""
    engine = staged_engine
    tokens = [(i * 13) % 256 for i in range(90)]
    first, second = Session("first"), Session("second")
    engine.append(first, tokens=tokens)
    before = [(np.array(c.keys.view(mx.uint16)), np.array(c.values.view(mx.uint16))) for c in first.cache]
    engine.sleep(first)
    got = engine.append(second, tokens=[*tokens[:80], 7, 8, 9])
    n = got["reused"]
    assert n >= 64
    for (k, v), c in zip(before, second.cache):  # the reused tokens' KV is the stored blocks', bit for bit
        assert np.array_equal(k[..., :n, :], np.array(c.keys[..., :n, :].view(mx.uint16)))
        assert np.array_equal(v[..., :n, :], np.array(c.values[..., :n, :].view(mx.uint16)))


def test_the_discrete_gpu_path_wakes_a_session_shorter_than_a_block(staged_engine):
    """Nothing staged (no full block): only the tail's partial block; the join must not need staging's shape."""
    engine = staged_engine
    a, b = Session("a"), Session("b")
    for s in (a, b):
        engine.append(s, tokens=list(range(30, 40)))
    engine.sleep(b)
    b, _ = engine.wake("b")
    for x, y in zip(a.cache, b.cache):
        assert mx.array_equal(x.keys[..., :9, :], y.keys[..., :9, :]).item()


def kv_of(cache: list, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first n tokens' keys and values of every layer, as bits."""
    return [(np.array(c.keys[..., :n, :].view(mx.uint16)), np.array(c.values[..., :n, :].view(mx.uint16)))
            for c in cache]


def assert_stages(engine) -> None:
    """`engine` (made) restores staged: restores_as(monkeypatch, "staged") ran before it was made."""
    assert engine.restore_mode == engine.kv.restore_mode == "staged" and engine.kv.device_planes


def count_calls(monkeypatch, engine, **kinds: str) -> dict[str, int]:
    """Calls of devplanes' functions (kind=function name) by `engine`'s sleeps and restores, from now on: once the
    engine is made, for on CUDA its start makes a wake's staging and runs each join once beside the weights'
    load (kernel_cache.BesideLoad, warm=False or not), which is not the restore a test counts."""
    from kvwake.daemon.kv import devplanes

    assert_stages(engine)
    calls = dict.fromkeys(kinds, 0)
    for kind, name in kinds.items():
        def counted(*args, _real=getattr(devplanes, name), _kind=kind, **kwargs):
            calls[_kind] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(devplanes, name, counted)
    return calls


def count_joins(monkeypatch, engine) -> dict[str, int]:
    """Spans joined on the device from byte planes and from raw runs, counted from now on (as count_calls)."""
    return count_calls(monkeypatch, engine, planes="join", raw="join_raw")


def test_the_discrete_gpu_path_stages_raw_and_planed_blocks_in_one_span_exactly(model_dir, tmp_path, monkeypatch):
    # Was: raw blocks were never staged, so on a GPU they went through host arrays the size of the session
    # and one upload per tensor and block: a long session's wake took minutes.
    # Now a raw block stages as stored and joins on the device; one span mixes a planes-zstd block (stored
    # by an earlier store setting), raw ones and one from the RAM tier; the KV must come back bit for bit.
    from kvwake.daemon.kv import devplanes
    from kvwake.store.format.codec import read_file_header

    restores_as(monkeypatch, "staged")
    tokens = [(i * 5) % 256 for i in range(150)]
    store = Store(tmp_path / "store", block_tokens=16, codec="planes-zstd")
    engine = Engine(store, tmp_path, model_dir, warm=False)
    a = Session("a")
    engine.append(a, tokens=tokens[:70])
    engine.sleep(a)
    engine.close()
    store.close()
    store = Store(tmp_path / "store", block_tokens=16, codec="raw")
    engine = Engine(store, tmp_path, model_dir, warm=False)
    monkeypatch.setattr(devplanes, "RING_SLOTS", 2)  # from here on, as count_calls
    real_ring, joins = devplanes.Ring.__init__, count_joins(monkeypatch, engine)

    def ring(self, blocks, size, plane_bytes, block_bytes, most=None, owner=None):
        monkeypatch.setattr(devplanes, "SPAN_BYTES", 6 * block_bytes)
        real_ring(self, blocks, size, plane_bytes, block_bytes, most, owner)
    monkeypatch.setattr(devplanes.Ring, "__init__", ring)
    try:
        b = Session("b")
        engine.append(b, tokens=tokens)
        before = kv_of(b.cache, 149)
        record = engine.store.snapshot(engine.sleep(b)["snapshot_id"])
        codecs = [read_file_header(engine.store.files.absolute(ref.file).read_bytes())[0] for ref in record.blocks]
        assert codecs[:4] == ["planes-zstd"] * 4 and codecs[4:] == ["raw"] * 5, codecs
        engine.ram_tier.__init__(engine.ram_tier.budget)
        engine.ram_tier.put(record.blocks[2].key, engine.store.read_block(record.blocks[2]))
        joins.update(planes=0, raw=0)  # b's append joined "a"'s blocks (a prefix hit): the wake's alone
        b, _ = engine.wake("b")
        # span 0: blocks 0-1 planes, 2 from memory, 3 planes, 4-5 raw; span 1: 6-8 raw; the tail raw
        assert joins == {"planes": 2, "raw": 3}, joins
        assert all(np.array_equal(x, y) for pair, again in zip(before, kv_of(b.cache, 149)) for x, y in zip(pair, again))
    finally:
        engine.close()
        store.close()


def test_the_discrete_gpu_path_stages_zstd_blocks_as_raw_runs_exactly(model_dir, tmp_path, monkeypatch):
    # Was: "zstd" blocks were never staged: decoded on the CPU into the device's arrays, a long session's
    # wake took minutes where codec "auto" had picked zstd.
    restores_as(monkeypatch, "staged")
    tokens = [(i * 7) % 256 for i in range(120)]
    store = Store(tmp_path / "store", block_tokens=16, codec="zstd")
    engine = Engine(store, tmp_path, model_dir, warm=False)
    joins = count_joins(monkeypatch, engine)
    try:
        a = Session("a")
        engine.append(a, tokens=tokens)
        before = kv_of(a.cache, 119)
        engine.sleep(a)
        engine.ram_tier.__init__(engine.ram_tier.budget)  # every block from its file
        a, _ = engine.wake("a")
        assert joins["raw"] >= 2 and joins["planes"] == 0, joins  # the spans and the tail, joined on the device
        assert all(np.array_equal(x, y) for pair, again in zip(before, kv_of(a.cache, 119)) for x, y in zip(pair, again))
    finally:
        engine.close()
        store.close()


def test_staging_mapped_for_the_gpu_is_kept_for_the_next_wake_and_unmapped_before_mlx_reuses_it(
        staged_engine, monkeypatch):
    # On CUDA the ring's slots (and the tail's staging) are kept on the host and mapped for the GPU
    # (cudart.py); a kernel must never write such memory once MLX takes it back. The ring's slots wait
    # for the next wake still mapped (made once: a fixed cost a small wake noticed); the tail's
    # staging is unmapped when its wake ends; drop_idle unmaps what waits.
    from kvwake.daemon.kv import cudart, devplanes

    devplanes.drop_idle()
    mapped, unmapped = [], []
    monkeypatch.setattr(cudart, "map_to_device", lambda ptr, n: mapped.append((ptr, n)) or True)
    monkeypatch.setattr(cudart, "unmap", lambda ptr, n: unmapped.append((ptr, n)) or True)
    monkeypatch.setattr(cudart, "active", lambda: True)
    engine = staged_engine
    a = Session("a")
    engine.append(a, tokens=list(range(70)))
    engine.sleep(a)
    engine.wake("a")
    slots = [m for m in mapped if m not in unmapped]
    assert len(mapped) == len(slots) + 1 and len(unmapped) == 1  # the tail's staging, unmapped at once
    engine.wake("a")
    assert len(mapped) == len(slots) + 2 and len(unmapped) == 2  # the ring's slots were reused, not made
    devplanes.drop_idle()
    assert sorted(unmapped) == sorted(mapped)
    mapped.clear(), unmapped.clear()
    ring = devplanes.Ring(4, 2, 64, 128)
    del ring  # dropped without close (a failed wake): its slots wait, mapped, for the next one
    assert mapped and not unmapped
    devplanes.drop_idle()
    assert sorted(unmapped) == sorted(mapped)


@pytest.fixture
def mapped_staging(monkeypatch):
    """Staging "mapped" as on CUDA (the mapping stood in), nothing idle, spans of 8 blocks of 128 bytes (3 slots
    for 24); the slots mapped so far, a list the tests read."""
    from kvwake.daemon.kv import cudart, devplanes

    devplanes.drop_idle()
    mapped: list = []
    monkeypatch.setattr(cudart, "map_to_device", lambda ptr, n: mapped.append((ptr, n)) or True)
    monkeypatch.setattr(cudart, "unmap", lambda ptr, n: True)
    monkeypatch.setattr(cudart, "active", lambda: True)
    monkeypatch.setattr(devplanes, "SPAN_BYTES", 8 * 128)
    return mapped


def test_a_ring_short_of_idle_slots_decodes_fewer_spans_ahead_rather_than_make_slots(mapped_staging):
    """Was: every ring made the slots the idle ones could not give; a restart's eight wakes at once made five
    slots afresh, each a long engine-thread job the other wakes waited behind (docs/benchmarks.md, "fleet")."""
    from kvwake.daemon.kv import devplanes

    mapped = mapped_staging
    try:
        alone = devplanes.Ring(24, 2, 64, 128)
        assert alone.slots == 1 and len(mapped) == 1  # nothing idle: its first slot made, no more
        alone.close()
        devplanes.warm(mx.zeros((1, 2, 32, 1), mx.bfloat16), tensors=1, block_tokens=32)  # 2 x 32 x 2 = 128 bytes
        assert len(mapped) == devplanes.KEEP_SLOTS  # the start's slots: the one made before and the rest
        rings = [devplanes.Ring(24, 2, 64, 128) for _ in range(devplanes.KEEP_SLOTS // 3 + 2)]
        assert [r.slots for r in rings] == [3] * (devplanes.KEEP_SLOTS // 3) + [1, 1]
        assert len(mapped) == devplanes.KEEP_SLOTS + 2  # the two wakes past the idle slots made one each
        for r in rings:
            r.close()
    finally:
        devplanes.drop_idle()


def test_a_start_told_of_the_wakes_ahead_makes_a_slot_for_each_and_they_make_none(mapped_staging):
    """Was: the slots made beside the load were KEEP_SLOTS whatever was to wake; a restart's sixteen wakes (a
    leader's ring of RING_SLOTS, one slot each for the fifteen waiting for it) made five afresh, long
    engine-thread jobs the leader's upload waited between (docs/benchmarks.md, "fleet")."""
    from kvwake.daemon.kv import devplanes

    mapped = mapped_staging
    wakes = devplanes.KEEP_SLOTS + 4
    try:
        devplanes.warm(mx.zeros((1, 2, 32, 1), mx.bfloat16), tensors=1, block_tokens=32, wakes=wakes)
        assert len(mapped) == wakes - 1 + devplanes.RING_SLOTS
        leader = devplanes.Ring(24, 2, 64, 128)
        waiters = [devplanes.Ring(24, 2, 64, 128, most=1) for _ in range(wakes - 1)]
        assert leader.slots == devplanes.RING_SLOTS and [r.slots for r in waiters] == [1] * (wakes - 1)
        assert len(mapped) == wakes - 1 + devplanes.RING_SLOTS  # none made for them
        for r in [leader, *waiters]:
            r.close()
        # a later warm-up naming no wakes keeps them; more than MOST_KEPT are never made
        devplanes.warm(mx.zeros((1, 2, 32, 1), mx.bfloat16), tensors=1, block_tokens=32)
        assert len(next(iter(devplanes._idle.values()))) == wakes - 1 + devplanes.RING_SLOTS
        devplanes.warm(mx.zeros((1, 2, 32, 1), mx.bfloat16), tensors=1, block_tokens=32, wakes=1000)
        assert len(next(iter(devplanes._idle.values()))) == devplanes.MOST_KEPT
    finally:
        devplanes.drop_idle()
    assert devplanes._keep == devplanes.KEEP_SLOTS  # dropped with the engine: the next start counts afresh


def test_a_block_decoded_anywhere_but_its_place_is_refused(engine):
    # The check that a decode landed in place is by identity with the view `place` handed out (it was
    # np.shares_memory, an overlap solver per tensor: 8% of a wake's decoding threads on the CPU).
    from kvwake.daemon.kv import restore_buffers as kvfill
    from kvwake.daemon.kv.cache_blocks import StateMismatchError

    s = Session("s")
    engine.append(s, tokens=list(range(40)))
    record = engine.store.snapshot(engine.sleep(s)["snapshot_id"])
    ref, b = record.blocks[1], engine.block_tokens
    sample = engine.store.block_specs(ref)
    buffers = kvfill.Buffers(engine.model, sample, b, 40, b, mode="direct")
    buffers.check(engine.store.read_block(ref, place=buffers.place(b, b)), b, b, "block 1")
    with pytest.raises(StateMismatchError, match="not of this model's KV"):
        buffers.check(engine.store.read_block(ref), b, b, "block 1")  # decoded into new arrays
    arrays = engine.store.read_block(ref, place=buffers.place(0, b))  # decoded into block 0's place
    with pytest.raises(StateMismatchError, match="not of this model's KV"):
        buffers.check(arrays, b, b, "block 1")


def test_a_mapping_is_all_or_nothing_and_its_undoing_tries_both_advices(monkeypatch):
    # A refused second advice left the first (host preferred) in place for good, and a refused first
    # undo skipped the second: memory MLX would reuse for a kernel's output stayed slow to write.
    from kvwake.daemon.kv import cudart, devplanes

    calls = []
    refuse = {cudart._SET_ACCESSED_BY, cudart._UNSET_ACCESSED_BY}
    monkeypatch.setattr(cudart, "_advise", lambda ptr, n, advice, kind, ident: calls.append(advice) or
                        (1 if advice in refuse else 0))
    assert not cudart.map_to_device(4096, 64)
    assert calls == [cudart._SET_PREFERRED, cudart._SET_ACCESSED_BY, cudart._UNSET_PREFERRED]
    calls.clear()
    assert not cudart.unmap(4096, 64)
    assert calls == [cudart._UNSET_ACCESSED_BY, cudart._UNSET_PREFERRED]
    # Where nothing is mapped (the CPU, Metal) a ring's slots are its own size and are not kept.
    monkeypatch.setattr(cudart, "_advise", False)
    devplanes.drop_idle()
    ring = devplanes.Ring(2, 2, 64, 128)
    assert ring.arrays[0].shape == (2, 128)
    ring.close()
    assert devplanes._idle == {}


@pytest.mark.parametrize("damaged", [None, 5, 0])
def test_a_staged_prefix_hit_joins_span_by_span_on_the_device_and_a_bad_block_shortens_it(
        model_dir, tmp_path, monkeypatch, damaged):
    # Was: a prefix hit decoded every block into host views (numpy joining byte planes on the CPU), kept
    # each in the RAM tier, and uploaded them at its end: decoding and uploading took longer than prefilling
    # them (docs/decisions.md, "Engine"). Now its blocks stage and join on
    # the device span by span, as a wake's do; a damaged block ends the hit there (its tokens prefilled).
    from kvwake.daemon.kv import restore_buffers as kvfill

    restores_as(monkeypatch, "staged")
    released, real_release = [], kvfill.Buffers.release
    monkeypatch.setattr(kvfill.Buffers, "release", lambda self: released.append(self) or real_release(self))
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, io_workers=3, warm=False, tuning=UNPAGED)
    _, joined = two_block_spans(monkeypatch, engine)
    try:
        tokens = [(i * 7) % 256 for i in range(150)]
        a = Session("a")
        engine.append(a, tokens=tokens)
        record = engine.store.snapshot(engine.sleep(a, free=False)["snapshot_id"])
        if damaged is not None:
            path = engine.store.files.absolute(record.blocks[damaged].file)
            data = bytearray(path.read_bytes())
            data[-5] ^= 0x40
            path.write_bytes(bytes(data))
        engine.ram_tier.__init__(engine.ram_tier.budget)
        b = Session("b")
        got = engine.append(b, tokens=[*tokens[:140], 1, 2, 3])
        blocks = 8 if damaged is None else damaged  # whole blocks of 16 in the 140 shared tokens
        reused = 140 if damaged is None else 16 * damaged  # and the partial block's 12 tokens
        assert got["reused"] == reused
        assert joined == {None: [(0, 2), (2, 2), (4, 2), (6, 2)], 5: [(0, 2), (2, 2), (4, 1)], 0: []}[damaged]
        assert len(released) == 1  # staging and joined spans go back through release, used or given up
        staged_hot = [k for k in (r.key for r in record.blocks[:blocks]) if engine.ram_tier.get(k) is not None]
        assert staged_hot == []  # staged blocks are not copied into the RAM tier
        for x, y in zip(kv_of(a.cache, reused), kv_of(b.cache, reused)):  # the reused tokens' KV, bit for bit
            assert np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])
    finally:
        engine.close()
        store.close()


@pytest.mark.parametrize("what", ["prefix hit", "wake"])
def test_a_staged_restore_lays_its_kv_out_a_slice_per_engine_job_exactly(engine, monkeypatch, what):
    # Was: a prefix hit moved all its KV from host views to the device in one engine-thread job: a decoding
    # neighbour waited for all of it. Now one job lays out tensors for ~UPLOAD_JOB_S.
    from kvwake.daemon.kv import restore_buffers as kvfill

    restores_as(monkeypatch, "staged", engine)
    monkeypatch.setattr(kvfill, "UPLOAD_JOB_S", 0)  # one tensor per job
    tokens = list(range(3, 203))
    hot = Session("hot")
    engine.append(hot, tokens=tokens)
    engine.sleep(hot, free=False)  # its blocks are stored: a prefix for the next session
    jobs: list[str] = []

    def mlx(fn):
        jobs.append(getattr(fn, "__qualname__", ""))
        return fn()

    if what == "prefix hit":
        cold = Session("cold")
        engine.append(cold, tokens=tokens, mlx=mlx)
        assert engine.counters["tokens_reused"] >= 192
    else:
        cold, _ = engine.wake("hot", mlx=mlx)
    uploads = [j for j in jobs if "<lambda>" in j and any(f in j for f in ("restore_prefix", "_restore", "_finish"))]
    tensors = 2 * len(engine.make_cache())  # keys and values per layer
    assert len(uploads) >= tensors, jobs  # a job per tensor (and the buffers' and the finish's)
    assert_same_kv_and_continuation(engine, hot, cold, 192)


@pytest.mark.parametrize("paged", [False, True])
def test_a_warmed_engine_wakes_through_staging_made_before_the_request(model_dir, tmp_path, monkeypatch, paged):
    # On CUDA a daemon's first restore made its ring (fresh managed allocations the CPU writes, slow to make)
    # in an engine-thread job, a decoding neighbour's gap. The warm-up makes the slots
    # (kept mapped, idle) and runs both joins once; a wake then takes those slots and makes none. Paged
    # (`paged_kv`), the wake joins its spans into pages through the same ring: the warm-up made none for it
    # (its sample was the engine's paged cache), so a restart's first paged wake made the ring itself.
    from kvwake.daemon.kv import cudart, devplanes

    restores_as(monkeypatch, "staged")
    monkeypatch.setattr(cudart, "_advise", lambda ptr, n, advice, kind, ident: 0)  # mapping "works" (as on CUDA)
    devplanes.drop_idle()
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, io_workers=3, tuning=Tuning(paged_kv=paged))
    try:
        assert engine._warm_staging() and (engine.pages is not None) is paged
        ((shape, idle),) = devplanes._idle.items()
        args = engine.model.args
        kv_heads, dim = args.num_key_value_heads, args.hidden_size // args.num_attention_heads
        block_bytes = 2 * args.num_hidden_layers * kv_heads * 16 * dim * 2  # keys and values, bf16
        assert len(idle) == devplanes.KEEP_SLOTS and shape == (devplanes.SPAN_BYTES // block_bytes, block_bytes)
        made = []
        real = devplanes.staging
        monkeypatch.setattr(devplanes, "staging", lambda shape: made.append(shape) or real(shape))
        before: list[bytes] = []
        a, b = slept_and_woken(engine, [(i * 5) % 256 for i in range(100)], before)
        assert [m for m in made if m == shape] == []  # the ring's slots were the warm-up's
        if paged:  # b's prefill mapped a's pages, a prefix hit (on CUDA held to a bound, not bits): b is its own reference
            assert kv_bytes(b, 99) == before
        else:
            assert_same_kv_and_continuation(engine, a, b, 99)
        # wakes running together (a restart's) each take a ring of kept slots: none is made for them
        rings = [devplanes.Ring(devplanes.KEEP_SLOTS * shape[0], 2, block_bytes // 2, block_bytes)
                 for _ in range(devplanes.KEEP_SLOTS // devplanes.RING_SLOTS)]
        assert sum(r.slots for r in rings) == devplanes.KEEP_SLOTS > devplanes.RING_SLOTS
        assert [m for m in made if m == shape] == []
        for ring in rings:
            ring.close()
        assert len(devplanes._idle[shape]) == devplanes.KEEP_SLOTS
        # another model's rings (another shape) are kept beside these, not in their place (none of its shape
        # idle: the ring makes its first slot only)
        other = (shape[0] * 2, block_bytes // 2)
        devplanes.Ring(devplanes.RING_SLOTS * other[0], 2, other[1] // 2, other[1]).close()
        assert len(devplanes._idle[shape]) == devplanes.KEEP_SLOTS and len(devplanes._idle[other]) == 1
        devplanes.drop_idle(other)
        assert list(devplanes._idle) == [shape]
    finally:
        engine.close()
        store.close()
        devplanes.drop_idle()


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_sessions_woken_together_read_each_shared_block_once_and_wake_exactly(engine, monkeypatch, mode):
    import concurrent.futures as cf

    restores_as(monkeypatch, mode, engine)
    shared = [(i * 5) % 256 for i in range(64)]  # 4 blocks of 16 both sessions hold
    sessions = {}
    for name, own in (("a", [1, 2, 3] * 7), ("b", [4, 5, 6] * 7)):
        s = Session(name)
        engine.append(s, tokens=shared + own)
        sessions[name] = kv_of(s.cache, 80)
        engine.sleep(s)
    engine.ram_tier.__init__(engine.ram_tier.budget)
    # Neither wake reads a block until both have said which blocks they need (they were sent together).
    both, wanting = threading.Barrier(2, timeout=10), engine.ram_tier.wanting

    @contextlib.contextmanager
    def wanting_together(keys):
        with wanting(keys) as wants:
            both.wait()
            yield wants
    monkeypatch.setattr(engine.ram_tier, "wanting", wanting_together)
    engine_thread = cf.ThreadPoolExecutor(1)  # MLX work on one thread, as the daemon's engine thread

    def on_engine(fn):
        return engine_thread.submit(fn).result()
    before = dict(engine.counters)
    with cf.ThreadPoolExecutor(2) as callers:
        woken = dict(zip("ab", callers.map(lambda sid: engine.wake(sid, None, on_engine), "ab")))
    engine_thread.shutdown()
    read = engine.counters["blocks_disk"] - before["blocks_disk"]
    taken = engine.counters["blocks_ram"] - before["blocks_ram"]
    if mode == "direct":  # the shared blocks once, each session's own block once
        assert (read, taken) == (4 + 1 + 1, 4)
    else:  # staged: each stages its own copy on the device (sharing through host views was slower on a GPU)
        assert (read, taken) == (5 + 5, 0)
    for name, (s, _) in woken.items():
        for (k, v), (k2, v2) in zip(sessions[name], kv_of(s.cache, 80)):
            assert np.array_equal(k, k2) and np.array_equal(v, v2)
    assert not engine.ram_tier._held and not engine.ram_tier._wants  # nothing held once both wakes ended


def test_staged_restores_running_together_clear_mlxs_cache_once_the_last_of_them_ends(model_dir, tmp_path,
                                                                                      monkeypatch):
    # A restart's wakes run together: each clearing MLX's cache as it ended made the next one allocate its
    # buffers afresh (and cleared gigabytes with a device sync per wake, on CUDA); the last one clears it.
    import gc

    from kvwake.daemon.kv import pipeline
    from kvwake.daemon.kv import restore_buffers as kvfill

    restores_as(monkeypatch, "staged")
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, io_workers=2, warm=False)
    try:
        a = Session("a")
        engine.append(a, tokens=[(i * 5) % 256 for i in range(150)])
        record = engine.store.snapshot(engine.sleep(a)["snapshot_id"])
        sample = pipeline.block_specs(engine.kv, record.blocks[0])
        cleared: list[int] = []
        monkeypatch.setattr(kvfill.mx, "clear_cache", lambda: cleared.append(1))

        def make() -> kvfill.Buffers:
            return kvfill.Buffers(engine.model, sample, 16, 150, 16, mode="staged", n_blocks=9)
        first, second = make(), make()
        first.release()
        assert cleared == []  # the second still runs
        second.release()
        assert cleared == [1]
        given_up = make()  # a restore dropped without its release does not keep the cache from clearing
        del given_up
        gc.collect()
        last = make()
        last.release()
        assert cleared == [1, 1]
        direct = kvfill.Buffers(engine.model, sample, 16, 150, 16, mode="direct", n_blocks=9)
        direct.release()
        assert cleared == [1, 1]  # direct restores (the CPU's, unified memory's) never cleared it
    finally:
        engine.close()
        store.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_an_engines_close_keeps_a_ring_of_its_own_slots_and_every_other_models(mapped_staging, tmp_path, monkeypatch,
                                                                              arch):
    """Was: closing an engine (a model's unload) dropped every model's kept slots, and its own to the last, so a
    model loaded again for its sessions made its first wake's slot afresh (a long job) and staged one span ahead
    (docs/decisions.md, "A load reads its sessions' blocks ahead"). A model with sliding-window layers stages its
    plain ones through the same rings: their slots are its own too."""
    from kvwake.daemon.kv import devplanes
    from testkit.tinymodel import make_model_dir

    restores_as(monkeypatch, "staged")
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, make_model_dir(tmp_path / arch, arch=arch), warm=False)
    other = devplanes.slot_shape((1, 2, 32, 1), 2, 1, 32)  # another model's KV, its slots of another shape
    try:
        a = Session("a")
        engine.append(a, tokens=[(i * 7) % 200 for i in range(70)])
        engine.sleep(a)
        engine.wake("a")
        (mine,) = devplanes._owned[id(engine.model)]
        assert devplanes._idle[mine]  # its wake's ring's, kept
        devplanes._give_back(mine, [devplanes.staging(mine) for _ in range(devplanes.KEEP_SLOTS)])
        devplanes.warm(mx.zeros((1, 2, 32, 1), mx.bfloat16), tensors=1, block_tokens=32)
        assert len(devplanes._idle[other]) == devplanes.KEEP_SLOTS
        engine.close()
        assert len(devplanes._idle[mine]) == devplanes.RING_SLOTS  # a ring's worth of its own
        assert len(devplanes._idle[other]) == devplanes.KEEP_SLOTS  # the other model's, all
        assert id(engine.model) not in devplanes._owned
    finally:
        store.close()
        devplanes.drop_idle()
