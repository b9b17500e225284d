"""The page pool: sharing by chain key, copy on write, reference counts, and the bytes held."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvwake.daemon.kv.pages import PageLayout, PagePool, PagePoolFullError, PageStateError

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=8, page_tokens=4, block_tokens=8, dtype=mx.float32)


def kv(tokens: int, seed: int) -> tuple[list[mx.array], list[mx.array]]:
    """Random K and V of `tokens` tokens for every layer of LAYOUT."""
    mx.random.seed(seed)
    shape = (LAYOUT.kv_heads, tokens, LAYOUT.head_dim)
    return ([mx.random.normal(shape) for _ in range(LAYOUT.layers)],
            [mx.random.normal(shape) for _ in range(LAYOUT.layers)])


def held(pool: PagePool, session: str) -> tuple[list[mx.array], list[mx.array]]:
    parts = [pool.gather(session, layer) for layer in range(LAYOUT.layers)]
    return [k for k, _ in parts], [v for _, v in parts]


def same(a: list[mx.array], b: list[mx.array]) -> bool:
    return all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))


def cat(*parts: list[mx.array]) -> list[mx.array]:
    return [mx.concatenate(layer, axis=1) for layer in zip(*parts, strict=True)]


def test_appended_kv_reads_back_across_pages() -> None:
    pool = PagePool(LAYOUT, capacity=8)
    pool.open("a")
    k1, v1 = kv(3, 1)
    k2, v2 = kv(7, 2)
    pool.append("a", k1, v1)
    pool.append("a", k2, v2)  # fills the partial page, then two more
    keys, values = held(pool, "a")
    assert same(keys, cat(k1, k2)) and same(values, cat(v1, v2))
    assert pool.table("a").tokens == 10 and len(pool.table("a").pages) == 3


def test_two_sessions_diverging_inside_a_shared_page_copy_it() -> None:
    pool = PagePool(LAYOUT, capacity=8)
    pool.open("a")
    prefix_k, prefix_v = kv(6, 1)  # a full page and half of the next
    pool.append("a", prefix_k, prefix_v)
    pool.fork("a", "b")
    shared_last = pool.table("a").pages[-1]
    assert pool.refs[shared_last] == 2
    ak, av = kv(1, 2)
    bk, bv = kv(1, 3)
    pool.append("a", ak, av)  # a writes into the shared partial page: a copy of its own
    pool.append("b", bk, bv)  # b is now the page's only reader: it writes in place
    assert pool.table("a").pages[0] == pool.table("b").pages[0]  # the full page is still shared
    assert pool.table("a").pages[-1] != shared_last and pool.table("b").pages[-1] == shared_last
    assert same(held(pool, "a")[0], cat(prefix_k, ak)) and same(held(pool, "a")[1], cat(prefix_v, av))
    assert same(held(pool, "b")[0], cat(prefix_k, bk)) and same(held(pool, "b")[1], cat(prefix_v, bv))
    assert pool.pages_held() == 3


def test_a_published_page_is_never_written_in_place() -> None:
    pool = PagePool(LAYOUT, capacity=8)
    pool.open("a")
    k, v = kv(8, 1)
    pool.append("a", k, v)
    pool.publish("a", 0, "block-0")
    pool.trim("a", 6)  # a rewind into the published block, the session its only reader
    page = pool.table("a").pages[-1]
    nk, nv = kv(1, 2)
    pool.append("a", nk, nv)
    assert pool.table("a").pages[-1] != page  # copied, though no other table lists the page
    assert same(held(pool, "a")[0], cat([x[:, :6] for x in k], nk))
    assert same(held(pool, "a")[1], cat([x[:, :6] for x in v], nv))
    pool.open("b")  # the block's second page went back when a let it go: the block is no longer whole
    assert pool.map_shared("b", ["block-0"]) == 0 and pool.pages_held() == 2


def test_a_mapped_block_reads_as_it_was_computed() -> None:
    pool = PagePool(LAYOUT, capacity=8)
    pool.open("a")
    k, v = kv(11, 1)
    pool.append("a", k, v)
    pool.publish("a", 0, "block-0")
    table = pool.open("b")
    assert pool.map_shared("b", ["block-0", "block-1"]) == 1 and table.tokens == 8
    bk, bv = kv(2, 2)
    pool.append("b", bk, bv)  # a page of its own after the shared block
    assert same(held(pool, "b")[0], cat([x[:, :8] for x in k], bk))
    assert same(held(pool, "b")[1], cat([x[:, :8] for x in v], bv))
    assert pool.table("b").pages[:2] == pool.table("a").pages[:2] and pool.pages_held() == 4


def test_a_block_computed_twice_is_held_once() -> None:
    pool = PagePool(LAYOUT, capacity=8)
    k, v = kv(8, 1)
    for session in ("a", "b"):
        pool.open(session)
        pool.append(session, k, v)
    assert pool.pages_held() == 4
    first = pool.publish("a", 0, "block-0")
    assert pool.publish("b", 0, "block-0") == first
    assert pool.table("b").pages == list(first) and pool.pages_held() == 2
    assert same(held(pool, "b")[0], k)


def test_a_restores_block_replaces_one_a_prefill_computed_and_a_wake_maps_the_stored_bytes() -> None:
    # On a GPU a prefill of the same tokens may differ from the store's bytes in the last bits: seeds 1 and 2
    # stand for the two. A restore's pages (stored) become the key's; the prefill's holder keeps its own.
    pool = PagePool(LAYOUT, capacity=16)
    computed, stored = kv(8, 1), kv(8, 2)
    pool.open("prefilled")
    pool.append("prefilled", *computed)
    theirs = pool.publish("prefilled", 0, "block-0")
    pool.open("woken")
    pool.append("woken", *stored)
    ours = pool.publish("woken", 0, "block-0", stored=True)
    assert ours != theirs and pool.shared["block-0"] == ours and "block-0" in pool.stored
    assert pool.table("prefilled").pages == list(theirs) and same(held(pool, "prefilled")[0], computed[0])
    pool.open("hit")  # a later prefix hit maps the stored bytes
    assert pool.map_shared("hit", ["block-0"]) == 1 and same(held(pool, "hit")[0], stored[0])
    for name, kind in (("woken2", True), ("prefilled2", False)):  # after it, both take the stored pages
        pool.open(name)
        pool.append(name, *computed)
        assert pool.publish(name, 0, "block-0", stored=kind) == ours and same(held(pool, name)[1], stored[1])
    pool.free_session("prefilled")  # the computed pages go with their last holder
    assert pool.pages_held() == 2
    for name in ("woken", "hit", "woken2", "prefilled2"):
        pool.free_session(name)
    assert pool.pages_held() == 0 and not pool.shared and not pool.stored


def test_refcounts_through_fork_and_free() -> None:
    pool = PagePool(LAYOUT, capacity=8)
    pool.open("a")
    pool.append("a", *kv(10, 1))
    pool.publish("a", 0, "block-0")
    pool.fork("a", "b")
    pool.fork("b", "c")
    assert [pool.refs[p] for p in pool.table("a").pages] == [3, 3, 3]
    pool.free_session("a")
    pool.free_session("b")
    assert [pool.refs[p] for p in pool.table("c").pages] == [1, 1, 1] and pool.pages_held() == 3
    assert "block-0" in pool.shared
    pool.free_session("c")
    assert pool.pages_held() == 0 and pool.refs == [0] * 8 and not pool.shared and not pool.key_of
    fresh = pool.open("d")
    assert pool.map_shared("d", ["block-0"]) == 0 and fresh.tokens == 0  # forgotten with its pages


def test_bytes_held_by_sessions_sharing_a_prefix_count_it_once() -> None:
    layout = PageLayout(layers=2, kv_heads=2, head_dim=8, page_tokens=4, block_tokens=4, dtype=mx.bfloat16)
    pool = PagePool(layout, capacity=64)
    prefix = [f"block-{i}".encode() for i in range(4)]  # 16 tokens in 4 blocks
    shape = (2, 16, 8)
    pool.open("first")
    pool.append("first", [mx.ones(shape, mx.bfloat16)] * 2, [mx.ones(shape, mx.bfloat16)] * 2)
    for block, key in enumerate(prefix):
        pool.publish("first", block, key)
    own = (2, 3, 8)  # each session's own 3 tokens: one private partial page
    for n in range(1, 8):
        pool.open(f"s{n}")
        assert pool.map_shared(f"s{n}", prefix) == 4
        pool.append(f"s{n}", [mx.zeros(own, mx.bfloat16)] * 2, [mx.zeros(own, mx.bfloat16)] * 2)
    page = 2 * 2 * 2 * 4 * 8 * 2  # keys and values, layers, heads, tokens, head size, bf16
    assert layout.page_bytes == page
    assert pool.bytes_held() == (4 + 7) * page  # the prefix once, one page per session
    assert pool.session_bytes("s3") == 5 * page


def test_a_full_pool_refuses_and_changes_nothing() -> None:
    pool = PagePool(LAYOUT, capacity=2)
    pool.open("a")
    pool.append("a", *kv(6, 1))
    with pytest.raises(PagePoolFullError, match="needs 1 pages for 4 tokens, 0 of 2 are free"):
        pool.reserve("a", 4)
    assert pool.table("a").tokens == 6 and len(pool.table("a").pages) == 2


def test_misuse_is_refused_with_the_facts() -> None:
    pool = PagePool(LAYOUT, capacity=4)
    pool.open("a")
    pool.append("a", *kv(5, 1))
    with pytest.raises(PageStateError, match="holds 5 tokens: block 0 is not full"):
        pool.publish("a", 0, b"k")
    with pytest.raises(PageStateError, match="holds 5 tokens, not whole blocks"):
        pool.map_shared("a", [b"k"])
    with pytest.raises(PageStateError, match="'nobody' has no page table"):
        pool.free_session("nobody")
    with pytest.raises(ValueError, match="a page of 3 tokens does not divide a block of 8"):
        PageLayout(layers=1, kv_heads=1, head_dim=8, page_tokens=3, block_tokens=8)


def test_pages_freed_are_taken_again_in_their_order() -> None:
    """A table's pages go back so that the next table takes them in the same order: one run again (which
    a paged cache reads as a slice, not a gather)."""
    pool = PagePool(LAYOUT, capacity=8)
    pool.open("a")
    pool.append("a", *kv(12, 1))
    pages = list(pool.table("a").pages)
    pool.free_session("a")
    pool.open("b")
    pool.append("b", *kv(12, 2))
    assert pool.table("b").pages == pages == [0, 1, 2]


def test_sessions_shares_of_the_bytes_add_up_to_the_bytes_held() -> None:
    pool = PagePool(LAYOUT, capacity=8)
    pool.open("a")
    pool.append("a", *kv(10, 1))
    pool.fork("a", "b")
    pool.fork("a", "c")
    pool.trim("c", 4)  # lists the first page only
    pool.append("b", *kv(3, 2))  # its own copy of the partial page
    shares = [pool.share_bytes(s) for s in "abc"]
    assert abs(sum(shares) - pool.bytes_held()) < pool.pages_held()
    assert shares[2] == LAYOUT.page_bytes // 3  # one page among three tables
    assert pool.share_bytes("c", layers=1) == LAYOUT.page_bytes // LAYOUT.layers // 3


def test_the_pools_grow_to_their_limit_keeping_what_they_hold() -> None:
    pool = PagePool(LAYOUT, 2, limit=8)
    pool.open("a")
    k1, v1 = kv(6, 1)
    pool.append("a", k1, v1)  # two pages: the first allocation
    k2, v2 = kv(5, 2)
    pool.append("a", k2, v2)  # three pages: grown to four
    assert pool.capacity == 4 and pool.table("a").pages == [0, 1, 2]
    assert same(held(pool, "a")[0], cat(k1, k2)) and same(held(pool, "a")[1], cat(v1, v2))
    pool.open("b")
    pool.append("b", *kv(4 * 5, 3))  # five more: grown to the limit
    assert pool.capacity == 8 and pool.pages_held() == 8
    assert pool.grows == 2 and pool.grow_s > 0  # counted for status: each growth copies every pool
    with pytest.raises(PagePoolFullError):
        pool.append("b", *kv(1, 4))


def test_a_write_at_slots_is_one_scatter_along_them() -> None:
    """A batch's decode step writes one slot a row: one scatter along the slots (ScatterAxis). Written as
    `pool[:, slots] = keys` MLX built index arrays for the heads too (an arange, casts and a general scatter),
    four kernels a write, 64 writes a step of an 8B model (docs/benchmarks.md, "Paged KV in the fleet")."""
    import io
    import re

    pool = PagePool(LAYOUT, capacity=8)
    held = {name: kv(5, seed) for name, seed in (("a", 1), ("b", 2))}
    for name, (keys, values) in held.items():
        pool.open(name)
        pool.append(name, keys, values)
    slots = mx.array([pool.reserve("a", 1), pool.reserve("b", 1)], mx.int32)
    k, v = kv(2, 9)
    mx.eval(k, v, slots, pool.keys, pool.values)  # the graph below is the write's alone
    pool.write(1, slots, k[0], v[0])
    dot = io.StringIO()
    mx.export_to_dot(dot, pool.keys[1], pool.values[1])
    labels = re.findall(r'label ="([^"]+)"', dot.getvalue())
    assert labels.count("ScatterAxis") == 2 and not {"Arange", "AsType", "Scatter"} & set(labels), labels
    for name, row in (("a", 0), ("b", 1)):
        keys, values = pool.gather(name, 1)
        assert same([keys[:, -1]], [k[0][:, row]]) and same([values[:, -1]], [v[0][:, row]]), name
        # each session's earlier tokens as they were: the write touched its two slots alone
        assert same([keys[:, :5], values[:, :5]], [held[name][0][1], held[name][1][1]]), name
