"""Restore points in the store (store/points.py): content-addressed by the chain key of the block they close,
deduplicated, verified on read, kept by gc as long as their block, checked by fsck, counted by status."""

from __future__ import annotations

import numpy as np
import pytest

from kvwake.errors import CorruptBlockError
from kvwake.store import Store
from kvwake.store.format.codec import Tensor
from kvwake.store.format.keys import chain_keys
from testkit.kvdata import BUNDLE, write_snapshot

TOKENS = list(range(100, 112))  # 3 blocks of 4


def point_arrays(seed: int) -> dict[str, Tensor]:
    """What a point holds for a tiny hybrid: a ring buffer's rows and a recurrent layer's state."""
    rng = np.random.default_rng(seed)
    return {"meta": Tensor.of(np.array([1, 8, 4], dtype=np.int64)),
            "layers.0.keys": Tensor.of(rng.standard_normal((1, 2, 8, 4)).astype(np.float16)),
            "layers.1.arrays.0": Tensor.of(rng.standard_normal((1, 3, 16)).astype(np.float32))}


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "store", block_tokens=4, keep_history=1)
    s.register_bundle(BUNDLE, {"model": "test-a"})
    yield s
    s.close()


def stored_point(store: Store, blocks: int = 2) -> str:
    """The key of block `blocks - 1` of TOKENS, with a point stored for it (and the snapshot that holds it)."""
    write_snapshot(store, "s", TOKENS)
    key = chain_keys(BUNDLE, TOKENS, 4)[blocks - 1]
    assert store.write_point(BUNDLE, key, blocks * 4, point_arrays(blocks))
    return key


def test_a_point_reads_back_exactly_and_is_stored_once(store):
    key = stored_point(store)
    assert not store.write_point(BUNDLE, key, 8, point_arrays(2))  # deduplicated: nothing written again
    assert len(list((store.root / "points").rglob("*.kvp"))) == 1
    ref = store.point_refs([key], BUNDLE)[key]
    got = store.read_point(ref)
    for name, want in point_arrays(2).items():
        assert got[name].dtype == want.dtype and np.array_equal(got[name].array, want.array), name
    assert store.point_refs([key], "d2" * 32) == {}  # another bundle's points are not this one's
    summary = store.points_summary()
    assert summary["points"] == 1 and summary["point_bytes"] == ref.stored_bytes > 0
    assert summary["point_share"] == round(ref.stored_bytes / store.stored_bytes(), 4) > 0
    assert store.stored_bytes() >= ref.stored_bytes


def test_a_damaged_or_swapped_point_is_refused_naming_it(store):
    key = stored_point(store)
    ref = store.point_refs([key], BUNDLE)[key]
    path = store.root / ref.file
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError, match=f"restore point {key[:16]}"):
        store.read_point(ref)
    other = chain_keys(BUNDLE, TOKENS, 4)[0]
    store.write_point(BUNDLE, other, 4, point_arrays(1))
    path.write_bytes((store.root / store.point_refs([other], BUNDLE)[other].file).read_bytes())  # another point's file
    with pytest.raises(CorruptBlockError):
        store.read_point(ref)


def test_fsck_checks_points_and_drops_a_bad_one(store):
    key = stored_point(store)
    report = store.fsck()
    assert report.ok and report.points_checked == 1
    ref = store.point_refs([key], BUNDLE)[key]
    (store.root / ref.file).write_bytes(b"not a point")
    report = store.fsck()
    assert not report.ok and [b["point"] for b in report.bad_points] == [key]
    assert store.point_refs([key], BUNDLE) == {} and not (store.root / ref.file).exists()
    assert store.fsck().ok  # the bad point is gone; the next prefill there takes it again


def test_fsck_skips_a_point_gc_dropped_after_fsck_listed_the_points(store, monkeypatch):
    # fsck listed the point rows once and verified each from that list: a point gc dropped meanwhile (its
    # file deleted) was reported bad.
    stored_point(store)
    listed, dropped = store.rows, []

    def gc_after_the_list(sql, params=()):
        rows = listed(sql, params)
        if "FROM points" in sql and not dropped:
            store.delete_session("s")
            dropped.append(store.gc(budget_bytes=0).points_dropped)  # its block evicted: the point with it
        return rows

    monkeypatch.setattr(store, "rows", gc_after_the_list)
    report = store.fsck()
    assert dropped == [1] and report.ok and report.points_checked == 0 and report.bad_points == []


