"""Moving snapshots between the local store and the shared tier, verified both ways.

Upload: every block file is decoded and checked against its index row before
it leaves (a create-only object can never be replaced, so a bad one must never
be written); blocks the remote already holds are not sent again; the tail
follows; the manifest is written last, and only while the uploader still holds
the session's lease. An upload cut off anywhere leaves no manifest, so no
reader ever sees the snapshot; running it again finishes it. Warmed prefixes
go the same way (store/remote/shared_prompts.py). Uploads are fenced against
the remote gc (`fenced`, `commit_manifest`; the rule is in store/remote/gc.py).

Download: every object is checked as an import file is (store/archive.py):
its chain key recomputed, its bundle, its decoded payload's digest against
the manifest, then the snapshot digest, before one local commit. Blocks the
local store already holds are not fetched. The restore points a snapshot's
blocks close go up with them and come back with it (store/remote/points.py).
Nothing here imports mlx.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from kvwake.errors import CorruptBlockError, KvwakeError
from kvwake.store.core import StoreCore
from kvwake.store.format.codec import Encoded
from kvwake.store.format.keys import block_key
from kvwake.store.index import BlockRef, SnapshotRecord
from kvwake.store.remote.client import Remote
from kvwake.store.remote.objects import GcRun, Lease, ObjectHeader
from kvwake.store.remote.points import fetch_named, upload_points
from kvwake.store.archive import check_encoded, import_verified, parse_manifest, snapshot_manifest
from kvwake.store.writer import SnapshotWriter

__all__ = ["LostLeaseError", "as_encoded", "check_block_object", "check_tail_object", "commit_manifest", "fenced",
           "fetch_block", "fetch_snapshot", "put_block", "put_tail", "upload_blocks", "upload_snapshot"]

OnBlock = Callable[[str, dict], None] | None  # (chain key, decoded verified tensors): the daemon's RAM tier


class LostLeaseError(KvwakeError):
    """This daemon no longer holds the session's lease: its snapshots are not published."""

    code = "BUSY"


# -- upload ----------------------------------------------------------------------


def _local_block(store: StoreCore, ref: BlockRef) -> bytes:
    """A block file's bytes, fully verified against its index row."""
    data = bytes(store.files.read(ref.file))
    if block_key(ref.parent, ref.bundle, ref.token_ids) != ref.key:
        raise CorruptBlockError(f"block {ref.key[:16]}: index row does not hash to its key", block=ref.key)
    try:
        check_encoded(data, ref.digest, ref.raw_bytes, ref.codec, ref.bundle, ref.key)
    except ValueError as exc:
        raise CorruptBlockError(f"block {ref.key[:16]} ({ref.file}) {exc}; not uploaded", block=ref.key) from None
    return data


def put_block(remote: Remote, store: StoreCore, ref: BlockRef) -> bool:
    """Put one local block (verified first), create-only; False when the remote already holds it."""
    data = _local_block(store, ref)
    header = ObjectHeader("block", ref.bundle, ref.digest, ref.codec, ref.raw_bytes, len(data), key=ref.key,
                          parent=ref.parent, token_ids=tuple(ref.token_ids))
    return remote.put_new(remote.block_key(ref.key), header.pack(data))  # "exists" is success: same content


def put_tail(remote: Remote, store: StoreCore, record: SnapshotRecord) -> bool:
    """Put a local snapshot's tail (verified first), create-only; False when the remote already holds it."""
    assert record.tail is not None
    data = bytes(store.files.read(record.tail.file))
    store.read_tail(record)  # verified before it leaves, like every block
    header = ObjectHeader("tail", record.bundle, record.tail.digest, record.tail.codec, record.tail.raw_bytes,
                          len(data), snapshot_id=record.id)
    return remote.put_new(remote.tail_key(record.id), header.pack(data))


def upload_blocks(remote: Remote, store: StoreCore, refs: list[BlockRef]) -> int:
    """Put the blocks the remote lacks (create-only); returns how many were written."""
    present = remote.parallel(lambda ref: remote.exists(remote.block_key(ref.key)), refs)
    written = sum(remote.parallel(lambda ref: put_block(remote, store, ref),
                                  [ref for ref, there in zip(refs, present) if not there]))
    remote.counters["uploaded_blocks"] += written
    return written


