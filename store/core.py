"""The store's lower half: one root folder of block files, its SQLite index, and verified reads.

It knows nothing of MLX. Callers hand the store named numpy arrays (see
`kvwake.store.format.codec.Tensor`) cut into blocks of `block_tokens` tokens,
and get them back verified: every read checks the payload digest, the block's
identity (its key, bundle and token ids) and, for snapshots, the snapshot
digest.

Every helper of the store (writer, prefix, maintenance, transfer, remote/*)
takes a StoreCore and stands on nothing above it; the `Store` facade
(store.py) extends StoreCore with the operations those helpers build. A Store
is a StoreCore, so the daemon and tests hand a Store wherever a helper asks
for a core.

Thread-safe: index access is serialized by a lock; encoding, decoding and
file I/O run outside it. Several processes may open the same root.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import sqlite_utils

from kvwake.errors import BundleMismatchError, CorruptBlockError, InvalidParamsError, NotFoundError
from kvwake.store import codecpick
from kvwake.store.decode_procs import DecodeProcs, OtherPayloadError
from kvwake.store.files import StoreFiles
from kvwake.store.format.codec import (CODEC_IDS, DEFAULT_CODEC, BlockFormatError, Place, Stage, Tensor, decode_into,
                                       read_file_header, read_specs)
from kvwake.store.format.keys import block_key, chain_keys
from kvwake.store.format.snapshot import snapshot_digest
from kvwake.store.index import BlockRef, Index, SnapshotRecord

__all__ = ["StoreCore"]

Specs = dict[str, tuple[str, tuple[int, ...]]]


class StoreCore:
    """One store root opened: its files, its index, and verified reads of what they hold.

    root: folder holding `index.sqlite`, `blocks/`, `tails/`, `quarantine/`.
    block_tokens: tokens per block (fixed for the life of the store; part of
        every bundle hash the daemon computes).
    budget_bytes: gc evicts least-recently-used prefix-only blocks above this.
    keep_history: unlabeled snapshots gc keeps per session (newest first).
    codec: the block codec new files are written with (format/codec.py), or "auto": the one
        measured fastest to wake on this machine (codecpick.py), recorded in the index; every
        store reads files of any codec whatever this says.
    auto_among: the codecs "auto" may pick (None: all): the daemon's restores stage only some of
        them on a GPU (daemon/kv/restore_buffers.py, STAGED_CODECS).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        block_tokens: int = 128,
        budget_bytes: int | None = None,
        keep_history: int = 4,
        codec: str = DEFAULT_CODEC,
        auto_among: tuple[str, ...] | None = None,
    ) -> None:
        if codec not in CODEC_IDS and codec != "auto":
            raise InvalidParamsError(f"unknown block codec {codec!r}; known: auto, {', '.join(sorted(CODEC_IDS))}",
                                     codec=codec)
        self.root = Path(root)
        self.files = StoreFiles(self.root)
        self.block_tokens, self.budget_bytes, self.keep_history, self.codec = block_tokens, budget_bytes, keep_history, codec
        self._lock = threading.RLock()
        # snapshot_read's read-only connections not in use (as many as lookups ever ran at once), closed with
        # the store; their own lock, never the index lock, which a writer holds
        self._readers: list[Index] = []
        self._readers_lock = threading.Lock()
        with self.files.lock(exclusive=True):
            self.index = Index(self.root / "index.sqlite")
            self.index.migrate()
            self._check_block_tokens()
        self.auto_among = auto_among
        self.codec_choice: dict[str, Any] | None = None  # the measurement behind codec="auto"
        if codec == "auto":
            self.codec_choice = codecpick.choose(self.root, self.meta(codecpick.META_KEY),
                                                 lambda value: self.set_meta(codecpick.META_KEY, value),
                                                 self._sample_blocks, among=auto_among)
            self.codec = self.codec_choice["codec"]

    def meta(self, key: str) -> str | None:
        """A value the store keeps about itself (`store_meta`), or None."""
        with self._lock:
            row = self.index.one("SELECT value FROM store_meta WHERE key = ?", (key,))
        return row["value"] if row else None

    def set_meta(self, key: str, value: str) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO store_meta (key, value) VALUES (?, ?)", (key, value))

    def _sample_blocks(self, count: int = 4) -> list[dict[str, Tensor]]:
        """A few of the store's blocks, decoded (verified), for the codec measurement."""
        with self._lock:
            refs = [r for r in self.index.blocks_by_key(
                [row["key"] for row in self.index.rows("SELECT key FROM blocks LIMIT ?", (count,))]).values()]
        out = []
        for ref in refs:
            try:
                out.append(self.read_block(ref))
            except CorruptBlockError:
                continue  # fsck's business; the measurement takes the others
        return out

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
        with self._lock, self._readers_lock:
            for reader in self._readers:
                reader.db.conn.close()
            self._readers.clear()
            self.index.db.conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- locks and raw index access (for the helpers of store/) ----------------

    def locked(self) -> threading.RLock:
        """The index lock (re-entrant): hold it around index calls that must see one state."""
        return self._lock

    @contextlib.contextmanager
    def snapshot_read(self) -> Iterator[Index]:
        """The index as of its last commit, for reads that must see one state, through a read-only connection
        of their own (taken from the store's few, made when none is free): it neither takes the index lock nor
        waits for a write under way (the index is in WAL mode), so a request's lookup does not wait for a
        checkpoint's commit (docs/decisions.md, Batched generation: "A request's lookup reads the index
        through a connection of its own"). What it
        reads may be a commit older than a write finishing meanwhile; its users (lookups that pick
        candidates) check what they find. Pooled, not one per thread: worker threads come and go."""
        with self._readers_lock:
            index = self._readers.pop() if self._readers else None
        if index is None:
            index = Index(self.root / "index.sqlite", read_only=True)
        try:
            index.db.execute("BEGIN")  # one read transaction: every query in it sees the same commit
            try:
                yield index
            finally:
                index.db.execute("COMMIT")
        except BaseException:
            index.db.conn.close()  # its state unknown: not handed out again
            raise
        with self._readers_lock:
            self._readers.append(index)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite_utils.Database]:
        """Hold the index lock and run one IMMEDIATE transaction (Index.write): all of it commits, or none."""
        with self._lock, self.index.write() as db:
            yield db

    def reading(self) -> Any:
        """Hold the store lock shared while reading a snapshot's files: gc cannot evict them meanwhile."""
        return self.files.lock(exclusive=False)

    def rows(self, sql: str, params: tuple | list | dict = ()) -> list[dict[str, Any]]:
        """Run a read query against the index (under the index lock)."""
        with self._lock:
            return self.index.rows(sql, params)

    # -- bundles and blocks ---------------------------------------------------

    def register_bundle(self, bundle: str, description: Mapping[str, Any]) -> None:
        """Record a bundle hash and its description (idempotent)."""
        with self.transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO bundles (hash, description, created) VALUES (?, ?, ?)",
                (bundle, json.dumps(description, sort_keys=True), time.time()),
            )

    def bundle(self, bundle: str) -> dict[str, Any] | None:
        with self._lock:
            row = self.index.one("SELECT description FROM bundles WHERE hash = ?", (bundle,))
        return json.loads(row["description"]) if row else None

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

    def touch(self, keys: list[str]) -> None:
        if keys:
            with self.transaction() as db:
                db.execute(f"UPDATE blocks SET last_used = ? WHERE key IN ({','.join('?' * len(keys))})", [time.time(), *keys])

    # -- verified reads -------------------------------------------------------

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

    def read_block(self, ref: BlockRef, *, snapshot_id: str | None = None, session_id: str | None = None,
                   place: Place | None = None, stage: Stage | None = None,
                   procs: DecodeProcs | None = None) -> dict[str, Tensor]:
        """Read, decode and verify one block; CorruptBlockError names what failed.

        place, stage: where tensors (or a run's planes) are decoded to (codec.decode_into);
        by default new arrays. procs: decoded and digested by a worker process, then copied into
        place (decode_procs.py; not with `stage`); the same checks, the same errors.
        """
        facts = {"block": ref.key, "snapshot_id": snapshot_id, "session_id": session_id, "file": ref.file}
        where = f"block {ref.key[:16]} of snapshot {snapshot_id} (session {session_id})"
        if ref.quarantined:
            raise CorruptBlockError(f"{where} is quarantined", **facts)
        if block_key(ref.parent, ref.bundle, ref.token_ids) != ref.key:
            raise CorruptBlockError(f"{where}: index row does not hash to its key", **facts)
        tensors, meta = self._read_verified(ref.file, ref.digest, ref.raw_bytes, where, facts, place, stage, procs)
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

    def read_verified(self, rel: str, digest: str, raw_bytes: int, where: str,
                      facts: dict) -> tuple[dict[str, Tensor], dict[str, str]]:
        """A file's arrays and metadata, its payload verified against `digest` (a restore point's: points.py);
        CorruptBlockError, with `where` and `facts`, for a missing, damaged or other file."""
        return self._read_verified(rel, digest, raw_bytes, where, facts, None, None)

    def _read_verified(self, rel: str, digest: str, raw_bytes: int, where: str, facts: dict,
                       place: Place | None, stage: Stage | None,
                       procs: DecodeProcs | None = None) -> tuple[dict[str, Tensor], dict[str, str]]:
        def other() -> CorruptBlockError:
            return CorruptBlockError(f"{where}: file {rel} holds another payload than indexed", **facts)
        try:
            if procs is not None and stage is None:
                try:
                    tensors, meta, actual = procs.decode(self.files.absolute(rel), digest, raw_bytes, place)
                except OtherPayloadError:
                    raise other() from None
            else:
                with self.files.mapped(rel) as data:
                    if read_file_header(data)[2] != digest:
                        raise other()
                    tensors, meta, actual = decode_into(data, place, stage=stage, max_raw_bytes=raw_bytes)
        except FileNotFoundError:
            raise CorruptBlockError(f"{where}: file {rel} is missing", **facts) from None
        except BlockFormatError as exc:
            raise CorruptBlockError(f"{where}: file {rel} is damaged: {exc}", **facts) from None
        if actual != digest:
            raise CorruptBlockError(f"{where}: payload digest {actual[:16]} != indexed {digest[:16]}", **facts)
        return tensors, meta

    def block_specs(self, ref: BlockRef) -> Specs:
        """A block's tensor names, dtypes and shapes from its header (to allocate before decoding)."""
        return self._specs(ref.file, {"block": ref.key, "file": ref.file})

    def tail_specs(self, record: SnapshotRecord) -> Specs:
        """The same for a snapshot's tail (empty if it has none)."""
        if record.tail is None:
            return {}
        return self._specs(record.tail.file, {"snapshot_id": record.id, "session_id": record.session_id,
                                              "block": "tail", "file": record.tail.file})

    def _specs(self, rel: str, facts: dict) -> Specs:
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
