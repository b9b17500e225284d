"""A page pool: the K and V of plain-attention layers in fixed-size pages, shared by chain key.

Layout. Every layer has one keys pool and one values pool, each shaped
[kv_heads, capacity * page_tokens, head_dim]: a page is `page_tokens`
consecutive token slots, page p holding slots p * page_tokens ..
(p + 1) * page_tokens - 1. Head-major, so one head's tokens of one page are a
contiguous run (what the decode kernel reads, paged_attention.py), and a
session's KV gathered by its slots is mlx-lm's own [kv_heads, tokens,
head_dim] for one row. Pools grow by doubling up to their limit (allocated
whole, an engine's budget would be taken and zeroed at its start); a write is
one update per layer and part (`write`).

Pages and sessions. A session's page table is the list of its pages in token
order; its last page may be partial. A page has a reference count: the number
of tables that list it. A block of the store (`block_tokens`, a whole number of
pages) is published under its chain key once a session has filled it; from then
on its pages are shared: a session whose prefix has that key maps them
(`map_shared`) instead of computing them, and two sessions that computed the
same block keep one copy (`publish` hands the later one the earlier one's
pages). Published pages are never written again: a session that writes into a
page that is published or listed by another table first copies it (copy on
write: `reserve`). A fork lists the same pages; a page goes back to the free list
when no table lists it, and its key is forgotten with it.

A block's key is the store's chain key of that block (store/format/keys.py), so
one string names a block on disk and its pages here.

Everything here runs on the engine thread (MLX's one thread); nothing locks. The
one call from elsewhere is `retire`: a table whose owner is gone (a finalizer,
kv/paged_cache.py) is queued, and the next call on the engine thread frees it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from kvwake.daemon.kv import cudart

__all__ = ["PageLayout", "PagePool", "PagePoolFullError", "PageStateError", "SessionPages", "Slots"]

Slots = int | mx.array  # where a write goes: the first of a run of slots, or each slot (int32)


class PagePoolFullError(MemoryError):
    """The pool has fewer free pages than an operation needs."""


class PageStateError(ValueError):
    """An operation does not fit the pages' state (unknown session, a partial page published, a key reused)."""


@dataclass(frozen=True)
class PageLayout:
    """The shape of every page: layers, KV heads, head size, dtype, and tokens per page (a divisor of the
    store's block)."""

    layers: int
    kv_heads: int
    head_dim: int
    page_tokens: int
    block_tokens: int
    dtype: mx.Dtype = mx.bfloat16

    def __post_init__(self) -> None:
        if self.page_tokens < 1 or self.block_tokens % self.page_tokens:
            raise ValueError(f"a page of {self.page_tokens} tokens does not divide a block of {self.block_tokens}")

    @property
    def pages_per_block(self) -> int:
        return self.block_tokens // self.page_tokens

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers, keys and values."""
        return 2 * self.layers * self.kv_heads * self.page_tokens * self.head_dim * self.dtype.size


@dataclass
class SessionPages:
    """A session's page table (page ids in token order) and how many tokens it holds."""

    pages: list[int] = field(default_factory=list)
    tokens: int = 0