def fenced(remote: Remote, put_objects: Callable[[], None]) -> GcRun:
    """Run put_objects until no remote gc was active or began while it ran; returns the gc run seen.

    An upload skips the blocks the remote already holds; a gc that runs meanwhile may remove one of
    them (unreferenced so far). Seeing the same, inactive gc run before and after proves none did.
    """
    while True:
        before = remote.wait_for_gc()
        put_objects()
        if remote.gc_run() == before:
            return before


def commit_manifest(remote: Remote, key: str, data: bytes, run: GcRun, put_objects: Callable[[], None]) -> None:
    """Write the commit object (the manifest); then, if a gc began before it could see it, wait for
    that gc to end and put back what it removed (a gc that begins later sees the manifest)."""
    remote.put_new(key, data)
    if remote.gc_run() != run:
        remote.wait_for_gc()
        put_objects()


def upload_snapshot(remote: Remote, store: StoreCore, snapshot_id: str, lease: Lease) -> dict[str, Any]:
    """Publish one committed local snapshot under `lease`; returns what was sent.

    Raises LostLeaseError when the lease moved on, RemoteUnavailableError, CorruptBlockError (local damage).
    """
    with store.reading():
        manifest, record = snapshot_manifest(store, snapshot_id)
    key = remote.manifest_key(record.session_id, lease.epoch, record.id)
    if remote.exists(key):
        return {"snapshot_id": record.id, "manifest": key, "new_blocks": 0, "existed": True}
    written: list[int] = []
    named: list[list[dict[str, Any]]] = []

    def put_objects() -> None:
        with store.reading():
            written.append(upload_blocks(remote, store, list(record.blocks)))
            if record.tail is not None:
                put_tail(remote, store, record)
            named.append(upload_points(remote, store, [b.key for b in record.blocks]))  # after their blocks

    run = fenced(remote, put_objects)
    current = remote.current_lease(record.session_id)
    if current != lease:
        now = f"{current.state} by daemon {current.daemon} at epoch {current.epoch}" if current else "gone"
        raise LostLeaseError(f"session {record.session_id}: this daemon no longer holds its lease (epoch "
                             f"{lease.epoch}; it is {now}); snapshot {record.id} stays local",
                             session_id=record.session_id, snapshot_id=record.id,
                             owner=current.daemon if current else None)
    manifest["remote"] = {"epoch": lease.epoch, "daemon": remote.daemon_id,
                          **({"keep_history": remote.keep_history} if remote.keep_history is not None else {})}
    manifest["points"] = named[-1]
    commit_manifest(remote, key, json.dumps(manifest, indent=1).encode(), run, put_objects)  # the commit point
    remote.counters["uploaded_snapshots"] += 1
    return {"snapshot_id": record.id, "manifest": key, "new_blocks": sum(written), "existed": False}


# -- download --------------------------------------------------------------------


def _refused(remote: Remote, what: str, why: str, **facts: Any) -> CorruptBlockError:
    return remote.refused(what, why, **facts)


def check_block_object(remote: Remote, key: str, data: bytes, digest: str | None = None,
                       raw_bytes: int | None = None, tokens: list[int] | None = None) -> tuple:
    """Verify one block object; returns (header, file bytes, decoded tensors); ValueError naming what is wrong.

    digest, raw_bytes: what a manifest says (None: the header's, bound by the key); tokens: the ones
    the caller expects (None: the header's, bound by the key as well).
    """
    header, body = ObjectHeader.unpack(data)
    tokens = list(header.token_ids or ()) if tokens is None else tokens
    if (header.kind != "block" or header.key != key or header.bundle != remote.bundle
            or list(header.token_ids or ()) != list(tokens)
            or block_key(header.parent or "", remote.bundle, tokens) != key):
        raise ValueError("its header names another block, bundle or tokens")
    if digest is not None and (header.digest != digest or header.raw_bytes != raw_bytes):
        raise ValueError("its header disagrees with the manifest")
    _, tensors = check_encoded(body, header.digest, header.raw_bytes, header.codec, remote.bundle, key)
    return header, body, tensors


