"""A decoding batch over its rows' own pages: no merge into one buffer at a join, no copy out at a leave.

mlx-lm's `GenerationBatch` steps a batch through one cache object per layer.
Over paged sessions (kv/paged_cache.py) that object is a `PagedBatchKVCache`:
it holds no KV of its own, only the rows' page tables (`PagedRows`, one for all
of the batch's layers, as one `PagedSession` serves all of a session's
layers). A step writes each row's new token's K and V into that row's pages
(one write per layer and part, at slots reserved for every row before the
pass, or by the first layer) and the attention reads every row's pages where they are
(model/ragged_decode.py: the CUDA kernel over the page table, or the gather
reference). Rows are ragged: no left padding, no mask, and a dead slot (a row
no call holds, None here) is written nowhere and attends over nothing.

So a call joins by putting its session's table in a row (`PagedRows.place`,
or a new batch's `merged`) and leaves by taking it back (`extract`): its pages
are its session's throughout, and what it decoded is already in them.

The batch's layers are called one after the other for each operation
(GenerationBatch filters and extends every layer in turn, the model updates
them in order), and the rows are shared: the first layer called does the
rows' part (an `epoch` counts them), the others see it done.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import _BaseCache

from kvwake.daemon.kv.paged_cache import PagedKVCache, PagedSession
from kvwake.daemon.kv.pages import PagePool, PagePoolFullError, PageStateError

__all__ = ["PagedBatchKVCache", "PagedRows", "dead", "in_pages", "merged", "takes"]


class PagedRows:
    """The page tables of a batch's rows (None: a dead slot), and what a step needs of them: each row's
    tokens before it and after it, the new tokens' slots, the page table (for the kernel) and each row's
    slots (for the gather)."""

    def __init__(self, pool: PagePool, sessions: list[PagedSession | None]) -> None:
        self.pool, self.sessions = pool, sessions
        self.epoch = 0  # operations on the rows so far (module docstring)
        self._settle()

    def _settle(self) -> None:
        """No step in progress: each row's tokens are its table's."""
        self.held = np.asarray([self.pool.table(s.name).tokens if s else 0 for s in self.sessions], np.int32)
        self.before = mx.array(self.held)  # tokens before the step in progress (the rotary offset)
        self.after = self.before
        self.slots: mx.array | None = None  # the step's new tokens' slots, live rows in order
        self.live: mx.array | None = None  # the live rows' indices, None when every row is live
        self._table: mx.array | None = None
        self._row_slots: list[slice | mx.array | None] | None = None

    def __len__(self) -> int:
        return len(self.sessions)

    def begin_step(self) -> list[int]:
        """Room for one token in every live row (copy on write and new pages: PagePool.reserve). A row the
        pool has no page for (PagePoolFullError) is left out of the step: vacated, its table as it was.
        Returns those rows (the decoder fails their calls; the model's pass, which calls this from its first
        layer when the decoder has not, raises instead)."""
        self.before = self.after
        slots, live, full = [], [], []
        for r, session in enumerate(self.sessions):
            if session is None:
                continue
            try:
                slots.append(self.pool.reserve(session.name, 1))  # one token: one slot, an int
            except PagePoolFullError:
                full.append(r)
                continue
            live.append(r)
            self.held[r] += 1
        for r in full:
            self.sessions[r] = None
            self.held[r] = 0
        self.after = mx.array(self.held)
        self.slots = mx.array(np.asarray(slots, np.int32))
        self.live = None if len(live) == len(self.sessions) else mx.array(np.asarray(live, np.int32))
        self._table = self._row_slots = None
        self.epoch += 1
        return full

    def page_table(self) -> mx.array:
        """[rows, most pages] int32: each row's pages in token order (a dead row's: none)."""
        if self._table is None:
            tables = [self.pool.table(s.name).pages if s else [] for s in self.sessions]
            table = np.zeros((len(tables), max([1, *map(len, tables)])), np.int32)
            for r, pages in enumerate(tables):
                table[r, : len(pages)] = pages
            self._table = mx.array(table)
        return self._table

    def row_slots(self) -> list[slice | mx.array | None]:
        """Where each row's tokens are in the pools, for the gather path (made once a step): a slice where
        its pages follow one another (read in place, as a `PagedKVCache` alone reads them), else its slots
        in token order; None for a dead row."""
        if self._row_slots is None:
            self._row_slots = []
            for s, held in zip(self.sessions, self.held.tolist(), strict=True):
                first = self.pool.run(self.pool.table(s.name).pages, 0, held) if s else None
                self._row_slots.append(slice(first, first + held) if first is not None else
                                       s.held_slots() if s else None)
        return self._row_slots

    # -- rows joining and leaving ----------------------------------------------------------------------

    def place(self, i: int, session: PagedSession) -> None:
        """Row i (dead) is `session`'s from now on."""
        if self.sessions[i] is not None:
            raise PageStateError(f"row {i} of the batch is {self.sessions[i].name!r}'s, not free")
        self.sessions[i] = session
        self._settle()

    def vacate(self, i: int) -> PagedSession | None:
        """Row i's session leaves (the slot is dead from now on, written nowhere); it is handed back. Between
        steps; a row `begin_step` left out is dead already (nothing done: the step's slots stand)."""
        session, self.sessions[i] = self.sessions[i], None
        if session is not None:
            _release(session)
            self._settle()
        return session

    def _filter(self, keep: list[int]) -> None:
        self.sessions = [self.sessions[i] for i in keep]
        self._settle()
        self.epoch += 1

    def _extend(self, other: PagedRows) -> None:
        if other.pool is not self.pool:
            raise PageStateError("rows of two page pools cannot decode in one batch")
        self.sessions = self.sessions + other.sessions
        self._settle()
        self.epoch += 1


