"""The engine's side of paged KV (kv/paging.py) on a tiny llama: a prefix mapped from memory before the store
is asked, a stored one moved into pages, blocks published after a prefill, a wake's cache adopted."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from kvwake.daemon.kv import cache_blocks
from kvwake.daemon.kv.paged_cache import PagedKVCache
from kvwake.daemon.kv.paging import Pages
from kvwake.daemon.model.thread import EngineThread
from kvwake.daemon.session_state import Session
from testkit.tinymodel import make_model_dir

BUNDLE, BLOCK = "cd" * 32, 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    loaded, _ = load(str(make_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama")))
    return loaded


def pages_for(model) -> Pages:
    probe = make_prompt_cache(model)
    pages = Pages.for_model(probe, cache_blocks.layout(probe, model=model), BLOCK, 1 << 20, BUNDLE)
    assert pages is not None
    return pages


def prefilled(model, pages: Pages, name: str, ids: list[int]) -> Session:
    s = Session(name, tokens=list(ids), processed=len(ids), cache=pages.make(make_prompt_cache(model)))
    mx.eval(model(mx.array([ids]), cache=s.cache))
    return s


def test_a_resident_prefix_is_mapped_and_the_store_not_asked(model) -> None:
    pages, ids = pages_for(model), list(range(40, 40 + 3 * BLOCK + 1))
    first = prefilled(model, pages, "first", ids[:-1])
    assert pages.publish(first) == 3 and pages.publish(first) == 0  # each block once
    asked = []
    cache, tokens = pages.prefix(lambda: make_prompt_cache(model), ids, lambda: asked.append(1) or (None, 0))
    assert tokens == 3 * BLOCK and not asked
    assert pages.pool.table(cache[0].session.name).pages == pages.pool.table(first.cache[0].session.name).pages


def test_a_longer_stored_prefix_is_restored_into_pages_and_published(model) -> None:
    pages, ids = pages_for(model), list(range(60, 60 + 2 * BLOCK + 1))
    restored = make_prompt_cache(model)
    mx.eval(model(mx.array([ids[:-1]]), cache=restored))
    cache, tokens = pages.prefix(lambda: make_prompt_cache(model), ids, lambda: (restored, 2 * BLOCK))
    assert tokens == 2 * BLOCK and all(isinstance(c, PagedKVCache) for c in cache)
    assert len(pages.pool.shared) == 2  # published: the next session maps them
    again, _ = pages.prefix(lambda: make_prompt_cache(model), ids, lambda: pytest.fail("the store was asked"))
    assert pages.pool.table(again[0].session.name).pages == pages.pool.table(cache[0].session.name).pages


def test_woken_sessions_over_one_prompt_hold_its_blocks_once(model) -> None:
    pages, ids = pages_for(model), list(range(90, 90 + 4 * BLOCK))
    woken = []
    for n in range(3):
        s = Session(f"w{n}", tokens=list(ids), processed=len(ids), cache=make_prompt_cache(model))
        mx.eval(model(mx.array([ids]), cache=s.cache))  # what a wake restores: a contiguous cache
        pages.adopt(s)
        woken.append(s)
    assert pages.pool.pages_held() == 4
    status = pages.status()
    assert (status["held_pages"], status["shared_pages"], status["published_blocks"]) == (4, 4, 4)
    assert status["held_bytes"] == 4 * pages.pool.layout.page_bytes
    assert all(mx.array_equal(w.cache[0].keys, woken[0].cache[0].keys).item() for w in woken)


def test_a_wake_gives_the_stored_bytes_not_the_pages_a_prefill_computed(model) -> None:
    # On a GPU a prefill of the same tokens may differ from the stored bytes in the last bits; here a prefill's
    # published pages are changed to stand for that. A wake adopted beside them keeps its restored bytes.
    pages, ids = pages_for(model), list(range(120, 120 + 2 * BLOCK))
    computed = prefilled(model, pages, "computed", ids)
    assert pages.publish(computed) == 2
    for layer in range(len(pages.pool.keys)):  # the prefill's pages, off by a little
        pages.pool.keys[layer] = pages.pool.keys[layer] + 1e-3
    s = Session("woken", tokens=list(ids), processed=len(ids), cache=make_prompt_cache(model))
    mx.eval(model(mx.array([ids]), cache=s.cache))  # what the wake restored from the store
    restored = [c.keys[..., : len(ids), :] for c in s.cache]
    pages.adopt(s)
    assert all(mx.array_equal(c.keys, r).item() for c, r in zip(s.cache, restored))
    assert not mx.array_equal(computed.cache[0].keys, restored[0]).item()  # the prefill keeps its own
    assert pages.status()["published_blocks"] == 2 and pages.pool.pages_held() == 4


def test_a_woken_cache_adopted_on_the_engine_thread_reads_on_another(model) -> None:
    """A restored cache is evaluated on return (callers read it off the engine thread); adopted into pages,
    it is too: MLX evaluates an operation only on a thread that has its stream."""
    pages, ids = pages_for(model), list(range(120, 120 + 2 * BLOCK + 3))
    thread = EngineThread()
    try:
        def woken() -> Session:
            s = Session("w", tokens=list(ids), processed=len(ids), cache=make_prompt_cache(model))
            mx.eval(model(mx.array([ids]), cache=s.cache))
            want = [c.keys[..., : c.offset, :] for c in s.cache]
            mx.eval(want)
            pages.adopt(s)
            return s, want
        s, want = thread.submit(woken).result()
        assert all(mx.array_equal(w, c.keys).item() for w, c in zip(want, s.cache, strict=True))
    finally:
        thread.stop()
