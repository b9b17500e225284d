"""kvwake.store: content-addressed KV block store with a SQLite index. Never imports mlx."""

from __future__ import annotations

from kvwake.store.format.codec import Tensor
from kvwake.store.format.keys import ROOT_KEY, block_key, chain_keys
from kvwake.store.format.snapshot import snapshot_digest
from kvwake.store.index import BlockRef, SnapshotRecord, TailRef
from kvwake.store.store import Store
from kvwake.store.writer import SnapshotInfo, SnapshotWriter

__all__ = [
    "ROOT_KEY",
    "BlockRef",
    "SnapshotInfo",
    "SnapshotRecord",
    "SnapshotWriter",
    "Store",
    "TailRef",
    "Tensor",
    "block_key",
    "chain_keys",
    "snapshot_digest",
]