def _release(session: PagedSession) -> None:
    """A session out of the batch: its layers' offsets are its table's again, its cached slots stale."""
    session.offsets = [session.tokens] * len(session.offsets)
    session.changed()


class PagedBatchKVCache(_BaseCache):
    """One paged layer of a decoding batch: `rows`' page tables, the layer's pools (module docstring)."""

    def __init__(self, rows: PagedRows, layer: int) -> None:
        self.rows, self.layer, self.epoch = rows, layer, rows.epoch

    def _leads(self) -> bool:
        """Whether this layer is the first to reach the rows' next operation (module docstring)."""
        return self.epoch == self.rows.epoch

    @property
    def offset(self) -> mx.array:
        """Each row's tokens before this step's (the rotary position of the token it feeds)."""
        return self.rows.after if self._leads() else self.rows.before

    @property
    def pool(self) -> PagePool:
        return self.rows.pool

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write every live row's new token's K and V ([rows, kv_heads, 1, head_dim]) into its pages. Returns
        them unchanged: the attention reads the pages (model/ragged_decode.py), never a merged buffer."""
        layout = self.pool.layout
        if keys.shape[0] != len(self.rows) or keys.shape[2] != 1 or keys.dtype != layout.dtype:
            raise PageStateError(f"layer {self.layer}: a paged batch of {len(self.rows)} rows decodes one token "
                                 f"a row in {layout.dtype}, not keys {tuple(keys.shape)} in {keys.dtype}")
        if self._leads() and self.rows.begin_step():
            raise PagePoolFullError(f"the page pool has no page for a row of the batch ({self.pool.limit} pages)")
        self.epoch = self.rows.epoch
        if self.rows.slots is not None and self.rows.slots.size:
            k, v = keys[:, :, 0], values[:, :, 0]
            if self.rows.live is not None:
                k, v = k[self.rows.live], v[self.rows.live]
            self.pool.write(self.layer, self.rows.slots, k.transpose(1, 0, 2), v.transpose(1, 0, 2))
        return keys, values

    def make_mask(self, N: int, *args: Any, **kwargs: Any) -> None:
        """No mask: each row attends over its own pages only. One token a row: a paged batch decodes."""
        if N != 1 or kwargs.get("window_size") is not None:
            raise PageStateError(f"a paged batch decodes one token a row with no window, not {N}")
        return None

    @property
    def state(self) -> list:
        return []  # nothing of its own to evaluate: the pools are the sessions'

    def is_trimmable(self) -> bool:
        return False

    def size(self) -> int:
        return int(self.rows.held.max()) if len(self.rows) else 0

    def empty(self) -> bool:
        return not self.rows.held.any()

    @property
    def nbytes(self) -> int:
        return 0  # the pages are counted by the pool (kv/paging.Pages.status), once

    def filter(self, keep: list[int]) -> None:
        if self._leads():
            self.rows._filter(keep)
        self.epoch = self.rows.epoch

    def extend(self, other: PagedBatchKVCache) -> None:
        if not isinstance(other, PagedBatchKVCache):
            raise PageStateError(f"a paged batch extends with paged rows, not {type(other).__name__}")
        if self._leads():
            self.rows._extend(other.rows)
        self.epoch = self.rows.epoch

    def extract(self, i: int) -> PagedKVCache:
        """Row i's layer as its session's own cache (its pages: nothing copied); the row stays until
        `PagedRows.vacate`."""
        session = self.rows.sessions[i]
        if session is None:
            raise PageStateError(f"row {i} of the batch is dead: it has no cache")
        _release(session)
        return PagedKVCache(session, self.layer)


def takes(cache: list | None) -> PagedSession | None:
    """The session of a cache that decodes in a paged batch: every layer paged, all at its table's length
    (a cuttable model's whole cache); else None."""
    if not cache or not all(isinstance(c, PagedKVCache) for c in cache):
        return None
    session = cache[0].session
    if any(c.session is not session for c in cache) or any(o != session.tokens for o in session.offsets):
        return None
    return session


def in_pages(caches: list) -> bool:
    """Whether a batch's layer caches are a paged batch's."""
    return bool(caches) and isinstance(caches[0], PagedBatchKVCache)


def merged(caches: list[list]) -> list[PagedBatchKVCache]:
    """A new batch's layers over the rows' caches (each one `takes`), in row order: no KV moved."""
    sessions = [takes(c) for c in caches]
    if any(s is None for s in sessions) or len({id(s.pool) for s in sessions}) != 1:
        raise PageStateError("a paged batch takes caches paged whole, in one pool")
    rows = PagedRows(sessions[0].pool, sessions)
    return [PagedBatchKVCache(rows, layer) for layer in range(len(caches[0]))]


def dead(like: list[PagedBatchKVCache], n: int) -> list[PagedBatchKVCache]:
    """`n` dead rows to extend the paged batch whose layers are `like`."""
    rows = PagedRows(like[0].pool, [None] * n)
    return [PagedBatchKVCache(rows, c.layer) for c in like]
