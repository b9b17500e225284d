"""Shared prompts on the remote tier: publishing a warmed prefix, and prefix lookups that read the remote.

Publication (`upload_prefix`): `prefix.warm` stores a prompt's full blocks and
its last partial block as a short block (daemon/kv/pipeline.py, write_prefix); all of
them go up as block objects, then the prefix manifest, written last:

    prefixes/<parent key>/<last key>.json

named by its last piece (the short block, or the last full block) under that
piece's parent, with the piece's token ids in `last_tokens`. Listing
`prefixes/<parent>/` thus answers "which published pieces continue this run",
which a chain key alone cannot: a request that shares only the first k tokens
of a piece cannot compute the piece's key.

Lookup (`fetch_prefix`): the blocks continuing the local longest prefix are
asked for by chain key, `batch` at a time; then, after the run, the published
piece under the run's last block that shares the most leading tokens with the
request (at least `min_partial`) is fetched and stored locally as a short
block, where the local lookup (store/reuse.py) finds it as a partial piece.
Everything fetched is verified like any remote read (the chain key recomputed
from parent, bundle and tokens, the payload's digest against the manifest);
the deadline covers the whole lookup.

Only published prefixes serve partial pieces across machines, never a
session's tail (docs/decisions.md, "Remote tier": a tail is private, and
token-granular answers would let any client of any daemon read it by guessing).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import time
from typing import Any

import numpy as np

from kvwake.errors import KvwakeError
from kvwake.store.core import StoreCore
from kvwake.store.format.keys import ROOT_KEY, chain_keys, tokens_to_bytes
from kvwake.store.reuse import common_length, longest_prefix, partial_candidate
from kvwake.store.remote.client import Remote
from kvwake.store.remote.points import fetch_points, upload_points
from kvwake.store.remote.snapshots import OnBlock, as_encoded, commit_manifest, fenced, fetch_block, upload_blocks
from kvwake.store.writer import SnapshotWriter

__all__ = ["PIECES_READ", "fetch_prefix", "upload_prefix"]

log = logging.getLogger("kvwake.remote")
PIECES_READ = 8  # prefix manifests read per partial lookup (published pieces under one parent; more are not ranked)


def upload_prefix(remote: Remote, store: StoreCore, token_ids: list[int]) -> dict[str, Any] | None:
    """Publish a warmed prefix: its blocks (the short last one too), then its prefix manifest, which
    keeps them from the remote gc. Returns what was sent; None when the store holds no block of it."""
    with store.reading():
        refs = longest_prefix(store, remote.bundle, token_ids, partial=True)
    if not refs:
        return None
    last = refs[-1]
    key = remote.prefix_key(last.parent, last.key)
    if remote.exists(key):
        return {"prefix": key, "blocks": len(refs), "new_blocks": 0, "existed": True}
    written: list[int] = []
    named: list[list[dict[str, Any]]] = []

    def put_objects() -> None:
        with store.reading():
            written.append(upload_blocks(remote, store, refs))
            named.append(upload_points(remote, store, [r.key for r in refs]))

    run = fenced(remote, put_objects)
    manifest = {"format": "kvwake-prefix", "version": 1, "bundle": remote.bundle, "block_tokens": store.block_tokens,
                "n_tokens": sum(len(r.token_ids) for r in refs), "last_tokens": list(last.token_ids),
                "blocks": [{"key": r.key, "digest": r.digest, "raw_bytes": r.raw_bytes} for r in refs],
                "points": named[-1]}
    commit_manifest(remote, key, json.dumps(manifest, indent=1).encode(), run, put_objects)
    return {"prefix": key, "blocks": len(refs), "new_blocks": sum(written), "existed": False}


def _arrived(f: cf.Future, what: str) -> bool:
    """A finished fetch with a result. Missing objects (KeyError) end a run quietly, refused or
    unreachable ones (KvwakeError, counted where they are refused) with a warning; anything else is a
    bug, logged with its traceback, never passed off as "not on the remote"."""
    if not f.done():
        return False
    exc = f.exception()
    if exc is None:
        return True
    if isinstance(exc, KvwakeError):
        log.warning("remote prefix fetch failed; prefilling instead", extra={"object": what, "error": exc.message})
    elif not isinstance(exc, KeyError):
        log.error("remote prefix fetch raised; prefilling instead", exc_info=exc, extra={"object": what})
    return False


def _whole_blocks(remote: Remote, store: StoreCore, token_ids: list[int], ends: float, batch: int,
                  on_block: OnBlock) -> tuple[int, str, int]:
    """Fetch the remote blocks continuing the local run, `batch` at a time, until one is missing or
    refused or the deadline passes (blocks still in flight are dropped).
    Returns (run length, its last chain key or ROOT_KEY, blocks added)."""
    b = store.block_tokens
    keys = chain_keys(remote.bundle, token_ids, b)
    have, added = len(longest_prefix(store, remote.bundle, token_ids)), 0
    while have < len(keys):
        wanted = range(have, min(have + batch, len(keys)))
        futures = [remote.pool.submit(fetch_block, remote, keys[i], None, None, token_ids[i * b : (i + 1) * b])
                   for i in wanted]
        cf.wait(futures, timeout=max(0.0, ends - time.monotonic()))
        got = []
        for i, f in zip(wanted, futures):
            if not _arrived(f, keys[i]):
                break
            got.append(f.result())
        if got:
            with SnapshotWriter(store, remote.bundle, token_ids[: (have + len(got)) * b], session_id=None) as w:
                for i, (header, body, tensors) in zip(range(have, have + len(got)), got):
                    w.add_encoded(i, as_encoded(body, header))
                    if on_block:
                        on_block(keys[i], tensors)
                w.commit()
            have, added = have + len(got), added + len(got)
        if len(got) < len(futures) or time.monotonic() >= ends:
            break
    return have, keys[have - 1] if have else ROOT_KEY, added


def _best_piece(remote: Remote, parent: str, following: list[int], least: int, ends: float) -> dict | None:
    """The published piece under `parent` sharing the most leading tokens with `following` (at least
    `least`): its manifest's last block entry plus "tokens" and "common"; None when there is none."""
    folder = f"{remote.ns}/prefixes/{parent}/"
    names = remote.names(folder)[:PIECES_READ]
    futures = [remote.pool.submit(remote.get, folder + name) for name in names]
    cf.wait(futures, timeout=max(0.0, ends - time.monotonic()))
    probe, best = np.asarray(following, dtype="<u4"), None
    for name, f in zip(names, futures):
        if not _arrived(f, folder + name):
            continue
        try:
            m = json.loads(f.result() or b"")
            entry, tokens = dict(m["blocks"][-1]), [int(t) for t in m["last_tokens"]]
        except (ValueError, TypeError, KeyError, IndexError):
            continue  # a damaged manifest serves nothing; the fetch below verifies what is used anyway
        common = common_length(tokens_to_bytes(tokens), probe)
        if entry.get("key") == name.removesuffix(".json") and common >= least and (best is None or common > best["common"]):
            best = {**entry, "tokens": tokens, "common": common}
    return best


