"""Sliding-window layers' K and V stored by token in blocks, so a restore point over them is a marker.

A token's K and V in a sliding-window layer depend only on the tokens before it,
as in a global layer; only the ring buffer that holds them forgets. So the rows
a ring holds at a restore point can be stored in the blocks of their tokens,
named as a cuttable unit's are (`{unit}.keys`, `{unit}.values`: [batch,
kv_heads, block_tokens, head_dim]), and the point keeps, for that unit, only
its ring's meta state and where its rows lie:

    {unit}.ring             int64 [offset, _idx, keep, max_size]   as in a point that holds its ring
    {unit}.rows_in_blocks   int64 [first_token, rows]              the ring's rows: tokens [first, first + rows)

A hit rebuilds the ring from those tokens' rows in token order, which is the
ring `points.compact_rings` stores (`_idx` = rows, `max_size` rows once the
window is full): the same arrays, so a hit through a marker is as exact as one
through a point holding the ring. docs/decisions.md, "Restore points (issue
52)", "Sliding-window rows in blocks", says why and what is left.

Only rings with `keep` = 0 (Gemma's) held in token order (grown by a prefill
chunk, or rotated all the way round), of a window no shorter than a block,
become markers (a shorter window's ring is smaller than the block rows that
would replace it); any other ring, and a window whose blocks the store holds
without rows, keep the whole ring in the point as before. Blocks without rows (a store written before, or blocks out of
every point's window) are read as they always were: their readers ignore
window rows they find (restore_buffers.Buffers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx
import numpy as np

from kvwake.daemon.kv import cache_blocks
from kvwake.daemon.kv.cache_blocks import Deferred, StateMismatchError
from kvwake.store.format.codec import DTYPES, Tensor
from kvwake.store.format.planes import join_into, scratch

__all__ = ["MARK", "Held", "WindowRun", "WindowSpan", "assemble", "blocks_of", "carries_rows", "defer_rows", "first_held",
           "held_blocks", "marked_blocks", "marker", "span_rows", "spans", "token_rows", "window_names", "worth_it"]

MARK = "rows_in_blocks"  # a point's name, after its unit's, for a ring whose rows are in the blocks


class WindowSpan:
    """Where one ring's rows lie at a point: the unit, its tokens [first, first + rows), and the ring."""

    __slots__ = ("name", "first", "rows", "ring")

    def __init__(self, name: str, first: int, rows: int, ring: Any) -> None:
        self.name, self.first, self.rows, self.ring = name, first, rows, ring


def window_names(cache: list) -> frozenset[str]:
    """The names window rows take in a block of this model (the rotating units' keys and values)."""
    return frozenset(f"{name}.{part}" for name, _, _, c in cache_blocks.units(cache)
                     if cache_blocks.kind_of(c, name) == "rotating" for part in ("keys", "values"))


def token_rows(c: Any) -> tuple[int, int] | None:
    """(first token, rows) a ring holds in token order (row r: token first + r), or None when it does not:
    `keep` set, rotated part way, or step-allocated rows past its tokens (mlx-lm's in-place growth)."""
    if c.keys is None or c.keep or c._idx != c.keys.shape[2]:
        return None
    rows = c.keys.shape[2]
    if rows < c.max_size and rows != c.offset:  # a ring not yet full holds every token since the first
        return None
    return c.offset - rows, rows


def spans(cache: list, position: int, block_tokens: int) -> list[WindowSpan] | None:
    """Where each ring's kept rows lie when the cache stands at `position` (a block boundary), or None when
    a ring cannot be a marker there: not in token order, or not holding every row of the blocks its kept
    rows start in (a block carries all of its tokens' rows)."""
    out = []
    for name, _, _, c in cache_blocks.units(cache):
        if cache_blocks.kind_of(c, name) != "rotating":
            continue
        held = token_rows(c)
        if held is None or c.offset != position:
            return None
        kept = min(position, c.max_size)  # the rows compact_rings keeps: the ring's next update reads no more
        first = position - kept
        if first // block_tokens * block_tokens < held[0]:
            return None
        out.append(WindowSpan(name, first, kept, c))
    return out or None


