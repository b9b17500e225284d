"""gc and fsck: keeping a store small and proving it sound, while sleeps and wakes go on.

gc:
  1. prunes unlabeled snapshots beyond `keep_history` per session (the head
     and labeled checkpoints always stay);
  2. drops the restore points of a conversation's older turns that no other
     session reaches, and those whose block is gone (points.py,
     `drop_unneeded`), before it evicts: the budget counts points;
  3. evicts blocks no snapshot references and nothing pinned, least recently
     used first, until the store fits `budget_bytes` (None: evict them all;
     with a budget they are the prefix cache); a block's point counts as
     freed with it, and is dropped after;
  4. deletes orphan files: temp files and block or tail files the index does
     not name (what a crash between file write and commit leaves behind).
Rows go first, in one transaction; files after. A crash in between leaves
orphans for the next gc, never an index row without its file.

fsck reads and verifies everything, moves bad files to quarantine/ and marks
their rows, recounts references, and reports. It deletes nothing but the rows
of bad restore points (a prefill takes the point again).

Beside serving (docs/decisions.md, Store: "gc and fsck beside serving"):
neither holds the store lock for its run. A writer holds the lock shared from its first file to its commit, and counts on the
blocks it reuses staying (they may be unreferenced: the prefix cache); a
reader holds it shared while it reads a snapshot's files. So gc takes the lock
exclusively only for what those two rely on, each time for a moment: (1) to
(3)'s row deletions, then the orphan decision (the folders are walked before,
unlocked; a file walked, not named by the index in that moment, and still
there is an orphan: no writer is between its first file and its commit then,
and a writer after it only makes files the walk did not see). Files are
deleted after the lock is given back: no row names them any more, so no
reader or writer can reach them. fsck verifies one block or snapshot at a
time under the shared lock, looking its row up again inside it (a block gc
evicted meanwhile is skipped, not reported missing), and checks SQLite on a
connection of its own; its orphan report is made as gc's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvwake.errors import KvwakeError, NotFoundError
from kvwake.store import points
from kvwake.store.core import StoreCore

__all__ = ["FsckReport", "GcReport", "fsck", "gc"]

Progress = Callable[[int, int], None] | None


@dataclass(frozen=True)
class GcReport:
    snapshots_pruned: int
    blocks_evicted: int
    block_bytes_freed: int
    orphans_removed: int
    orphan_bytes_freed: int
    bytes_after: int
    points_dropped: int = 0


@dataclass
class FsckReport:
    blocks_checked: int = 0
    snapshots_checked: int = 0
    bad_blocks: list[dict[str, Any]] = field(default_factory=list)
    damaged_snapshots: list[dict[str, Any]] = field(default_factory=list)
    refcounts_fixed: list[dict[str, Any]] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    sqlite: list[str] = field(default_factory=list)
    points_checked: int = 0
    bad_points: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.bad_blocks or self.damaged_snapshots or self.refcounts_fixed or self.sqlite or self.bad_points)


def stored_bytes(store: StoreCore) -> int:
    """Bytes of every indexed block, tail and restore point file."""
    row = store.index.one(
        "SELECT (SELECT coalesce(sum(stored_bytes), 0) FROM blocks) + "
        "(SELECT coalesce(sum(tail_stored), 0) FROM snapshots) + "
        "(SELECT coalesce(sum(stored_bytes), 0) FROM points) AS n"
    )
    return int(row["n"]) if row else 0


def _prune_history(store: StoreCore, keep: int) -> int:
    with store.index.write() as db:
        return db.execute(
            "DELETE FROM snapshots WHERE id IN (SELECT id FROM (SELECT id, ROW_NUMBER() OVER ("
            " PARTITION BY session_id ORDER BY created DESC, id DESC) AS rn FROM snapshots WHERE label IS NULL)"
            " WHERE rn > ?) AND id NOT IN (SELECT head FROM sessions WHERE head IS NOT NULL)",
            (keep,),
        ).rowcount


def _evict(store: StoreCore, budget: int | None) -> tuple[list[str], int]:
    """Evict unreferenced, unpinned blocks, least recently used first, until the store fits `budget`;
    returns their files and their bytes. A block's point goes with it (`_drop_points` after), so its
    bytes count as freed too: the budget counts them."""
    total = stored_bytes(store)
    files, block_bytes, freed = [], 0, 0
    with store.index.write() as db:
        rows = db.execute("SELECT b.key, b.file, b.stored_bytes, coalesce(p.stored_bytes, 0) FROM blocks b "
                          "LEFT JOIN points p ON p.key = b.key WHERE b.refs = 0 AND b.pins = 0 "
                          "ORDER BY b.last_used, b.key").fetchall()
        for key, rel, size, point_size in rows:
            if budget is not None and total - freed <= budget:
                break
            db.execute("DELETE FROM blocks WHERE key = ?", (key,))
            files.append(rel)
            block_bytes += size
            freed += size + point_size
    return files, block_bytes


def _drop_points(store: StoreCore) -> list[str]:
    with store.index.write() as db:
        return points.drop_unneeded(db)


def _orphans(store: StoreCore) -> list[Path]:
    """Files no index row names and no writer will (see the module docstring: walked unlocked, decided
    under the exclusive lock)."""
    walked = list(store.files.walk())
    with store.files.lock(exclusive=True), store.locked():
        named = {r["f"] for r in store.index.rows("SELECT file AS f FROM blocks UNION SELECT tail_file FROM snapshots "
                                                  "WHERE tail_file IS NOT NULL UNION SELECT file FROM points")}
        unnamed = [p for p in walked if store.files.relative(p) not in named]
    return [p for p in unnamed if p.exists()]  # not a temp file renamed since the walk (no one makes these paths)


def gc(store: StoreCore, *, budget_bytes: int | None = None, keep_history: int | None = None) -> GcReport:
    """Prune, evict and sweep (see the module docstring); returns what it did."""
    budget = store.budget_bytes if budget_bytes is None else budget_bytes
    keep = store.keep_history if keep_history is None else keep_history
    with store.files.lock(exclusive=True), store.locked():  # a moment: no writer counts on what is evicted
        pruned = _prune_history(store, keep)
        dropped = _drop_points(store)  # older turns' points first: the budget counts what they free
        evicted, freed = _evict(store, budget)
        dropped += _drop_points(store)  # the evicted blocks' points
    for rel in evicted + dropped:
        with contextlib.suppress(FileNotFoundError):
            store.files.absolute(rel).unlink()
    orphans = _orphans(store)
    orphan_bytes = 0
    for path in orphans:
        with contextlib.suppress(FileNotFoundError):
            orphan_bytes += path.stat().st_size
            path.unlink()
    with store.locked():
        return GcReport(pruned, len(evicted), freed, len(orphans), orphan_bytes, stored_bytes(store), len(dropped))


def _quarantine(store: StoreCore, rel: str) -> None:
    src = store.files.absolute(rel)
    if src.exists():
        os.replace(src, store.files.quarantine / src.name)


def _check_block(store: StoreCore, key: str, report: FsckReport) -> bool:
    """Verify one block as it is now, under the shared lock; False when it is gone (gc evicted it)."""
    with store.reading():
        with store.locked():
            ref = store.index.blocks_by_key([key]).get(key)
        if ref is None or ref.quarantined:
            return False
        try:
            store.read_block(ref)
        except KvwakeError as exc:
            report.bad_blocks.append({"block": ref.key, "file": ref.file, "reason": exc.message})
            _quarantine(store, ref.file)
            with store.transaction() as db:
                db.execute("UPDATE blocks SET quarantined = 1 WHERE key = ? AND file = ?", (ref.key, ref.file))
    return True


def _check_blocks(store: StoreCore, report: FsckReport, progress: Progress) -> None:
    keys = [r["key"] for r in store.rows("SELECT key FROM blocks WHERE quarantined = 0 ORDER BY key")]
    for n, key in enumerate(keys, 1):
        report.blocks_checked += _check_block(store, key, report)
        if progress:
            progress(n, len(keys))
    for row in store.rows("SELECT key, file FROM blocks WHERE quarantined = 1"):
        if not any(b["block"] == row["key"] for b in report.bad_blocks):
            report.bad_blocks.append({"block": row["key"], "file": row["file"], "reason": "quarantined earlier"})


def _check_refcounts(store: StoreCore, report: FsckReport) -> None:
    with store.transaction() as db:
        for key, refs, actual in db.execute(
            "SELECT key, refs, (SELECT count(*) FROM snapshot_blocks WHERE block_key = key) FROM blocks "
            "WHERE refs != (SELECT count(*) FROM snapshot_blocks WHERE block_key = key)"
        ).fetchall():
            report.refcounts_fixed.append({"block": key, "recorded": refs, "actual": actual})
            db.execute("UPDATE blocks SET refs = ? WHERE key = ?", (actual, key))


def _check_snapshot(store: StoreCore, snapshot_id: str, report: FsckReport) -> None:
    """Verify one snapshot's record and tail as they are now, under the shared lock (one pruned meanwhile
    is skipped)."""
    facts: dict[str, Any] = {"snapshot_id": snapshot_id}
    with store.reading():
        try:
            record = store.snapshot(snapshot_id)
            facts["session_id"] = record.session_id
            bad = [b.key for b in record.blocks if b.quarantined]
            if bad:
                raise KvwakeError(f"{len(bad)} quarantined block(s): {', '.join(k[:16] for k in bad)}")
            try:
                store.read_tail(record)
            except KvwakeError:
                if record.tail:
                    _quarantine(store, record.tail.file)
                raise
        except NotFoundError:
            return  # pruned or deleted since the list was read
        except KvwakeError as exc:
            report.damaged_snapshots.append({**facts, "reason": exc.message})
    report.snapshots_checked += 1


def _check_snapshots(store: StoreCore, report: FsckReport) -> None:
    for row in store.rows("SELECT id FROM snapshots ORDER BY created"):
        _check_snapshot(store, row["id"], report)


def fsck(store: StoreCore, *, progress: Progress = None) -> FsckReport:
    """Verify every block and snapshot; quarantine bad files; report. Deletes nothing.

    Sleeps, wakes and gc go on meanwhile (see the module docstring); what they add after fsck
    listed the blocks and snapshots is left for the next run."""
    report = FsckReport()
    report.sqlite = store.index.check()
    _check_blocks(store, report, progress)
    _check_refcounts(store, report)
    _check_snapshots(store, report)
    report.points_checked, report.bad_points = points.check(store)
    report.orphans = [store.files.relative(p) for p in _orphans(store)]
    return report