class PagePool:
    """K and V pools of `capacity` pages for `layout`, with free list, reference counts and the chain-key
    map. With a `limit` above `capacity`, the pools grow, doubling, up to it when a reservation needs more
    pages: an engine's whole budget allocated at its start would take (and zero) memory no session uses yet."""

    def __init__(self, layout: PageLayout, capacity: int, limit: int | None = None) -> None:
        self.layout, self.limit, self.capacity = layout, max(capacity, limit or 0), 0
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.refs: list[int] = []
        self.free: list[int] = []  # a stack: popped from the end, page 0 first
        self._grow(capacity)
        self.sessions: dict[str, SessionPages] = {}
        self.shared: dict[str, tuple[int, ...]] = {}  # chain key -> its block's pages
        self.key_of: dict[int, str] = {}  # published page -> its block's chain key
        self.stored: set[str] = set()  # keys whose pages hold the store's bytes (a restore's), not a prefill's
        self.retired: deque[str] = deque()  # tables to free, queued from any thread (`retire`)
        self.grows, self.grow_s = 0, 0.0  # growths past the first allocation, and their time (copies included)

    # -- sessions --------------------------------------------------------------

    def open(self, session: str) -> SessionPages:
        """An empty page table for `session`."""
        self.drain()
        if session in self.sessions:
            raise PageStateError(f"session {session!r} already has a page table")
        table = self.sessions[session] = SessionPages()
        return table

    def table(self, session: str) -> SessionPages:
        try:
            return self.sessions[session]
        except KeyError:
            raise PageStateError(f"session {session!r} has no page table") from None

    def fork(self, source: str, session: str) -> SessionPages:
        """`session` lists the same pages as `source` (the partial last page too: whichever writes first
        copies it)."""
        src = self.table(source)
        table = self.open(session)
        table.pages, table.tokens = list(src.pages), src.tokens
        for page in table.pages:
            self.refs[page] += 1
        return table

    def splice(self, session: str, source: str) -> None:
        """`source`'s pages appended to `session`'s table, in order, and `source`'s table dropped: no page
        copied, no count changed (a restore's own pages placed after the prefix it mapped). `session` must
        hold whole pages."""
        table, moved = self.table(session), self.table(source)
        if table.tokens != len(table.pages) * self.layout.page_tokens:
            raise PageStateError(f"session {session!r} holds {table.tokens} tokens, not whole pages")
        table.pages += moved.pages
        table.tokens += moved.tokens
        del self.sessions[source]

    def retire(self, session: str) -> None:
        """Free `session`'s table at the pool's next call on the engine thread (safe from any thread: a
        finalizer may run wherever the last reference to a cache goes)."""
        self.retired.append(session)

    def drain(self) -> None:
        """Free the tables `retire` queued."""
        while self.retired:
            session = self.retired.popleft()
            if session in self.sessions:
                self.free_session(session)

    def free_session(self, session: str) -> None:
        """Drop `session`'s table; pages no other table lists go back to the free list."""
        for page in reversed(self.table(session).pages):  # the free stack gives them back in order: a run
            self._release(page)
        del self.sessions[session]

    def trim(self, session: str, tokens: int) -> None:
        """Keep the first `tokens` of `session` (a rewind): pages past them are released. A kept partial
        page that is shared stays shared until written (copied then)."""
        table = self.table(session)
        if not 0 <= tokens <= table.tokens:
            raise PageStateError(f"session {session!r} holds {table.tokens} tokens, cannot trim to {tokens}")
        keep = -(-tokens // self.layout.page_tokens)
        for page in reversed(table.pages[keep:]):
            self._release(page)
        del table.pages[keep:]
        table.tokens = tokens

    # -- writing ---------------------------------------------------------------

    def reserve(self, session: str, count: int) -> Slots:
        """Room for `count` more tokens of `session`: its partial last page copied first when it is not
        the session's alone, new pages taken as needed. Returns the new tokens' slots for `write`: the
        first, where they are one run (a decode step's token always is), else all of them (int32 [count]).
        Raises PagePoolFullError (nothing changed) when too few pages are free."""
        self.drain()
        table, p = self.table(session), self.layout.page_tokens
        partial = table.tokens % p
        needed = -(-(table.tokens + count) // p) - len(table.pages)
        copy = partial > 0 and count > 0 and not self._writable(table.pages[-1])
        if needed + copy > len(self.free) and self.capacity < self.limit:
            self._grow(min(self.limit, max(2 * self.capacity, self.capacity + needed + copy - len(self.free))))
        if needed + copy > len(self.free):
            raise PagePoolFullError(f"session {session!r} needs {needed + copy} pages for {count} tokens, "
                                    f"{len(self.free)} of {self.limit} are free")
        if copy:
            table.pages[-1] = self._copy(table.pages[-1], partial)
        for _ in range(needed):
            table.pages.append(self._take())
        start = table.tokens
        table.tokens += count
        first = self.run(table.pages, start, table.tokens)
        return first if first is not None else self.slots(table.pages, start, table.tokens)

    def write(self, layer: int, slots: Slots, keys: mx.array, values: mx.array) -> None:
        """Store one layer's new K and V ([kv_heads, n, head_dim]) at `slots` (from `reserve`): a run of n
        slots from the first (an update of a slice, cheaper than a scatter), or n slots (a batch's step: one
        slot a row). Those go by `put_along_axis`, one scatter along the slots: the same update written as
        `pool[:, slots] = keys` makes MLX build index arrays for the heads too (an arange and casts, each a kernel
        the host launches), at every layer's write of every decode step (docs/benchmarks.md, "Paged KV in the fleet,
        again")."""
        if isinstance(slots, int):
            slots = slice(slots, slots + keys.shape[1])
            self.keys[layer][:, slots] = keys
            self.values[layer][:, slots] = values
            return
        at = slots[None, :, None]
        self.keys[layer] = mx.put_along_axis(self.keys[layer], at, keys, axis=1)
        self.values[layer] = mx.put_along_axis(self.values[layer], at, values, axis=1)

    def append(self, session: str, keys: list[mx.array], values: list[mx.array]) -> None:
        """`reserve` and `write` for every layer: keys[l], values[l] are [kv_heads, n, head_dim]."""
        slots = self.reserve(session, keys[0].shape[1])
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.write(layer, slots, k, v)

    def run(self, pages: list[int], start: int, stop: int) -> int | None:
        """The first slot of tokens [start, stop) of a table listing `pages` when their pages follow one
        another in the pool (their slots one run), else None."""
        p = self.layout.page_tokens
        if stop <= start:
            return None
        first, last = start // p, (stop - 1) // p
        if any(pages[i + 1] != pages[i] + 1 for i in range(first, last)):
            return None
        return pages[first] * p + start % p

    def slots(self, pages: list[int], start: int, stop: int) -> mx.array:
        """The slots of tokens [start, stop) of a table listing `pages` (int32). Made on the host: the array
        holds its values, not an MLX operation, so any thread may use it (MLX evaluates an operation only on
        a thread that has its stream, and a cache's slots are kept)."""
        p = self.layout.page_tokens
        positions = np.arange(start, stop, dtype=np.int64)
        return mx.array((np.asarray(pages, np.int64)[positions // p] * p + positions % p).astype(np.int32))

    # -- sharing by chain key ---------------------------------------------------

    def publish(self, session: str, block: int, key: str, stored: bool = False) -> tuple[int, ...]:
        """Block `block` of `session` (filled) is the block whose chain key is `key`: its pages become
        shared and read-only. Where `key` already has pages (another session computed the same block),
        the session's table takes those and its own go back. `stored`: the pages hold the store's bytes
        (a restore's): they replace pages a prefill computed for the key (on a GPU a prefill of the same
        tokens may differ in the last bits, and a wake must give the stored bytes); the sessions that
        hold the computed ones keep them, unshared. Returns the block's pages."""
        table, n = self.table(session), self.layout.pages_per_block
        first = block * n
        if (block + 1) * self.layout.block_tokens > table.tokens:
            raise PageStateError(f"session {session!r} holds {table.tokens} tokens: block {block} is not full")
        own = tuple(table.pages[first:first + n])
        known = self.shared.get(key)
        if known is not None and stored and key not in self.stored and known != own:
            for page in known:  # a prefill's: kept by whoever holds them, no longer the key's
                del self.key_of[page]
            known = None
        if known is None:
            for page in own:
                if self.key_of.get(page, key) != key:
                    raise PageStateError(f"page {page} is published under another key than {key[:16]}")
            self.shared[key] = own
            self.key_of.update((page, key) for page in own)
            if stored:
                self.stored.add(key)
            return own
        if known != own:
            for page in known:
                self.refs[page] += 1
            for page in own:
                self._release(page)
            table.pages[first:first + n] = known
        return known

    def mark_stored(self, session: str, block: int, key: str) -> bool:
        """The store's block `key` was written from block `block` of `session`: where those pages are still the
        key's, they hold the store's bytes from now on (a wake may map them). Returns whether they are."""
        n = self.layout.pages_per_block
        own = tuple(self.table(session).pages[block * n:(block + 1) * n])
        if len(own) < n or self.shared.get(key) != own:
            return False
        self.stored.add(key)
        return True

    def stored_run(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, name blocks whose pages hold the store's bytes (a wake maps
        those and reads the rest)."""
        self.drain()
        return self.resident_run(keys)

    def resident_run(self, keys: list[str]) -> int:
        """`stored_run` without draining first: read from any thread (the room a wake needs, counted before it
        runs; a table that waits to be drained may still hold a page counted here)."""
        return next((i for i, key in enumerate(keys) if key not in self.stored or key not in self.shared), len(keys))

    def shared_run(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, name published blocks (`map_shared` would map them); read from any
        thread, without draining (the room a new session's prefix hit needs, counted before it runs)."""
        return next((i for i, key in enumerate(keys) if key not in self.shared), len(keys))

    def map_shared(self, session: str, keys: list[str]) -> int:
        """A prefix hit: append the pages of the blocks named by `keys`, in order, up to the first key no
        pages hold. `session` must hold whole blocks. Returns how many blocks were mapped."""
        self.drain()
        table = self.table(session)
        if table.tokens % self.layout.block_tokens or table.tokens != len(table.pages) * self.layout.page_tokens:
            raise PageStateError(f"session {session!r} holds {table.tokens} tokens, not whole blocks")
        mapped = 0
        for key in keys:
            pages = self.shared.get(key)
            if pages is None:
                break
            for page in pages:
                self.refs[page] += 1
            table.pages.extend(pages)
            table.tokens += self.layout.block_tokens
            mapped += 1
        return mapped

    # -- reading and accounting --------------------------------------------------

    def gather(self, session: str, layer: int) -> tuple[mx.array, mx.array]:
        """`session`'s K and V of `layer` as contiguous [kv_heads, tokens, head_dim] (copies)."""
        table = self.table(session)
        slots = self.slots(table.pages, 0, table.tokens)
        return self.keys[layer][:, slots], self.values[layer][:, slots]

    def pages_held(self) -> int:
        """Pages some table lists (a shared page once)."""
        self.drain()
        return self.capacity - len(self.free)

    def bytes_held(self) -> int:
        """Bytes of KV held: every page some table lists, a shared page once."""
        return self.pages_held() * self.layout.page_bytes

    def session_bytes(self, session: str) -> int:
        """Bytes of KV `session` lists, shared pages included (what it would hold alone)."""
        return len(self.table(session).pages) * self.layout.page_bytes

    def own_bytes(self, session: str) -> int:
        """Bytes of the pages only `session` lists: what freeing its table gives back."""
        refs = self.refs
        return sum(refs[p] == 1 for p in self.table(session).pages) * self.layout.page_bytes

    def share_bytes(self, session: str, layers: int | None = None) -> int:
        """`session`'s share of the bytes held: each page it lists split evenly among the tables listing it
        (rounded down), so the shares of all sessions add up to `bytes_held` (within a byte a page), a
        shared page counted once. `layers`: of that many layers' pages (default: all)."""
        page = self.layout.page_bytes // self.layout.layers * (self.layout.layers if layers is None else layers)
        return sum(page // self.refs[p] for p in self.table(session).pages)

    # -- pages -------------------------------------------------------------------

    def _writable(self, page: int) -> bool:
        """A page its one table may write into: listed once, never published."""
        return self.refs[page] == 1 and page not in self.key_of

    def _grow(self, capacity: int) -> None:
        """Pools of `capacity` pages, the pages held kept (each pool copied, as a KVCache's growth copies its
        buffer); the new pages go under the free ones, so pages freed before are taken first."""
        began = time.perf_counter()
        shape = (self.layout.kv_heads, (capacity - self.capacity) * self.layout.page_tokens, self.layout.head_dim)
        layers = range(self.layout.layers)
        if self.capacity == 0:
            self.keys = [mx.zeros(shape, self.layout.dtype) for _ in layers]
            self.values = [mx.zeros(shape, self.layout.dtype) for _ in layers]
        else:
            self.keys = [mx.concatenate([k, mx.zeros(shape, self.layout.dtype)], axis=1) for k in self.keys]
            self.values = [mx.concatenate([v, mx.zeros(shape, self.layout.dtype)], axis=1) for v in self.values]
        mx.eval(self.keys, self.values)
        if self.capacity:
            self.grows += 1
            self.grow_s += time.perf_counter() - began
        self.refs += [0] * (capacity - self.capacity)
        self.free[:0] = range(capacity - 1, self.capacity - 1, -1)
        self.capacity = capacity

    def _take(self) -> int:
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def _release(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            key = self.key_of.pop(page, None)
            if key is not None and page in self.shared.get(key, ()):  # the block is no longer whole
                del self.shared[key]
                self.stored.discard(key)
            self.free.append(page)

    def _copy(self, page: int, tokens: int) -> int:
        """A private copy of the first `tokens` of `page` (every layer), replacing one reference to it."""
        fresh = self._take()
        p = self.layout.page_tokens
        pools = (*self.keys, *self.values)
        # Gathered (a copy, never a view) and evaluated before the writes: a pool's update whose source is still
        # a pending read of that pool copies the whole pool instead of writing in place. On CUDA the gathers'
        # inputs, the pools, stay held by a stream's worker until it runs their finished tasks, with the same
        # effect (docs/decisions.md, "The paged default's CUDA failures, found"): `synchronize` returns once those
        # ran (MLX's CommandEncoder::synchronize waits for a completion handler queued after them), on this
        # thread's stream and on the decode steps' (mlx-lm's generation stream), whose pending reads hold them too
        rows = mx.arange(page * p, page * p + tokens, dtype=mx.int32)
        sources = [pool[:, rows] for pool in pools]
        mx.eval(sources)
        if cudart.on_cuda():
            from mlx_lm.generate import generation_stream

            mx.synchronize()
            mx.synchronize(generation_stream)
        for pool, source in zip(pools, sources, strict=True):
            pool[:, fresh * p:fresh * p + tokens] = source
        self._release(page)
        return fresh
