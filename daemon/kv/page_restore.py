"""A paged wake's blocks restored straight into pages (`--tune paged_kv`, a model whose every layer is plain KV).

A restore into contiguous buffers (kv/restore_buffers.py) holds the session's
KV whole while it runs, and `paged_cache.adopt` then copies it into pages.
`PageRestore` is that restore with the buffers gone: the decoders fill host
rows of a small ring (a few spans of blocks and one row for the partial
block), and as each span is in, the engine thread writes it into pages it
takes for it (`join_span`), so the ring's rows take a later span. `finish`
writes the partial block, places the restore's pages after the prefix it
mapped (`PagePool.splice`), and publishes the blocks under their chain keys
as the store's bytes, as `adopt` did. Pages are taken as spans land (what the
wake holds is counted by pages from its first span), and a restore given up
gives its pages back (`release`).

Why a ring and not the pages themselves: a decoder runs on a pool thread while
the engine thread runs other sessions' steps, which write their tokens into
the same pool arrays. MLX updates an array in place only when nothing else
holds its buffer: a decoder's numpy view of a pool (a bfloat16 one through
`view(mx.uint16)`) would make every such write copy the whole layer; and a
pool that grows, or a write that copies, puts the pool in a new buffer, so
bytes decoded into the old one would be lost (or land in freed memory). So the
pool is written on the engine thread only, and a read byte is still written
twice (decoder -> ring, ring -> page), but no buffer the session's size is
held, and the second write overlaps the decoding of later spans instead of
following all of it (docs/decisions.md, "Paged wakes straight into pages").
Direct (the CPU: the pool's memory is the host's), a span is copied into the
pages by numpy within the engine thread's job; staged (a GPU), the ring is the
pipeline's own staging (devplanes.Ring), and a span joined on the device goes
into pages (MLX's update) instead of into a piece kept until the end.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from kvwake.daemon.kv import paged_cache, restore_buffers
from kvwake.daemon.kv.cache_blocks import StateMismatchError, check_meta, take_ints
from kvwake.daemon.kv.pages import PagePool
from kvwake.store.format.codec import DTYPES

__all__ = ["ENABLED", "PageRestore", "finish", "make"]

# Off, a paged wake restores into contiguous buffers and `adopt` copies them into pages (the path this one
# replaced): bench/paged_wakes.py measures both in one run.
ENABLED = True
# A span of the CPU's ring: at most SPAN_BLOCKS blocks and SPAN_BYTES (one block at least); the engine thread
# writes a span into pages in one job. SLOTS spans decode at once. Staged, the pipeline's ring sizes them
# (devplanes.SPAN_BYTES, RING_SLOTS).
SPAN_BLOCKS = 16
SPAN_BYTES = 8 << 20
SLOTS = 3


def make(pool: PagePool | None, model: Any, sample: restore_buffers.Specs, sample_tokens: int, capacity: int,
         block_tokens: int, token_ids: list[int], bundle_hash: str, **options: Any) -> restore_buffers.Buffers:
    """Engine thread: a `PageRestore` into `pool` where the model's every layer is plain KV and `sample` holds it
    unquantized in the pool's dtype, else the contiguous `Buffers` (`options`: theirs)."""
    blank = make_prompt_cache(model)
    kv = [dtype for name, (dtype, _) in sample.items() if name.endswith((".keys", ".values", ".keys.0"))]
    fits = (ENABLED and pool is not None and all(type(c) is KVCache for c in blank)
            and pool.layout.layers == len(blank)
            and all(restore_buffers.MX_DTYPES.get(dtype) == pool.layout.dtype for dtype in kv))  # quantized parts: not KV dtypes
    if not fits:
        return restore_buffers.Buffers(model, sample, sample_tokens, capacity, block_tokens, **options)
    return PageRestore(pool, token_ids, bundle_hash, model, sample, sample_tokens, capacity, block_tokens, **options)


def finish(buffers: restore_buffers.Buffers, n_tokens: int, tail: dict, prefix: list | None, token_ids: list[int],
           bundle_hash: str) -> list:
    """Engine thread: the restored cache, evaluated. `prefix`: a paged cache holding the first blocks (mapped, not
    read): a `PageRestore`'s pages go after its pages; contiguous buffers' tokens past it are moved into pages
    (`paged_cache.adopt`)."""
    if isinstance(buffers, PageRestore):
        return buffers.finish(n_tokens, tail, prefix)
    cache = buffers.finish(n_tokens, tail)
    if prefix is not None:
        cache = paged_cache.adopt(prefix[0].session.pool, cache, token_ids, bundle_hash, prefix=prefix)
    return cache