def test_gc_keeps_a_point_while_its_block_lives_and_drops_it_after(store):
    key = stored_point(store)
    store.write_point(BUNDLE, chain_keys(BUNDLE, [7] * 8, 4)[1], 8, point_arrays(3))  # its block never stored
    (store.root / "points" / "ab").mkdir()
    (store.root / "points" / "ab" / "orphan.kvp").write_bytes(b"x")  # a file no row names
    report = store.gc(budget_bytes=0)
    assert report.points_dropped == 1 and report.orphans_removed == 1
    assert list(store.point_refs([key], BUNDLE)) == [key]  # its block is referenced by a snapshot
    store.delete_session("s")
    report = store.gc(budget_bytes=0)  # the blocks are evicted, and their point with them
    assert report.blocks_evicted == 3 and report.points_dropped == 1
    assert store.points_summary() == {"points": 0, "point_bytes": 0, "point_share": 0.0}
    assert list((store.root / "points").rglob("*.kvp")) == []


def test_gc_keeps_a_conversations_newest_points_and_those_another_session_reaches(store):
    tokens = list(range(100, 132))  # 8 blocks of 4
    write_snapshot(store, "a", tokens)
    keys = chain_keys(BUNDLE, tokens, 4)
    for k, key in enumerate(keys):  # a point at every boundary: its older turns' and its newest
        store.write_point(BUNDLE, key, 4 * (k + 1), point_arrays(k))
    write_snapshot(store, "b", tokens[:8] + [9] * 4)  # another conversation shares the first two blocks
    report = store.gc(budget_bytes=0)
    kept = store.point_refs(keys, BUNDLE)
    assert report.points_dropped == 3 and sorted(kept) == sorted([keys[0], keys[1], *keys[-3:]])
    store.delete_session("b")  # no one else reaches the shared ones now: "a" keeps its deepest three
    assert store.gc(budget_bytes=0).points_dropped == 2 and sorted(store.point_refs(keys, BUNDLE)) == sorted(keys[-3:])


def test_gc_counts_a_blocks_point_as_freed_and_drops_older_turns_points_before_it_evicts(store):
    # The budget counts points; eviction counted only a block's own bytes freed, and older turns' points
    # were dropped after it: gc evicted far more of the prefix cache than the budget asked.
    cached = chain_keys(BUNDLE, TOKENS, 4)
    write_snapshot(store, "cache", TOKENS)
    for k, key in enumerate(cached):  # a point outweighs its block (a window's rows, a recurrent state)
        state = np.random.default_rng(k).standard_normal((1, 3, 512)).astype(np.float32)
        store.write_point(BUNDLE, key, 4 * (k + 1), {**point_arrays(k), "layers.1.arrays.0": Tensor.of(state)})
    store.delete_session("cache")  # its blocks and points are the prefix cache now
    block = store.index.one("SELECT stored_bytes AS n FROM blocks WHERE key = ?", (cached[0],))["n"]
    one = block + store.point_refs([cached[0]], BUNDLE)[cached[0]].stored_bytes
    assert block < one // 2
    report = store.gc(budget_bytes=store.stored_bytes() - one // 2)  # half a block and its point too many
    assert (report.blocks_evicted, report.points_dropped) == (1, 1) and len(store.point_refs(cached, BUNDLE)) == 2
    tokens = list(range(200, 232))  # a conversation of 8 blocks, a point at each: 5 of its older turns'
    write_snapshot(store, "a", tokens)
    turns = chain_keys(BUNDLE, tokens, 4)
    for k, key in enumerate(turns):
        store.write_point(BUNDLE, key, 4 * (k + 1), point_arrays(k))
    older = sum(r.stored_bytes for r in store.point_refs(turns[:-3], BUNDLE).values())
    report = store.gc(budget_bytes=store.stored_bytes() - older)  # dropping them is enough
    assert (report.blocks_evicted, report.points_dropped) == (0, 5) and len(store.point_refs(cached, BUNDLE)) == 2
