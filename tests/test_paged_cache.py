"""Paged caches in a tiny model: the same logits as mlx-lm's KVCache, sharing, copy on write, refcounts."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

from kvwake.daemon.kv import cache_blocks
from kvwake.daemon.model import packing
from kvwake.daemon.model.thread import EngineThread
from kvwake.daemon.kv.pages import PageLayout, PagePool, PageStateError
from kvwake.daemon.kv.paged_cache import (PagedKVCache, adopt, fill, fork, map_prefix, page_layout, paged_cache,
                                            publish, resident_prefix)
from testkit.tinymodel import make_model_dir

BUNDLE = "ab" * 32
PAGE, BLOCK = 4, 8  # small, so chunks and decode steps cross pages and blocks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    loaded, _ = load(str(make_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama")))
    return loaded


def pool_for(model, capacity: int = 64, page: int = PAGE, block: int = BLOCK) -> PagePool:
    blank = make_prompt_cache(model)
    return PagePool(page_layout(blank, cache_blocks.layout(blank, model=model), page, block), capacity)


def tokens(n: int, seed: int) -> list[int]:
    mx.random.seed(seed)
    return mx.random.randint(0, 256, (n,)).tolist()


def feed(model, cache: list, ids: list[int], chunks: list[int]) -> list[bytes]:
    """Feed `ids` in chunks of the given sizes; each chunk's last logits as bytes."""
    out, at = [], 0
    for n in chunks:
        logits = model(mx.array([ids[at : at + n]]), cache=cache)[0, -1]
        mx.eval(logits)
        out.append(bytes(memoryview(logits.astype(mx.float32))))
        at += n
    return out


@pytest.mark.parametrize("one_run", [True, False])
def test_prefill_chunks_and_decode_give_kvcache_logits_bit_for_bit(model, one_run) -> None:
    """Pages in one run are read as a slice of the pools, others gathered: both give KVCache's logits."""
    ids = tokens(37, 1)
    chunks = [5, 11, 16, 1, 1, 1, 1, 1]  # prefill chunks across pages and blocks, then decode steps
    plain = feed(model, make_prompt_cache(model), ids, chunks)
    pool = pool_for(model)
    if not one_run:
        pool.free.reverse()  # pages taken from the last down: no two in a row
    cache = paged_cache(pool, make_prompt_cache(model))
    assert feed(model, cache, ids, chunks) == plain
    assert (cache[0].session.run_start() is not None) == one_run


def test_a_trimmed_paged_cache_rewinds_as_kvcache_does(model) -> None:
    ids, other = tokens(30, 2), tokens(6, 3)
    plain, pool = make_prompt_cache(model), pool_for(model)
    paged = paged_cache(pool, make_prompt_cache(model))
    for cache in (plain, paged):
        feed(model, cache, ids, [30])
        trim_prompt_cache(cache, 7)  # back into the middle of a page
    assert pool.table(paged[0].session.name).tokens == 23
    assert feed(model, paged, other, [6]) == feed(model, plain, other, [6])


def test_two_sessions_diverging_inside_a_shared_block_each_see_their_own(model) -> None:
    shared, a_tail, b_tail = tokens(13, 4), tokens(3, 5), tokens(3, 6)  # 13: a block, a page and a token
    pool = pool_for(model)
    a = paged_cache(pool, make_prompt_cache(model))
    feed(model, a, shared, [13])
    publish(a, shared, BUNDLE)
    b = fork(a, 13)
    held = pool.pages_held()
    got_a, got_b = feed(model, a, a_tail, [3]), feed(model, b, b_tail, [3])
    assert pool.pages_held() == held + 1  # one copy of the shared partial page, the block still shared
    assert a[0].session.pool.table(a[0].session.name).pages[:2] == b[0].session.pool.table(b[0].session.name).pages[:2]
    for own, got in ((a_tail, got_a), (b_tail, got_b)):
        alone = make_prompt_cache(model)
        assert feed(model, alone, shared + own, [13, 3])[-1] == got[-1]


