"""Snapshot archives: export and import, one portable file per snapshot.

The file is an uncompressed POSIX tar (block files are already compressed), so
ops can look inside with `tar tvf`. Members, in this order:

    manifest.json        UTF-8 JSON, described below
    blocks/<key>.kvb     each block file exactly as the store keeps it, in chain order
    tail.kvb             the tail's file, when the snapshot has one

manifest.json:

    {"format": "kvwake-snapshot", "version": 1, "kvwake": "<version>",
     "block_tokens": 128,
     "bundle": {"hash": "<64 hex>", "description": {...}},
     "snapshot": {"id", "session_id", "digest", "label", "parent", "created",
                  "metadata", "n_tokens", "token_ids": "<base64 of u32 LE ids>"},
     "blocks": [{"key", "parent", "digest", "codec", "raw_bytes", "stored_bytes"}, ...],
     "tail": {"digest", "codec", "raw_bytes", "stored_bytes"} | null}

Import trusts nothing in the file: member names must be exactly the expected
ones (no paths, links or devices), sizes must match the manifest and stay
under limits, every block is decoded and checked against its digest, its key
(recomputed from the token ids) and its bundle, and the snapshot digest is
recomputed. Files are written as they are verified and the index learns of
them in one transaction at the end; any failure removes them again. Blocks the
store already holds are verified but not stored twice.
"""

from __future__ import annotations

import base64
import json
import os
import sqlite3
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import kvwake
from kvwake.errors import InvalidParamsError, KvwakeError
from kvwake.store.core import StoreCore
from kvwake.store.files import fsync_dir, sync
from kvwake.store.format.codec import BlockFormatError, Encoded, decode
from kvwake.store.format.keys import tokens_from_bytes, tokens_to_bytes
from kvwake.store.format.snapshot import snapshot_digest
from kvwake.store.writer import SnapshotWriter

__all__ = ["MAX_BLOCK_BYTES", "MAX_MANIFEST_BYTES", "check_encoded", "export_snapshot", "import_snapshot",
           "import_verified", "parse_manifest", "snapshot_manifest"]

MAX_MANIFEST_BYTES = 64 << 20
MAX_BLOCK_BYTES = 1 << 30
Progress = Callable[[int, int], None] | None


def snapshot_manifest(store: StoreCore, snapshot_id: str) -> tuple[dict[str, Any], Any]:
    r = store.snapshot(snapshot_id)
    manifest = {
        "format": "kvwake-snapshot", "version": 1, "kvwake": kvwake.__version__,
        "block_tokens": store.block_tokens,
        "bundle": {"hash": r.bundle, "description": store.bundle(r.bundle) or {}},
        "snapshot": {"id": r.id, "session_id": r.session_id, "digest": r.digest, "label": r.label,
                     "parent": r.parent, "created": r.created, "metadata": r.metadata, "n_tokens": len(r.token_ids),
                     "token_ids": base64.b64encode(tokens_to_bytes(r.token_ids)).decode()},
        "blocks": [{"key": b.key, "parent": b.parent, "digest": b.digest, "codec": b.codec,
                    "raw_bytes": b.raw_bytes, "stored_bytes": b.stored_bytes} for b in r.blocks],
        "tail": None if r.tail is None else {"digest": r.tail.digest, "codec": r.tail.codec,
                                             "raw_bytes": r.tail.raw_bytes, "stored_bytes": r.tail.stored_bytes},
    }
    return manifest, r


