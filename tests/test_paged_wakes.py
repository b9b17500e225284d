"""A paged wake maps the pages already resident and reads only the rest (kv/paged_wake.py; tiny llama, CPU):
sessions sharing a prompt, one hot and the others woken, read only their own blocks and hold the prompt's pages
once, bit for bit as an unpaged wake and as before their sleep; wakes over one prompt share a flight."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvwake.daemon.config import Settings, Tuning
from kvwake.daemon.kv.cudart import on_cuda
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.model.provider import ModelProvider
from kvwake.daemon.model.thread import EngineThread
from kvwake.daemon.session_state import Session
from kvwake.daemon.sessions.manager import SessionManager
from kvwake.store import Store
from tests.test_shared_wakes import BLOCKS, OWN, SHARED, SHARED_BLOCKS, slept, wake_together

BLOCK = 16
EIGHT = {f"s{i}": [(i * 13 + k) % 90 + 5 for k in range(40)] for i in range(8)}  # 340 tokens: 21 blocks, 3 more
OWN_PAGES = 22 - SHARED_BLOCKS  # a session's pages past the prompt's: blocks 18-20 and its partial page


def kv_of(session: Session) -> list[bytes]:
    """Every layer's K and V the session holds, as bytes (a paged layer's gathered from its pages)."""
    return [np.asarray(a[..., : c.offset, :].view(mx.uint16)).tobytes() for c in session.cache
            for a in (c.keys, c.values)]


@pytest.fixture(params=["direct", "staged"])
def engines(request, model_dir, tmp_path, monkeypatch):
    """A plain engine and a paged one, each with its own store, restoring in the mode named whatever the
    backend; "staged": a discrete GPU's restore path (a ring of two-block spans), here too."""
    from tests.test_pipeline import restores_as, two_block_spans

    restores_as(monkeypatch, request.param)  # "direct" too: a CUDA engine's default is staged
    # On CUDA the unpaged engine decodes through MLX's fused attention, as the paged one's gather path does (the
    # row kernel's numerics are its own): the tests' tokens compare one kernel's results, as on the CPU.
    made = [Engine(Store(tmp_path / n, block_tokens=BLOCK), tmp_path, model_dir, max_batch=8, warm=False,
                   tuning=Tuning(paged_kv=n == "paged", row_kernel=not on_cuda())) for n in ("plain", "paged")]
    if request.param == "staged":
        two_block_spans(monkeypatch, made[1])
    yield made
    for e in made:
        e.close()
        e.store.close()


def reads(info: dict) -> int:
    return info["blocks_from_disk"] + info["blocks_from_memory"]


def test_woken_sessions_map_the_hot_sessions_pages_and_read_only_their_own(engines):
    plain, paged = engines
    pool, hot = paged.pages.pool, "s0"
    before, plain_before, plain_sessions = {}, {}, {}
    for sid, own in EIGHT.items():
        s, p = Session(sid), Session(sid)
        paged.append(s, tokens=SHARED + own)
        plain.append(p, tokens=SHARED + own)
        before[sid], plain_before[sid], plain_sessions[sid] = kv_of(s), kv_of(p), p
        if not on_cuda():  # bit for bit as today's path on the CPU; on CUDA the gather's numerics are its own
            assert before[sid] == plain_before[sid], sid
        if sid != hot:
            paged.sleep(s)
            plain.sleep(p)
        else:
            hot_session = s
    assert pool.pages_held() == SHARED_BLOCKS + OWN_PAGES  # the hot one's, the prompt's pages kept stored
    woken = {}
    for sid in list(EIGHT)[1:]:
        woken[sid], info = paged.wake(sid)
        assert (info["blocks_shared"], reads(info)) == (SHARED_BLOCKS, BLOCKS - SHARED_BLOCKS), (sid, info)
        assert kv_of(woken[sid]) == before[sid], sid  # as before its sleep
        plain_woken, plain_info = plain.wake(sid)
        assert plain_info["blocks_shared"] == 0 and kv_of(plain_woken) == plain_before[sid], sid  # an unpaged wake too
        assert woken[sid].restored == BLOCKS * BLOCK  # the mapped pages are the stored bytes
    assert pool.pages_held() == SHARED_BLOCKS + 8 * OWN_PAGES  # the prompt's pages held once by all eight
    assert paged.pages.status()["shared_pages"] == SHARED_BLOCKS
    params = GenerateParams(max_tokens=6)
    for sid in ("s1", "s7"):  # and they go on as the unpaged ones do
        assert paged.generate(woken[sid], params).tokens == plain.generate(plain.wake(sid)[0], params).tokens
    assert paged.generate(hot_session, params).tokens == plain.generate(plain_sessions[hot], params).tokens