def test_a_copy_on_write_copies_a_page_not_the_pool(model) -> None:
    """A shared partial page copied for its writer: the page, not every layer's pool (its source was a pending
    read of the pool being updated: the update copied the pool whole)."""
    shared = tokens(13, 4)
    pool = pool_for(model, capacity=1 << 15)  # 8 MiB a layer's keys or values
    a = paged_cache(pool, make_prompt_cache(model))
    feed(model, a, shared, [13])
    b = fork(a, 13)
    mx.eval(pool.keys, pool.values)
    mx.reset_peak_memory()
    held = mx.get_active_memory()
    pages = pool.pages_held()
    slots = b[0].session.slots_for(13, 1)  # b writes into the partial page a lists too: copied first
    mx.eval(pool.keys, pool.values, slots if isinstance(slots, mx.array) else [])
    grew, one_pool = mx.get_peak_memory() - held, pool.keys[0].nbytes
    assert pool.pages_held() == pages + 1
    assert grew < one_pool // 4, f"a page's copy took {grew} bytes; one pool is {one_pool}"


def test_on_cuda_a_copy_on_write_waits_for_the_streams_finished_tasks_before_it_writes(model, monkeypatch) -> None:
    # On CUDA the page's gathers keep the pools held by the stream's worker until it runs their finished tasks, and
    # the write then copied the pools whole (the test above, on a GPU: docs/decisions.md): the copy synchronizes
    # first. (Here, off CUDA, only the order is seen; the test above holds it to the bytes on a GPU.)
    from kvwake.daemon.kv import cudart

    shared = tokens(13, 4)
    pool = pool_for(model)
    a = paged_cache(pool, make_prompt_cache(model))
    feed(model, a, shared, [13])
    b = fork(a, 13)
    page, fresh, p = pool.table(a[0].session.name).pages[-1], pool.free[-1], pool.layout.page_tokens
    held = 13 % p or p  # the partial page's tokens

    def copied() -> bool:
        return mx.array_equal(pool.keys[0][:, fresh * p : fresh * p + held],
                              pool.keys[0][:, page * p : page * p + held]).item()

    events = []

    def synchronize(*_) -> None:  # the fresh page not yet written (the copy's writes come after)
        events.append(("synchronize", copied()))

    monkeypatch.setattr(cudart, "on_cuda", lambda: True)
    monkeypatch.setattr(mx, "synchronize", synchronize)
    real = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *args: events.append("eval") or real(*args))
    b[0].session.slots_for(13, 1)  # b writes into the partial page a lists too: copied first
    assert events[:3] == ["eval", ("synchronize", False), ("synchronize", False)], events
    assert pool.table(b[0].session.name).pages[-1] == fresh and copied()  # and then copied there


def test_a_session_maps_a_published_prefix_and_decodes_as_if_it_had_computed_it(model) -> None:
    prefix, rest = tokens(24, 7), tokens(5, 8)
    pool = pool_for(model)
    first = paged_cache(pool, make_prompt_cache(model))
    feed(model, first, prefix, [24])
    assert publish(first, prefix, BUNDLE) == 3
    second = paged_cache(pool, make_prompt_cache(model))
    held = pool.pages_held()
    assert map_prefix(second, prefix + rest, BUNDLE) == 24 and pool.pages_held() == held  # no page taken
    assert feed(model, second, rest, [5]) == feed(model, make_prompt_cache(model), prefix + rest, [24, 5])[1:]


def test_refcounts_under_fork_trim_and_drop(model) -> None:
    ids = tokens(20, 9)
    pool = pool_for(model)
    a = paged_cache(pool, make_prompt_cache(model))
    feed(model, a, ids, [20])  # five pages
    b = fork(a, 20)
    c = fork(a, 10)  # three pages listed: two full and half of the third
    table = pool.table(a[0].session.name).pages
    assert [pool.refs[p] for p in table] == [3, 3, 3, 2, 2] and pool.pages_held() == 5
    trim_prompt_cache(b, 12)  # b keeps two pages
    assert [pool.refs[p] for p in table] == [3, 3, 2, 1, 1]
    del a
    gc.collect()
    assert pool.pages_held() == 3  # a's last two pages went back when its cache was dropped
    del b, c
    gc.collect()
    assert pool.pages_held() == 0 and len(pool.free) == pool.capacity


def test_a_splice_moves_pages_behind_whole_pages_without_counting_them_again() -> None:
    pool = PagePool(PageLayout(layers=1, kv_heads=1, head_dim=2, page_tokens=PAGE, block_tokens=BLOCK), 8)
    for name, n in (("head", 8), ("partial", 6), ("rest", 6)):
        pool.open(name)
        pool.reserve(name, n)
    own = list(pool.table("rest").pages)
    with pytest.raises(PageStateError, match="not whole pages"):
        pool.splice("partial", "rest")
    pool.splice("head", "rest")
    assert pool.table("head").pages[2:] == own and pool.table("head").tokens == 14
    assert "rest" not in pool.sessions and [pool.refs[p] for p in own] == [1, 1] and pool.pages_held() == 6


