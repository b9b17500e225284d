"""Head lookups by chain key (store/heads.py) agree with comparing every session's tokens, at thousands of sessions."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from kvwake.daemon.session_state import common_prefix
from kvwake.store import heads
from testkit.kvdata import BUNDLE, OTHER_BUNDLE, write_snapshot


def brute_force(store, bundle, tokens, *, origin, mode, exclude=()):
    """What the lookup must return, by reading every head and comparing its tokens (the old matcher's way)."""
    found = []
    for h in store.heads(bundle):
        if h["metadata"].get("origin") != origin or h["state"].get("mode") != mode or h["id"] in exclude:
            continue
        found.append((common_prefix(h["token_ids"], tokens), store.session(h["id"])["created"], h["id"]))
    best = max((f[0] for f in found), default=0)
    return best, [sid for shared, _, sid in sorted(found, key=lambda f: (f[1], f[2])) if shared == best > 0]


def check(store, tokens, **where):
    got = store.deepest_heads(BUNDLE, tokens, **where)
    best, ids = brute_force(store, BUNDLE, tokens, **where)
    # The longest prefix exactly; on a tie, some of the tied sessions, oldest first (only the rows the
    # neighbour reads reach are ranked; a tie of identical conversations is rare, and either continues).
    assert bool(got) == bool(ids) and all(m.shared == best for m in got), (tokens, where)
    assert set(m.session_id for m in got) <= set(ids) and len(got) <= heads.TIES
    if len(ids) <= heads.NEIGHBOURS:
        assert [m.session_id for m in got] == ids, (tokens, where)
    return got


def fill(store, rng, n, base):
    """n sessions, most of them stateless, branching off one another and `base` at random points."""
    made = [base]
    for i in range(n):
        parent = rng.choice(made)
        tokens = parent[: rng.randrange(len(parent) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(12))]
        sid = f"s{i:05d}"
        if rng.random() < 0.2:  # an older snapshot first: history the lookup must not take for the head
            write_snapshot(store, sid, tokens[: len(tokens) // 2], metadata={"mode": "chat"})
        write_snapshot(store, sid, tokens, bundle=BUNDLE if rng.random() < 0.95 else OTHER_BUNDLE,
                       metadata={"mode": "chat" if rng.random() < 0.9 else "raw", "pending": [1]})
        store.ensure_session(sid, {"origin": "http" if rng.random() < 0.85 else "rpc"})
        made.append(tokens)
    return made


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_lookup_finds_what_comparing_every_head_finds(store, seed):
    rng = random.Random(seed)
    made = fill(store, rng, 150, [rng.randrange(4) for _ in range(20)])
    for _ in range(120):
        source = rng.choice(made)
        query = source[: rng.randrange(len(source) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(10))]
        exclude = set(rng.sample([f"s{i:05d}" for i in range(150)], 5)) if rng.random() < 0.3 else set()
        check(store, query, origin="http", mode=rng.choice(["chat", "chat", "raw"]), exclude=exclude)


def test_a_deleted_session_or_its_pruned_head_is_not_found(store):
    write_snapshot(store, "a", list(range(10)), metadata={"mode": "chat"})
    store.ensure_session("a", {"origin": "http"})
    (m,) = check(store, list(range(12)), origin="http", mode="chat")
    assert (m.session_id, m.shared, m.n_tokens, m.pending, m.reply_start) == ("a", 10, 10, [], None)
    newer = write_snapshot(store, "a", list(range(6)) + [9, 9], metadata={"mode": "chat"})
    assert check(store, list(range(12)), origin="http", mode="chat")[0].shared == 6  # the head, not the history
    store.delete_snapshot(newer.id)
    assert check(store, list(range(12)), origin="http", mode="chat")[0].shared == 10
    store.delete_session("a")
    assert store.deepest_heads(BUNDLE, list(range(12)), origin="http", mode="chat") == []


def test_thousands_of_sessions_sharing_a_long_prompt(store, monkeypatch):
    # Created cheaply (no fsync per commit, nor per file): what is asserted is the answer, not durability.
    store.index.db.execute("PRAGMA synchronous=OFF")
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    rng = random.Random(7)
    prompt = [rng.randrange(50) for _ in range(64)]  # 16 shared blocks
    convs = {}
    for i in range(2000):
        tokens = prompt + [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
        convs[f"c{i:05d}"] = tokens
        write_snapshot(store, f"c{i:05d}", tokens, metadata={"mode": "chat", "reply_start": len(tokens) - 1,
                                                             "pending": [i]})
        store.ensure_session(f"c{i:05d}", {"origin": "http"})
    for sid in ("c00000", "c01234", "c01999"):  # a next turn contains the whole conversation: that one
        (m,) = check(store, convs[sid] + [1, 2, 3], origin="http", mode="chat")
        i = int(sid[1:])
        assert (m.session_id, m.shared, m.pending, m.reply_start) == (sid, len(convs[sid]), [i], len(convs[sid]) - 1)
    new = check(store, prompt + [99, 98], origin="http", mode="chat")  # a new thread: the prompt, no more
    assert new and all(m.shared == len(prompt) for m in new)
    partly = check(store, convs["c00042"][:-1] + [77], origin="http", mode="chat")
    assert "c00042" in [m.session_id for m in partly] or partly[0].shared > len(convs["c00042"]) - 1


def test_every_lookup_goes_from_a_key_to_the_heads_holding_it(store):
    # Was: the planner chose to scan every session of the origin (sessions_origin) and look each one's
    # blocks up, O(sessions) per lookup; the queries now fix the join order. No table is scanned whole.
    write_snapshot(store, "a", list(range(10)), metadata={"mode": "chat"})
    store.ensure_session("a", {"origin": "http"})
    where = {"origin": "http", "mode": "chat", "exclude": "[]", "bundle": BUNDLE, "ties": 8, "key": "00" * 32,
             "parent": "00" * 32, "probe": b"\0\0\0\0", "n": 4}
    for name in ("_HELD", "_HELD_BY", "_HOLDERS", "_TAILS", "_CHILD_BLOCKS"):
        sql = getattr(heads, name).format(op="<=", order="DESC")
        plan = [r["detail"] for r in store.rows("EXPLAIN QUERY PLAN " + sql, where)]
        assert not [step for step in plan if step.startswith("SCAN") and "json_each" not in step], (name, plan)
        assert not [step for step in plan if "sessions_origin" in step], (name, plan)
        assert any("sessions_head" in step for step in plan), (name, plan)


def test_sessions_are_paged_by_id_and_stale_ones_by_age(store):
    for i in range(9):
        store.ensure_session(f"s{i}", {"origin": "http" if i % 3 else "rpc"})
    with store.index.write() as db:  # s0..s8 last changed at t = 100 + i
        for i in range(9):
            db.execute("UPDATE sessions SET updated = ? WHERE id = ?", (100.0 + i, f"s{i}"))
    pages, after = [], None
    while page := store.session_page(after=after, limit=2, origin="http"):
        pages.append([r["id"] for r in page])
        after = page[-1]["id"]
    assert pages == [["s1", "s2"], ["s4", "s5"], ["s7", "s8"]]
    assert [r["id"] for r in store.session_page(limit=4)] == ["s0", "s1", "s2", "s3"]
    assert {r["origin"] for r in store.session_page(limit=9)} == {"http", "rpc"}
    stale, after = [], None
    while page := store.stale_sessions("http", 107.0, 2, after):
        stale += [sid for _, sid in page]
        after = page[-1]
    assert stale == ["s1", "s2", "s4", "s5", "s7"]  # least recently updated first; s8 is too recent


def test_stored_bytes_reads_indexes_not_snapshot_rows(store):
    # Was: a full scan of snapshot rows, each carrying a head's token ids and messages (status slowed with the
    # number of sessions).
    write_snapshot(store, "a", list(range(10)), metadata={"mode": "chat"})
    plan = [r["detail"] for r in store.rows(
        "EXPLAIN QUERY PLAN SELECT (SELECT coalesce(sum(stored_bytes), 0) FROM blocks) + "
        "(SELECT coalesce(sum(tail_stored), 0) FROM snapshots) AS n")]
    assert [step for step in plan if step.startswith("SCAN") and step != "SCAN CONSTANT ROW"] == [
        "SCAN blocks USING COVERING INDEX blocks_stored", "SCAN snapshots USING COVERING INDEX snapshots_tail_stored"]
    assert store.stored_bytes() > 0


def test_gc_walks_the_store_without_holding_the_index(store, monkeypatch):
    # Was: gc held the index lock while it walked every block and tail file, so every lookup (matching,
    # status, listing) waited for the walk: seconds with thousands of sessions.
    import threading

    write_snapshot(store, "a", list(range(10)), metadata={"mode": "chat"})
    walk, free = store.files.walk, []

    def try_index():
        took = store.locked().acquire(timeout=2)
        if took:
            store.locked().release()
        free.append(took)

    def watched():
        t = threading.Thread(target=try_index)  # another thread: the lock is re-entrant for gc's own
        t.start()
        t.join()
        return walk()

    monkeypatch.setattr(store.files, "walk", watched)
    store.gc()
    assert free == [True]


def test_common_prefix_of_lists_and_arrays_agree_at_every_kind_of_position():
    from kvwake.daemon.session_state import PREFIX_PIECE

    rng = np.random.default_rng(7)
    base = [int(t) for t in rng.integers(0, 50_000, 3 * PREFIX_PIECE + 17)]
    for at in (0, 1, PREFIX_PIECE - 1, PREFIX_PIECE, PREFIX_PIECE + 1, 2 * PREFIX_PIECE + 5, len(base) - 1):
        other = list(base)
        other[at] += 1
        for a, b in ((base, other), (base, np.asarray(other)), (np.asarray(base), other)):
            assert common_prefix(a, b) == at, (at, type(a), type(b))
    for a, b in ((base, base[:100]), (base[:PREFIX_PIECE], base), ([], base), (base, base)):
        assert common_prefix(a, b) == common_prefix(np.asarray(a), np.asarray(b)) == min(len(a), len(b))


def test_a_lookup_does_not_wait_for_a_commit_under_way_and_sees_the_last_one(store):
    # Was: the lookup took the index lock, which a checkpoint's transaction holds through its commit (long
    # over a long conversation), so a request's matching waited for it.
    import threading
    import time

    tokens = list(range(40))
    write_snapshot(store, "http-a", tokens, metadata={"mode": "chat"})
    store.ensure_session("http-a", {"origin": "http"})
    holding, release = threading.Event(), threading.Event()

    def write_slowly():
        with store.transaction() as db:  # a commit under way: a session row no reader may see yet
            db.execute("INSERT INTO sessions (id, created, updated) VALUES ('http-b', 0, 0)")
            holding.set()
            release.wait(10)

    writer = threading.Thread(target=write_slowly)
    writer.start()
    try:
        assert holding.wait(10)
        began = time.perf_counter()
        got = store.deepest_heads(BUNDLE, tokens + [99], origin="http", mode="chat")
        took = time.perf_counter() - began
    finally:
        release.set()
        writer.join()
    assert took < 2, took  # the writer held on for up to 10 s
    assert [m.session_id for m in got] == ["http-a"] and got[0].shared == 40
    assert store.deepest_heads(BUNDLE, tokens + [99], origin="http", mode="chat")[0].session_id == "http-a"


def test_the_lookups_connections_are_reused_and_close_with_the_store(tmp_path):
    # Worker threads come and go (anyio prunes idle ones): a connection per thread would pile up for the
    # daemon's life. The lookups share a few, as many as ever ran at once.
    import threading

    from kvwake.store import Store

    s = Store(tmp_path / "s", block_tokens=4)
    s.register_bundle(BUNDLE, {"model": "test-a"})
    write_snapshot(s, "http-a", list(range(12)), metadata={"mode": "chat"})
    s.ensure_session("http-a", {"origin": "http"})
    for _ in range(5):  # one thread after another, each new
        t = threading.Thread(target=s.deepest_heads, args=(BUNDLE, list(range(12))),
                             kwargs={"origin": "http", "mode": "chat"})
        t.start()
        t.join()
    assert len(s._readers) == 1
    with s.snapshot_read() as a, s.snapshot_read() as b:  # two at once: two connections
        assert a is not b
    readers = list(s._readers)
    assert len(readers) == 2
    s.close()
    for reader in readers:
        with pytest.raises(Exception, match="closed"):
            reader.db.execute("SELECT 1")
