"""`--tune paged_kv=true` through the engine (tiny llama, CPU): the same tokens as plain caches, a shared prompt
held once by sessions that come one after another, and a wake into pages."""

from __future__ import annotations

import pytest

from kvwake.daemon.config import Settings, Tuning
from kvwake.daemon.kv.paged_cache import PagedKVCache
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.model.provider import ModelProvider
from kvwake.daemon.model.thread import EngineThread
from kvwake.daemon.session_state import Session
from kvwake.daemon.sessions.manager import SessionManager
from kvwake.store import Store

BLOCK = 16
PROMPT = "a shared system prompt with the tools an agent may call, " * 6  # 18 blocks and a part


@pytest.fixture
def engines(model_dir, tmp_path):
    made = [(Engine(Store(tmp_path / n, block_tokens=BLOCK), tmp_path, model_dir, max_batch=8,
                    tuning=Tuning(paged_kv=n == "paged")), n) for n in ("plain", "paged")]
    yield made[0][0], made[1][0]
    for e, _ in made:
        e.close()
        e.store.close()


def turn(engine: Engine, name: str, text: str, n: int = 8) -> tuple[Session, list[int]]:
    s = Session(name)
    engine.append(s, text=text)
    return s, engine.generate(s, GenerateParams(max_tokens=n)).tokens


def test_sessions_over_one_prompt_share_its_pages_and_decode_as_plain_caches_do(engines):
    plain, paged = engines
    assert paged.pages is not None and plain.pages is None
    for i in range(4):
        text = PROMPT + f" user {i}: go"
        s, tokens = turn(paged, f"s{i}", text)
        assert tokens == turn(plain, f"s{i}", text)[1]
        assert all(isinstance(c, PagedKVCache) for c in s.cache)
        if i == 0:
            alone = paged.pages.pool.pages_held()
    # each later session took the prompt's 18 resident blocks, and holds its own last two pages
    assert paged.pages.pool.pages_held() <= alone + 3 * 2


def test_a_paged_session_sleeps_and_wakes_into_pages(engines):
    _, paged = engines
    s, _ = turn(paged, "s", PROMPT)
    before = [c.keys for c in s.cache]
    paged.sleep(s)
    woken, _ = paged.wake("s")
    assert all(isinstance(c, PagedKVCache) for c in woken.cache)
    assert all((a == c.keys).all().item() for a, c in zip(before, woken.cache))


async def test_hot_kv_counts_the_pages_held_once_and_whole_after_a_sharing_session_sleeps(model_dir, tmp_path):
    # Each session's measure (taken at its claims) counts its share of the pages it lists; once a session that
    # shared them sleeps, the other's share grows without a claim of its own: hot KV is read from the pool.
    store = Store(tmp_path / "store", block_tokens=BLOCK)
    thread = EngineThread()
    engine = thread.submit(lambda: Engine(store, tmp_path, model_dir, tuning=Tuning(paged_kv=True))).result()
    m = SessionManager(ModelProvider.of(engine, thread), Settings(socket=tmp_path / "s.sock", data_dir=tmp_path))
    try:
        for sid in ("a", "b"):
            await m.create(sid)
            await m.append(sid, text=PROMPT + f" user {sid}: go")
        b = m.entries["b"].session
        share = engine.cache_bytes(b)  # b's measure at its claim: half the prompt's pages, all of its own
        assert m.hot_bytes() == engine.page_bytes() == share + engine.cache_bytes(m.entries["a"].session)
        await m.sleep("a")
        await m.released()
        thread.call(lambda: engine.pages.pool.drain())  # a's table, freed where the engine runs
        whole = len(engine.pages.pool.table(b.cache[0].session.name).pages) * engine.pages.pool.layout.page_bytes
        assert m.hot_bytes() == engine.page_bytes() == whole > share  # b holds the prompt's pages alone now
    finally:
        thread.stop()
        engine.close()
        store.close()


def test_the_page_pools_bound_follows_the_kv_room_as_other_models_load_and_unload(engines):
    # A second model's weights shrink this one's KV room (model/budget.py): the pool must not grow past the
    # new room; unloaded, it may grow again. Pages allocated already stay (a pool does not shrink).
    _, paged = engines
    pool, page = paged.pages.pool, paged.pages.pool.layout.page_bytes
    turn(paged, "s", PROMPT)
    allocated = pool.capacity
    paged.set_kv_room((allocated + 40) * page + page // 2)
    assert pool.limit == allocated + 40
    paged.set_kv_room(1)  # less than what is allocated: no further growth
    assert pool.limit == allocated
    paged.set_kv_room(4 * allocated * page)
    assert pool.limit == 4 * allocated


def test_pages_are_the_default_on_cuda_for_a_plain_model_and_asked_for_elsewhere(model_dir, tmp_path, monkeypatch):
    from kvwake.daemon.kv import cudart
    from kvwake.daemon.model import kernel_cache

    assert Tuning().paged_kv is None and Tuning().paged_kernel is None  # the machine's choice
    windowed = tmp_path / "windowed"
    windowed.mkdir()
    (windowed / "config.json").write_text('{"model_type": "gemma3_text", "sliding_window": 512}')
    for cuda in (False, True):
        monkeypatch.setattr(cudart, "on_cuda", lambda cuda=cuda: cuda)
        assert kernel_cache.paged_wanted(None, model_dir) is cuda  # tiny llama: plain attention only
        assert kernel_cache.paged_wanted(None, windowed) is False  # a window's layers keep their rings
        assert kernel_cache.paged_wanted(True, windowed) and not kernel_cache.paged_wanted(False, model_dir)
    monkeypatch.undo()
    engine = Engine(Store(tmp_path / "store", block_tokens=BLOCK), tmp_path, model_dir, warm=False)
    try:  # the engine takes the guess: pages and their kernel on CUDA, buffers on the CPU
        assert (engine.pages is not None) is cudart.on_cuda() is engine.decoder.paged_kernel
    finally:
        engine.close()
        engine.store.close()
    asked = []  # and where the guess says pages, whatever the machine, the engine pages (a CPU run sees that too)
    monkeypatch.setattr(kernel_cache, "paged_wanted", lambda configured, path: asked.append(configured) or True)
    engine = Engine(Store(tmp_path / "store2", block_tokens=BLOCK), tmp_path, model_dir, warm=False)
    try:
        assert asked == [None] and engine.pages is not None
    finally:
        engine.close()
        engine.store.close()
