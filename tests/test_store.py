"""Store: exact read-back, dedup, prefix lookup, refusal of corrupt or swapped data, gc, fsck."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from kvwake.errors import BundleMismatchError, CorruptBlockError, InvalidParamsError, NotFoundError
from kvwake.store import Store
from testkit.kvdata import BUNDLE, OTHER_BUNDLE, assert_snapshot_exact, kv_arrays, write_snapshot

TOKENS = list(range(100, 114))  # 3 full 4-token blocks + a 2-token tail


def block_files(store):
    return sorted(p for p in store.files.blocks.rglob("*.kvb"))


def test_snapshot_reads_back_exactly_and_index_is_wal(store):
    info = write_snapshot(store, "s1", TOKENS)
    assert (info.new_blocks, info.reused_blocks, info.n_tokens) == (3, 0, 14)
    assert_snapshot_exact(store, info.id)
    assert store.rows("PRAGMA journal_mode")[0]["journal_mode"] == "wal"
    assert store.rows("PRAGMA foreign_keys")[0]["foreign_keys"] == 1
    assert store.session("s1")["head"] == info.id


def test_writing_an_existing_block_is_a_reference_not_a_write(store):
    first = write_snapshot(store, "s1", TOKENS)
    files = block_files(store)
    second = write_snapshot(store, "s2", TOKENS[:12] + [7, 7, 7, 7, 7])
    assert (second.new_blocks, second.reused_blocks) == (1, 3)
    assert len(block_files(store)) == len(files) + 1
    refs = {r["key"][:8]: r["refs"] for r in store.rows("SELECT key, refs FROM blocks")}
    assert sorted(refs.values()) == [1, 2, 2, 2]
    assert_snapshot_exact(store, first.id)
    assert_snapshot_exact(store, second.id)


def test_longest_prefix_checks_bundle_and_tokens(store):
    write_snapshot(store, "s1", TOKENS)
    assert len(store.longest_prefix(BUNDLE, TOKENS[:10] + [0] * 20)) == 2
    assert len(store.longest_prefix(BUNDLE, TOKENS)) == 3
    assert store.longest_prefix(OTHER_BUNDLE, TOKENS) == []
    assert store.longest_prefix(BUNDLE, [1] + TOKENS[1:]) == []
    # A row whose token ids were altered is never served as a hit.
    key = store.longest_prefix(BUNDLE, TOKENS)[1].key
    with store.index.write() as db:
        db.execute("UPDATE blocks SET token_ids = ? WHERE key = ?", (b"\0" * 16, key))
    assert len(store.longest_prefix(BUNDLE, TOKENS)) == 1


def test_prefix_only_blocks_are_pinned_and_have_no_snapshot(store):
    with store.writer(None, BUNDLE, TOKENS, pin=True) as w:
        for i in w.needed:
            w.add_block(i, kv_arrays(w.block_tokens(i), i * 4))
        info = w.commit()
    assert info.id is None and info.new_blocks == 3
    assert store.snapshots() == []
    assert {r["pins"] for r in store.rows("SELECT pins FROM blocks")} == {1}
    assert store.gc(budget_bytes=0).blocks_evicted == 0


def test_bundle_mismatch_is_refused_with_facts(store):
    info = write_snapshot(store, "s1", TOKENS)
    with pytest.raises(BundleMismatchError) as err:
        store.snapshot(info.id, bundle=OTHER_BUNDLE)
    assert err.value.data["snapshot_id"] == info.id and err.value.data["loaded_bundle"] == OTHER_BUNDLE


def test_index_row_naming_another_bundle_is_refused(store):
    info = write_snapshot(store, "s1", TOKENS)
    key = store.snapshot(info.id).blocks[0].key
    with store.index.write() as db:
        db.execute("UPDATE blocks SET bundle = ? WHERE key = ?", (OTHER_BUNDLE, key))
    with pytest.raises(BundleMismatchError, match="names bundle"):
        store.snapshot(info.id, bundle=BUNDLE)


def test_flipped_byte_raises_corrupt_block_naming_snapshot_and_block(store):
    info = write_snapshot(store, "s1", TOKENS)
    ref = store.snapshot(info.id).blocks[1]
    path = store.files.absolute(ref.file)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    record = store.snapshot(info.id)
    with pytest.raises(CorruptBlockError) as err:
        list(store.iter_blocks(record))
    assert err.value.data["block"] == ref.key and err.value.data["snapshot_id"] == info.id
    assert err.value.data["session_id"] == "s1" and ref.key[:16] in err.value.message


def test_missing_file_raises_corrupt_block(store):
    info = write_snapshot(store, "s1", TOKENS)
    ref = store.snapshot(info.id).blocks[0]
    store.files.absolute(ref.file).unlink()
    with pytest.raises(CorruptBlockError, match="missing"):
        store.read_block(ref, snapshot_id=info.id)


def test_block_files_swapped_between_keys_are_refused(store):
    info = write_snapshot(store, "s1", TOKENS)
    a, b = store.snapshot(info.id).blocks[:2]
    pa, pb = store.files.absolute(a.file), store.files.absolute(b.file)
    da, db_ = pa.read_bytes(), pb.read_bytes()
    pa.write_bytes(db_)
    pb.write_bytes(da)
    with pytest.raises(CorruptBlockError, match="another payload"):
        store.read_block(a)
    # Even with the index digests swapped too, the payload names its own key.
    with store.index.write() as db:
        db.execute("UPDATE blocks SET digest = ?, raw_bytes = ? WHERE key = ?", (b.digest, b.raw_bytes, a.key))
    with pytest.raises(CorruptBlockError):
        store.snapshot(info.id)  # the snapshot digest no longer matches its rows
    with pytest.raises(CorruptBlockError, match="file holds block"):
        store.read_block(store.index.blocks_by_key([a.key])[a.key])


def test_snapshot_rows_swapped_for_anothers_are_refused(store):
    one = write_snapshot(store, "s1", TOKENS)
    two = write_snapshot(store, "s2", [5] * 14)
    with store.index.write() as db:
        rows = db.execute("SELECT token_ids FROM snapshots WHERE id = ?", (two.id,)).fetchone()
        db.execute("UPDATE snapshots SET token_ids = ? WHERE id = ?", (rows[0], one.id))
    with pytest.raises(CorruptBlockError, match="block list does not match"):
        store.snapshot(one.id)


def test_tails_swapped_between_snapshots_are_refused(store):
    one = write_snapshot(store, "s1", TOKENS)
    two = write_snapshot(store, "s2", TOKENS[:12] + [1, 2])
    t1 = store.files.absolute(store.snapshot(one.id).tail.file)
    t2 = store.files.absolute(store.snapshot(two.id).tail.file)
    d1, d2 = t1.read_bytes(), t2.read_bytes()
    t1.write_bytes(d2)
    t2.write_bytes(d1)
    with pytest.raises(CorruptBlockError, match="tail"):
        store.read_tail(store.snapshot(one.id))
    with store.index.write() as db:  # swap the index's tail digests as well
        db.execute("UPDATE snapshots SET tail_digest = (SELECT tail_digest FROM snapshots WHERE id = ?), "
                   "tail_raw = (SELECT tail_raw FROM snapshots WHERE id = ?) WHERE id = ?", (two.id, two.id, one.id))
    with pytest.raises(CorruptBlockError, match="digest mismatch"):
        store.snapshot(one.id)


def test_gc_evicts_unreferenced_blocks_and_orphans_but_keeps_checkpoints(store):
    keep = write_snapshot(store, "keep", TOKENS, label="before-refactor")
    gone = write_snapshot(store, "gone", [9] * 13)
    (store.files.blocks / "ab").mkdir(exist_ok=True)
    (store.files.blocks / "ab" / ".stale.123.tmp").write_bytes(b"partial")
    store.delete_session("gone")
    report = store.gc(budget_bytes=0)
    assert (report.blocks_evicted, report.orphans_removed) == (3, 2)  # 3 blocks; the tmp file and gone's tail
    with pytest.raises(NotFoundError):
        store.snapshot(gone.id)
    assert_snapshot_exact(store, keep.id)
    assert store.fsck().ok


def test_budget_evicts_least_recently_used_prefix_blocks_first(store):
    for n, session in enumerate(["a", "b", "c"]):
        write_snapshot(store, session, [n] * 8)
    old, mid, new = (store.snapshot(store.latest_snapshot(s)) for s in "abc")
    for s in "abc":
        store.delete_session(s)
    store.touch([b.key for b in old.blocks])  # "a" used most recently now
    total = store.stored_bytes()
    report = store.gc(budget_bytes=total - sum(b.stored_bytes for b in mid.blocks))
    assert report.blocks_evicted == 2
    left = {r["key"] for r in store.rows("SELECT key FROM blocks")}
    assert {b.key for b in old.blocks} <= left and not ({b.key for b in mid.blocks} & left)


def test_gc_prunes_history_but_keeps_head_and_labels(store):
    ids = [write_snapshot(store, "s", TOKENS[: 4 + n]).id for n in range(6)]
    store.set_label(ids[0], "first")
    report = store.gc(keep_history=2)
    assert report.snapshots_pruned == 3
    assert [s["id"] for s in store.snapshots("s")] == [ids[0], ids[4], ids[5]]
    assert store.session("s")["head"] == ids[5]


def test_fsck_quarantines_bad_blocks_and_reports_damaged_snapshots(store):
    info = write_snapshot(store, "s1", TOKENS)
    ref = store.snapshot(info.id).blocks[2]
    path = store.files.absolute(ref.file)
    path.write_bytes(path.read_bytes()[:-3])
    with store.index.write() as db:
        db.execute("UPDATE blocks SET refs = 7 WHERE key = ?", (store.snapshot(info.id).blocks[0].key,))
    report = store.fsck()
    assert [b["block"] for b in report.bad_blocks] == [ref.key]
    assert report.damaged_snapshots[0]["snapshot_id"] == info.id
    assert report.refcounts_fixed[0]["recorded"] == 7 and report.refcounts_fixed[0]["actual"] == 1
    assert (store.files.quarantine / path.name).exists() and not path.exists()
    assert store.rows("SELECT count(*) AS n FROM snapshots")[0]["n"] == 1  # nothing deleted
    assert len(store.longest_prefix(BUNDLE, TOKENS)) == 2


def test_a_quarantined_block_is_healed_by_the_next_writer(store):
    info = write_snapshot(store, "s1", TOKENS)
    ref = store.snapshot(info.id).blocks[0]
    store.files.absolute(ref.file).unlink()
    store.fsck()
    again = write_snapshot(store, "s2", TOKENS)
    assert again.new_blocks == 1
    assert_snapshot_exact(store, info.id)
    assert store.fsck().bad_blocks == []


def test_fork_shares_blocks_and_copies_the_tail(store):
    info = write_snapshot(store, "s1", TOKENS)
    before = len(block_files(store))
    fork_id = store.fork(info.id, "s2")
    assert len(block_files(store)) == before
    assert store.snapshot(fork_id).session_id == "s2"
    assert_snapshot_exact(store, fork_id)
    store.delete_session("s1")
    store.gc(budget_bytes=0)
    assert_snapshot_exact(store, fork_id)


def test_unknown_ids_raise_not_found(store):
    with pytest.raises(NotFoundError):
        store.snapshot("nope")
    with pytest.raises(NotFoundError):
        store.session("nope")
    with pytest.raises(NotFoundError):
        store.delete_session("nope")
    with pytest.raises(NotFoundError, match="not registered"):
        store.writer("s", "ee" * 32, TOKENS)


def test_an_aborted_writer_leaves_nothing(store):
    with pytest.raises(RuntimeError):
        with store.writer("s1", BUNDLE, TOKENS) as w:
            w.add_block(0, kv_arrays(w.block_tokens(0), 0))
            raise RuntimeError("engine died")
    assert block_files(store) == [] and store.snapshots() == []


def test_commit_refuses_missing_blocks(store):
    with store.writer("s1", BUNDLE, TOKENS) as w:
        with pytest.raises(ValueError, match=r"blocks \[1, 2\]"):
            w.add_block(0, kv_arrays(w.block_tokens(0), 0))
            w.commit()


def test_reopening_keeps_everything_and_migrations_run_once(store, tmp_path):
    info = write_snapshot(store, "s1", TOKENS)
    store.close()
    again = Store(tmp_path / "store", block_tokens=4)
    assert_snapshot_exact(again, info.id)
    names = [r["name"] for r in again.rows("SELECT name FROM _sqlite_migrations")]
    assert names == ["m001_initial", "m002_store_meta", "m003_children", "m004_responses", "m005_heads", "m006_points"]
    again.close()
    with pytest.raises(sqlite3.IntegrityError):  # foreign keys are enforced
        conn = sqlite3.connect(tmp_path / "store" / "index.sqlite")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("INSERT INTO snapshot_blocks VALUES ('x', 0, 'y')")


@pytest.mark.parametrize("second", ["commit", "abort"])
def test_racing_writers_of_the_same_blocks_never_delete_the_indexed_file(store, second):
    # Both plan before either commits, so both write every block (same key, same bytes).
    a, b = store.writer("a", BUNDLE, TOKENS), store.writer("b", BUNDLE, TOKENS)
    for w in (a, b):
        for i in w.needed:
            w.add_block(i, kv_arrays(w.block_tokens(i), i * 4))
        w.set_tail(kv_arrays(TOKENS[12:], 12))
    first = a.commit()
    if second == "commit":
        info = b.commit()
        assert (info.new_blocks, info.reused_blocks) == (0, 3)
        assert_snapshot_exact(store, info.id)
    else:
        b.abort()
    assert_snapshot_exact(store, first.id)
    assert store.fsck().ok and len(block_files(store)) == 3


def test_disk_full_raises_storage_full_and_leaves_nothing_half_written(store, monkeypatch):
    import errno
    import os

    previous = write_snapshot(store, "s1", TOKENS)
    real_write, calls = os.write, []

    def full_after_one(fd, data):
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_after_one)
    from kvwake.errors import StorageFullError

    with pytest.raises(StorageFullError, match="no room"):
        write_snapshot(store, "s1", [1] * 14)
    monkeypatch.undo()
    assert [s["id"] for s in store.snapshots("s1")] == [previous.id]
    assert not [p for p in store.files.walk() if p.name.endswith(".tmp")]
    assert store.gc().orphans_removed == 0 and store.fsck().ok  # the aborted writer cleaned up after itself
    assert_snapshot_exact(store, previous.id)


def test_fork_into_the_same_session_is_refused(store):
    from kvwake.errors import InvalidParamsError

    info = write_snapshot(store, "s1", TOKENS)
    with pytest.raises(InvalidParamsError, match="source session"):
        store.fork(info.id, "s1")


def test_writers_racing_on_one_snapshot_id_never_delete_the_winners_tail(store):
    # Was: tails/<id>.kvb was shared, so the loser's abort deleted the committed snapshot's tail
    # (two concurrent imports of one file do exactly this).
    a = store.writer("s1", BUNDLE, TOKENS, snapshot_id="same-id")
    b = store.writer("s1", BUNDLE, TOKENS, snapshot_id="same-id")
    for w in (a, b):
        for i in w.needed:
            w.add_block(i, kv_arrays(w.block_tokens(i), i * 4))
        w.set_tail(kv_arrays(TOKENS[12:], 12))
    a.commit()
    with pytest.raises(sqlite3.IntegrityError):
        b.commit()
    assert_snapshot_exact(store, "same-id")
    assert store.fsck().ok and store.gc().orphans_removed == 0


def test_gc_waits_for_a_reader_of_a_snapshot_it_would_prune(store):
    # Was: wake/export/fork read snapshot files without the store lock: gc could evict them mid-read.
    import threading

    old = write_snapshot(store, "s", TOKENS)
    write_snapshot(store, "s", TOKENS[:8] + [1, 2, 3, 4, 5, 6])  # the new head; `old` is prunable history
    finished = threading.Event()
    with store.reading():
        t = threading.Thread(target=lambda: (store.gc(keep_history=0, budget_bytes=0), finished.set()))
        t.start()
        assert not finished.wait(0.5)  # gc waits for the reader
        assert_snapshot_exact(store, old.id)
    t.join(10)
    assert finished.is_set()
    with pytest.raises(NotFoundError):
        store.snapshot(old.id)


def test_a_writer_holds_no_block_bytes_until_commit(store):
    # Was: every written block's compressed bytes stayed in the writer until commit (a sleep grew RSS by
    # most of its KV's size).
    import tracemalloc

    import numpy as np

    rng = np.random.default_rng(0)
    tokens = list(range(4 * 40))
    block = lambda: {"layers.0.keys": rng.integers(0, 2**16, 64 << 10, dtype=np.uint16)}  # noqa: E731  128 KiB
    with store.writer("big", BUNDLE, tokens) as w:
        tracemalloc.start()
        for i in w.needed:
            w.add_block(i, block())
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        info = w.commit()
    assert info.new_blocks == 40 and info.stored_bytes > 40 * (100 << 10)
    assert peak < 8 * (128 << 10), f"writer peak {peak} bytes for 40 blocks of 128 KiB"


def test_a_store_refuses_another_block_size(store, tmp_path):
    # Was: opened with another block size, every snapshot looked damaged to fsck and export failed.
    write_snapshot(store, "s", TOKENS)
    with pytest.raises(InvalidParamsError, match="uses 4-token blocks, not 8"):
        Store(tmp_path / "store", block_tokens=8)
    assert_snapshot_exact(store, store.latest_snapshot("s"))


def test_the_snapshot_digest_covers_its_session_state(store):
    # Was: pending tokens, messages and tools (what a wake restores besides the KV) were outside the digest.
    info = write_snapshot(store, "s", TOKENS, metadata={"pending": [5], "messages": []})
    with store.index.write() as db:
        db.execute("UPDATE snapshots SET metadata = ? WHERE id = ?", ('{"pending": [6], "messages": []}', info.id))
    with pytest.raises(CorruptBlockError, match="digest mismatch"):
        store.snapshot(info.id)


def test_heads_are_each_sessions_newest_snapshot_of_one_bundle(store):
    write_snapshot(store, "a", TOKENS[:6], metadata={"pending": [1]})
    head_a = write_snapshot(store, "a", TOKENS, metadata={"pending": [2], "mode": "chat"})
    write_snapshot(store, "b", [7, 8, 9, 10, 11], OTHER_BUNDLE)
    store.ensure_session("c", {"origin": "http"})  # never slept: no head
    store.ensure_session("a", {"origin": "http"})
    (a,) = store.heads(BUNDLE)
    assert a["id"] == "a" and a["metadata"] == {"origin": "http"} and a["state"] == {"pending": [2], "mode": "chat"}
    assert a["token_ids"].dtype == np.int64 and a["token_ids"].tolist() == TOKENS
    assert store.latest_snapshot("a") == head_a.id
    assert [h["id"] for h in store.heads(OTHER_BUNDLE)] == ["b"]
    store.delete_snapshot(head_a.id)  # the older snapshot becomes the head
    assert store.heads(BUNDLE)[0]["token_ids"].tolist() == TOKENS[:6]
    assert store.heads("dd" * 32) == []


def test_a_snapshot_summary_is_its_row_without_tokens(store):
    info = write_snapshot(store, "s", TOKENS, metadata={"pending": [5, 6]})
    store.set_label(info.id, "before-tools")
    summary = store.snapshot_summary(info.id)
    created = store.snapshot(info.id).created
    assert summary == {"id": info.id, "session_id": "s", "n_tokens": len(TOKENS), "label": "before-tools",
                       "metadata": {"pending": [5, 6]}, "bundle": BUNDLE, "created": created}
    with pytest.raises(NotFoundError):
        store.snapshot_summary("nope")


def test_stored_responses_round_trip_outlive_their_session_and_expire(store, tmp_path):
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    store.responses.put("resp_1", "s-gone", 42, conversation, {"id": "resp_1", "object": "response"})
    got = store.responses.get("resp_1")
    assert (got["session_id"], got["position"], got["conversation"]) == ("s-gone", 42, conversation)
    assert got["response"] == {"id": "resp_1", "object": "response"}
    store.close()
    reopened = Store(tmp_path / "store", block_tokens=4)  # durable: a new process finds it
    assert reopened.responses.get("resp_1")["position"] == 42
    assert reopened.responses.expire(got["created"]) == 0 and reopened.responses.expire(got["created"] + 1) == 1
    with pytest.raises(NotFoundError):
        reopened.responses.get("resp_1")
    reopened.responses.put("resp_2", "s-x", 1, [], {})
    reopened.responses.delete("resp_2")
    with pytest.raises(NotFoundError):
        reopened.responses.delete("resp_2")
    reopened.close()


def test_a_snapshot_replaces_the_checkpoint_it_supersedes_only_while_that_is_the_unlabeled_head(store):
    # Continuous persistence (daemon/kv/persist.py): each checkpoint replaces the last in its own commit.
    b = store.block_tokens
    first = write_snapshot(store, "s", list(range(2 * b)))
    check = write_snapshot(store, "s", list(range(3 * b)) + [5, 6], parent=first.id)  # with a tail file
    newer = write_snapshot(store, "s", list(range(4 * b)) + [7], parent=check.id, supersede=check.id)
    assert [(s["id"], s["parent"]) for s in store.snapshots("s")] == [(first.id, None), (newer.id, first.id)]
    assert newer.new_blocks == 1 and newer.reused_blocks == 3  # the replaced one's blocks, referenced again
    assert_snapshot_exact(store, newer.id)
    assert store.session("s")["head"] == newer.id
    assert store.fsck().ok and store.gc(keep_history=10).orphans_removed == 0  # its tail file went with it
    # Labeled, no longer the head, or another session's: kept.
    labeled = write_snapshot(store, "s", list(range(4 * b)), label="keep")
    write_snapshot(store, "s", list(range(5 * b)), supersede=labeled.id)
    write_snapshot(store, "s", list(range(5 * b)), supersede=newer.id)
    other = write_snapshot(store, "t", list(range(b)))
    write_snapshot(store, "s", list(range(5 * b)), supersede=other.id)
    assert {newer.id, labeled.id, other.id} <= {s["id"] for s in store.snapshots()}
    assert store.fsck().ok


def test_writers_racing_on_a_block_with_other_bytes_both_commit_snapshots_that_verify(store):
    # Was: the losing writer's snapshot digest named its own bytes for the block, the index kept the winner's,
    # and its wake failed "digest mismatch" (on CUDA the prefill of one prefix is not bit-stable
    # across chunk shapes, so two sessions' KV for one block differ in the last bits).
    a = store.writer("a", BUNDLE, TOKENS)
    b = store.writer("b", BUNDLE, TOKENS)
    for w, nudge in ((a, 0), (b, 1)):
        for i in w.needed:
            arrays = kv_arrays(w.block_tokens(i), i * 4)
            packed = arrays["layers.0.packed"]
            packed.array[...] += nudge  # b's bytes differ from a's
            w.add_block(i, arrays)
        w.set_tail(kv_arrays(TOKENS[12:], 12))
    first, second = a.commit(), b.commit()
    assert second.new_blocks == 0 and second.written_bytes < first.written_bytes  # only its tail counts as written
    for info in (first, second):
        record = store.snapshot(info.id, bundle=BUNDLE)  # verifies the digest over the index rows
        assert record.digest == info.digest
    assert_snapshot_exact(store, second.id)  # the winner's (a's) bytes stand for both
    assert store.fsck().ok and store.gc().orphans_removed == 0


def test_a_reused_block_quarantined_and_written_again_meanwhile_is_named_with_its_new_bytes(store):
    # Was: a writer's snapshot digest named a reused block's digest as read when the writer opened; if fsck
    # quarantined the block and another writer stored it again (other bytes) before this commit, the
    # committed snapshot failed every wake with "digest mismatch".
    first = write_snapshot(store, "first", TOKENS)
    later = store.writer("later", BUNDLE, TOKENS)  # reuses every block
    assert later.needed == []
    key = store.rows("SELECT block_key FROM snapshot_blocks ORDER BY pos LIMIT 1")[0]["block_key"]
    with store.index.write() as db:
        db.execute("UPDATE blocks SET quarantined = 1 WHERE key = ?", (key,))
    again = store.writer(None, BUNDLE, TOKENS[:4])  # stores block 0 again, with other bytes
    arrays = kv_arrays(TOKENS[:4], 0)
    arrays["layers.0.packed"].array[...] += 1
    again.add_block(0, arrays)
    again.commit()
    later.set_tail(kv_arrays(TOKENS[12:], 12))
    info = later.commit()
    assert store.snapshot(info.id, bundle=BUNDLE).digest == info.digest  # verifies against the index rows
    # Only the snapshot made before the quarantine names the bytes fsck condemned.
    assert [d["snapshot_id"] for d in store.fsck().damaged_snapshots] == [first.id]


def test_a_file_name_that_leaves_the_store_is_refused(store):
    # The index names files relative to the store; a name is checked as a name (no realpath walk per
    # block read: 5% of a wake's decoding threads), and one that leaves the store is refused.
    files = store.files
    assert files.absolute("blocks/ab/cd.kvb") == files.root.resolve() / "blocks" / "ab" / "cd.kvb"
    for bad in ("../x", "/etc/passwd", "blocks/../../x", "", "blocks/\0x"):
        with pytest.raises(ValueError, match="outside the store"):
            files.absolute(bad)


def test_a_reused_block_quarantined_meanwhile_fails_the_commit_and_names_it(store):
    # The commit checks the blocks it reuses (their digests and quarantine marks: index.digests_by_key, inside
    # the transaction); a block fsck condemned since the writer opened, and nobody wrote again, is named.
    write_snapshot(store, "first", TOKENS)
    later = store.writer("later", BUNDLE, TOKENS)  # reuses every block
    key = store.rows("SELECT block_key FROM snapshot_blocks ORDER BY pos LIMIT 1")[0]["block_key"]
    with store.index.write() as db:
        db.execute("UPDATE blocks SET quarantined = 1 WHERE key = ?", (key,))
    later.set_tail(kv_arrays(TOKENS[12:], 12))
    with pytest.raises(CorruptBlockError, match="quarantined while") as caught:
        later.commit()
    assert caught.value.data["blocks"] == [key]
    assert [s["session_id"] for s in store.snapshots()] == ["first"]  # nothing of `later` committed