class _Rows:
    """One tensor's ring rows as `Buffers.views` are sliced (`[..., start:stop, :]` by the restore's tokens): a
    block's tokens map to its row (`PageRestore.row`)."""

    def __init__(self, owner: PageRestore, host: np.ndarray) -> None:
        self.owner, self.host, self.shape = owner, host, host.shape

    def __getitem__(self, key: tuple) -> np.ndarray:
        _, tokens, _ = key
        b = self.owner.block_tokens
        first = self.owner.row(tokens.start // b) * b + tokens.start % b
        return self.host[..., first : first + tokens.stop - tokens.start, :]


class PageRestore(restore_buffers.Buffers):
    """A restore (kv/restore_buffers.Buffers' protocol, as kv/pipeline.py drives it) whose KV goes into pages of
    `pool` (module docstring); `token_ids` and `bundle_hash` name its blocks' chain keys."""

    def __init__(self, pool: PagePool, token_ids: list[int], bundle_hash: str, model: Any,
                 sample: restore_buffers.Specs, sample_tokens: int, capacity: int, block_tokens: int,
                 **options: Any) -> None:
        super().__init__(model, sample, sample_tokens, capacity, block_tokens, **options)
        self.pool, self.token_ids, self.bundle_hash = pool, token_ids, bundle_hash
        self.n_full = capacity // block_tokens
        self.own: paged_cache.PagedSession | None = paged_cache.PagedSession(pool)  # pages taken as spans land
        self.head: list | None = None  # a plain prefix taken (`take_prefix`), in pages of its own
        blocks = options.get("n_blocks") or self.n_full
        if self.ring is not None:
            self._slots = self.ring.slots
        else:
            block_bytes = sum(math.prod(spec[1]) * DTYPES[spec[0]][0].itemsize
                              for name, spec in sample.items() if name in self.order)
            fit = SPAN_BYTES * sample_tokens // block_tokens // max(1, block_bytes)
            self.span = max(1, min(blocks, SPAN_BLOCKS, fit))
            self._slots = max(1, min(options.get("ring_slots") or SLOTS, -(-blocks // self.span)))
        self.ring_blocks = min(self._slots * self.span, blocks)  # rows of blocks; then one for the partial block
        self.buffers = {}  # the empty ones `_allocate` made
        for name in self.order:
            shape = (*sample[name][1][:-2], (self.ring_blocks + 1) * block_tokens, sample[name][1][-1])
            self.views[name] = _Rows(self, np.empty(shape, DTYPES[self.dtypes[name]][0]))

    def _allocate(self, name: str, dtype: str, shape: tuple[int, ...], tokens: int, rows: int) -> None:
        super()._allocate(name, dtype, shape, tokens, 0)  # checked, nothing the session's size: rows are the ring's

    @property
    def slots(self) -> int:
        return self._slots

    def row(self, k: int) -> int:
        """The ring row of block k (the partial block: the last row)."""
        if k >= self.n_full:
            return self.ring_blocks
        i = k - self.first
        return (i // self.span) % self._slots * self.span + i % self.span

    def leave_prefix(self, tokens: int) -> None:
        """The first `tokens` are mapped by the caller: nothing of theirs is allocated here."""
        self._check_prefix(tokens)
        self._prefix_taken(tokens)

    def take_prefix(self, prefix: list, tokens: int) -> None:
        """A plain cache's first `tokens`, written into pages of their own (placed before the restore's at `finish`)."""
        self._check_prefix(tokens)
        self.head = paged_cache.paged_cache(self.pool, [KVCache() for _ in prefix])
        for mine, theirs in zip(self.head, prefix, strict=True):
            if type(theirs) is not KVCache or theirs.offset < tokens:
                raise StateMismatchError(f"layer {mine.layer}: the prefix given is not {tokens} tokens of plain KV")
            mine.extend(theirs.keys[..., :tokens, :], theirs.values[..., :tokens, :])
        mx.eval(paged_cache.state_arrays(self.head))
        self._prefix_taken(tokens)

    def join_span(self, first: int, count: int) -> None:
        """Engine thread, once blocks [first, first + count) are in: into pages taken for them, so their rows
        take a later span. Direct: copied on the host; staged: joined on the device (`Buffers.join_span`)."""
        if self.mode == "direct":
            self._copy(self.row(first) * self.block_tokens, count * self.block_tokens)
            return
        super().join_span(first, count)
        self._write([self.pieces[name].pop() for name in self.order])

    def _copy(self, row: int, tokens: int) -> None:
        """Direct (the pool's memory is the host's): ring rows [row, row + tokens) appended to the restore's
        pages by numpy, on the engine thread, where nothing else writes the pool meanwhile (faster than MLX's
        update here: docs/benchmarks.md, "Paged wakes straight into pages (h-pw)")."""
        slots = self.pool.reserve(self.own.name, tokens)
        where = slice(slots, slots + tokens) if isinstance(slots, int) else np.asarray(slots)
        for t, name in enumerate(self.order):
            pool = (self.pool.keys if t % 2 == 0 else self.pool.values)[t // 2]
            target = np.asarray(pool.view(mx.uint16) if pool.dtype == mx.bfloat16 else pool)
            target[:, where] = self.views[name].host[0, :, row : row + tokens]
            del target  # a view of the pool held on would keep MLX from updating it in place
        self.own.changed()

    def _write(self, parts: list[mx.array]) -> None:
        """Staged: device arrays (in `order`: each layer's keys, then values) appended to the restore's pages,
        evaluated."""
        slots = self.pool.reserve(self.own.name, parts[0].shape[-2])
        for layer in range(len(parts) // 2):
            self.pool.write(layer, slots, parts[2 * layer][0], parts[2 * layer + 1][0])
        mx.eval(self.pool.keys, self.pool.values)
        self.own.changed()

    def upload(self, n_tokens: int, budget_s: float | None = None) -> bool:
        """Nothing to lay out: every span went into pages as it was joined."""
        return True

    def finish(self, n_tokens: int, tail: dict | None, prefix: list | None = None) -> list:
        """Engine thread: the partial block into pages, the restore's pages after `prefix`'s (a paged cache
        holding the first blocks, or the plain prefix taken), its blocks published; the cache, evaluated."""
        rest = dict(tail or {})
        check_meta(rest, n_tokens, self.block_tokens)
        for unit in self.parts:
            (offset,) = take_ints(rest, f"{unit}.offset", 1)
            if offset != n_tokens:
                raise StateMismatchError(f"{unit}: tail says {offset} tokens, restore asked for {n_tokens}")
        if rest:
            raise StateMismatchError(f"tail holds arrays this model's cache has no place for: {sorted(rest)}")
        self._partial(n_tokens)
        head = prefix if prefix is not None else self.head
        held = head[0].session.tokens if head is not None else 0
        if held + self.own.tokens != n_tokens:
            raise StateMismatchError(f"{held} tokens mapped and {self.own.tokens} restored, not {n_tokens}")
        session = head[0].session if head is not None else self.own
        if head is not None:
            self.pool.splice(session.name, self.own.name)
        self.own = self.head = None
        session.offsets = [n_tokens] * len(session.offsets)
        session.changed()
        cache = head or [paged_cache.PagedKVCache(session, layer) for layer in range(len(session.offsets))]
        paged_cache.publish(cache, self.token_ids, self.bundle_hash, stored=True)
        mx.eval(paged_cache.state_arrays(cache))
        self.release()
        return cache

    def _partial(self, n_tokens: int) -> None:
        """The partial block into pages: from its row, or joined on the device where it was staged."""
        rest, row = n_tokens % self.block_tokens, self.row(self.n_full) * self.block_tokens
        joined = self._tail_join(n_tokens)
        if joined is not None:
            self._write(joined)
        elif rest and self.mode == "direct":
            self._copy(row, rest)
        elif rest:
            hosted = [mx.array(self.views[name].host[..., row : row + rest, :]) for name in self.order]
            self._write([a.view(restore_buffers.MX_DTYPES[self.dtypes[name]]) for a, name in zip(hosted, self.order)])

    def release(self) -> None:
        """Engine thread: `Buffers.release`, the ring's rows, and the pages of a restore given up."""
        if self.own is not None:
            self.pool.free_session(self.own.name)
            self.own = None
        if self.head is not None:
            self.pool.free_session(self.head[0].session.name)
            self.head = None
        super().release()
