"""Restore points: the state of the layers that cannot be cut by token, at a block boundary.

A point is named by the chain key of the block it closes (`key`: the prefix of
`n_tokens` tokens under one bundle, which the key hashes), so two sessions that
prefilled the same prefix store one point. Its file is a block file (codec.py)
whose metadata says `kvwake.kind = "point"`, its key and its bundle; its arrays
are what a snapshot's tail holds at a block boundary (the daemon's
kv/cache_blocks.py names them: meta state, the cut layers' offsets, the whole
state of the others), so a store without MLX reads and verifies it as any
block.

Row and file, as for blocks: the file is written durably first (temp file,
fsync, rename), then the row; a key already indexed is not written again (the
second writer's file is deleted). A point lives at most as long as the block it
closes, and gc drops those of a conversation's older turns that no other
session reaches (`drop_unneeded`); fsck verifies each point, its row looked up
again under the shared lock (one gc dropped meanwhile is skipped), and drops a
bad one (`check`). docs/decisions.md,
"Restore points (issue 52)", says why.
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

from kvwake.errors import CorruptBlockError, KvwakeError
from kvwake.store.core import StoreCore
from kvwake.store.files import fsync_dir, write_durable
from kvwake.store.format.codec import Encoded, Tensor, encode

__all__ = ["KEEP_PER_HEAD", "PointRef", "by_key", "check", "drop_unneeded", "read", "summary", "write",
           "write_encoded"]

@dataclass(frozen=True)
class PointRef:
    """One restore point's index row."""

    key: str
    bundle: str
    n_tokens: int
    digest: str
    codec: str
    raw_bytes: int
    stored_bytes: int
    file: str

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> PointRef:
        return cls(row["key"], row["bundle"], row["n_tokens"], row["digest"], row["codec"], row["raw_bytes"],
                   row["stored_bytes"], row["file"])


def _path(store: StoreCore, key: str) -> Path:
    """A fresh file name for point `key` (a nonce, as for blocks: racing writers never share a path)."""
    return store.files.points / key[:2] / f"{key}.{secrets.token_hex(6)}.kvp"


def by_key(store: StoreCore, keys: Sequence[str], bundle: str) -> dict[str, PointRef]:
    """The points of `bundle` the index holds for `keys`."""
    out: dict[str, PointRef] = {}
    with store.locked():
        for start in range(0, len(keys), 500):
            chunk = list(keys[start : start + 500])
            rows = store.index.rows(f"SELECT * FROM points WHERE bundle = ? AND key IN ({','.join('?' * len(chunk))})",
                                    [bundle, *chunk])
            out.update({r["key"]: PointRef.from_row(r) for r in rows})
    return out


def write(store: StoreCore, bundle: str, key: str, n_tokens: int, arrays: Mapping[str, Tensor | np.ndarray]) -> bool:
    """Store the point that closes block `key` (`n_tokens` tokens); False when the index has it already.

    Durable before visible: the file is synced and renamed, its folder synced, then the row committed. The
    caller holds the blocks that lead to it (or they are stored already): a point without its block is
    dropped by the next gc."""
    if by_key(store, [key], bundle):
        return False
    meta = {"kvwake.kind": "point", "kvwake.key": key, "kvwake.bundle": bundle, "kvwake.tokens": str(n_tokens)}
    return write_encoded(store, bundle, key, n_tokens, encode(arrays, metadata=meta, codec=store.codec))


def write_encoded(store: StoreCore, bundle: str, key: str, n_tokens: int, encoded: Encoded) -> bool:
    """Store a point's file as encoded (`write`'s, or one fetched from the remote tier and verified there
    against its key, bundle and tokens); False when the index has it already. Durable as `write` says."""
    path = _path(store, key)
    with store.files.lock(exclusive=False):  # gc's orphan sweep waits: the file is named before it looks
        store.files.ensure_parent(path)
        write_durable(path, encoded.parts)
        now = time.time()
        with store.transaction() as db:
            added = db.execute(
                "INSERT OR IGNORE INTO points (key, bundle, n_tokens, digest, codec, raw_bytes, stored_bytes, file,"
                " created, last_used) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (key, bundle, n_tokens, encoded.digest, encoded.codec, encoded.raw_bytes, encoded.nbytes,
                 store.files.relative(path), now, now)).rowcount
    if not added:  # another writer indexed the same point first
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return bool(added)


