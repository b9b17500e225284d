"""The Store: one root folder of block files plus its SQLite index.

It knows nothing of MLX. Callers hand it named numpy arrays (see
`kvwake.store.format.codec.Tensor`) cut into blocks of `block_tokens` tokens, and get
them back verified: every read checks the payload digest, the block's identity
(its key, bundle and token ids) and, for snapshots, the snapshot digest.

Thread-safe: index access is serialized by a lock; encoding, decoding and
file I/O run outside it. Several processes may open the same root.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvwake.errors import BundleMismatchError, CorruptBlockError, InvalidParamsError, NotFoundError
from kvwake.store.format.codec import CODEC_IDS, DEFAULT_CODEC, BlockFormatError, Place, Stage, Tensor, decode_into, read_file_header, read_specs
from kvwake.store.files import StoreFiles
from kvwake.store.index import BlockRef, Index, SnapshotRecord
from kvwake.store.format.keys import block_key, chain_keys, tokens_to_bytes
from kvwake.store import maintenance, prefix, transfer
from kvwake.store.format.snapshot import snapshot_digest
from kvwake.store.writer import SnapshotWriter

__all__ = ["Store"]


class Store:
    """A content-addressed KV block store.

    root: folder holding `index.sqlite`, `blocks/`, `tails/`, `quarantine/`.
    block_tokens: tokens per block (fixed for the life of the store; part of
        every bundle hash the daemon computes).
    budget_bytes: gc evicts least-recently-used prefix-only blocks above this.
    keep_history: unlabeled snapshots gc keeps per session (newest first).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        block_tokens: int = 128,
        budget_bytes: int | None = None,
        keep_history: int = 4,
        codec: str = DEFAULT_CODEC,
    ) -> None:
        if codec not in CODEC_IDS:
            raise InvalidParamsError(f"unknown block codec {codec!r}; known: {sorted(CODEC_IDS)}", codec=codec)
        self.root = Path(root)
        self.files = StoreFiles(self.root)
        self.block_tokens, self.budget_bytes, self.keep_history, self.codec = block_tokens, budget_bytes, keep_history, codec
        self._lock = threading.RLock()
        with self.files.lock(exclusive=True):
            self.index = Index(self.root / "index.sqlite")
            self.index.migrate()
            self._check_block_tokens()

    def _check_block_tokens(self) -> None:
        """The block size is fixed when a store is made; opening it with another one is refused."""
        with self.index.write() as db:
            db.execute("INSERT OR IGNORE INTO store_meta (key, value) VALUES ('block_tokens', ?)",
                       (str(self.block_tokens),))
            stored = int(db.execute("SELECT value FROM store_meta WHERE key = 'block_tokens'").fetchone()[0])
        if stored != self.block_tokens:
            self.index.db.conn.close()
            raise InvalidParamsError(f"the store at {self.root} uses {stored}-token blocks, not {self.block_tokens}; "
                                     f"open it with block_tokens={stored}", store=str(self.root), block_tokens=stored)

    def close(self) -> None:
        with self._lock:
            self.index.db.conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reading(self) -> Any:
        """Hold the store lock shared while reading a snapshot's files: gc cannot evict them meanwhile."""
        return self.files.lock(exclusive=False)

    def rows(self, sql: str, params: tuple | list | dict = ()) -> list[dict[str, Any]]:
        """Run a read query against the index (under the index lock)."""
        with self._lock:
            return self.index.rows(sql, params)

    # -- maintenance (see maintenance.py and transfer.py) ---------------------

    def gc(self, **options: Any) -> maintenance.GcReport:
        return maintenance.gc(self, **options)

    def fsck(self, **options: Any) -> maintenance.FsckReport:
        return maintenance.fsck(self, **options)

    def export(self, snapshot_id: str, path: str | Path, **options: Any) -> dict[str, Any]:
        return transfer.export_snapshot(self, snapshot_id, path, **options)

    def import_(self, path: str | Path, **options: Any) -> dict[str, Any]:
        return transfer.import_snapshot(self, path, **options)

    def stored_bytes(self) -> int:
        with self._lock:
            return maintenance.stored_bytes(self)

    # -- bundles and sessions -------------------------------------------------

    def register_bundle(self, bundle: str, description: Mapping[str, Any]) -> None:
        """Record a bundle hash and its description (idempotent)."""
        with self._lock, self.index.write() as db:
            db.execute(
                "INSERT OR IGNORE INTO bundles (hash, description, created) VALUES (?, ?, ?)",
                (bundle, json.dumps(description, sort_keys=True), time.time()),
            )

    def bundle(self, bundle: str) -> dict[str, Any] | None:
        with self._lock:
            row = self.index.one("SELECT description FROM bundles WHERE hash = ?", (bundle,))
        return json.loads(row["description"]) if row else None

    def ensure_session(self, session_id: str, metadata: Mapping[str, Any] | None = None) -> None:
        """Create the session row if missing; replace its metadata when given."""
        now = time.time()
        with self._lock, self.index.write() as db:
            db.execute(
                "INSERT INTO sessions (id, created, updated, metadata) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET updated = excluded.updated, "
                "metadata = CASE WHEN ? THEN excluded.metadata ELSE sessions.metadata END",
                (session_id, now, now, json.dumps(dict(metadata or {}), sort_keys=True), metadata is not None),
            )

    def session(self, session_id: str) -> dict[str, Any]:
        """The session row (metadata decoded); NotFoundError if absent."""
        with self._lock:
            row = self.index.one("SELECT * FROM sessions WHERE id = ?", (session_id,))
        if row is None:
            raise NotFoundError(f"no session {session_id!r} in the store", session_id=session_id)
        return {**row, "metadata": json.loads(row["metadata"])}

    def sessions(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self.index.rows("SELECT * FROM sessions ORDER BY created")
        return [{**r, "metadata": json.loads(r["metadata"])} for r in rows]

    def delete_session(self, session_id: str) -> int:
        """Delete a session and all its snapshots (checkpoints too); returns snapshots removed.

        Their blocks stay as prefix cache until gc evicts them; tails become orphans.
        """
        with self._lock, self.index.write() as db:
            n = db.execute("SELECT count(*) FROM snapshots WHERE session_id = ?", (session_id,)).fetchone()[0]
            if db.execute("DELETE FROM sessions WHERE id = ?", (session_id,)).rowcount == 0:
                raise NotFoundError(f"no session {session_id!r} in the store", session_id=session_id)
        return n

    # -- writing --------------------------------------------------------------

    def writer(self, session_id: str | None, bundle: str, token_ids: Sequence[int], **options: Any) -> SnapshotWriter:
        """Open a SnapshotWriter (session_id None: prefix blocks only, no snapshot)."""
        if self.bundle(bundle) is None:
            raise NotFoundError(f"bundle {bundle} is not registered in this store", bundle=bundle)
        return SnapshotWriter(self, bundle, token_ids, session_id=session_id, **options)

    def usable_blocks(self, keys: list[str], token_ids: Sequence[int]) -> dict[str, BlockRef]:
        """The rows among `keys` that can be reused as-is: not quarantined, tokens matching."""
        with self._lock:
            rows = self.index.blocks_by_key(keys)
        b = self.block_tokens
        return {
            key: rows[key]
            for i, key in enumerate(keys)
            if key in rows and not rows[key].quarantined and list(rows[key].token_ids) == list(token_ids[i * b : (i + 1) * b])
        }

    def commit_write(self, w: SnapshotWriter) -> list[str]:
        """Index everything a writer made durable, in one transaction.

        Returns the files of blocks another writer indexed first (duplicates to delete).
        """
        now, losers = time.time(), []
        with self._lock, self.index.write() as db:
            for _, ref in w.block_rows():
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
                if cur.rowcount == 0:
                    losers.append(ref.file)
            self._check_reused(db, w)
            marks = ",".join("?" * len(w.keys))
            db.execute(f"UPDATE blocks SET last_used = ?{', pins = 1' if w.pin else ''} WHERE key IN ({marks})", [now, *w.keys])
            if w.id is not None:
                self._insert_snapshot(db, w, now)
        return losers

    def _check_reused(self, db: Any, w: SnapshotWriter) -> None:
        # The shared lock keeps gc away, but fsck may have quarantined a block since planning.
        reused = [k for k in w.keys if k not in {ref.key for _, ref in w.block_rows()}]
        rows = self.index.blocks_by_key(reused)
        bad = [k for k in reused if k not in rows or rows[k].quarantined]
        if bad:
            raise CorruptBlockError(f"blocks quarantined while snapshot {w.id} was written; retry", blocks=bad)

    def _insert_snapshot(self, db: Any, w: SnapshotWriter, now: float) -> None:
        tail = w.tail
        digest = snapshot_digest(w.bundle, w.token_ids, w.digests(), tail.digest if tail else None, w.metadata)
        db.execute(
            "INSERT INTO sessions (id, created, updated) VALUES (?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET updated = excluded.updated",
            (w.session_id, now, now),
        )
        db.execute(
            "INSERT INTO snapshots (id, session_id, bundle, token_ids, n_tokens, tail_file, tail_digest,"
            " tail_codec, tail_raw, tail_stored, digest, label, parent, created, metadata, tail_parent, tail_tokens)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (w.id, w.session_id, w.bundle, tokens_to_bytes(w.token_ids), len(w.token_ids),
             tail.file if tail else None, tail.digest if tail else None, tail.codec if tail else None,
             tail.raw_bytes if tail else 0, tail.stored_bytes if tail else 0,
             digest, w.label, w.parent, now, w.metadata_json(), *(w.tail_index() if tail else (None, None))),
        )
        db.conn.executemany("INSERT INTO snapshot_blocks (snapshot_id, pos, block_key) VALUES (?, ?, ?)",
                            [(w.id, pos, key) for pos, key in enumerate(w.keys)])
        db.execute("UPDATE sessions SET head = ? WHERE id = ?", (w.id, w.session_id))

    # -- reading --------------------------------------------------------------

    def snapshot(self, snapshot_id: str, *, bundle: str | None = None) -> SnapshotRecord:
        """A snapshot's record, its digest and chain verified.

        bundle: the loaded model's bundle hash; a snapshot of another bundle
        raises BundleMismatchError. Raises NotFoundError, CorruptBlockError.
        """
        with self._lock:
            record = self.index.snapshot(snapshot_id)
        if record is None:
            raise NotFoundError(f"no snapshot {snapshot_id!r}", snapshot_id=snapshot_id)
        if bundle is not None and record.bundle != bundle:
            raise BundleMismatchError(
                f"snapshot {snapshot_id} of session {record.session_id} was made with bundle "
                f"{record.bundle[:12]}, the loaded model is {bundle[:12]}",
                session_id=record.session_id, snapshot_id=snapshot_id, snapshot_bundle=record.bundle, loaded_bundle=bundle,
            )
        self._verify_record(record)
        return record

    def _verify_record(self, r: SnapshotRecord) -> None:
        facts = {"session_id": r.session_id, "snapshot_id": r.id}
        expected = chain_keys(r.bundle, r.token_ids, self.block_tokens)
        if [b.key for b in r.blocks] != expected:
            raise CorruptBlockError(f"snapshot {r.id} of session {r.session_id}: block list does not match its tokens", **facts)
        for b in r.blocks:
            if b.bundle != r.bundle:
                raise BundleMismatchError(f"snapshot {r.id}: block {b.key[:12]} names bundle {b.bundle[:12]}, "
                                          f"snapshot names {r.bundle[:12]}", block=b.key, **facts)
        digest = snapshot_digest(r.bundle, r.token_ids, [(b.key, b.digest) for b in r.blocks],
                                 r.tail.digest if r.tail else None, r.metadata)
        if digest != r.digest:
            raise CorruptBlockError(f"snapshot {r.id} of session {r.session_id}: digest mismatch "
                                    f"(index says {r.digest[:12]}, rows give {digest[:12]})", **facts)

    def latest_snapshot(self, session_id: str) -> str:
        """The session's head snapshot id; NotFoundError if it never slept."""
        head = self.session(session_id)["head"]
        if head is None:
            raise NotFoundError(f"session {session_id!r} has no snapshot", session_id=session_id)
        return head

    def read_block(self, ref: BlockRef, *, snapshot_id: str | None = None, session_id: str | None = None,
                   place: Place | None = None, stage: Stage | None = None) -> dict[str, Tensor]:
        """Read, decode and verify one block; CorruptBlockError names what failed.

        place, stage: where tensors (or a run's planes) are decoded to (codec.decode_into);
        by default new arrays.
        """
        facts = {"block": ref.key, "snapshot_id": snapshot_id, "session_id": session_id, "file": ref.file}
        where = f"block {ref.key[:16]} of snapshot {snapshot_id} (session {session_id})"
        if ref.quarantined:
            raise CorruptBlockError(f"{where} is quarantined", **facts)
        if block_key(ref.parent, ref.bundle, ref.token_ids) != ref.key:
            raise CorruptBlockError(f"{where}: index row does not hash to its key", **facts)
        tensors, meta = self._read_verified(ref.file, ref.digest, ref.raw_bytes, where, facts, place, stage)
        if meta.get("kvwake.key") != ref.key or meta.get("kvwake.bundle") != ref.bundle:
            raise CorruptBlockError(f"{where}: file holds block {meta.get('kvwake.key', '?')[:16]} "
                                    f"of bundle {meta.get('kvwake.bundle', '?')[:12]}", **facts)
        return tensors

    def read_tail(self, record: SnapshotRecord, place: Place | None = None, stage: Stage | None = None) -> dict[str, Tensor]:
        """Read and verify a snapshot's tail (empty if it has none)."""
        if record.tail is None:
            return {}
        facts = {"snapshot_id": record.id, "session_id": record.session_id, "file": record.tail.file, "block": "tail"}
        where = f"tail of snapshot {record.id} (session {record.session_id})"
        tensors, meta = self._read_verified(record.tail.file, record.tail.digest, record.tail.raw_bytes, where, facts,
                                            place, stage)
        if meta.get("kvwake.bundle") != record.bundle:
            raise CorruptBlockError(f"{where}: file belongs to bundle {meta.get('kvwake.bundle', '?')[:12]}", **facts)
        return tensors

    def _read_verified(self, rel: str, digest: str, raw_bytes: int, where: str, facts: dict,
                       place: Place | None, stage: Stage | None) -> tuple[dict[str, Tensor], dict[str, str]]:
        try:
            data = self.files.read(rel)
        except FileNotFoundError:
            raise CorruptBlockError(f"{where}: file {rel} is missing", **facts) from None
        try:
            if read_file_header(data)[2] != digest:
                raise CorruptBlockError(f"{where}: file {rel} holds another payload than indexed", **facts)
            tensors, meta, actual = decode_into(data, place, stage=stage, max_raw_bytes=raw_bytes)
        except BlockFormatError as exc:
            raise CorruptBlockError(f"{where}: file {rel} is damaged: {exc}", **facts) from None
        if actual != digest:
            raise CorruptBlockError(f"{where}: payload digest {actual[:16]} != indexed {digest[:16]}", **facts)
        return tensors, meta

    def block_specs(self, ref: BlockRef) -> dict[str, tuple[str, tuple[int, ...]]]:
        """A block's tensor names, dtypes and shapes from its header (to allocate before decoding)."""
        return self._specs(ref.file, {"block": ref.key, "file": ref.file})

    def tail_specs(self, record: SnapshotRecord) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The same for a snapshot's tail (empty if it has none)."""
        if record.tail is None:
            return {}
        return self._specs(record.tail.file, {"snapshot_id": record.id, "session_id": record.session_id,
                                              "block": "tail", "file": record.tail.file})

    def _specs(self, rel: str, facts: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
        try:
            return read_specs(self.files.read(rel))
        except FileNotFoundError:
            raise CorruptBlockError(f"file {rel} is missing", **facts) from None
        except BlockFormatError as exc:
            raise CorruptBlockError(f"file {rel} is damaged: {exc}", **facts) from None

    def iter_blocks(self, record: SnapshotRecord) -> Iterator[dict[str, Tensor]]:
        """Yield each block of a snapshot in order, verified, and mark them used."""
        self.touch([b.key for b in record.blocks])
        for ref in record.blocks:
            yield self.read_block(ref, snapshot_id=record.id, session_id=record.session_id)

    def touch(self, keys: list[str]) -> None:
        if keys:
            with self._lock, self.index.write() as db:
                db.execute(f"UPDATE blocks SET last_used = ? WHERE key IN ({','.join('?' * len(keys))})", [time.time(), *keys])

    def longest_prefix(self, bundle: str, token_ids: Sequence[int], *, partial: bool = False) -> list[BlockRef]:
        """The longest run of stored, usable full blocks that starts `token_ids` under `bundle`
        (with `partial`, ending in the short block of the trailing tokens when that is stored too)."""
        keys = chain_keys(bundle, token_ids, self.block_tokens, partial=partial)
        usable = self.usable_blocks(keys, token_ids)
        run = []
        for key in keys:
            if key not in usable:
                break
            run.append(usable[key])
        return run

    def prefix_hit(self, bundle: str, token_ids: Sequence[int], *, min_partial: int = 1) -> prefix.PrefixHit:
        """longest_prefix, then the stored block or tail continuing it with the most matching
        tokens (at least min_partial); see prefix.py."""
        return prefix.find(self, bundle, token_ids, min_partial)

    # -- snapshots ------------------------------------------------------------

    def snapshots(self, session_id: str | None = None) -> list[dict[str, Any]]:
        """Snapshot summaries (no token ids), oldest first."""
        sql = ("SELECT id, session_id, bundle, n_tokens, digest, label, parent, created,"
               " (SELECT count(*) FROM snapshot_blocks WHERE snapshot_id = s.id) AS n_blocks FROM snapshots s")
        with self._lock:
            if session_id is None:
                return self.index.rows(sql + " ORDER BY created, id")
            return self.index.rows(sql + " WHERE session_id = ? ORDER BY created, id", (session_id,))

    def set_label(self, snapshot_id: str, label: str | None) -> None:
        """Label a snapshot as a checkpoint (gc keeps it), or clear its label."""
        with self._lock, self.index.write() as db:
            if db.execute("UPDATE snapshots SET label = ? WHERE id = ?", (label, snapshot_id)).rowcount == 0:
                raise NotFoundError(f"no snapshot {snapshot_id!r}", snapshot_id=snapshot_id)

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove one snapshot; its blocks lose a reference, its tail becomes an orphan."""
        with self._lock, self.index.write() as db:
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
