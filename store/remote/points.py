"""Restore points on the shared tier: pushed with the blocks they close, fetched and verified on a hit.

A point object (`ObjectHeader` kind "point", store/remote/objects.py) holds a
local point file as it is (store/points.py: a block file whose metadata names
kind, key, bundle and tokens) under `points/<chain key>`, create-only.

- **Upload** (`upload_points`): a snapshot's or a warmed prefix's upload puts
  the points the local store holds for its blocks, each verified before it
  leaves (a create-only object can never be replaced, so a bad one must never
  be written), and names them in its manifest (`"points"`), which keeps them
  from the remote gc as long as the manifest lives.
- **Lookup** (`fetch_points`): after a prefix lookup has brought the run of
  blocks a request shares (shared_prompts.fetch_prefix), the points of that
  run the local store lacks, deeper than its own deepest one, are asked for by
  chain key, deepest first, `batch` at a time, until a batch finds one or the
  deadline passes. The key binds the point to the request's tokens (it hashes
  the bundle and every token before it); the object is checked as any remote
  read: its header's kind, key, bundle and token count, then the decoded
  payload's digest and the file's own metadata, before it is stored locally.
  Which boundaries hold a point is up to the daemon that took them
  (daemon/kv/points.py), so a lookup cannot compute them: it asks.
- **Adoption**: a fetched snapshot brings the points its manifest names
  (`fetch_named`), so the adopted conversation falls back to them as it would
  where it was made; one refused is skipped, never fails the adoption.

Nothing here imports mlx.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from typing import Any

from kvwake.errors import KvwakeError
from kvwake.store import points
from kvwake.store.core import StoreCore
from kvwake.store.format.codec import BlockFormatError, Encoded, decode
from kvwake.store.format.keys import chain_keys
from kvwake.store.remote.client import Remote
from kvwake.store.remote.objects import ObjectHeader

__all__ = ["check_point_object", "fetch_named", "fetch_point", "fetch_points", "put_point", "upload_points"]

log = logging.getLogger("kvwake.remote")


def _entry(ref: points.PointRef) -> dict[str, Any]:
    """A point as a manifest names it."""
    return {"key": ref.key, "digest": ref.digest, "raw_bytes": ref.raw_bytes, "n_tokens": ref.n_tokens}


def put_point(remote: Remote, store: StoreCore, ref: points.PointRef) -> bool:
    """Put one local point (verified first), create-only; False when the remote already holds it."""
    data = bytes(store.files.read(ref.file))
    points.read(store, ref)  # CorruptBlockError: a damaged point stays here
    header = ObjectHeader("point", ref.bundle, ref.digest, ref.codec, ref.raw_bytes, len(data), key=ref.key,
                          n_tokens=ref.n_tokens)
    return remote.put_new(remote.point_key(ref.key), header.pack(data))


def upload_points(remote: Remote, store: StoreCore, keys: list[str]) -> list[dict[str, Any]]:
    """Put the points the local store holds for block `keys` that the remote lacks (the caller holds the
    store's read lock); returns the manifest entries of all of them."""
    refs = list(points.by_key(store, keys, remote.bundle).values())
    present = remote.parallel(lambda ref: remote.exists(remote.point_key(ref.key)), refs)
    written = sum(remote.parallel(lambda ref: put_point(remote, store, ref),
                                  [ref for ref, there in zip(refs, present) if not there]))
    remote.counters["uploaded_points"] += written
    return [_entry(ref) for ref in refs]


def check_point_object(remote: Remote, key: str, data: bytes, n_tokens: int, digest: str | None = None,
                       raw_bytes: int | None = None) -> Encoded:
    """Verify one point object; returns its file as the local store writes it; ValueError naming what is
    wrong. `n_tokens`: the tokens the key names (the caller's); digest, raw_bytes: what a manifest says."""
    header, body = ObjectHeader.unpack(data)
    if (header.kind, header.key, header.bundle, header.n_tokens) != ("point", key, remote.bundle, n_tokens):
        raise ValueError("its header names another point, bundle or token count")
    if digest is not None and (header.digest != digest or header.raw_bytes != raw_bytes):
        raise ValueError("its header disagrees with the manifest")
    try:
        _, meta, actual = decode(body, max_raw_bytes=int(header.raw_bytes))
    except BlockFormatError as exc:
        raise ValueError(f"damaged: {exc}") from None
    if actual != header.digest:
        raise ValueError(f"payload digest {actual[:16]} != its header's {header.digest[:16]}")
    own = (meta.get("kvwake.kind"), meta.get("kvwake.key"), meta.get("kvwake.bundle"), meta.get("kvwake.tokens"))
    if own != ("point", key, remote.bundle, str(n_tokens)):
        raise ValueError("its file belongs to another point or bundle")
    return Encoded((bytes(body),), actual, int(header.raw_bytes), header.codec)


def fetch_point(remote: Remote, store: StoreCore, key: str, n_tokens: int, digest: str | None = None,
                raw_bytes: int | None = None) -> bool:
    """Fetch, verify and store locally the point closing block `key`; False when the store had it.
    Raises KeyError when the remote has none, CorruptBlockError when it does not check out."""
    encoded = remote.get_checked(remote.point_key(key), lambda data: check_point_object(
        remote, key, data, n_tokens, digest, raw_bytes), f"restore point {key[:16]}", block=key, point=True)
    remote.counters["fetched_points"] += 1
    return points.write_encoded(store, remote.bundle, key, n_tokens, encoded)


def fetch_points(remote: Remote, store: StoreCore, token_ids: list[int], have: int, ends: float,
                 batch: int = 16) -> int:
    """The points of the first `have` blocks of `token_ids` (held locally) that lie deeper than the local
    store's deepest one: asked deepest first, `batch` at a time, until a batch finds any or `ends` (a
    monotonic time) passes. Returns the points stored (a refused one is logged and counted, not stored)."""
    b = store.block_tokens
    keys = chain_keys(remote.bundle, token_ids[: have * b], b)
    local = points.by_key(store, keys, remote.bundle)
    deepest = max((i for i, key in enumerate(keys) if key in local), default=-1)
    wanted, added = list(range(len(keys) - 1, deepest, -1)), 0
    for start in range(0, len(wanted), batch):
        if time.monotonic() >= ends:
            break
        part = wanted[start : start + batch]
        futures = [remote.pool.submit(fetch_point, remote, store, keys[i], (i + 1) * b) for i in part]
        cf.wait(futures, timeout=max(0.0, ends - time.monotonic()))
        found = [f for f in futures if f.done() and not isinstance(f.exception(), KeyError)]
        for f in found:
            if f.exception() is None:
                added += int(f.result())
            elif isinstance(f.exception(), KvwakeError):
                log.warning("remote restore point unusable; a shallower one serves",
                            extra={"error": f.exception().message})  # type: ignore[union-attr]
            else:
                log.error("remote restore point fetch raised", exc_info=f.exception())
        if found:
            break
    return added


def fetch_named(remote: Remote, store: StoreCore, entries: list[dict[str, Any]]) -> int:
    """Fetch the points a manifest names that the local store lacks; returns how many were stored. One
    missing or refused is logged and skipped (the snapshot they came with is whole without them)."""
    def one(entry: dict[str, Any]) -> int:
        try:
            return int(fetch_point(remote, store, str(entry["key"]), int(entry["n_tokens"]), str(entry["digest"]),
                                   int(entry["raw_bytes"])))
        except (KeyError, KvwakeError, ValueError, TypeError) as exc:
            log.warning("remote restore point not fetched", extra={"point": str(entry.get("key"))[:16],
                                                                   "error": getattr(exc, "message", repr(exc))})
            return 0

    held = points.by_key(store, [str(e.get("key")) for e in entries], remote.bundle)
    return sum(remote.parallel(one, [e for e in entries if e.get("key") not in held]))