def _partial_piece(remote: Remote, store: StoreCore, token_ids: list[int], have: int, parent_key: str,
                   min_partial: int, ends: float) -> int:
    """Fetch the best published piece continuing the run of `have` blocks (ending at `parent_key`) and
    store it as a short block; returns the tokens it serves (0: none, late, or none better than the
    local store's own)."""
    b = store.block_tokens
    following = token_ids[have * b : (have + 1) * b]
    local = partial_candidate(store, remote.bundle, parent_key, following, min_partial)
    least = max(min_partial, 1, local.tokens + 1 if local else 0)
    if len(following) < least or time.monotonic() >= ends:
        return 0
    piece = _best_piece(remote, parent_key, following, least, ends)
    if piece is None:
        return 0
    future = remote.pool.submit(fetch_block, remote, piece["key"], piece["digest"], int(piece["raw_bytes"]),
                                piece["tokens"])
    cf.wait([future], timeout=max(0.0, ends - time.monotonic()))
    if not future.done() or isinstance(future.exception(), KeyError):  # late, or removed since its manifest
        return 0
    header, body, _ = future.result()  # CorruptBlockError for one that does not verify
    if header.parent != parent_key:  # a key is self-consistent; it must also continue *this* run
        return 0
    with SnapshotWriter(store, remote.bundle, token_ids[: have * b] + piece["tokens"], session_id=None,
                        partial=True) as w:
        w.add_encoded(have, as_encoded(body, header))
        w.commit()
    return int(piece["common"])


def fetch_prefix(remote: Remote, store: StoreCore, token_ids: list[int], *, deadline_s: float, batch: int = 8,
                 min_partial: int = 1, on_block: OnBlock = None, with_points: bool = False) -> tuple[int, int]:
    """Bring the remote's blocks that continue the local longest prefix of `token_ids` into the local
    store, then the published piece that continues them furthest (module docstring), all under the
    deadline; `with_points` (a model whose cache does not cut by token): the restore points of the run
    instead of a partial piece (store/remote/points.py). Returns (whole blocks added, tokens the partial
    piece serves).

    Raises CorruptBlockError for a refused partial piece (the whole blocks fetched before it stay).
    """
    ends = time.monotonic() + deadline_s
    have, parent_key, added = _whole_blocks(remote, store, token_ids, ends, batch, on_block)
    if with_points:  # a partial piece serves no such model: it restores whole blocks up to a point
        fetch_points(remote, store, token_ids, have, ends)
        return added, 0
    return added, _partial_piece(remote, store, token_ids, have, parent_key, min_partial, ends)