def _ring_order(c: Any) -> tuple[int, int, int] | None:
    """(first token, rows, row of the first token) a ring holds in token order from that row on, wrapping
    round; None when it holds none or is not one read here (`keep` set). Unlike `token_rows`, a ring rotated by
    decoding counts: its oldest row is at `_idx` (a sleep's ring)."""
    if c.keys is None or c.keep:
        return None
    n, idx = c.keys.shape[2], c._idx
    if idx == n or idx == c.offset:  # in token order: rows [0, idx) are tokens [offset - idx, offset)
        if idx < c.max_size and idx != c.offset:  # not full, yet not every token since the first
            return None
        return c.offset - idx, idx, 0
    if n == c.max_size and idx < c.offset:  # rotated: rows [idx, n) then [0, idx), in token order
        return c.offset - n, n, idx
    return None


def _ring_rows(c: Any, start: int, stop: int) -> tuple[mx.array, mx.array] | None:
    """Lazy keys and values of tokens [start, stop) as a ring holds them, in token order, or None when it
    does not hold them all."""
    order = _ring_order(c)
    if order is None or start < order[0] or stop > order[0] + order[1]:
        return None
    n = c.keys.shape[2]
    lo = (order[2] + start - order[0]) % n
    hi = lo + stop - start

    def cut(a: mx.array) -> mx.array:
        return a[..., lo:hi, :] if hi <= n else mx.concatenate([a[..., lo:, :], a[..., : hi - n, :]], axis=2)
    return cut(c.keys), cut(c.values)