def test_a_wake_maps_no_pages_a_prefill_computed_unless_the_store_wrote_them(engines):
    # The prompt's pages a prefill computed are the store's bytes only once a sleep wrote the store's blocks from
    # them; a store holding the blocks already (written from other bytes, on a GPU) does not make them so.
    _, paged = engines
    first = Session("first")
    paged.append(first, tokens=SHARED + EIGHT["s1"])
    paged.sleep(first)  # its pages freed; the store holds the prompt's blocks
    hot = Session("hot")
    paged.append(hot, tokens=SHARED + EIGHT["s2"])  # a prefix hit: restored, so its pages are the store's
    paged.pages.pool.stored.clear()  # as if its pages were a prefill's that the store did not write
    woken, info = paged.wake("first")
    assert (info["blocks_shared"], reads(info)) == (0, BLOCKS), info


@pytest.fixture
def paged_manager(model_dir, tmp_path):
    store = Store(tmp_path / "store", block_tokens=BLOCK)
    thread = EngineThread()
    engine = thread.submit(lambda: Engine(store, tmp_path, model_dir, tuning=Tuning(paged_kv=True))).result()
    yield SessionManager(ModelProvider.of(engine, thread), Settings(socket=tmp_path / "s.sock", data_dir=tmp_path))
    thread.stop()
    engine.close()
    store.close()


async def test_paged_wakes_over_one_prompt_share_a_flight_and_hold_its_pages_once(paged_manager, monkeypatch):
    m = paged_manager
    await slept(m)
    got = await wake_together(m, monkeypatch)
    assert reads(got["agent0"]) == BLOCKS and got["agent0"]["blocks_shared"] == 0, got["agent0"]
    for sid in ("agent1", "agent2", "agent3"):  # the leader's pages mapped, their own blocks read
        assert (got[sid]["blocks_shared"], reads(got[sid])) == (SHARED_BLOCKS, BLOCKS - SHARED_BLOCKS), got[sid]
    assert m.counters["wake_waits"] == 3 and len(m.shared) == 0
    pool = m.engine.pages.pool
    assert m.thread.call(pool.pages_held) == SHARED_BLOCKS + len(OWN) * OWN_PAGES
    together = {sid: kv_of(m.entries[sid].session) for sid in OWN}
    for sid in OWN:
        await m.sleep(sid)
    await m.released()
    assert m.thread.call(pool.pages_held) == 0  # the last sleep gave the prompt's pages back
    for sid in OWN:  # each woken alone after the others slept: every block read, the same bytes
        info = await m.wake(sid)
        assert info["blocks_shared"] == 0 and kv_of(m.entries[sid].session) == together[sid], sid
        await m.sleep(sid)
        await m.released()  # its pages gone (until then a wake may map them: they are the store's bytes)


def test_a_kill_9_after_paged_wakes_leaves_a_store_whose_wakes_count_their_pages_again(tmp_path, model_dir):
    # Reference counts live in memory: a daemon killed while woken sessions map one another's pages restarts
    # with none, wakes them reading the prompt once and mapping it after, gives every page back once they
    # sleep again, and its store checks clean.
    import signal

    from testkit.daemon import Daemon, freed

    d = Daemon(tmp_path, model_dir, env={"KVWAKE_PAGED_KV": "true"}).start()
    sids = ["s0", "s1", "s2", "s3"]
    with d.client() as c:
        for sid in sids:
            c.call("session.create", session_id=sid)
            c.call("session.append", session_id=sid, tokens=SHARED + EIGHT[sid])
        for sid in sids[1:]:
            c.call("session.sleep", session_id=sid)
        assert c.call("session.wake", session_id="s1")["blocks_shared"] == SHARED_BLOCKS  # s0's pages mapped
    d.stop(signal.SIGKILL)
    d.start()
    with d.client() as c:
        woken = [c.call("session.wake", session_id=sid) for sid in sids[1:]]
        assert [(w["blocks_shared"], reads(w)) for w in woken] == [(0, BLOCKS)] + 2 * [
            (SHARED_BLOCKS, BLOCKS - SHARED_BLOCKS)], woken
        pages = c.call("status")["pages"]
        assert (pages["held_pages"], pages["shared_pages"]) == (SHARED_BLOCKS + 3 * OWN_PAGES, SHARED_BLOCKS)
        for sid in sids[1:]:
            c.call("session.sleep", session_id=sid)
        freed(c)  # a sleep's KV is freed in the background, after its reply
        assert c.call("status")["pages"]["held_pages"] == 0
        assert c.call("store.fsck")["ok"]
    assert d.stop() == 0
    assert d.log_problems() == []


