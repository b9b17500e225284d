"""KvContext: the narrow view of the loaded model and the daemon that the KV layer works with.

The pipeline (sleep, wake, prefix writes) and prefix restores take this, never
the `Engine`: the store, the bundle hash, the block size, the RAM tier, the
worker pool, the counters, and the few facts of the model's cache they need
(its skeleton, its quantization, whether it can be cut by token). The engine
(daemon/model/) builds one when it loads a model and shares it; nothing in
kv/ imports model/.

`Mlx`, the runner the caller gives for MLX work, is daemon/jobs.py's.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.models.cache import KVCache, make_prompt_cache

from kvwake.daemon.jobs import Mlx, direct
from kvwake.daemon.kv.bundle import Bundle, diff_descriptions
from kvwake.daemon.kv.ram_tier import RamTier
from kvwake.daemon.kv.pool import Pool
from kvwake.errors import BundleMismatchError, KvwakeError
from kvwake.store import SnapshotRecord, Store
from kvwake.store.decode_procs import DecodeProcs

__all__ = ["Counters", "KvContext", "Mlx", "direct", "quantize_cache"]

log = logging.getLogger("kvwake.engine")  # the name its messages had before the layers (logs are read by it)


def quantize_cache(cache: list, bits: int | None, group_size: int) -> list:
    """The cache with its plain KV layers quantized when `bits` is set (mlx-lm cannot quantize the
    others); as it is otherwise."""
    if bits is None:
        return cache
    return [c.to_quantized(group_size=group_size, bits=bits) if type(c) is KVCache else c for c in cache]


class Counters(dict):
    """Named event counts, added to from the engine thread and the pool's workers alike."""

    def __init__(self, *names: str) -> None:
        super().__init__({name: 0 for name in names})
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self[name] += n


@dataclass
class KvContext:
    """Everything sleep, wake and prefix restores need, and nothing else.

    model: the loaded MLX model, only for its cache skeleton (`make_prompt_cache`).
    kv_bits, kv_group_size: quantized KV (plain KV layers only, as mlx-lm quantizes them).
    device_planes: KV on a discrete GPU: a sleep splits byte planes there (devplanes.py).
    cuttable: every layer can be cut by token, so prefixes are reusable across sessions.
    """

    store: Store
    bundle: Bundle
    model: Any
    ram_tier: RamTier
    pool: Pool
    vocab_size: int
    cuttable: bool
    kv_bits: int | None = None
    kv_group_size: int = 64
    device_planes: bool = False
    restore_mode: str | None = None  # "direct" | "staged" (kv/restore_buffers.py); None: by the backend
    window_blocks: bool = False  # every writer stores sliding-window rows in the blocks (kv/window_rows.py)
    # direct restores' block files decoded by worker processes (tuning decode_processes; store/decode_procs.py)
    procs: DecodeProcs | None = None
    counters: Counters = field(default_factory=lambda: Counters("blocks_ram", "blocks_disk", "blocks_shared",
                                                                "tokens_reused", "tokens_prefilled", "prefill_packs",
                                                                "prefill_packed_chunks", "tokens_from_points"))

    @property
    def block_tokens(self) -> int:
        return self.store.block_tokens

    @property
    def min_partial(self) -> int:
        """The fewest tokens a partial block or tail serves: a quarter block. Below that the match is the
        chat template's opening, which every session shares: restoring (and keeping in RAM) a whole
        block for it would cost more than prefilling it and push real shared prompts out of the RAM tier."""
        return max(1, self.block_tokens // 4)

    def make_blank(self) -> list:
        """make_prompt_cache(model): the cache skeleton a restore fills (MLX work)."""
        return make_prompt_cache(self.model)

    def make_cache(self) -> list:
        """A fresh cache; with kv_bits, plain KV layers are quantized (mlx-lm cannot quantize the others)."""
        return self.quantize(self.make_blank())

    def quantize(self, cache: list) -> list:
        """The cache with its plain KV layers quantized when kv_bits is set; as it is otherwise."""
        return quantize_cache(cache, self.kv_bits, self.kv_group_size)

    def record(self, snapshot_id: str) -> SnapshotRecord:
        """A snapshot's verified record; BundleMismatchError (with the differences) for another model's."""
        try:
            return self.store.snapshot(snapshot_id, bundle=self.bundle.hash)
        except BundleMismatchError as exc:
            theirs = self.store.bundle(exc.data.get("snapshot_bundle", "")) or {}
            diffs = diff_descriptions(theirs, self.bundle.description) if theirs else []
            if diffs:
                exc.message += "; differences: " + "; ".join(diffs[:5])
                exc.args = (exc.message,)
                exc.data["differences"] = diffs
            raise

    @staticmethod
    def log_unusable(exc: KvwakeError) -> None:
        log.warning("prefix block unusable, prefilling instead: %s", exc.message)
