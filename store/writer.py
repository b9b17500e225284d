"""Writing snapshots and prefix blocks, block by block, visible only when durable.

A writer is opened with the full token sequence. It computes the chain keys,
asks the index which blocks already exist (those are references, not writes)
and tells the caller which block indices it still `needed`. The caller hands
over those blocks one at a time (`add_block`), each encoded and made durable
right away so the caller can free it, then the tail, then `commit()` writes
every index row in one transaction. Until that commit nothing is visible; a
crash leaves only orphan files, which gc sweeps.

A writer stands on the store's core (core.py) and commits itself: the rows it
inserts are its own, so no layer above it needs to read its internals.

The snapshot digest a commit records is defined in store/format/snapshot.py.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import sqlite_utils

from kvwake.errors import CorruptBlockError, NotFoundError
from kvwake.store.core import StoreCore
from kvwake.store.files import fsync_dirs, write_durable
from kvwake.store.format.codec import Encoded, Tensor, encode
from kvwake.store.format.keys import ROOT_KEY, chain_keys, tokens_to_bytes
from kvwake.store.format.snapshot import metadata_json, snapshot_digest
from kvwake.store.index import BlockRef

__all__ = ["SnapshotInfo", "SnapshotWriter", "Written", "new_snapshot_id"]

Arrays = Mapping[str, Tensor | np.ndarray]


def new_snapshot_id() -> str:
    """Time-ordered, unguessable: 11 hex digits of milliseconds, 10 random."""
    return f"{int(time.time() * 1000):011x}{secrets.token_hex(5)}"


@dataclass(frozen=True)
class Written:
    """What a writer keeps of a file it made durable: the facts, never the bytes
    (holding every block's bytes until commit grew a sleep's memory by most of its KV: docs/decisions.md,
    Store: "A writer keeps facts, not bytes")."""

    digest: str
    codec: str
    raw_bytes: int
    stored_bytes: int
    file: str


@dataclass(frozen=True)
class SnapshotInfo:
    """What a commit did."""

    id: str | None
    digest: str | None
    n_tokens: int
    raw_bytes: int
    stored_bytes: int
    new_blocks: int
    reused_blocks: int
    written_bytes: int
    ms: float


class SnapshotWriter:
    """Stream one snapshot (or, with session_id None, prefix blocks only) into the store.

    Use as a context manager; leaving it without `commit()` aborts and removes
    the files it wrote. Holds the store lock shared from open to commit, so gc
    cannot evict a block this writer decided to reuse. Raises NotFoundError when
    `bundle` is not registered in the store.
    """

    def __init__(
        self,
        store: StoreCore,
        bundle: str,
        token_ids: Sequence[int],
        *,
        session_id: str | None,
        parent: str | None = None,
        label: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        pin: bool = False,
        snapshot_id: str | None = None,
        partial: bool = False,
        supersede: str | None = None,
    ) -> None:
        if store.bundle(bundle) is None:
            raise NotFoundError(f"bundle {bundle} is not registered in this store", bundle=bundle)
        if partial and session_id is not None:
            raise ValueError("only prefix-only writes store a short last block; a snapshot keeps it in its tail")
        self.store, self.bundle, self.session_id = store, bundle, session_id
        self.token_ids = [int(t) for t in token_ids]
        self.parent, self.label, self.metadata, self.pin = parent, label, dict(metadata or {}), pin
        self.supersede, self.superseded = supersede, None  # see _replace
        self.id = (snapshot_id or new_snapshot_id()) if session_id is not None else None
        self.keys = chain_keys(bundle, self.token_ids, store.block_tokens, partial=partial)
        self._started = time.perf_counter()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(store.files.lock(exclusive=False))
        self._existing = store.usable_blocks(self.keys, self.token_ids)
        self.needed = [i for i, key in enumerate(self.keys) if key not in self._existing]
        self._new: dict[int, Written] = {}
        self._indexed: dict[str, str] = {}  # key: its digest as the index holds it at commit (see _index)
        self._tail: Written | None = None
        self._dropped: list[str] = []  # the tail file of the snapshot this one replaced
        self._dirs: set[Path] = set()
        self._done = False
        self._lost: set[str] = set()  # files of blocks another writer indexed first (commit)

    def __enter__(self) -> SnapshotWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self.abort()

    def block_tokens(self, i: int) -> list[int]:
        b = self.store.block_tokens
        return self.token_ids[i * b : (i + 1) * b]

    def add_block(self, i: int, arrays: Arrays) -> bool:
        """Encode and durably write block i; False (and nothing written) if it already exists."""
        if i not in self.needed or i in self._new:
            return False
        key = self.keys[i]
        meta = {"kvwake.kind": "block", "kvwake.key": key, "kvwake.bundle": self.bundle,
                "kvwake.tokens": str(len(self.block_tokens(i)))}
        return self.add_encoded(i, encode(arrays, metadata=meta, codec=self.store.codec))

    def add_encoded(self, i: int, encoded: Encoded) -> bool:
        """Durably write block i from already-encoded (and verified) bytes."""
        if i not in self.needed or i in self._new:
            return False
        path = self.store.files.block_path(self.keys[i])
        self.store.files.ensure_parent(path)
        write_durable(path, encoded.parts, sync_dir=False)  # each directory is synced once, at commit
        self._new[i] = self._written(encoded, path)
        self._dirs.add(path.parent)
        return True

    def _written(self, encoded: Encoded, path: Any) -> Written:
        return Written(encoded.digest, encoded.codec, encoded.raw_bytes, encoded.nbytes, self.store.files.relative(path))

    def set_tail(self, arrays: Arrays) -> None:
        """Encode and durably write the tail (what is not a full block)."""
        if self.id is None:
            raise ValueError("prefix-only writes have no tail")
        meta = {"kvwake.kind": "tail", "kvwake.bundle": self.bundle, "kvwake.tokens": str(len(self.token_ids))}
        self.set_tail_encoded(encode(arrays, metadata=meta, codec=self.store.codec))

    def set_tail_encoded(self, encoded: Encoded) -> None:
        """Durably write the tail from already-encoded (and verified) bytes."""
        if self.id is None:
            raise ValueError("prefix-only writes have no tail")
        path = self.store.files.tail_path(self.id)
        write_durable(path, encoded.parts)
        self._tail = self._written(encoded, path)

    def abort(self) -> None:
        """Forget this write: remove the files it made, release the lock."""
        self._done = True
        for written in list(self._new.values()) + ([self._tail] if self._tail else []):
            with contextlib.suppress(FileNotFoundError):
                self.store.files.absolute(written.file).unlink()
        self._stack.close()

    def commit(self) -> SnapshotInfo:
        """Make everything visible in one index transaction; returns what was done."""
        missing = [i for i in self.needed if i not in self._new]
        if missing:
            raise ValueError(f"blocks {missing} were never added; cannot commit")
        try:
            fsync_dirs(sorted(self._dirs))  # the renames are durable before the index names the files
            losers = self._index()
        except BaseException:
            self.abort()
            raise
        self._done, self._lost = True, set(losers)
        self._stack.close()
        for rel in losers + self._dropped:  # duplicates of blocks another writer indexed first; a replaced tail
            with contextlib.suppress(FileNotFoundError):
                self.store.files.absolute(rel).unlink()
        return self._info(losers)

    def own_blocks(self) -> dict[int, str]:
        """After `commit`: index -> key of the blocks whose stored bytes are this writer's (written here and
        indexed, not another writer's indexed first)."""
        return {i: self.keys[i] for i, w in self._new.items() if w.file not in self._lost}

    def _index(self) -> list[str]:
        """Index everything this writer made durable, in one transaction.

        Returns the files of blocks another writer indexed first (duplicates to delete).
        """
        now, losers, self._indexed = time.time(), [], {}
        # Outside the index lock, which lookups wait on: the token ids as an array once (the snapshot row and
        # its digest take them; a long list converted twice lengthened a checkpoint's transaction:
        # docs/decisions.md, "Figures behind the store's comments").
        tokens = np.asarray(self.token_ids, dtype=np.int64)
        with self.store.transaction() as db:
            for _, ref in self.block_rows():
                cur = db.execute(
                    "INSERT INTO blocks (key, parent, bundle, token_ids, n_tokens, digest, codec, raw_bytes,"
                    " stored_bytes, file, created, last_used) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)"
                    " ON CONFLICT(key) DO UPDATE SET parent=excluded.parent, token_ids=excluded.token_ids,"
                    " n_tokens=excluded.n_tokens, digest=excluded.digest, codec=excluded.codec,"
                    " raw_bytes=excluded.raw_bytes, stored_bytes=excluded.stored_bytes, file=excluded.file,"
                    " quarantined=0 WHERE blocks.quarantined = 1 OR blocks.token_ids != excluded.token_ids",
                    (ref.key, ref.parent, ref.bundle, tokens_to_bytes(ref.token_ids), len(ref.token_ids),
                     ref.digest, ref.codec, ref.raw_bytes, ref.stored_bytes, ref.file, now, now),
                )
                # Another writer indexed this block first: its bytes stand for the key, and this snapshot's
                # digest names them (they differ from this writer's where prefill is not bit-stable: CUDA).
                if cur.rowcount == 0:
                    losers.append(ref.file)
                    row = db.execute("SELECT digest FROM blocks WHERE key = ?", (ref.key,)).fetchone()
                    self._indexed[ref.key] = row[0]
            self._indexed.update(self._check_reused())
            marks = ",".join("?" * len(self.keys))
            db.execute(f"UPDATE blocks SET last_used = ?{', pins = 1' if self.pin else ''} WHERE key IN ({marks})",
                       [now, *self.keys])
            if self.id is not None:
                self._insert_snapshot(db, now, tokens)
        return losers

    def _check_reused(self) -> dict[str, str]:
        """The reused blocks' digests as the index holds them now (a block fsck quarantined and another
        writer wrote again since planning has new bytes: the snapshot names those)."""
        # The shared lock keeps gc away, but fsck may have quarantined a block since planning.
        written = {self.keys[i] for i in self._new}
        reused = [k for k in self.keys if k not in written]
        rows = self.store.index.digests_by_key(reused)  # under the index lock: _index's transaction holds it
        bad = [k for k in reused if k not in rows or rows[k][1]]
        if bad:
            raise CorruptBlockError(f"blocks quarantined while snapshot {self.id} was written; retry", blocks=bad)
        return {k: rows[k][0] for k in reused}

    def _replace(self, db: sqlite_utils.Database) -> None:
        """Drop the snapshot `supersede` names, in this transaction, when it is still this session's head
        and unlabeled (a persistence checkpoint: daemon/kv/persist.py); this one takes its parent. Its
        blocks lose a reference (this snapshot holds them again); its tail file goes after the commit."""
        row = db.execute("SELECT s.parent, s.tail_file FROM snapshots s JOIN sessions h ON h.head = s.id"
                         " WHERE s.id = ? AND s.session_id = ? AND s.label IS NULL",
                         (self.supersede, self.session_id)).fetchone()
        if row is None:
            return
        db.execute("DELETE FROM snapshots WHERE id = ?", (self.supersede,))
        self.parent, self.superseded = row[0], self.supersede
        self._dropped += [row[1]] if row[1] else []

    def _insert_snapshot(self, db: sqlite_utils.Database, now: float, tokens: np.ndarray) -> None:
        if self.supersede is not None:
            self._replace(db)
        tail = self.tail
        digest = snapshot_digest(self.bundle, tokens, self.digests(), tail.digest if tail else None, self.metadata)
        db.execute(
            "INSERT INTO sessions (id, created, updated) VALUES (?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET updated = excluded.updated",
            (self.session_id, now, now),
        )
        db.execute(
            "INSERT INTO snapshots (id, session_id, bundle, token_ids, n_tokens, tail_file, tail_digest,"
            " tail_codec, tail_raw, tail_stored, digest, label, parent, created, metadata, tail_parent, tail_tokens)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (self.id, self.session_id, self.bundle, tokens_to_bytes(tokens), len(tokens),
             tail.file if tail else None, tail.digest if tail else None, tail.codec if tail else None,
             tail.raw_bytes if tail else 0, tail.stored_bytes if tail else 0,
             digest, self.label, self.parent, now, self.metadata_json(), *(self.tail_index() if tail else (None, None))),
        )
        db.conn.executemany("INSERT INTO snapshot_blocks (snapshot_id, pos, block_key) VALUES (?, ?, ?)",
                            [(self.id, pos, key) for pos, key in enumerate(self.keys)])
        db.execute("UPDATE sessions SET head = ? WHERE id = ?", (self.id, self.session_id))

    def block_rows(self) -> list[tuple[int, BlockRef]]:
        """Index rows for the blocks this writer wrote itself."""
        rows = []
        for i, enc in sorted(self._new.items()):
            rows.append((i, BlockRef(
                key=self.keys[i], parent=self.keys[i - 1] if i else ROOT_KEY, bundle=self.bundle,
                token_ids=tuple(self.block_tokens(i)), digest=enc.digest, codec=enc.codec,
                raw_bytes=enc.raw_bytes, stored_bytes=enc.stored_bytes, file=enc.file)))
        return rows

    def digests(self) -> list[tuple[str, str]]:
        """(key, digest) of every block: as the index holds it once committed, else as this writer knows it."""
        own = {i: enc.digest for i, enc in self._new.items()}
        return [(k, self._indexed.get(k) or own.get(i) or self._existing[k].digest) for i, k in enumerate(self.keys)]

    @property
    def tail(self) -> Written | None:
        return self._tail

    def tail_index(self) -> tuple[str, bytes]:
        """The tail's parent (the last block's key, or the root) and its token ids as stored."""
        full = len(self.keys) * self.store.block_tokens
        return (self.keys[-1] if self.keys else ROOT_KEY), tokens_to_bytes(self.token_ids[full:])

    def _info(self, losers: list[str]) -> SnapshotInfo:
        new = list(self._new.values()) + ([self._tail] if self._tail else [])
        reused = list(self._existing.values())
        raw = sum(w.raw_bytes for w in new) + sum(r.raw_bytes for r in reused)
        stored = sum(w.stored_bytes for w in new) + sum(r.stored_bytes for r in reused)
        written = sum(w.stored_bytes for w in new if w.file not in losers)
        digest = snapshot_digest(self.bundle, self.token_ids, self.digests(), self._tail.digest if self._tail else None,
                                 self.metadata)
        return SnapshotInfo(
            id=self.id, digest=digest if self.id else None, n_tokens=len(self.token_ids), raw_bytes=raw,
            stored_bytes=stored, new_blocks=len(self._new) - len(losers),
            reused_blocks=len(self._existing) + len(losers),
            written_bytes=written, ms=(time.perf_counter() - self._started) * 1000,
        )

    def metadata_json(self) -> str:
        return metadata_json(self.metadata)