def test_a_paged_prefix_that_comes_after_the_wakes_own_blocks_is_mapped_exactly(engines):
    # A waiting wake's prefix (a leader's copy: a fork of its pages) comes once the wake's own blocks are in:
    # staged, the rows left for it go before the joined spans.
    from kvwake.daemon.kv import cache_blocks
    from tests.test_shared_wakes import Coming

    _, paged = engines
    a, b = Session("a"), Session("b")
    paged.append(a, tokens=SHARED + EIGHT["s1"])
    paged.append(b, tokens=SHARED + EIGHT["s2"])
    before = kv_of(b)
    paged.sleep(b)
    paged.pages.pool.stored.clear()  # nothing resident to map: the prefix comes from the leader
    coming = Coming(cache_blocks.copy_prefix(a.cache, SHARED_BLOCKS * BLOCK), SHARED_BLOCKS * BLOCK)
    woken, info = paged.wake("b", prefix=(coming, SHARED_BLOCKS * BLOCK))
    assert (info["blocks_shared"], reads(info)) == (SHARED_BLOCKS, BLOCKS - SHARED_BLOCKS), info
    assert kv_of(woken) == before
    pool = paged.pages.pool
    assert pool.table(woken.cache[0].session.name).pages[:SHARED_BLOCKS] == \
        pool.table(a.cache[0].session.name).pages[:SHARED_BLOCKS]  # a's pages listed, not copied


def asleep(paged: Engine, sid: str, tokens: list[int]) -> tuple[list[bytes], str]:
    """A session of `tokens` put to sleep, its pages freed and none resident (a wake reads every block): its KV
    before the sleep, and its snapshot."""
    s = Session(sid)
    paged.append(s, tokens=tokens)
    before = kv_of(s)
    snapshot = paged.sleep(s)["snapshot_id"]
    paged.release(s)
    paged.pages.pool.drain()
    paged.pages.pool.stored.clear()
    return before, snapshot


def peak_over(run) -> int:
    """The most bytes MLX held while `run()` ran above what it held before."""
    before = (mx.reset_peak_memory(), mx.get_active_memory())[1]
    run()
    return mx.get_peak_memory() - before


def test_a_paged_wake_restores_into_pages_without_a_buffer_of_the_sessions_size(engines, monkeypatch):
    # Every block read: straight into pages, the wake holds a ring of a few blocks beside the pages; through a
    # contiguous buffer (the path it replaced) it held the session's KV once more.
    from kvwake.daemon.kv import page_restore

    from kvwake.daemon.kv import devplanes

    _, paged = engines
    monkeypatch.setattr(page_restore, "SPAN_BLOCKS", 4)  # direct: a ring of 3 x 4 blocks for 21 (staged: 2 x 2)
    # A GPU's staging slots (SPAN_BYTES each, whatever the session's size) are made where none is idle and kept
    # for later wakes (kv/devplanes.py): on CUDA a wake here made one, 134 MB. Not the session's buffer: not counted.
    made = [0]
    real_staging = devplanes.staging

    def staging(shape):
        made[0] += int(np.prod(shape))
        return real_staging(shape)
    monkeypatch.setattr(devplanes, "staging", staging)
    pool = paged.pages.pool
    before, _ = asleep(paged, "s", SHARED + EIGHT["s1"])
    for into_pages in (False, True):  # what a first wake of each path makes and keeps (a GPU's staging ring's
        monkeypatch.setattr(page_restore, "ENABLED", into_pages)  # slots, of each path's shape) is not a wake's
        warm, _ = paged.wake("s")  # to count
        warm.cache = None
        pool.drain()
        pool.stored.clear()
    peaks = {}
    for into_pages in (False, True):
        monkeypatch.setattr(page_restore, "ENABLED", into_pages)
        box = []
        made[0] = 0
        peaks[into_pages] = peak_over(lambda: box.append(paged.wake("s"))) - made[0]
        woken, info = box[0]
        assert (info["blocks_shared"], reads(info)) == (0, BLOCKS), info
        table = pool.table(woken.cache[0].session.name)
        assert kv_of(woken) == before and len(table.pages) == BLOCKS + 1
        woken.cache = box[0] = None
        pool.drain()
        pool.stored.clear()
    # the pool's pages are allocated already: what a wake adds is its buffer (the session's KV) or its ring
    assert peaks[False] >= pool.layout.page_bytes * (BLOCKS + 1) > peaks[True], peaks