def first_held(cache: list, block_tokens: int) -> int | None:
    """The first block whose rows every ring of a window no shorter than a block holds (through the cache's
    end), or None when a ring holds none or is not one `_ring_rows` reads."""
    firsts = []
    for name, _, _, c in cache_blocks.units(cache):
        if cache_blocks.kind_of(c, name) != "rotating":
            continue
        order = _ring_order(c) if c.max_size >= block_tokens else None
        if order is None:
            return None
        firsts.append(-(-order[0] // block_tokens))
    return max(firsts) if firsts else None


def span_rows(cache: list, first: int, count: int, block_tokens: int) -> dict[str, mx.array]:
    """Lazy window rows of blocks [first, first + count), named as a block's (`{unit}.keys`, `.values`), for a
    writer to store beside the plain layers' KV (a sleep's, a warm's: pipeline.defer_blocks); empty when a
    ring does not hold them all or its window is shorter than a block (`worth_it`)."""
    out: dict[str, mx.array] = {}
    for name, _, _, c in cache_blocks.units(cache):
        if cache_blocks.kind_of(c, name) != "rotating":
            continue
        rows = _ring_rows(c, first * block_tokens, (first + count) * block_tokens) \
            if c.max_size >= block_tokens else None
        if rows is None:
            return {}
        out[f"{name}.keys"], out[f"{name}.values"] = rows
    return out


def held_blocks(cache: list, block_tokens: int) -> tuple[list[WindowSpan], list[int]]:
    """Every ring's rows as held in token order, and the blocks whose rows all of them hold whole (none when
    a ring is not in token order): what a prefill chunk leaves that a later one forgets."""
    window = []
    for name, _, _, c in cache_blocks.units(cache):
        if cache_blocks.kind_of(c, name) == "rotating":
            held = token_rows(c)
            if held is None:
                return [], []
            window.append(WindowSpan(name, held[0], held[1], c))
    if not window:
        return [], []
    lo = max(-(-s.first // block_tokens) for s in window)
    hi = min((s.first + s.rows) // block_tokens for s in window)
    return window, list(range(lo, hi))


def worth_it(window: list[WindowSpan], block_tokens: int) -> bool:
    """Whether the blocks' rows cost less than the rings they replace: not for a window shorter than a
    block (a block carries all its tokens' rows, a point only the window's)."""
    return all(s.ring.max_size >= block_tokens for s in window)


def blocks_of(window: list[WindowSpan], block_tokens: int) -> list[int]:
    """The blocks that hold the rows of every span, in order."""
    first = min(s.first for s in window) // block_tokens
    last = max(s.first + s.rows for s in window) // block_tokens
    return list(range(first, last))


def defer_rows(window: list[WindowSpan], blocks: list[int], block_tokens: int) -> Deferred:
    """Engine thread: the rings' rows of `blocks`, copied (the cache goes on growing), deferred: `host()` gives
    {block: {"{unit}.keys": Tensor, "{unit}.values": Tensor}}. One copy per dtype and shape, the slices
    stacked, as cache_blocks copies blocks: on CUDA each copy is a host allocation and a transfer of its own."""
    lazy: dict[tuple[int, str], mx.array] = {}
    bf16: set[tuple[int, str]] = set()  # moved as their uint16 bits (numpy has no bfloat16)
    for k in blocks:
        for s in window:
            start = k * block_tokens - (s.ring.offset - s.ring.keys.shape[2])  # the ring's row of token k * B
            for part in ("keys", "values"):
                a = getattr(s.ring, part)[..., start : start + block_tokens, :]
                if a.dtype == mx.bfloat16:
                    a = a.view(mx.uint16)
                    bf16.add((k, f"{s.name}.{part}"))
                lazy[k, f"{s.name}.{part}"] = a
    kinds: dict[tuple, list[tuple[int, str]]] = {}
    for key, a in lazy.items():
        kinds.setdefault((a.dtype, tuple(a.shape)), []).append(key)
    groups = list(kinds.values())

    def make(host: list[np.ndarray]) -> dict[int, dict[str, Tensor]]:
        out: dict[int, dict[str, Tensor]] = {k: {} for k in blocks}
        for group, h in zip(groups, host):
            for i, (k, name) in enumerate(group):  # views of the stacked copy, which nothing else holds
                out[k][name] = Tensor("BF16", h[i]) if (k, name) in bf16 else Tensor.of(h[i])
        return out

    return Deferred([mx.stack([lazy[key] for key in group]) for group in groups], make)


def marker(point: dict[str, Tensor], window: list[WindowSpan]) -> dict[str, Tensor]:
    """The point with each span's ring rows left to the blocks: its keys and values out, its span in."""
    out = dict(point)
    for s in window:
        offset, idx, _, max_size = (int(x) for x in point[f"{s.name}.ring"].array)
        if idx != s.rows or offset != s.first + s.rows:  # the ring compact_rings kept is not these rows
            raise StateMismatchError(f"{s.name}: a ring of {idx} rows at {offset} is not tokens "
                                     f"[{s.first}, {s.first + s.rows})")
        out.pop(f"{s.name}.keys", None)
        out.pop(f"{s.name}.values", None)
        out[f"{s.name}.{MARK}"] = Tensor.of(np.array([s.first, s.rows], dtype=np.int64))
    return out


def carries_rows(names: Mapping[str, Any] | frozenset[str], wanted: frozenset[str]) -> bool:
    """Whether a block's tensors (names or specs) hold every window row this model's points need."""
    return wanted <= set(names)


def marked_blocks(point: Mapping[str, Tensor], block_tokens: int) -> set[int]:
    """The blocks whose rows a marker point's rings are joined from (none for a point holding its rings)."""
    out: set[int] = set()
    for name, t in point.items():
        if name.endswith("." + MARK):
            first, rows = (int(x) for x in t.array)
            out.update(range(first // block_tokens, -(-(first + rows) // block_tokens)))
    return out


class Held:
    """A marker point's window rows as a restore decodes its blocks [first, first + count): into one host
    array per name (`where`), so that a ring whose rows start on a block is joined with no copy (`span`);
    rows a block decoded elsewhere (its specs not these) are kept as they came (`took`). A block the RAM
    tier gave holds none: `rows_of` says so, and the caller reads its file. `host`: False for a staged
    restore's (kv/window_stage.py), which places nothing on the host."""

    staged = False  # rows staged as their runs hold them, joined on the device (kv/window_stage.py)

    def __init__(self, first: int, count: int, block_tokens: int, names: frozenset[str],
                 specs: Mapping[str, tuple[str, tuple[int, ...]]], host: bool = True) -> None:
        self.first, self.count, self.b = first, count, block_tokens
        self.names = names
        self.dtypes = {n: specs[n][0] for n in names if n in specs}
        self.arrays = {n: np.empty((*specs[n][1][:-2], count * block_tokens, specs[n][1][-1]), DTYPES[d][0])
                       for n, d in self.dtypes.items()} if host and len(self.dtypes) == len(names) else {}
        self._placed: dict[tuple[str, int], np.ndarray] = {}
        self.filled: set[int] = set()  # blocks whose rows went where `where` said
        self.rows: dict[int, dict[str, Tensor]] = {}  # blocks whose rows came otherwise

    def where(self, name: str, start: int) -> np.ndarray | None:
        k = start // self.b - self.first
        if name not in self.arrays or not 0 <= k < self.count:
            return None
        self._placed[name, k] = view = self.arrays[name][..., k * self.b : (k + 1) * self.b, :]
        return view

    def took(self, arrays: Mapping[str, Tensor], start: int) -> None:
        """After block start // B decoded (a pool thread): where its window rows are, if it has them."""
        k = start // self.b - self.first
        if not 0 <= k < self.count or not self.names <= set(arrays):
            return
        if all(arrays[n].array is self._placed.get((n, k)) for n in self.names):
            self.filled.add(k)
        else:
            self.rows[k] = {n: arrays[n] for n in self.names}

    def rows_of(self, block: int) -> Mapping[str, Tensor] | None:
        k = block - self.first
        if k in self.filled:
            return {n: Tensor(self.dtypes[n], a[..., k * self.b : (k + 1) * self.b, :]) for n, a in self.arrays.items()}
        return self.rows.get(k)

    def span(self, name: str, lo: int, hi: int) -> Tensor | None:
        """Blocks lo .. hi - 1's rows of `name` as one array, when they all went where `where` said."""
        if name not in self.arrays or not set(range(lo - self.first, hi - self.first)) <= self.filled:
            return None
        a = self.arrays[name][..., (lo - self.first) * self.b : (hi - self.first) * self.b, :]
        return Tensor(self.dtypes[name], a)


def assemble(point: dict[str, Tensor], block_tokens: int, rows_of: Callable[[int], Mapping[str, Tensor]],
             span_of: Callable[[str, int, int], Tensor | None] = lambda name, lo, hi: None) -> dict[str, Tensor]:
    """A marker point made whole: each marked ring's keys and values joined, in token order, from the rows
    `rows_of(k)` gives for block k (a block's tensors), or taken whole from `span_of(name, lo, hi)` where it
    has them. A point with no marker is returned as it is.
    Raises StateMismatchError, naming the block and the unit, when a block lacks the rows."""
    marked = {name[: -len(MARK) - 1]: name for name in point if name.endswith("." + MARK)}
    if not marked:
        return point
    out, blocks = dict(point), {}
    for unit, name in marked.items():
        first, rows = (int(x) for x in out.pop(name).array)
        lo, hi = first // block_tokens, -(-(first + rows) // block_tokens)
        start = first - lo * block_tokens
        for part in ("keys", "values"):
            whole = span_of(f"{unit}.{part}", lo, hi)
            if whole is not None:
                out[f"{unit}.{part}"] = Tensor(whole.dtype, np.ascontiguousarray(whole.array[:, :, start : start + rows]))
                continue
            pieces = []
            for k in range(lo, hi):
                if k not in blocks:
                    blocks[k] = rows_of(k)
                t = blocks[k].get(f"{unit}.{part}")
                if t is None:
                    raise StateMismatchError(f"block {k} holds no rows of {unit}.{part} for the point's ring")
                pieces.append(t)
            if len({t.dtype for t in pieces}) != 1:
                raise StateMismatchError(f"{unit}.{part}: the blocks' rows are of dtypes {[t.dtype for t in pieces]}")
            joined = np.concatenate([t.array for t in pieces], axis=2)
            out[f"{unit}.{part}"] = Tensor(pieces[0].dtype, np.ascontiguousarray(joined[:, :, start : start + rows]))
    return out


class WindowRun:
    """A staged block whose run holds window rows after the plain tensors a restore stages (its `order`).

    The run's sections decode whole into this thread's scratch (`sections`: a planes run's byte planes, or a
    raw run's bytes); then `finish` (the same pool thread, before its next decode) copies the plain part of
    each section into the block's ring rows, the first values of each plane, and joins only the window rows
    a marker point wants (`Held.where`) on the host; a wake wants none and joins none. So the block's plain
    KV reaches the device as staged blocks' does, with the span, and the window rows cost their
    decompression and digest alone where nothing reads them.
    """

    __slots__ = ("names", "plain", "size", "shape", "rows", "planes", "sections")

    def __init__(self, names: tuple[str, ...], plain: int, dtype: str, shape: tuple[int, ...],
                 rows: list[np.ndarray], planes: bool) -> None:
        self.names, self.plain, self.shape, self.rows, self.planes = names, plain, shape, rows, planes
        self.size = DTYPES[dtype][0].itemsize
        values = plain + len(names) * math.prod(shape)
        buf = scratch(np.dtype(np.uint8), (self.size * values,), "window_run")
        self.sections = [buf[p * values : (p + 1) * values] for p in range(self.size)] if planes else [buf]

    @classmethod
    def of(cls, names: tuple[str, ...], order: tuple[str, ...], window: frozenset[str], dtype: str, values: int,
           shape: tuple[int, ...], rows: list[np.ndarray], planes: bool) -> WindowRun | None:
        """The run `names` of `values` values as the plain tensors `order` (each of `shape`, staged into
        `rows`) followed by window rows of the same shape; None when it is not that."""
        extra = names[len(order):]
        if names[: len(order)] != order or not extra or not set(extra) <= window:
            return None
        plain = len(order) * math.prod(shape)
        if values != plain + len(extra) * math.prod(shape) or len(rows) != (DTYPES[dtype][0].itemsize if planes else 1):
            return None
        return cls(extra, plain, dtype, shape, rows, planes)

    def finish(self, held: Held | None, start: int) -> dict[str, Tensor]:
        """The plain part into the ring's rows; the window rows `held` places, joined there (returned, as a
        decode returns placed tensors, for `Held.took`)."""
        cut = self.plain if self.planes else self.plain * self.size
        for row, section in zip(self.rows, self.sections):
            np.copyto(row, section[:cut])
        out: dict[str, Tensor] = {}
        if held is not None and held.staged:  # kept as planes for the device's join
            held.stage_run(start, self)  # type: ignore[attr-defined]
            return out
        if held is None or set(self.names) - set(held.arrays):
            return out  # nothing wants them (a wake), or they are not the rows a marker reads
        lo = self.plain
        for name in self.names:  # each at its own size, in the run's order
            n = held.arrays[name].size // held.count
            dest = held.where(name, start)
            if dest is not None:
                if self.planes:
                    # staged planes are format 4's whatever the block's format (codec.Stage): never rotated
                    join_into([s[lo : lo + n] for s in self.sections], False, dest.view(f"<u{self.size}"))
                else:
                    np.copyto(dest, self.sections[0][lo * self.size : (lo + n) * self.size].view(dest.dtype)
                              .reshape(dest.shape))
                out[name] = Tensor(held.dtypes[name], dest)
            lo += n
        if lo != self.plain + len(self.names) * math.prod(self.shape):
            raise StateMismatchError(f"block at token {start}: window rows of {lo - self.plain} values where the "
                                     f"run holds {len(self.names) * math.prod(self.shape)}")
        return out