def _add_member(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(mtime), 0o600
    tar.addfile(info, _BytesReader(data))


class _BytesReader:
    def __init__(self, data: bytes) -> None:
        self.view, self.pos = memoryview(data), 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n < 0 else self.pos + n
        chunk, self.pos = self.view[self.pos : end], min(end, len(self.view))
        return bytes(chunk)


def export_snapshot(store: StoreCore, snapshot_id: str, path: str | Path, *, progress: Progress = None) -> dict[str, Any]:
    """Write one snapshot to a portable file at `path` (atomically); returns a summary.

    Every block is verified on the way out: a corrupt store raises CorruptBlockError.
    """
    with store.reading():  # gc cannot evict this snapshot's files while they are copied
        return _export(store, snapshot_id, Path(path), progress)


def _export(store: StoreCore, snapshot_id: str, path: Path, progress: Progress) -> dict[str, Any]:
    manifest, record = snapshot_manifest(store, snapshot_id)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    total = len(record.blocks) + (1 if record.tail else 0)
    try:
        with open(tmp, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
            _add_member(tar, "manifest.json", json.dumps(manifest, indent=1).encode(), record.created)
            for n, ref in enumerate(record.blocks, 1):
                store.read_block(ref, snapshot_id=record.id, session_id=record.session_id)
                _add_member(tar, f"blocks/{ref.key}.kvb", store.files.absolute(ref.file).read_bytes(), record.created)
                if progress:
                    progress(n, total)
            if record.tail:
                store.read_tail(record)
                _add_member(tar, "tail.kvb", store.files.absolute(record.tail.file).read_bytes(), record.created)
            tar.close()
            f.flush()
            sync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return {"snapshot_id": record.id, "path": str(path), "bytes": path.stat().st_size,
            "blocks": len(record.blocks), "tokens": len(record.token_ids)}


def _bad(path: Path, why: str) -> InvalidParamsError:
    return InvalidParamsError(f"cannot import {path.name}: {why}", path=str(path))


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo | None, name: str, limit: int, path: Path) -> bytes:
    if member is None:
        raise _bad(path, f"file ends before {name} (truncated?)")
    if member.name != name or not member.isreg():
        raise _bad(path, f"expected regular member {name!r}, found {member.name!r} (type {member.type!r})")
    if member.size > limit:
        raise _bad(path, f"member {name} is {member.size} bytes, more than the {limit} allowed")
    f: IO[bytes] | None = tar.extractfile(member)
    data = f.read(member.size) if f else b""
    if len(data) != member.size:
        raise _bad(path, f"member {name} is truncated: {len(data)} of {member.size} bytes")
    return data


def parse_manifest(raw: bytes, store: StoreCore, path: Path) -> dict[str, Any]:
    try:
        m = json.loads(raw)
        snap, blocks, tail = m["snapshot"], m["blocks"], m["tail"]
        if m["format"] != "kvwake-snapshot" or m["version"] != 1:
            raise _bad(path, f"unknown format {m['format']!r} version {m['version']!r}")
        m["token_ids"] = tokens_from_bytes(base64.b64decode(snap["token_ids"], validate=True))
        for b in blocks + ([tail] if tail else []):
            if not (isinstance(b["digest"], str) and 0 < int(b["raw_bytes"]) and 0 < int(b["stored_bytes"]) <= MAX_BLOCK_BYTES):
                raise _bad(path, f"manifest entry {b} has bad sizes")
        bytes.fromhex(m["bundle"]["hash"]), str(snap["session_id"]), str(snap["digest"])
        if not isinstance(snap["metadata"], dict):
            raise _bad(path, "snapshot metadata must be a map")
    except KvwakeError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise _bad(path, f"manifest is malformed ({type(exc).__name__}: {exc})") from None
    if m["block_tokens"] != store.block_tokens:
        raise _bad(path, f"made with {m['block_tokens']}-token blocks, this store uses {store.block_tokens}")
    if len(m["token_ids"]) != snap["n_tokens"] or len(blocks) != len(m["token_ids"]) // store.block_tokens:
        raise _bad(path, "manifest token count and block count disagree")
    return m


def check_encoded(data: bytes | memoryview, digest: str, raw_bytes: int, codec: str, bundle: str,
                  key: str | None) -> tuple[Encoded, dict]:
    """Decode a block (or tail) file and check it is what a manifest says: digest, bundle, key.

    Returns the file as Encoded and its decoded tensors. Raises ValueError saying what is wrong.
    """
    try:
        tensors, meta, actual = decode(data, max_raw_bytes=int(raw_bytes))
    except BlockFormatError as exc:
        raise ValueError(f"damaged: {exc}") from None
    if actual != digest:
        raise ValueError(f"payload digest {actual[:16]} != manifest {str(digest)[:16]}")
    if meta.get("kvwake.bundle") != bundle or (key is not None and meta.get("kvwake.key") != key):
        raise ValueError("belongs to another block or bundle")
    return Encoded((data,), actual, int(raw_bytes), codec), tensors


def _verified(data: bytes, entry: dict[str, Any], what: str, bundle: str, path: Path, key: str | None) -> Encoded:
    try:
        return check_encoded(data, entry["digest"], entry["raw_bytes"], entry["codec"], bundle, key)[0]
    except ValueError as exc:
        raise _bad(path, f"{what} {exc}") from None


def import_snapshot(store: StoreCore, path: str | Path, *, session_id: str | None = None, progress: Progress = None) -> dict[str, Any]:
    """Verify a portable snapshot file completely, then add it to the store in one commit.

    Raises InvalidParamsError naming what is wrong with the file. Importing the
    same file twice returns the existing snapshot.
    """
    path = Path(path)
    try:
        with tarfile.open(path, mode="r:") as tar:
            return _import(store, tar, path, session_id, progress)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise _bad(path, f"not a readable snapshot file ({type(exc).__name__}: {exc})") from None


def _existed(snapshot_id: str, session_id: str, blocks: int, tokens: int) -> dict[str, Any]:
    return {"snapshot_id": snapshot_id, "session_id": session_id, "new_blocks": 0, "reused_blocks": blocks,
            "tokens": tokens, "existed": True}


def _import(store: StoreCore, tar: tarfile.TarFile, path: Path, session_id: str | None, progress: Progress) -> dict[str, Any]:
    m = parse_manifest(_read_member(tar, tar.next(), "manifest.json", MAX_MANIFEST_BYTES, path), store, path)
    bundle = m["bundle"]["hash"]

    def members(w: SnapshotWriter) -> None:
        for i, entry in enumerate(m["blocks"]):
            data = _read_member(tar, tar.next(), f"blocks/{entry['key']}.kvb", int(entry["stored_bytes"]), path)
            w.add_encoded(i, _verified(data, entry, f"block {i} ({entry['key'][:16]})", bundle, path, entry["key"]))
            if progress:
                progress(i + 1, len(m["blocks"]))
        if m["tail"]:
            data = _read_member(tar, tar.next(), "tail.kvb", int(m["tail"]["stored_bytes"]), path)
            w.set_tail_encoded(_verified(data, m["tail"], "tail", bundle, path, None))
        extra = tar.next()
        if extra is not None:
            raise _bad(path, f"unexpected member {extra.name!r} after the snapshot")

    return import_verified(store, m, session_id, members, lambda why: _bad(path, why))


def import_verified(store: StoreCore, m: dict[str, Any], session_id: str | None, fill: Callable[[SnapshotWriter], None],
                    bad: Callable[[str], KvwakeError]) -> dict[str, Any]:
    """Commit a parsed manifest's snapshot: `fill` hands the writer every block it needs, verified, and the tail.

    The snapshot digest is recomputed from the manifest before the commit; `bad(why)` makes the error
    raised when anything disagrees. The same snapshot imported twice returns the existing one.
    """
    snap, bundle = m["snapshot"], m["bundle"]["hash"]
    existing = store.rows("SELECT id FROM snapshots WHERE id = ? AND digest = ? AND session_id = ?",
                          (snap["id"], snap["digest"], session_id or snap["session_id"]))
    store.register_bundle(bundle, m["bundle"]["description"])
    taken = store.rows("SELECT 1 FROM snapshots WHERE id = ?", (snap["id"],))
    with SnapshotWriter(store, bundle, m["token_ids"], session_id=session_id or snap["session_id"],
                        parent=snap["parent"], label=snap["label"], metadata=snap["metadata"],
                        snapshot_id=None if taken else snap["id"]) as w:
        if [b["key"] for b in m["blocks"]] != w.keys:
            raise bad("block keys in the manifest do not match its token ids")
        fill(w)
        digests = [(b["key"], b["digest"]) for b in m["blocks"]]
        if snapshot_digest(bundle, m["token_ids"], digests, m["tail"]["digest"] if m["tail"] else None,
                           snap["metadata"]) != snap["digest"]:
            raise bad("snapshot digest does not match its blocks, tail and tokens")
        if existing:
            return _existed(existing[0]["id"], snap["session_id"], len(w.keys), len(m["token_ids"]))
        try:
            info = w.commit()
        except sqlite3.IntegrityError:  # the same snapshot imported concurrently: the other import won
            if store.rows("SELECT 1 FROM snapshots WHERE id = ? AND digest = ?", (snap["id"], snap["digest"])):
                return _existed(snap["id"], snap["session_id"], len(w.keys), len(m["token_ids"]))
            raise
    return {"snapshot_id": info.id, "session_id": session_id or snap["session_id"], "new_blocks": info.new_blocks,
            "reused_blocks": info.reused_blocks, "tokens": info.n_tokens, "existed": False}