def test_a_failed_paged_wake_gives_back_the_pages_it_took(engines, monkeypatch):
    from kvwake.daemon.kv import page_restore
    from kvwake.errors import CorruptBlockError

    _, paged = engines
    monkeypatch.setattr(page_restore, "SPAN_BLOCKS", 4)  # the last block is read once spans went into pages
    joined, real_join = [], page_restore.PageRestore.join_span
    monkeypatch.setattr(page_restore.PageRestore, "join_span",
                        lambda self, first, count: joined.append(first) or real_join(self, first, count))
    pool = paged.pages.pool
    before, snapshot = asleep(paged, "s", SHARED + EIGHT["s1"])
    held = pool.pages_held()
    path = paged.store.files.absolute(paged.store.snapshot(snapshot).blocks[-1].file)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError):
        paged.wake("s")
    assert joined and pool.pages_held() == held and len(pool.sessions) == 0  # spans went into pages, and back
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))
    assert kv_of(paged.wake("s")[0]) == before


def test_a_paged_wake_exact_while_the_pool_grows_and_after_a_plain_prefix(engines):
    # A pool of 16 pages grows while the wake's spans go into it, one block coming from the RAM tier (staged:
    # uploaded from its host rows beside staged ones); a plain cache's first blocks given as the prefix (not
    # pages: written into pages of their own) go before the blocks read.
    from kvwake.daemon.kv import paged_cache
    from kvwake.daemon.kv.pages import PagePool

    plain, paged = engines
    a = Session("a")
    plain.append(a, tokens=SHARED + EIGHT["s1"])
    before, snapshot = asleep(paged, "b", SHARED + EIGHT["s2"])
    paged.pages.pool = small = PagePool(paged.pages.pool.layout, 16, 64)
    block = paged.store.snapshot(snapshot).blocks[5]
    paged.ram_tier.put(block.key, paged.store.read_block(block))
    woken, info = paged.wake("b")
    assert (info["blocks_from_memory"], info["blocks_from_disk"]) == (1, BLOCKS - 1), info
    assert small.capacity == 32 and kv_of(woken) == before, info
    woken.cache = None
    small.stored.clear()
    shared = SHARED_BLOCKS * BLOCK
    woken, info = paged.wake("b", prefix=(a.cache, shared))
    assert (info["blocks_shared"], reads(info)) == (SHARED_BLOCKS, BLOCKS - SHARED_BLOCKS), info
    assert kv_of(woken) == before and paged_cache.is_paged(woken.cache)


def test_a_paged_wake_of_less_than_a_block_restores_its_partial_page(engines):
    _, paged = engines
    before, _ = asleep(paged, "short", SHARED[: BLOCK - 3])
    woken, _ = paged.wake("short")
    assert kv_of(woken) == before and woken.cache[0].session.tokens == BLOCK - 4  # the last token pending


def test_a_prefix_hit_over_pages_computes_its_tail_as_the_first_prefill_did(model_dir, tmp_path):
    """A second session over the same tokens maps the first's pages and computes only the tail past them: its
    KV is the first's bit for bit where chunked prefill is bit-stable (the CPU), else its next logits are within
    the bound a hit is held to (test_prefix's). An engine as the daemon makes it (warmed: on CUDA its prefill
    paths are measured and chosen then). Over pages such a hit happens where buffers would prefill cold: on
    CUDA the tail then differs from the cold prefill's in its second layer, not in every run (docs/decisions.md,
    "The paged default on the GPU's suite")."""
    from tests.capabilities import chunked_prefill_is_exact
    from tests.test_prefix import CHUNKED_LOGIT_BOUND, logits_after

    store = Store(tmp_path / "store", block_tokens=BLOCK)
    engine = Engine(store, tmp_path, model_dir, tuning=Tuning(paged_kv=True))
    try:
        tokens = [(i * 5) % 256 for i in range(100)]
        first, second = Session("first"), Session("second")
        engine.append(first, tokens=tokens)
        info = engine.append(second, tokens=tokens)
        assert info["reused"] == 96 and second.processed == first.processed == 99, info  # six whole blocks
        if chunked_prefill_is_exact(engine):
            assert kv_of(second) == kv_of(first)
        else:
            want, got = (logits_after(engine, s).astype(mx.float32) for s in (first, second))
            diff, scale = mx.abs(got - want).max().item(), mx.abs(want).max().item()
            assert diff <= CHUNKED_LOGIT_BOUND * scale, f"hit of 96 tokens: max logit diff {diff}, max logit {scale}"
    finally:
        engine.close()
        store.close()
