"""The engine's side of paged KV (`--tune paged_kv`): its one page pool, and what it does with sessions' caches.

Four moments, each one call from the engine (kv/paged_cache.py does the work):
- a new cache (`make`): the model's fresh cache with its plain KV layers paged;
- a prefix for a fresh cache (`prefix`): the published blocks that start the
  target, mapped where they are resident (no read, no copy), else the stored
  prefix the caller restores, moved into pages and published;
- after a prefill (`publish`): the session's full blocks published under their
  chain keys, for the sessions that come after it;
- a wake: its first blocks resident as the store's bytes mapped (`wake_prefix`),
  and only the rest read, straight into pages (pipeline.wake's `pages`:
  kv/page_restore.py), published, so sessions woken over one prompt hold it
  once; a cache restored otherwise (a model with layers of other kinds) is
  moved into pages after (`adopt`).
Pool work runs on the engine thread (through `mlx`); the store's lookups on the caller's.
"""

from __future__ import annotations

from collections.abc import Callable

from mlx_lm.models.cache import KVCache

from kvwake.daemon.jobs import Mlx, direct
from kvwake.daemon.kv import paged_cache, paged_wake
from kvwake.daemon.kv.pages import PagePool, PageStateError
from kvwake.daemon.session_state import Session
from kvwake.store import SnapshotRecord, chain_keys

__all__ = ["Pages"]

FIRST_BYTES = 64 << 20  # the pool's first allocation (it grows, doubling, up to the budget)
Prefix = tuple[list | None, int]  # a cache for a fresh session and the tokens it holds; (None, 0): none


