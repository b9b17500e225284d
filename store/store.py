"""The Store facade: the core's verified reads plus everything built on them.

`Store` is a `StoreCore` (core.py: files, index, locks, verified reads) with the
operations the helpers below it build: writers (writer.py), prefix lookups
(reuse.py), gc and fsck (maintenance.py), export and import (archive.py),
the Responses API's records (responses.py, as the `responses` attribute), and
the session and snapshot bookkeeping no helper needs. Nothing below this
module imports it; it is the only place they are composed.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvwake.errors import CorruptBlockError, InvalidParamsError, NotFoundError
from kvwake.store import archive, heads, maintenance, points, reuse
from kvwake.store.core import StoreCore
from kvwake.store.index import BlockRef, SnapshotRecord
from kvwake.store.responses import StoredResponses
from kvwake.store.writer import SnapshotWriter

__all__ = ["Store"]


class Store(StoreCore):
    """A content-addressed KV block store (the arguments are StoreCore's)."""

    # -- maintenance (see maintenance.py and archive.py) ---------------------

    def gc(self, **options: Any) -> maintenance.GcReport:
        return maintenance.gc(self, **options)

    def fsck(self, **options: Any) -> maintenance.FsckReport:
        return maintenance.fsck(self, **options)

    def export(self, snapshot_id: str, path: str | Path, **options: Any) -> dict[str, Any]:
        return archive.export_snapshot(self, snapshot_id, path, **options)

    def import_(self, path: str | Path, **options: Any) -> dict[str, Any]:
        return archive.import_snapshot(self, path, **options)

    def stored_bytes(self) -> int:
        with self.locked():
            return maintenance.stored_bytes(self)

    # -- restore points (see points.py) ---------------------------------------

    def point_refs(self, keys: Sequence[str], bundle: str) -> dict[str, points.PointRef]:
        return points.by_key(self, keys, bundle)

    def write_point(self, bundle: str, key: str, n_tokens: int, arrays: Mapping[str, Any]) -> bool:
        return points.write(self, bundle, key, n_tokens, arrays)

    def read_point(self, ref: points.PointRef) -> dict[str, Any]:
        return points.read(self, ref)

    def points_summary(self) -> dict[str, Any]:
        """How many restore points, their bytes on disk, and their share of the store's bytes."""
        with self.locked():
            summary, total = points.summary(self), maintenance.stored_bytes(self)
        return {**summary, "point_share": round(summary["point_bytes"] / total, 4) if total else 0.0}

    # -- sessions -------------------------------------------------------------

    def ensure_session(self, session_id: str, metadata: Mapping[str, Any] | None = None) -> None:
        """Create the session row if missing; replace its metadata when given."""
        now = time.time()
        with self.transaction() as db:
            db.execute(
                "INSERT INTO sessions (id, created, updated, metadata) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET updated = excluded.updated, "
                "metadata = CASE WHEN ? THEN excluded.metadata ELSE sessions.metadata END",
                (session_id, now, now, json.dumps(dict(metadata or {}), sort_keys=True), metadata is not None),
            )

    def session(self, session_id: str) -> dict[str, Any]:
        """The session row (metadata decoded); NotFoundError if absent."""
        with self.locked():
            row = self.index.one("SELECT * FROM sessions WHERE id = ?", (session_id,))
        if row is None:
            raise NotFoundError(f"no session {session_id!r} in the store", session_id=session_id)
        return {**row, "metadata": json.loads(row["metadata"])}

    def sessions(self) -> list[dict[str, Any]]:
        with self.locked():
            rows = self.index.rows("SELECT * FROM sessions ORDER BY created")
        return [{**r, "metadata": json.loads(r["metadata"])} for r in rows]

    def heads(self, bundle: str, session_id: str | None = None) -> list[dict[str, Any]]:
        """Every session (or the one `session_id` names) whose head snapshot was made with `bundle`, oldest first:
        {"id", "metadata" (the session's, decoded), "token_ids" (the head's, numpy int64),
        "state" (the head snapshot's metadata, decoded)}.

        Unverified and cheap (no digest check, no block rows): for matching a request to a
        stored session, which a wake then verifies.
        """
        with self.locked():
            rows = self.index.rows("SELECT s.id, s.metadata, p.token_ids, p.metadata AS state FROM sessions s "
                                   "JOIN snapshots p ON p.id = s.head WHERE p.bundle = ?"
                                   + (" AND s.id = ?" if session_id is not None else "") + " ORDER BY s.created, s.id",
                                   (bundle, session_id) if session_id is not None else (bundle,))
        return [{"id": r["id"], "metadata": json.loads(r["metadata"]),
                 "token_ids": np.frombuffer(r["token_ids"], dtype="<u4").astype(np.int64),  # stored as u32 LE
                 "state": json.loads(r["state"])} for r in rows]

    def recent_heads(self, window_s: float) -> list[str]:
        """The head snapshots of the sessions touched last, newest first: those made within `window_s`
        seconds of the newest head (a daemon's stop sleeps every hot session within moments; a kill -9
        leaves their latest checkpoints). Unverified: the reader verifies what it reads."""
        with self.locked():
            rows = self.index.rows("SELECT p.id FROM sessions s JOIN snapshots p ON p.id = s.head "
                                   "WHERE p.created >= (SELECT max(q.created) FROM sessions t "
                                   "JOIN snapshots q ON q.id = t.head) - ? ORDER BY p.created DESC, p.id",
                                   (window_s,))
        return [r["id"] for r in rows]

    def session_page(self, *, after: str | None = None, limit: int = 100, origin: str | None = None) -> list[dict[str, Any]]:
        """At most `limit` sessions in id order after the id `after` (None: from the first), of `origin`
        (their metadata's) when given: {"id", "created", "updated", "origin", "head"}. One index range."""
        sql = "SELECT id, created, updated, origin, head FROM sessions WHERE id > :after"
        with self.locked():
            return self.index.rows(sql + (" AND origin = :origin" if origin is not None else "") + " ORDER BY id LIMIT :n",
                                   {"after": after or "", "origin": origin, "n": limit})

    def stale_sessions(self, origin: str, updated_before: float, limit: int,
                       after: tuple[float, str] | None = None) -> list[tuple[float, str]]:
        """(updated, id) of at most `limit` sessions of `origin` not updated since `updated_before`, least
        recently updated first, starting past `after` (the last pair of the previous page). One index range."""
        updated, ident = after if after is not None else (-1.0, "")
        with self.locked():
            rows = self.index.rows("SELECT updated, id FROM sessions WHERE origin = ? AND updated <= ? "
                                   "AND (updated, id) > (?, ?) ORDER BY updated, id LIMIT ?",
                                   (origin, updated_before, updated, ident, limit))
        return [(r["updated"], r["id"]) for r in rows]

    def delete_session(self, session_id: str) -> int:
        """Delete a session and all its snapshots (checkpoints too); returns snapshots removed.

        Their blocks stay as prefix cache until gc evicts them; tails become orphans.
        """
        with self.transaction() as db:
            n = db.execute("SELECT count(*) FROM snapshots WHERE session_id = ?", (session_id,)).fetchone()[0]
            if db.execute("DELETE FROM sessions WHERE id = ?", (session_id,)).rowcount == 0:
                raise NotFoundError(f"no session {session_id!r} in the store", session_id=session_id)
        return n

    @functools.cached_property
    def responses(self) -> StoredResponses:
        """The Responses API's stored responses (responses.py): their own table, kept beside the sessions."""
        return StoredResponses(self)

    # -- writing --------------------------------------------------------------

    def writer(self, session_id: str | None, bundle: str, token_ids: Sequence[int], **options: Any) -> SnapshotWriter:
        """Open a SnapshotWriter (session_id None: prefix blocks only, no snapshot);
        NotFoundError if `bundle` is not registered."""
        return SnapshotWriter(self, bundle, token_ids, session_id=session_id, **options)

    # -- prefix lookups and heads ------------------------------------------------

    def latest_snapshot(self, session_id: str) -> str:
        """The session's head snapshot id; NotFoundError if it never slept."""
        head = self.session(session_id)["head"]
        if head is None:
            raise NotFoundError(f"session {session_id!r} has no snapshot", session_id=session_id)
        return head

    def longest_prefix(self, bundle: str, token_ids: Sequence[int], *, partial: bool = False) -> list[BlockRef]:
        """Stored, usable full blocks starting `token_ids` under `bundle`, as far as they go
        (with `partial`, maybe a last short block); see reuse.longest_prefix."""
        return reuse.longest_prefix(self, bundle, token_ids, partial=partial)

    def prefix_hit(self, bundle: str, token_ids: Sequence[int], *, min_partial: int = 1) -> reuse.PrefixHit:
        """longest_prefix, then the stored block or tail continuing it with the most matching
        tokens (at least min_partial); see reuse.py."""
        return reuse.find(self, bundle, token_ids, min_partial)

    def deepest_heads(self, bundle: str, token_ids: Sequence[int], *, origin: str, mode: str | None,
                      exclude: Collection[str] = ()) -> list[heads.HeadMatch]:
        """The sessions of `origin` whose head snapshots (of `mode`, not in `exclude`) share the longest
        token prefix with `token_ids`, found by chain key whatever the number of sessions; see heads.py."""
        return heads.deepest_head(self, bundle, token_ids, origin=origin, mode=mode, exclude=exclude)

    # -- snapshots ------------------------------------------------------------

    def snapshots(self, session_id: str | None = None) -> list[dict[str, Any]]:
        """Snapshot summaries (no token ids), oldest first."""
        sql = ("SELECT id, session_id, bundle, n_tokens, digest, label, parent, created,"
               " (SELECT count(*) FROM snapshot_blocks WHERE snapshot_id = s.id) AS n_blocks FROM snapshots s")
        with self.locked():
            if session_id is None:
                return self.index.rows(sql + " ORDER BY created, id")
            return self.index.rows(sql + " WHERE session_id = ? ORDER BY created, id", (session_id,))

    def snapshot_summary(self, snapshot_id: str) -> dict[str, Any]:
        """One snapshot's facts without its token ids, unverified and cheap: {"id", "session_id",
        "n_tokens", "label", "metadata" (decoded), "bundle", "created"}. NotFoundError if absent."""
        with self.locked():
            row = self.index.one("SELECT id, session_id, n_tokens, label, metadata, bundle, created FROM snapshots "
                                 "WHERE id = ?", (snapshot_id,))
        if row is None:
            raise NotFoundError(f"no snapshot {snapshot_id!r}", snapshot_id=snapshot_id)
        return {**row, "metadata": json.loads(row["metadata"])}

    def set_label(self, snapshot_id: str, label: str | None) -> None:
        """Label a snapshot as a checkpoint (gc keeps it), or clear its label."""
        with self.transaction() as db:
            if db.execute("UPDATE snapshots SET label = ? WHERE id = ?", (label, snapshot_id)).rowcount == 0:
                raise NotFoundError(f"no snapshot {snapshot_id!r}", snapshot_id=snapshot_id)

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove one snapshot; its blocks lose a reference, its tail becomes an orphan."""
        with self.transaction() as db:
            if db.execute("DELETE FROM snapshots WHERE id = ?", (snapshot_id,)).rowcount == 0:
                raise NotFoundError(f"no snapshot {snapshot_id!r}", snapshot_id=snapshot_id)
            db.execute("UPDATE sessions SET head = (SELECT id FROM snapshots WHERE session_id = sessions.id "
                       "ORDER BY created DESC, id DESC LIMIT 1) WHERE head = ?", (snapshot_id,))

    def fork(self, snapshot_id: str, session_id: str, *, label: str | None = None) -> str:
        """A new snapshot for `session_id` sharing every block of `snapshot_id` (tail copied).

        The same session is allowed only with a label: a checkpoint copy of an older state.
        """
        with self.reading():
            record = self.snapshot(snapshot_id)
            if session_id == record.session_id and label is None:
                raise InvalidParamsError(f"fork target {session_id!r} is the source session", session_id=session_id)
            tail = self.read_tail(record) if record.tail else None
            return self._copy(record, session_id, label, tail)

    def _copy(self, record: SnapshotRecord, session_id: str, label: str | None, tail: dict | None) -> str:
        with self.writer(session_id, record.bundle, record.token_ids, parent=record.id, label=label,
                         metadata=record.metadata) as w:
            if w.needed:
                raise CorruptBlockError(f"snapshot {record.id}: blocks vanished during fork", snapshot_id=record.id)
            if tail is not None:
                w.set_tail(tail)
            return w.commit().id
