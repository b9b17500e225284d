"""The SQLite index: schema, migrations and the records it holds.

WAL mode, `synchronous=FULL` (a committed snapshot survives power loss, not
just a killed process; on macOS with `fullfsync` and `checkpoint_fullfsync`
too, since fsync there leaves the data in the drive's cache), foreign keys on, a 30 s busy timeout for other
processes. Write transactions use `BEGIN IMMEDIATE` rather than sqlite-utils'
`atomic()` (a deferred `BEGIN`): two processes that both read and then write
would otherwise fail with SQLITE_BUSY instead of waiting their turn.

Block reference counts are kept by triggers on `snapshot_blocks`, so every
path that adds or removes a snapshot (including cascades) keeps them right;
fsck checks them against a recount.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlite_utils
from sqlite_utils.migrations import Migrations

from kvwake.store.format.keys import ROOT_KEY, tokens_from_bytes
from kvwake.store.responses import m004_responses

__all__ = ["BlockRef", "Index", "SnapshotRecord", "TailRef", "migrations"]

migrations = Migrations("kvwake.store")


@migrations()
def m001_initial(db: sqlite_utils.Database) -> None:
    for sql in (
        """CREATE TABLE bundles (
            hash TEXT PRIMARY KEY, description TEXT NOT NULL, created REAL NOT NULL)""",
        """CREATE TABLE sessions (
            id TEXT PRIMARY KEY, created REAL NOT NULL, updated REAL NOT NULL,
            metadata TEXT NOT NULL DEFAULT '{}', head TEXT)""",
        """CREATE TABLE blocks (
            key TEXT PRIMARY KEY, parent TEXT NOT NULL,
            bundle TEXT NOT NULL REFERENCES bundles(hash),
            token_ids BLOB NOT NULL, n_tokens INTEGER NOT NULL,
            digest TEXT NOT NULL, codec TEXT NOT NULL,
            raw_bytes INTEGER NOT NULL, stored_bytes INTEGER NOT NULL, file TEXT NOT NULL,
            refs INTEGER NOT NULL DEFAULT 0, pins INTEGER NOT NULL DEFAULT 0,
            quarantined INTEGER NOT NULL DEFAULT 0,
            created REAL NOT NULL, last_used REAL NOT NULL)""",
        """CREATE TABLE snapshots (
            id TEXT PRIMARY KEY,
            session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
            bundle TEXT NOT NULL REFERENCES bundles(hash),
            token_ids BLOB NOT NULL, n_tokens INTEGER NOT NULL,
            tail_file TEXT, tail_digest TEXT, tail_codec TEXT,
            tail_raw INTEGER NOT NULL DEFAULT 0, tail_stored INTEGER NOT NULL DEFAULT 0,
            digest TEXT NOT NULL, label TEXT, parent TEXT,
            created REAL NOT NULL, metadata TEXT NOT NULL DEFAULT '{}')""",
        """CREATE TABLE snapshot_blocks (
            snapshot_id TEXT NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
            pos INTEGER NOT NULL,
            block_key TEXT NOT NULL REFERENCES blocks(key),
            PRIMARY KEY (snapshot_id, pos))""",
        "CREATE INDEX snapshot_blocks_key ON snapshot_blocks(block_key)",
        "CREATE INDEX snapshots_session ON snapshots(session_id, created)",
        "CREATE INDEX blocks_evictable ON blocks(refs, pins, last_used)",
        """CREATE TRIGGER snapshot_blocks_ref AFTER INSERT ON snapshot_blocks BEGIN
            UPDATE blocks SET refs = refs + 1 WHERE key = NEW.block_key; END""",
        """CREATE TRIGGER snapshot_blocks_unref AFTER DELETE ON snapshot_blocks BEGIN
            UPDATE blocks SET refs = refs - 1 WHERE key = OLD.block_key; END""",
    ):
        db.execute(sql)


@migrations()
def m002_store_meta(db: sqlite_utils.Database) -> None:
    # Facts fixed for the life of a store (block_tokens): a process opening it with others is refused.
    db.execute("CREATE TABLE store_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")


@migrations()
def m003_children(db: sqlite_utils.Database) -> None:
    # Token-granular prefix reuse (store/reuse.py) asks for the children of a chain key: the
    # blocks and snapshot tails that continue it, ordered by token ids, so the ones nearest a
    # request are one index seek away. Block rows have named their parent since m001. A tail's
    # parent (its snapshot's last block, or the root) and its token ids are derived here from
    # the rows already present: a block's token count is its row's n_tokens.
    db.execute("CREATE INDEX blocks_children ON blocks(parent, bundle, token_ids)")
    db.execute("ALTER TABLE snapshots ADD COLUMN tail_parent TEXT")
    db.execute("ALTER TABLE snapshots ADD COLUMN tail_tokens BLOB")
    db.execute(
        "UPDATE snapshots SET tail_parent = coalesce((SELECT block_key FROM snapshot_blocks"
        "  WHERE snapshot_id = snapshots.id ORDER BY pos DESC LIMIT 1), ?),"
        " tail_tokens = substr(token_ids, 1 + 4 * (SELECT coalesce(sum(b.n_tokens), 0) FROM snapshot_blocks sb"
        "  JOIN blocks b ON b.key = sb.block_key WHERE sb.snapshot_id = snapshots.id))"
        " WHERE tail_file IS NOT NULL",
        (ROOT_KEY,),
    )
    db.execute("CREATE INDEX snapshots_tails ON snapshots(tail_parent, bundle, tail_tokens)")


# Stored responses of the Responses API: the table is store/responses.py's.
migrations()(m004_responses)


@migrations()
def m005_heads(db: sqlite_utils.Database) -> None:
    # Thousands of sessions (docs/decisions.md, "Matching by chain key"): the matcher finds a request's
    # session by its head's chain keys (store/heads.py: snapshot_blocks by key, then sessions by head),
    # lists sessions a page at a time by id and origin, and expires stateless ones by origin and age, all
    # through indexes. `origin` is the session metadata's own field ("http" for the ones stateless
    # requests made), computed, never stored.
    db.execute("ALTER TABLE sessions ADD COLUMN origin TEXT GENERATED ALWAYS AS (json_extract(metadata, '$.origin'))"
               " VIRTUAL")
    db.execute("CREATE INDEX sessions_head ON sessions(head)")
    db.execute("CREATE INDEX sessions_origin ON sessions(origin, updated)")
    db.execute("CREATE INDEX sessions_origin_id ON sessions(origin, id)")
    # status sums stored bytes: over these, not over rows whose pages carry every head's token ids and
    # messages (docs/history/benchmarks-journal.md, "Thousands of stateless conversations (issue 26)").
    db.execute("CREATE INDEX snapshots_tail_stored ON snapshots(tail_stored)")
    db.execute("CREATE INDEX blocks_stored ON blocks(stored_bytes)")


@migrations()
def m006_points(db: sqlite_utils.Database) -> None:
    # Restore points (store/points.py), one row each; the key is the chain key of the block a point closes,
    # not a foreign key: the block may be evicted first, and gc then drops the point (points.drop_unneeded).
    db.execute("""CREATE TABLE points (
        key TEXT PRIMARY KEY, bundle TEXT NOT NULL REFERENCES bundles(hash), n_tokens INTEGER NOT NULL,
        digest TEXT NOT NULL, codec TEXT NOT NULL, raw_bytes INTEGER NOT NULL, stored_bytes INTEGER NOT NULL,
        file TEXT NOT NULL, created REAL NOT NULL, last_used REAL NOT NULL)""")
    db.execute("CREATE INDEX points_stored ON points(stored_bytes)")


@dataclass(frozen=True)
class BlockRef:
    """One block's index row (token ids included, so a hit can be checked)."""

    key: str
    parent: str
    bundle: str
    token_ids: tuple[int, ...]
    digest: str
    codec: str
    raw_bytes: int
    stored_bytes: int
    file: str
    refs: int = 0
    pins: int = 0
    quarantined: bool = False

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> BlockRef:
        return cls(
            key=row["key"], parent=row["parent"], bundle=row["bundle"],
            token_ids=tuple(tokens_from_bytes(row["token_ids"])), digest=row["digest"],
            codec=row["codec"], raw_bytes=row["raw_bytes"], stored_bytes=row["stored_bytes"],
            file=row["file"], refs=row["refs"], pins=row["pins"], quarantined=bool(row["quarantined"]),
        )


