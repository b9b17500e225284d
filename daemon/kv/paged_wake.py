"""A paged wake: a snapshot's blocks whose pages are resident are mapped, not read.

A snapshot's full blocks are named by their chain keys (store/format/keys.py),
the keys the page pool publishes pages under (kv/pages.py). A wake maps, from
its first block on, every block whose pages hold the store's bytes
(`PagePool.stored`: a restore published them, or a sleep or a checkpoint wrote
the store's block from them: `mark_stored`), shared and counted by reference,
and reads only the blocks after them (kv/pipeline.py, a paged `prefix`),
straight into pages placed after the mapped ones (kv/page_restore.py). Only the store's
bytes will do: on a GPU a prefill of the same tokens may differ from them in
the last bits, and a wake gives the stored bytes (docs/decisions.md, "A paged
wake maps resident pages (issue 51)").

All of it runs on the engine thread (the pool takes no lock).
"""

from __future__ import annotations

from mlx_lm.models.cache import KVCache

from kvwake.daemon.kv import paged_cache
from kvwake.daemon.kv.pages import PagePool

__all__ = ["cut", "mark_stored", "resident"]


def resident(pool: PagePool, blank: list, keys: list[str]) -> tuple[list | None, int]:
    """A paged cache (from `blank`, the model's fresh cache, every layer plain KV) mapping the blocks named by
    `keys` (a snapshot's, in order) from the first up to the first whose pages do not hold the store's bytes;
    (None, 0) when the first does not."""
    count = pool.stored_run(keys)
    if not count or not all(type(c) is KVCache for c in blank):
        return None, 0
    cache = paged_cache.paged_cache(pool, blank)
    tokens = paged_cache.map_keys(cache, keys[:count])
    return (cache, tokens) if tokens else (None, 0)


def cut(cache: list, tokens: int) -> list:
    """A paged cache of this wake's own (a copy another session's cache gave: its pages listed, not copied)
    kept to its first `tokens`."""
    for c in cache:
        c.trim(c.offset - tokens)
    return cache


def mark_stored(cache: list | None, written: dict[int, str]) -> int:
    """After a commit that wrote blocks of `cache`'s session (index -> chain key: the writer's own blocks):
    those whose pages are still the key's hold the store's bytes from now on. A cache not paged whole has
    none to mark. Returns how many were marked."""
    if not cache or not all(isinstance(c, paged_cache.PagedKVCache) for c in cache):
        return 0
    session = cache[0].session
    return sum(session.pool.mark_stored(session.name, k, key) for k, key in written.items()
               if k < len(session.keys) and session.keys[k] == key)