class Pages:
    """The pool of a model's plain KV layers, a page per store block, and the bundle its keys are for."""

    def __init__(self, pool: PagePool, bundle_hash: str) -> None:
        self.pool, self.bundle_hash = pool, bundle_hash

    @classmethod
    def for_model(cls, probe: list, kv_layout: list, block_tokens: int, budget_bytes: int,
                  bundle_hash: str) -> Pages | None:
        """Pages for a model whose fresh cache is `probe` (kv/cache_blocks.layout gives `kv_layout`), up to as
        many as `budget_bytes` holds; None for a model with no plain KV layer (nothing to page) or quantized KV."""
        if not any(type(c) is KVCache for c in probe):
            return None
        layout = paged_cache.page_layout(probe, kv_layout, block_tokens, block_tokens)
        limit = max(1, budget_bytes // layout.page_bytes)
        return cls(PagePool(layout, min(limit, max(16, FIRST_BYTES // layout.page_bytes)), limit), bundle_hash)

    def set_budget(self, budget_bytes: int) -> None:
        """The most bytes of pages the pool may grow to, set again when what all KV may hold changes (another
        model loaded or unloaded beside this one): pages allocated already stay, the pool grows no further
        than the new bound."""
        self.pool.limit = max(self.pool.capacity, 1, budget_bytes // self.pool.layout.page_bytes)

    def make(self, cache: list) -> list:
        """`cache` (a model's fresh cache) with its plain KV layers paged, in a new table."""
        return paged_cache.paged_cache(self.pool, cache)

    def prefix(self, blank: Callable[[], list], target: list[int], stored: Callable[[], Prefix],
               mlx: Mlx = direct) -> Prefix:
        """A fresh cache for `target`: its resident published blocks mapped, unless `stored()` (a restore of
        the store's blocks and partial piece, asked unless the resident blocks hold all but the pending
        token) holds more; then that, moved into pages and published (its blocks that are resident are
        taken from the pages, so they are held once; they are read all the same)."""
        resident: Prefix = mlx(lambda: paged_cache.resident_prefix(self.pool, blank(), target, self.bundle_hash))
        if resident[1] >= len(target) - 1:
            return resident
        cache, tokens = stored()
        if cache is None or tokens <= resident[1]:
            return resident
        return mlx(lambda: paged_cache.adopt(self.pool, cache, target, self.bundle_hash)), tokens

    def wake_prefix(self, blank: Callable[[], list], record: SnapshotRecord, given: Prefix | None,
                    mlx: Mlx = direct) -> Prefix | None:
        """The first blocks of a wake from `record`: those whose pages are resident as the store's bytes, mapped
        (kv/paged_wake.py), unless `given` (a copy of another session's cache, or one still coming: pipeline.wake's
        `prefix`) holds more; None for neither."""
        keys = [ref.key for ref in record.blocks]
        cache, tokens = mlx(lambda: paged_wake.resident(self.pool, blank(), keys)) if keys else (None, 0)
        if cache is None or (given is not None and given[1] > tokens):
            return given
        return cache, tokens

    def publish(self, session: Session) -> int:
        """Publish the session's new full blocks (engine thread); a cache not paged whole has none to share."""
        cache = session.cache
        if cache is None or not all(isinstance(c, paged_cache.PagedKVCache) for c in cache):
            return 0
        return paged_cache.publish(cache, session.tokens[: session.processed], self.bundle_hash)

    def adopt(self, session: Session) -> None:
        """A woken session's cache moved into pages, its full blocks published (engine thread)."""
        if session.cache is not None and not paged_cache.is_paged(session.cache):
            session.cache = paged_cache.adopt(self.pool, session.cache, session.tokens[: session.processed],
                                              self.bundle_hash)

    def wake_bytes(self, record: SnapshotRecord, maps: bool = True) -> int:
        """Bytes of pages a wake from `record` adds to the pool: its tokens' pages less those of its first blocks
        resident as the store's bytes, which it maps (`wake_prefix`; `maps`: whether this model's wakes map any,
        kv/paged_wake.py `resident`). Read from any thread (sessions/room.py)."""
        layout = self.pool.layout
        resident = self.pool.resident_run([ref.key for ref in record.blocks]) if maps else 0
        pages = -(-len(record.token_ids) // layout.page_tokens) - resident * layout.pages_per_block
        return max(0, pages) * layout.page_bytes

    def append_bytes(self, cache: list | None, target: list[int], maps: bool = True) -> int:
        """Bytes of pages growing `cache` (None: a new session's) to hold `target` but its pending last token
        adds: its pages past those its table lists and, for a session holding none yet, past the published blocks
        that start `target`, which it maps (`prefix`; `maps`: whether this model's prompts map any). Read from
        any thread (sessions/room.py)."""
        layout = self.pool.layout
        layer = next((c for c in cache or () if isinstance(c, paged_cache.PagedKVCache)), None)
        table = self.pool.sessions.get(layer.session.name) if layer is not None else None
        listed = len(table.pages) if table is not None else 0
        if not listed and maps and self.pool.shared:  # a new session maps the resident blocks of its prompt (their
            # keys hashed here, on the event loop, once per new session and only while some block is published)
            usable = (len(target) - 1) // layout.block_tokens * layout.block_tokens
            keys = chain_keys(self.bundle_hash, target[:usable], layout.block_tokens) if usable else []
            listed = self.pool.shared_run(keys) * layout.pages_per_block
        return max(0, -(-(len(target) - 1) // layout.page_tokens) - listed) * layout.page_bytes

    def most_tokens(self) -> int:
        """The most tokens one session's paged layers may hold: every page the pool may have (its free pages,
        those it may grow by, and those other sessions hold, which they give back by sleeping: the manager
        makes room before a session grows). A shared page counts whole here: the session lists it."""
        return self.pool.limit * self.pool.layout.page_tokens

    def frees(self, cache: list | None) -> tuple[int, int]:
        """(Bytes of pages freeing `cache` gives back: those no other session lists; bytes of pages it lists,
        shared ones whole: what it would hold alone). Read from any thread, as `status` is (counts)."""
        layer = next((c for c in cache or () if isinstance(c, paged_cache.PagedKVCache)), None)
        if layer is None:
            return 0, 0
        name = layer.session.name
        try:
            return self.pool.own_bytes(name), self.pool.session_bytes(name)
        except PageStateError:  # its table freed meanwhile (a release running on the engine thread)
            return 0, 0

    def status(self) -> dict[str, int]:
        """The pool in numbers, for `status` (read from any thread: counts, nothing changed). `held`: pages
        some table lists, a shared page once; `shared`: of them, those listed by more than one table."""
        pool = self.pool
        held = pool.capacity - len(pool.free)
        return {"page_tokens": pool.layout.page_tokens, "page_bytes": pool.layout.page_bytes,
                "allocated_pages": pool.capacity, "limit_pages": pool.limit, "held_pages": held,
                "held_bytes": held * pool.layout.page_bytes, "shared_pages": sum(r > 1 for r in list(pool.refs)),
                "published_blocks": len(pool.shared), "grows": pool.grows, "grow_ms": round(pool.grow_s * 1e3, 1)}
