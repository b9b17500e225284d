"""Memory counted by pages with `paged_kv` on (tiny llama, CPU): a sleep for memory picks by the bytes it frees,
and a prompt longer than the page pool may hold is CONTEXT_TOO_LONG before any prefill."""

from __future__ import annotations

import dataclasses

import pytest

from kvwake.daemon.config import Tuning
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.session_state import Session
from kvwake.errors import ContextTooLongError
from kvwake.store import Store
from tests.test_paged_wakes import paged_manager  # noqa: F401 - an in-process manager, paged_kv on
from tests.test_shared_wakes import SHARED

BLOCK = 16


async def test_over_the_budget_the_session_whose_sleep_frees_most_sleeps_not_the_lru_sharing_one(paged_manager):
    # "a" and "b" share a long prompt (least recently used), "c" holds a prompt of its own. Sleeping "a" would
    # free only its own last pages (the prompt's stay, "b" lists them); sleeping "c" frees all it holds.
    m = paged_manager
    for sid, tokens in (("a", SHARED + [7] * 20), ("b", SHARED + [9] * 20), ("c", [(i * 3) % 200 + 11 for i in range(300)])):
        await m.create(sid)
        await m.append(sid, tokens=tokens)
    engine = m.engine
    frees = {sid: engine.sleep_frees(m.entries[sid].session) for sid in "abc"}
    assert frees["a"][0] < frees["a"][1] // 2 and frees["c"][0] == frees["c"][1]
    m.settings = dataclasses.replace(m.settings, hot_budget_bytes=m.hot_bytes() - frees["c"][0])
    assert await m.enforce_limits() == 1
    assert set(m.entries.hot) == {"a", "b"}  # was: "a" and then "b" slept, least recently used first


async def test_sessions_sharing_all_their_pages_still_sleep_when_nothing_else_frees_enough(paged_manager):
    m = paged_manager
    for sid in ("a", "b"):
        await m.create(sid)
        await m.append(sid, tokens=SHARED + [5] * 20)
    m.settings = dataclasses.replace(m.settings, hot_budget_bytes=1)
    assert await m.enforce_limits() == 2 and not m.entries.hot
    assert m.thread.call(m.engine.pages.pool.pages_held) == 0


def test_a_prompt_longer_than_the_page_pool_may_hold_is_too_long_before_any_prefill(model_dir, tmp_path, monkeypatch):
    # Was: the memory bound counted the room by tokens, not by whole pages: a prompt in the last page's worth
    # passed the check, and the pool, full mid-prefill, raised PagePoolFullError (INTERNAL to a client).
    from kvwake.daemon.kv import paging

    monkeypatch.setattr(paging, "FIRST_BYTES", 0)  # the pool starts small: its bound is what the room sets
    store = Store(tmp_path / "store", block_tokens=BLOCK)
    engine = Engine(store, tmp_path, model_dir, tuning=Tuning(paged_kv=True), warm=False)
    try:
        layout = engine.pages.pool.layout
        engine.set_kv_room(20 * layout.page_bytes + 15 * engine.token_bytes)  # 20 pages and 15 tokens
        assert (engine.session_tokens, engine.pages.pool.limit, engine.max_tokens) == (335, 20, 320)
        with pytest.raises(ContextTooLongError, match="page pool may hold: 20 pages") as raised:
            engine.append(Session("long"), tokens=[(i * 7) % 250 + 5 for i in range(330)])
        assert (raised.value.data["bound"], raised.value.data["limit"]) == ("memory", 320)
        engine.append(Session("fits"), tokens=[(i * 7) % 250 + 5 for i in range(300)])
    finally:
        engine.close()
        store.close()