def read(store: StoreCore, ref: PointRef) -> dict[str, Tensor]:
    """The point's arrays, verified (payload digest; the file's own key and bundle against the row).
    Raises CorruptBlockError naming the point and what failed."""
    facts = {"block": ref.key, "file": ref.file, "point": True}
    where = f"restore point {ref.key[:16]} ({ref.n_tokens} tokens)"
    tensors, meta = store.read_verified(ref.file, ref.digest, ref.raw_bytes, where, facts)
    if (meta.get("kvwake.kind"), meta.get("kvwake.key"), meta.get("kvwake.bundle")) != ("point", ref.key, ref.bundle):
        raise CorruptBlockError(f"{where}: file holds {meta.get('kvwake.kind')} {meta.get('kvwake.key', '?')[:16]} "
                                f"of bundle {meta.get('kvwake.bundle', '?')[:12]}", **facts)
    with store.transaction() as db:
        db.execute("UPDATE points SET last_used = ? WHERE key = ?", (time.time(), ref.key))
    return tensors


KEEP_PER_HEAD = 3  # points kept on each conversation's head chain (one turn's: kv/points.py takes at most three)

# The points gc drops: those whose block is gone, and those of a conversation's older turns (their block
# referenced, not pinned, not reached by a second session's snapshots, and not among the KEEP_PER_HEAD
# deepest points on its session's head). A point in the prefix cache (its block unreferenced) stays while
# that block does: the budget evicts the block, then the point goes with it.
_UNNEEDED = f"""
WITH head_points AS (
  SELECT sb.block_key AS key, ROW_NUMBER() OVER (PARTITION BY s.id ORDER BY sb.pos DESC) AS depth
  FROM sessions s JOIN snapshot_blocks sb ON sb.snapshot_id = s.head JOIN points p ON p.key = sb.block_key),
shared AS (
  SELECT sb.block_key AS key FROM snapshot_blocks sb JOIN points p ON p.key = sb.block_key
  JOIN snapshots sn ON sn.id = sb.snapshot_id GROUP BY sb.block_key HAVING count(DISTINCT sn.session_id) > 1)
SELECT p.key, p.file FROM points p LEFT JOIN blocks b ON b.key = p.key
WHERE b.key IS NULL OR (b.refs > 0 AND b.pins = 0
  AND p.key NOT IN (SELECT key FROM head_points WHERE depth <= {KEEP_PER_HEAD})
  AND p.key NOT IN (SELECT key FROM shared))
"""


def drop_unneeded(db: sqlite_utils.Database) -> list[str]:
    """Inside gc's transaction: delete the points no one needs (`_UNNEEDED`); returns their files (to unlink
    after the commit)."""
    rows = db.execute(_UNNEEDED).fetchall()
    db.conn.executemany("DELETE FROM points WHERE key = ?", [(key,) for key, _ in rows])
    return [rel for _, rel in rows]


def check(store: StoreCore) -> tuple[int, list[dict[str, Any]]]:
    """fsck's part: verify every point; a bad one's file goes to quarantine/ and its row is deleted (the
    next prefill there takes it again). Returns (points checked, the bad ones)."""
    bad: list[dict[str, Any]] = []
    keys = [row["key"] for row in store.rows("SELECT key FROM points ORDER BY key")]
    return sum(_check_one(store, key, bad) for key in keys), bad


def _check_one(store: StoreCore, key: str, bad: list[dict[str, Any]]) -> bool:
    """Verify point `key` as it is now, its row looked up again under the shared lock; False when it is
    gone (gc dropped it since fsck listed the points: its file may be deleted, and it is not bad)."""
    with store.reading():
        rows = store.rows("SELECT * FROM points WHERE key = ?", (key,))
        if not rows:
            return False
        ref = PointRef.from_row(rows[0])
        try:
            read(store, ref)
            return True
        except KvwakeError as exc:
            bad.append({"point": ref.key, "file": ref.file, "reason": exc.message})
        src = store.files.absolute(ref.file)
        if src.exists():
            src.replace(store.files.quarantine / src.name)
            fsync_dir(store.files.quarantine)
    with store.transaction() as db:
        db.execute("DELETE FROM points WHERE key = ? AND file = ?", (ref.key, ref.file))
    return True


def summary(store: StoreCore) -> dict[str, int]:
    """How many points the store holds and their bytes on disk (`status`)."""
    row = store.index.one("SELECT count(*) AS n, coalesce(sum(stored_bytes), 0) AS b FROM points")
    return {"points": int(row["n"]) if row else 0, "point_bytes": int(row["b"]) if row else 0}
