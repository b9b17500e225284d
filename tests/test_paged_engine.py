"""Sessions whose caches are paged, through the engine (tiny llama, CPU): prefill, batched and lone decode,
sleep and wake, and a fork, against the same engine's plain caches."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kvwake.daemon.kv import cache_blocks
from kvwake.daemon.kv.pages import PagePool
from kvwake.daemon.kv.paged_cache import PagedKVCache, page_layout, paged_cache
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.session_state import Session
from kvwake.store import Store
from tests.test_batching import PROMPTS, run_together, session

BLOCK = 16


def paged(engine: Engine, capacity: int = 512) -> PagePool:
    """Make `engine`'s new caches paged in a pool of its own (what `--tune paged_kv=true` wires)."""
    blank = make_prompt_cache(engine.model)
    pool = PagePool(page_layout(blank, cache_blocks.layout(blank, model=engine.model), BLOCK, BLOCK), capacity)
    plain = engine.kv.make_cache
    engine.kv.make_cache = lambda: paged_cache(pool, plain())
    return pool


@pytest.fixture
def engines(model_dir, tmp_path):
    made = []
    for name in ("plain", "paged"):
        store = Store(tmp_path / name, block_tokens=BLOCK)
        made.append((Engine(store, tmp_path, model_dir, max_batch=8), store))
    pool = paged(made[1][0])
    yield made[0][0], made[1][0], pool
    for e, store in made:
        e.close()
        store.close()


def test_paged_sessions_decode_batched_and_alone_the_tokens_plain_ones_do(engines):
    plain, paged_engine, pool = engines
    params = GenerateParams(max_tokens=12)
    want = [plain.generate(session(plain, f"a{i}", p), params).tokens for i, p in enumerate(PROMPTS)]
    alone = paged_engine.generate(session(paged_engine, "lone", PROMPTS[0]), params).tokens
    sessions = [session(paged_engine, f"b{i}", p) for i, p in enumerate(PROMPTS)]
    calls = [paged_engine.start_call(s, params) for s in sessions]
    run_together(paged_engine, calls, join_at={1: 2, 3: 5})
    assert engine_merged(paged_engine) and alone == want[0] and [c.future.result().tokens for c in calls] == want
    for s in sessions:  # the tokens the batch added went back into the session's pages
        assert all(isinstance(c, PagedKVCache) for c in s.cache)
        assert s.cache[0].offset == s.processed == pool.table(s.cache[0].session.name).tokens


def test_a_paged_session_sleeps_and_wakes_exactly(engines):
    _, engine, _ = engines
    s = session(engine, "s", PROMPTS[2])
    engine.generate(s, GenerateParams(max_tokens=9))
    engine.append(s, text=" and then")
    before = [(mx.array(c.keys), mx.array(c.values)) for c in s.cache]
    engine.sleep(s)
    woken, _ = engine.wake("s")
    assert woken.tokens == s.tokens and woken.processed == s.processed
    for (k, v), c in zip(before, woken.cache, strict=True):
        assert mx.array_equal(k, c.keys[..., : c.offset, :]).item()
        assert mx.array_equal(v, c.values[..., : c.offset, :]).item()


def test_a_copied_prefix_lists_the_same_pages_and_decodes_as_a_cold_session(engines):
    _, engine, pool = engines
    s = session(engine, "src", PROMPTS[2])
    n = 2 * BLOCK + 3
    held = pool.pages_held()
    copy = engine.copy_prefix(s, n)
    assert pool.pages_held() == held
    assert pool.table(copy[0].session.name).pages == pool.table(s.cache[0].session.name).pages[:3]
    twin = Session("twin", tokens=s.tokens[: n + 1], processed=n, cache=copy)  # the last token pending
    cold = Session("cold")
    engine.append(cold, tokens=s.tokens[: n + 1])
    params = GenerateParams(max_tokens=6)
    assert engine.generate(twin, params).tokens == engine.generate(cold, params).tokens


def engine_merged(engine: Engine) -> bool:
    """The calls did decode in a batch (merged into it), not each alone."""
    return engine.decoder.counters["merges"] > 0


def test_pages_shared_by_a_copy_outlive_the_session_that_sleeps_and_go_with_the_last(engines):
    _, engine, pool = engines
    s = session(engine, "first", PROMPTS[2])
    before = pool.pages_held()
    twin = Session("twin", tokens=list(s.tokens), processed=s.processed, cache=engine.copy_prefix(s, s.processed))
    shared = pool.table(twin.cache[0].session.name).pages
    kept = [mx.array(c.keys) for c in twin.cache]
    engine.sleep(s)  # its table is freed; the pages the twin lists stay, as they were
    assert pool.pages_held() == before and all(pool.refs[p] == 1 for p in shared)
    assert all(mx.array_equal(k, c.keys).item() for k, c in zip(kept, twin.cache, strict=True))
    engine.release(twin)
    assert pool.pages_held() == 0


def test_a_paged_row_that_leaves_the_batch_to_go_on_alone_keeps_its_pages(engines, monkeypatch):
    """(A merged batch's: one over pages pads nothing, so no row leaves it for its length.)"""
    from kvwake.daemon.model import decoder as decoder_module

    plain, engine, pool = engines
    engine.decoder.in_pages = False
    monkeypatch.setattr(decoder_module, "PAD_SLACK", 64)
    no_eos = tuple((t, -100.0) for t in engine.tokenizer.eos_token_ids)
    params = GenerateParams(max_tokens=10, logit_bias=no_eos)
    texts = ["word " * 40, "a short one"] + [f"agent {i}" for i in range(5)]  # the long row is evicted at the join
    want = [plain.generate(session(plain, f"p{i}", t), params).tokens for i, t in enumerate(texts)]
    sessions = [session(engine, f"e{i}", t) for i, t in enumerate(texts)]
    calls = [engine.start_call(s, params) for s in sessions]
    run_together(engine, calls, join_at={i: 3 for i in range(2, 7)})
    assert [c.future.result().tokens for c in calls] == want
    assert engine.decoder.counters["alone_for_length"] >= 1 and not engine.decoder.paged
    for s in sessions:
        assert all(isinstance(c, PagedKVCache) for c in s.cache)
        assert s.cache[0].offset == s.processed == pool.table(s.cache[0].session.name).tokens


def test_a_paged_sessions_prefill_and_turns_never_gather_what_it_holds(engines, monkeypatch):
    """The engine evaluates a paged layer's pools after a chunk, not its `state` (a gathered copy of every token
    it holds: the whole session's KV per layer and chunk; docs/benchmarks.md, "Paged KV in the fleet")."""
    _, engine, _ = engines
    gathered = []
    state = PagedKVCache.state
    monkeypatch.setattr(PagedKVCache, "state", property(lambda c: gathered.append(c.layer) or state.fget(c),
                                                        state.fset))
    s = session(engine, "s", PROMPTS[2] * 6)  # a prefill of several chunks
    engine.append(s, tokens=list(range(40, 75)))  # and a turn after it
    engine.generate(s, GenerateParams(max_tokens=4))
    assert s.processed > 6 * len(PROMPTS[2]) and gathered == []