def test_a_layer_cannot_write_where_the_table_does_not_end(model) -> None:
    pool = pool_for(model)
    cache = paged_cache(pool, make_prompt_cache(model))
    feed(model, cache, tokens(6, 10), [6])
    cache[0].trim(2)  # one layer rewound, the other not: the table keeps its tokens
    k = mx.zeros((1, 2, 1, 16), mx.bfloat16)
    with pytest.raises(PageStateError, match="cannot write tokens"):
        cache[0].update_and_fetch(k, k)


def test_a_row_out_of_a_batch_fills_back_into_pages(model) -> None:
    ids, more = tokens(10, 11), tokens(3, 12)
    pool = pool_for(model)
    paged, plain = paged_cache(pool, make_prompt_cache(model)), make_prompt_cache(model)
    feed(model, paged, ids, [10])
    feed(model, plain, ids + more, [13])
    refilled = fill(paged, plain)
    assert refilled[0].offset == 13 and pool.table(refilled[0].session.name).tokens == 13
    assert all(mx.array_equal(r.keys, p.keys[..., :13, :]).item() for r, p in zip(refilled, plain, strict=True))


def test_eight_sessions_over_a_shared_prefix_hold_a_quarter_of_eight_copies(model) -> None:
    """8 sessions over one prompt as long as the fleet's (9.3k tokens; the tiny model's KV shapes, random KV
    written as the model would), each with its own turn: the prompt's blocks are held once, against
    mlx-lm's KVCache buffers of the same tokens, one per session."""
    block, prefix = 128, tokens(9300, 13)  # 72 blocks and a partial one
    pool = pool_for(model, capacity=128, page=block, block=block)
    kv = [mx.random.normal((1, pool.layout.kv_heads, 9300 + 20, pool.layout.head_dim)).astype(pool.layout.dtype)
          for _ in range(pool.layout.layers)]
    sessions, private = [], 0
    for n in range(8):
        turn = tokens(20, 20 + n)
        cache = paged_cache(pool, make_prompt_cache(model))
        done = map_prefix(cache, prefix, BUNDLE)
        plain = make_prompt_cache(model)
        for layer, (c, p) in enumerate(zip(cache, plain, strict=True)):
            c.update_and_fetch(kv[layer][:, :, done:], kv[layer][:, :, done:])
            p.update_and_fetch(kv[layer], kv[layer])
        publish(cache, prefix + turn, BUNDLE)
        sessions.append(cache)
        private += cache_blocks.cache_nbytes(plain)
    assert sessions[1][0].session.keys == sessions[0][0].session.keys[:72]  # the prompt's blocks, mapped
    assert pool.bytes_held() <= 0.25 * private
    # what the memory accounting sums (each session's cache_nbytes) counts the shared pages once
    counted = sum(cache_blocks.cache_nbytes(c) for c in sessions)
    assert pool.bytes_held() - pool.pages_held() * pool.layout.layers <= counted <= pool.bytes_held()


def twins_watched(model, one_run: bool, monkeypatch) -> tuple[list, list, list]:
    """The same 40 tokens' KV in pages (one run of them, or none in a row) and in buffers, and the list every
    paged gather from now on appends its (start, stop) to (() for a layer's every token)."""
    pool = pool_for(model)
    if not one_run:
        pool.free.reverse()  # pages taken from the last down: no two in a row
    paged, plain = paged_cache(pool, make_prompt_cache(model)), make_prompt_cache(model)
    for cache in (paged, plain):
        feed(model, cache, tokens(40, 15), [17, 23])
    gathers = []
    real = PagedKVCache._gathered
    monkeypatch.setattr(PagedKVCache, "_gathered", lambda self, *a: gathers.append(a[1:]) or real(self, *a))
    return paged, plain, gathers