async def test_a_wake_over_resident_pages_makes_room_only_for_the_pages_it_adds(paged_manager):
    # "a" and "b" share a long prompt, "c" holds one of its own; "b" sleeps. Its wake maps the prompt's pages,
    # which "a" still lists, and adds only its own: with room for those beside the hot KV, nobody sleeps for it.
    # Was: the room was made for b's whole KV as a buffer would hold it, and "a" and "c" slept for a wake that
    # needed two pages.
    m = await b_asleep_beside_a_and_c(paged_manager)
    layout = m.engine.pages.pool.layout
    shared_blocks = len(SHARED) // BLOCK  # whole blocks of the prompt, listed by "a"
    own = -(-(len(SHARED) + 20 - 1) // layout.page_tokens) - shared_blocks * layout.pages_per_block
    m.engine.kv_room_bytes = m.hot_bytes() + own * layout.page_bytes
    await m.wake("b")
    assert set(m.entries.hot) == {"a", "b", "c"} and m.counters["room_sleeps"] == 0
    assert m.hot_bytes() <= m.engine.kv_room_bytes  # and the wake took no more than that


async def test_a_wake_whose_room_sleeps_the_prompts_last_holder_counts_the_prompts_pages_again(paged_manager):
    # As above, but the room is short by more than "a"'s own pages: sleeping "a", the least recently used and the
    # last session listing the prompt's pages, frees them, so "b"'s wake must read them again, not map them. The
    # room is counted again after each sleep (was: once before them, so the wake went past the room).
    m = await b_asleep_beside_a_and_c(paged_manager)
    page = m.engine.pages.pool.layout.page_bytes
    m.engine.kv_room_bytes = m.hot_bytes() - 2 * page  # the wake's own two pages and two more must be freed
    await m.wake("b")
    assert m.counters["room_sleeps"] >= 1 and "b" in m.entries.hot
    assert m.hot_bytes() <= m.engine.kv_room_bytes


async def test_a_paged_wakes_room_counts_its_layers_that_are_not_paged_as_a_buffer_holds_them(paged_manager,
                                                                                                monkeypatch):
    # A model whose cache mixes paged layers and others (a KVCache inside a CacheList, a concatenating cache):
    # the wake adds its pages and the other layers' buffer. The tiny llama pages every layer: more bytes a token
    # than its pages hold stand for such layers.
    from kvwake.daemon.kv import capacity

    m = paged_manager
    await m.create("b")
    await m.append("b", tokens=SHARED + [9] * 20)
    snapshot = (await m.sleep("b"))["snapshot_id"]
    await m.released()
    engine, layout = m.engine, m.engine.pages.pool.layout
    record = engine.record(snapshot)
    pages = engine.wake_bytes(record)  # nothing resident: every page of its tokens
    assert pages == -(-len(record.token_ids) // layout.page_tokens) * layout.page_bytes
    monkeypatch.setattr(engine, "token_bytes", engine.token_bytes + 10)
    assert engine.wake_bytes(record) == pages + capacity.capacity(len(record.token_ids)) * 10



async def test_a_new_conversation_over_resident_pages_makes_room_only_for_the_pages_it_adds(paged_manager):
    # A new session over the prompt "a" holds maps its published pages (a prefix hit from memory) and computes
    # only its own: with room for those beside the hot KV, nobody sleeps for it. Was: the room was made for its
    # whole KV as a buffer would hold it, and "a" and "c" slept.
    m = await b_asleep_beside_a_and_c(paged_manager)
    layout = m.engine.pages.pool.layout
    tokens = SHARED + [5] * 20  # its KV: all but the pending last token
    own = -(-(len(tokens) - 1) // layout.page_tokens) - len(SHARED) // BLOCK * layout.pages_per_block
    m.engine.kv_room_bytes = m.hot_bytes() + own * layout.page_bytes
    await m.create("n")
    info = await m.append("n", tokens=tokens)
    assert info["reused"] >= len(SHARED) // BLOCK * BLOCK  # the prompt's pages mapped (and more from the store)
    assert set(m.entries.hot) == {"a", "c", "n"} and m.counters["room_sleeps"] == 0
    assert m.hot_bytes() <= m.engine.kv_room_bytes
    # and a turn of a session that holds its pages counts only the pages past them
    m.engine.kv_room_bytes = m.hot_bytes() + 2 * layout.page_bytes
    await m.append("n", tokens=[6] * 20)
    assert m.counters["room_sleeps"] == 0 and m.hot_bytes() <= m.engine.kv_room_bytes


async def b_asleep_beside_a_and_c(m):
    """"a" and "b" over one long prompt and "c" over its own, hot; then "b" asleep, its KV freed."""
    for sid, tokens in (("a", SHARED + [7] * 20), ("b", SHARED + [9] * 20), ("c", [(i * 3) % 200 + 11 for i in range(300)])):
        await m.create(sid)
        await m.append(sid, tokens=tokens)
    await m.sleep("b")
    await m.released()
    return m