def fetch_block(remote: Remote, key: str, digest: str | None, raw_bytes: int | None, tokens: list[int]) -> tuple:
    """Fetch and verify one block object; returns (header, file bytes, decoded tensors).

    Raises CorruptBlockError for anything that does not check out, KeyError when it is missing.
    """
    found = remote.get_checked(remote.block_key(key), lambda data: check_block_object(
        remote, key, data, digest, raw_bytes, tokens), f"block {key[:16]}", block=key)
    remote.counters["fetched_blocks"] += 1
    return found


def _fill_from_remote(remote: Remote, m: dict[str, Any], w: SnapshotWriter, on_block: OnBlock) -> None:
    def one(i: int) -> None:
        entry = m["blocks"][i]
        try:
            header, body, tensors = fetch_block(remote, entry["key"], entry["digest"], int(entry["raw_bytes"]),
                                                w.block_tokens(i))
        except KeyError:
            raise _refused(remote, f"snapshot {m['snapshot']['id']}", f"block {i} ({entry['key'][:16]}) is missing",
                           block=entry["key"]) from None
        w.add_encoded(i, as_encoded(body, header))
        if on_block:
            on_block(entry["key"], tensors)

    _all(remote, one, w.needed)
    if m["tail"]:
        sid = m["snapshot"]["id"]
        data = remote.get(remote.tail_key(sid))
        try:
            encoded = check_tail_object(remote, sid, data or b"", m["tail"]["digest"])
        except ValueError as exc:
            raise _refused(remote, f"tail of snapshot {sid}", str(exc), snapshot_id=sid) from None
        w.set_tail_encoded(encoded)


def check_tail_object(remote: Remote, snapshot_id: str, data: bytes, digest: str) -> Encoded:
    """Verify a snapshot's tail object against the digest its manifest names; ValueError naming what is wrong."""
    header, body = ObjectHeader.unpack(data)
    if header.kind != "tail" or header.snapshot_id != snapshot_id or header.digest != digest:
        raise ValueError("its header names another tail")
    encoded, _ = check_encoded(body, header.digest, header.raw_bytes, header.codec, remote.bundle, None)
    return encoded


def as_encoded(body: memoryview, header: ObjectHeader) -> Encoded:
    """A fetched block file as the writer takes it (already verified by fetch_block)."""
    return Encoded((bytes(body),), header.digest, header.raw_bytes, header.codec)


def _all(remote: Remote, fn: Callable[[int], None], items: list[int]) -> None:
    """fn over items on the remote's pool; waits for all, then raises the first failure."""
    futures = [remote.pool.submit(fn, i) for i in items]
    cf.wait(futures)
    for f in futures:
        f.result()


def fetch_snapshot(remote: Remote, store: StoreCore, manifest_key: str, session_id: str, on_block: OnBlock = None) -> dict[str, Any]:
    """Fetch, verify and commit locally the snapshot a manifest names; returns the import summary.

    Raises CorruptBlockError (nothing committed) or RemoteUnavailableError.
    """
    raw = remote.get(manifest_key)
    if raw is None:
        raise _refused(remote, f"manifest {manifest_key}", "it is missing", session_id=session_id)
    try:
        m = parse_manifest(raw, store, PurePosixPath(manifest_key))
    except KvwakeError as exc:
        raise _refused(remote, f"manifest {manifest_key}", exc.message, session_id=session_id) from None
    if m["bundle"]["hash"] != remote.bundle or m["snapshot"]["session_id"] != session_id:
        raise _refused(remote, f"manifest {manifest_key}", "it names another bundle or session", session_id=session_id)
    result = import_verified(store, m, session_id, lambda w: _fill_from_remote(remote, m, w, on_block),
                             lambda why: _refused(remote, f"manifest {manifest_key}", why, session_id=session_id))
    result["points"] = fetch_named(remote, store, m.get("points") or [])
    remote.counters["fetched_snapshots"] += 1
    return result