@pytest.mark.parametrize("one_run", [True, False])
def test_a_span_copied_before_it_is_held_is_a_slice_of_the_pool_where_its_pages_are_one_run(model, one_run,
                                                                                             monkeypatch) -> None:
    # A checkpoint's capture (copied: `own`, or CUDA's stacked copy) read a paged span by a gather by token; where
    # the span's pages follow one another it now reads them as a slice of the pool, the same bits. A capture that
    # keeps views (unified memory, not `own`: the CPU here) still gathers: a view of the pool held would make its next write
    # copy it whole.
    paged, plain, gathers = twins_watched(model, one_run, monkeypatch)
    for own in (True, False):
        gathers.clear()
        got, want = (cache_blocks.defer_blocks(c, 1, 3, BLOCK, own=own).host() for c in (paged, plain))
        assert [{n: t.array.tobytes() for n, t in b.items()} for b in got] == \
            [{n: t.array.tobytes() for n, t in b.items()} for b in want]
        copied = own or cache_blocks._discrete()  # on CUDA a capture copies, `own` or not
        assert (gathers == []) == (copied and one_run), (own, one_run, gathers)


@pytest.mark.parametrize("one_run", [True, False])
def test_a_span_made_into_byte_planes_reads_only_its_own_tokens_of_the_pages(model, one_run, monkeypatch) -> None:
    # CUDA's checkpoints capture spans as byte planes made on the device (`defer_planed`). Over pages that took each
    # layer's `keys` and `values`, a gather of every token the session holds, and then sliced the span: at 75k tokens
    # each span gathered the whole session, a lone agent's turns waited on it (docs/benchmarks.md).
    paged, plain, gathers = twins_watched(model, one_run, monkeypatch)
    got, want = (cache_blocks.defer_planed(c, 1, 3, BLOCK).host() for c in (paged, plain))
    assert [(p.names, [x.tobytes() for x in p.planes]) for p in got] == \
        [(p.names, [x.tobytes() for x in p.planes]) for p in want]  # the same bytes
    span = (BLOCK, 4 * BLOCK)
    assert all(g == span for g in gathers) and (gathers == []) == one_run, (one_run, gathers)


def test_a_paged_cache_sleeps_into_the_blocks_and_tail_a_kvcache_gives(model) -> None:
    ids = tokens(21, 14)
    plain, paged = make_prompt_cache(model), paged_cache(pool_for(model), make_prompt_cache(model))
    for cache in (plain, paged):
        feed(model, cache, ids, [9, 12])
    blocks = [cache_blocks.capture_blocks(c, 0, 2, BLOCK) for c in (paged, plain)]
    tails = [[cache_blocks.capture_tail(c, 21, BLOCK)] for c in (paged, plain)]
    for got, want in (blocks, tails):
        for mine, theirs in zip(got, want, strict=True):
            assert mine.keys() == theirs.keys()
            assert all(mine[n].dtype == theirs[n].dtype and mine[n].array.tobytes() == theirs[n].array.tobytes()
                       for n in mine)
    assert cache_blocks.layout(paged, model=model) == cache_blocks.layout(plain, model=model)  # one bundle hash


def test_sessions_adopting_one_restored_prefix_hold_its_blocks_once(model) -> None:
    ids = tokens(2 * BLOCK + 5, 15)
    pool, restored = pool_for(model), make_prompt_cache(model)
    feed(model, restored, ids, [len(ids)])  # what a wake restores: a contiguous cache
    first = adopt(pool, restored, ids, BUNDLE)
    held = pool.pages_held()
    second = adopt(pool, restored, ids, BUNDLE)
    assert pool.pages_held() == held + 2  # its own partial block only: 5 tokens in two pages
    assert feed(model, second, [7], [1]) == feed(model, first, [7], [1])


def test_a_resident_prefix_is_mapped_whole_blocks_leaving_the_last_token_pending(model) -> None:
    ids = tokens(3 * BLOCK + 1, 16)  # three blocks and the pending token
    pool = pool_for(model)
    assert resident_prefix(pool, make_prompt_cache(model), ids, BUNDLE) == (None, 0)
    source = paged_cache(pool, make_prompt_cache(model))
    feed(model, source, ids, [len(ids)])
    publish(source, ids, BUNDLE)
    cache, held = resident_prefix(pool, make_prompt_cache(model), ids, BUNDLE)
    assert held == 3 * BLOCK and cache[0].offset == held
    cache, held = resident_prefix(pool, make_prompt_cache(model), ids[:-1], BUNDLE)
    assert held == 2 * BLOCK  # the last token of a target stays pending: two blocks