@dataclass(frozen=True)
class TailRef:
    """A snapshot's private tail file."""

    file: str
    digest: str
    codec: str
    raw_bytes: int
    stored_bytes: int


@dataclass(frozen=True)
class SnapshotRecord:
    """An immutable snapshot as the index holds it."""

    id: str
    session_id: str
    bundle: str
    token_ids: tuple[int, ...]
    blocks: tuple[BlockRef, ...]
    tail: TailRef | None
    digest: str
    label: str | None
    parent: str | None
    created: float
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def raw_bytes(self) -> int:
        return sum(b.raw_bytes for b in self.blocks) + (self.tail.raw_bytes if self.tail else 0)

    @property
    def stored_bytes(self) -> int:
        return sum(b.stored_bytes for b in self.blocks) + (self.tail.stored_bytes if self.tail else 0)


class Index:
    """A connection to one store's index. Not thread-safe: the StoreCore serializes access (core.py)."""

    def __init__(self, path: Path, *, read_only: bool = False) -> None:
        """`read_only`: a connection that only reads (StoreCore.snapshot_read: one per thread); the store's
        own connection sets the journal (WAL, which lets such readers see the last commit during a write)."""
        if read_only:
            conn = sqlite3.connect(f"{Path(path).as_uri()}?mode=ro", uri=True, isolation_level=None,
                                   check_same_thread=False, timeout=30.0)
            self.db = sqlite_utils.Database(conn)
            return
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
        self.db = sqlite_utils.Database(conn)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        if sys.platform == "darwin":  # SQLite's syncs as F_FULLFSYNC (store/files.py, `sync`)
            self.db.execute("PRAGMA fullfsync=ON")
            self.db.execute("PRAGMA checkpoint_fullfsync=ON")
        self.db.execute("PRAGMA foreign_keys=ON")

    def check(self) -> list[str]:
        """SQLite's integrity and foreign-key checks, on a read-only connection of their own: they read
        one consistent state (WAL) and never wait for, nor hold up, this connection's writes. Returns
        the problems found (none: [])."""
        path = self.db.conn.execute("PRAGMA database_list").fetchone()[2]
        conn = sqlite3.connect(f"{Path(path).as_uri()}?mode=ro", uri=True, timeout=30.0)
        try:
            conn.execute("PRAGMA foreign_keys=ON")
            integrity = [r[0] for r in conn.execute("PRAGMA integrity_check").fetchall()]
            keys = [f"foreign key: {r}" for r in conn.execute("PRAGMA foreign_key_check").fetchall()]
        finally:
            conn.close()
        return ([] if integrity == ["ok"] else integrity) + keys

    def migrate(self) -> None:
        """Apply pending migrations (the caller holds the store lock exclusively)."""
        with self.write():
            migrations.ensure_migrations_table(self.db)
        migrations.apply(self.db)

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite_utils.Database]:
        """One IMMEDIATE transaction: all of it commits, or none of it."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            if self.db.conn.in_transaction:
                self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def rows(self, sql: str, params: tuple | list | dict = ()) -> list[dict[str, Any]]:
        return list(self.db.query(sql, params))

    def one(self, sql: str, params: tuple | list = ()) -> dict[str, Any] | None:
        rows = self.rows(sql, params)
        return rows[0] if rows else None

    def blocks_by_key(self, keys: list[str]) -> dict[str, BlockRef]:
        return {row["key"]: BlockRef.from_row(row) for row in self._blocks_where_key_in("*", keys)}

    def digests_by_key(self, keys: list[str]) -> dict[str, tuple[str, bool]]:
        """(digest, quarantined) of each block of `keys` the index holds: what a commit checks of the blocks it
        reuses, without their token ids (a 75k-token checkpoint reuses ~600 blocks, inside the index lock)."""
        return {row["key"]: (row["digest"], bool(row["quarantined"]))
                for row in self._blocks_where_key_in("key, digest, quarantined", keys)}

    def _blocks_where_key_in(self, columns: str, keys: list[str]) -> Iterator[dict[str, Any]]:
        """`columns` of the blocks rows whose key is one of `keys`, 500 keys a query (SQLite's limit on
        parameters)."""
        for start in range(0, len(keys), 500):
            chunk = keys[start : start + 500]
            yield from self.db.query(f"SELECT {columns} FROM blocks WHERE key IN ({','.join('?' * len(chunk))})", chunk)

    def snapshot(self, snapshot_id: str) -> SnapshotRecord | None:
        row = self.one("SELECT * FROM snapshots WHERE id = ?", (snapshot_id,))
        if row is None:
            return None
        blocks = [
            BlockRef.from_row(r)
            for r in self.db.query(
                "SELECT b.* FROM snapshot_blocks sb JOIN blocks b ON b.key = sb.block_key "
                "WHERE sb.snapshot_id = ? ORDER BY sb.pos",
                (snapshot_id,),
            )
        ]
        tail = None
        if row["tail_file"] is not None:
            tail = TailRef(row["tail_file"], row["tail_digest"], row["tail_codec"], row["tail_raw"], row["tail_stored"])
        return SnapshotRecord(
            id=row["id"], session_id=row["session_id"], bundle=row["bundle"],
            token_ids=tuple(tokens_from_bytes(row["token_ids"])), blocks=tuple(blocks), tail=tail,
            digest=row["digest"], label=row["label"], parent=row["parent"], created=row["created"],
            metadata=json.loads(row["metadata"]),
        )