def test_turns_packed_in_one_pass_write_each_session_s_pages(model) -> None:
    turns = [tokens(9, 17), tokens(4, 18)]
    pool = pool_for(model)
    plain = [make_prompt_cache(model) for _ in turns]
    paged = [paged_cache(pool, make_prompt_cache(model)) for _ in turns]
    for caches in (plain, paged):
        packing.forward(model, list(zip(turns, caches, strict=True)), [lambda fused: fused] * len(turns))
        mx.eval([c.state for cache in caches for c in cache])
    for mine, theirs in zip(paged, plain, strict=True):
        assert all(mx.array_equal(m.keys, t.keys[..., : t.offset, :]).item() and m.offset == t.offset
                   for m, t in zip(mine, theirs, strict=True))


def test_turns_packed_into_one_pool_write_it_in_place(model) -> None:
    """A pack's rows all write the pool before any reads it: a read still pending when the next row wrote made
    that write copy the layer's whole pool, once per row and layer (MLX's peak grew by pools, not by rows)."""
    turns = [tokens(9, 21 + i) for i in range(4)]
    pool = pool_for(model, capacity=1 << 15)  # 32 MiB of pages in all, 8 MiB a layer's keys or values
    paged = [paged_cache(pool, make_prompt_cache(model)) for _ in turns]
    one_pool = pool.keys[0].nbytes
    mx.eval(pool.keys, pool.values)
    mx.reset_peak_memory()
    held = mx.get_active_memory()
    packing.forward(model, list(zip(turns, paged, strict=True)), [lambda fused: fused] * len(turns))
    mx.eval([c.state for cache in paged for c in cache])
    grew = mx.get_peak_memory() - held
    assert grew < one_pool // 4, f"a pack of {len(turns)} rows took {grew} bytes more; one pool is {one_pool}"


@pytest.mark.parametrize("one_run", [True, False])
def test_a_padded_chunk_over_pages_gathered_whole_gives_the_zero_padded_result_bit_for_bit(model, one_run,
                                                                                         monkeypatch) -> None:
    """`padded` gathers whole pages to the padded length (the pages past the table stand in for padding, masked):
    the attention gives what the tokens gathered and padded with zeros give."""
    from kvwake.daemon.kv import paged_cache as module
    from kvwake.daemon.model import attention

    monkeypatch.setattr(attention, "KEY_BUCKET_MIN", 16)
    pool = pool_for(model)
    if not one_run:
        pool.free.reverse()
    other = paged_cache(pool, make_prompt_cache(model))
    feed(model, other, tokens(7, 30), [7])  # a page left partly written by another session, before ours
    cache = paged_cache(pool, make_prompt_cache(model))
    feed(model, cache, tokens(21, 31), [21])
    layer = cache[0]
    last = pool.table(layer.session.name).pages[-1]
    for part in (pool.keys[0], pool.values[0]):  # what a rewind or the page's earlier owner may leave past the tokens
        part[:, last * PAGE + layer.offset % PAGE : (last + 1) * PAGE] = mx.array(float("inf"), part.dtype)
    heads, dim = layer.fetch()[0].shape[1], layer.fetch()[0].shape[3]
    queries = mx.random.normal((1, heads * 2, 3, dim)).astype(mx.bfloat16)
    k, v = layer.fetch()
    got = []
    for whole in (True, False):
        monkeypatch.setattr(module, "PAGE_GATHER", whole)
        assert (layer.padded(attention.key_bucket(layer.offset)) is not None) == whole
        got.append(attention.padded_attention(lambda *a, **kw: None)(queries, k, v, layer, 0.125, "causal"))
    mx.eval(got)
    assert mx.array_equal(got[0], got[1]).item() and not mx.isnan(got[0]).any().item()
    monkeypatch.setattr(module, "PAGE_GATHER", True)
    assert layer.padded(attention.key_bucket(layer.offset) + 1) is None  # not whole pages
    assert layer.padded(layer.offset - 1 - (layer.offset - 1) % PAGE) is None  # short of the tokens held


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_pages_gathered_whole_are_the_pools_pages_in_order(dtype) -> None:
    """`gather_pages` (a kernel on CUDA, MLX's gather elsewhere) against the pages sliced out one by one."""
    from kvwake.daemon.kv.paged_cache import gather_pages

    pool = mx.random.normal((3, 6 * 16, 64)).astype(dtype)
    pool[:, 5 * 16] = mx.array(float("inf"), dtype)  # what a page's earlier owner may have left in it
    order = [4, 0, 5, 4]
    got = gather_pages(pool, mx.array(order, mx.int32), 16, mx.array([37], mx.int32))
    want = mx.concatenate([pool[:, p * 16 : (p + 1) * 16] for p in order], axis=1)[None]
    assert got.shape == (1, 3, 64, 64) and mx.array_equal(got[:, :, :37], want[:, :, :37]).item()
    assert not got[:, :, 37:].any().item()  # every token from the held ones' end on: zeros, the inf too


def test_a_paged_cache_read_on_another_thread_still_sleeps_on_its_own(model) -> None:
    """The engine thread computes; another thread reads the cache's shapes (a sleep's budget reads `keys`):
    nothing that thread makes may stay in the cache, since MLX evaluates an array only on a thread that has
    its stream."""
    thread = EngineThread()
    try:
        def prefilled() -> list:
            cache = paged_cache(pool_for(model), make_prompt_cache(model))  # one run: read as a slice
            feed(model, cache, tokens(21, 19), [21])
            return cache
        cache = thread.submit(prefilled).result()
        assert cache_blocks.bytes_per_token(cache) > 0
        tail = thread.submit(lambda: cache_blocks.capture_tail(cache, 21, BLOCK)).result()
        assert len(tail) > 1
    finally:
        thread.stop()


def test_a_model_whose_plain_layers_are_paged_beside_windows_cannot_copy_a_prefix(tmp_path) -> None:
    gemma, _ = load(str(make_model_dir(tmp_path / "gemma", arch="gemma3_text")))
    pool = pool_for(gemma)
    cache = paged_cache(pool, make_prompt_cache(gemma))
    assert sum(isinstance(c, PagedKVCache) for c in cache) == 1  # the global layer; the windows stay rings
    gemma(mx.array([tokens(12, 21)]), cache=cache)
    with pytest.raises(cache_blocks.NotCuttableError, match="RotatingKVCache"):
        cache_blocks.copy_prefix(cache, 8)


def test_a_paged_chunk_pads_while_its_mask_stays_within_the_bound(model, monkeypatch) -> None:
    """A paged layer pads at any length (it has no buffer whose shape to share), but not to a mask of more than
    PADDED_MASK_BYTES: a padded row's mask is held for its pass, GBs across a pack at long contexts."""
    from kvwake.daemon.model import attention

    cache = paged_cache(pool_for(model), make_prompt_cache(model))
    feed(model, cache, tokens(21, 40), [21])
    monkeypatch.setattr(attention, "KEY_BUCKET_MIN", 16)
    shape = attention.padded_shape(cache, 5)
    assert shape == (attention.query_bucket(5), attention.key_bucket(26))
    monkeypatch.setattr(attention, "PADDED_MASK_BYTES", shape[0] * shape[1] * 2 - 1)
    assert attention.padded_shape(cache, 5) is None


def test_a_pack_of_paged_rows_at_padded_shapes_gathers_no_row_by_token(model, monkeypatch) -> None:
    """Rows whose path reads their pages itself (`padded_attention`) are not fetched (a gather by token each, built
    and never read); the pack leaves each cache as the rows fed one at a time do."""
    from kvwake.daemon.model import attention

    monkeypatch.setattr(attention, "KEY_BUCKET_MIN", 16)
    history, turns = [tokens(13, 50), tokens(21, 51)], [tokens(6, 52), tokens(9, 53)]
    pool = pool_for(model)
    paged = [paged_cache(pool, make_prompt_cache(model)) for _ in turns]
    alone = [paged_cache(pool, make_prompt_cache(model)) for _ in turns]
    for cache, ids in zip(paged + alone, history * 2, strict=True):
        feed(model, cache, ids, [len(ids)])
    fetched = []
    fetch = PagedKVCache.fetch
    monkeypatch.setattr(PagedKVCache, "fetch", lambda c: fetched.append(c.layer) or fetch(c))
    packing.forward(model, list(zip(turns, paged, strict=True)), [attention.padded_attention] * len(turns))
    mx.eval([c.session.pool.keys for c in paged[0]])
    assert fetched == []
    for cache, turn in zip(alone, turns, strict=True):
        packing.forward(model, [(turn, cache)], [attention.padded_attention])
    for mine, theirs in zip(paged, alone, strict=True):
        assert all(mx.array_equal(m.keys, t.keys).item() and m.offset == t.offset
                   for m, t in zip(mine, theirs, strict=True))
