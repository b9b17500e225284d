"""Capture an mlx-lm prompt cache as store blocks plus a tail, and restore it exactly.

A prompt cache is the list `make_prompt_cache(model)` returns, one cache object
per layer. A `CacheList` layer holds several caches; each leaf cache is a
*unit*, named `layers.{i}` (a plain layer) or `layers.{i}.{j}` (member j of the
CacheList at layer i). Units of the kinds "kv", "concat_kv" and "quantized_kv"
can be cut by token: block k holds tokens [k*B, (k+1)*B) of every such unit.
Everything else (ring buffers, recurrent state, chunked attention) is whole in
the tail. Arrays travel as `kvwake.store.codec.Tensor`; bf16 is moved bit for
bit as "BF16" (a uint16 view), never through a float conversion.

Array names, in blocks and (for tokens [n_full*B, n), absent when n % B == 0) in the tail:

    {unit}.keys, {unit}.values      [batch, kv_heads, tokens, head_dim]      kv, concat_kv
    {unit}.keys.0, .keys.1, .keys.2 packed data (U32), scales, biases,       quantized_kv
    {unit}.values.0, .1, .2           each [batch, kv_heads, tokens, ...]
    {unit}.quant                    int32 [group_size, bits]                 quantized_kv

In the tail only:

    meta                            int64 [STATE_FORMAT, n_tokens, block_tokens]
    {unit}.offset                   int64 [offset]                           cuttable units
    {unit}.keys, {unit}.values      the ring buffer exactly as held          rotating
    {unit}.ring                     int64 [offset, _idx, keep, max_size]     rotating
    {unit}.keys, {unit}.values      rows [0, offset - start_position)        chunked
    {unit}.chunk                    int64 [offset, start_position, chunk_size]  chunked
    {unit}.arrays.{k}               state array k when not None (conv, ssm)  arrays
    {unit}.left_padding, .lengths   when set (batched generation only)       arrays

Restore starts from `make_prompt_cache(model)`; a KVCache slot whose slices
are quantized becomes a QuantizedKVCache (the daemon may quantize KV). Cuttable
buffers are allocated as mlx-lm allocates them after one prefill (a multiple of
256 rows); a captured buffer grown by uneven chunks may have held more rows,
but only rows [0, offset) are ever read, and the tests show the logits equal.
Written for mlx-lm 0.32 (its cache `state` layouts changed between 0.31 and
0.32); cache classes it does not know raise UnsupportedCacheError.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from kvwake.store.codec import Tensor

__all__ = [
    "STATE_FORMAT",
    "NotCuttableError",
    "StateMismatchError",
    "UnsupportedCacheError",
    "cache_nbytes",
    "capture_block",
    "capture_tail",
    "cuttable",
    "layout",
    "restore",
    "restore_prefix",
]

STATE_FORMAT = 1  # version of the naming scheme above; stored in the tail's "meta"
_KINDS = {KVCache: "kv", ConcatenateKVCache: "concat_kv", QuantizedKVCache: "quantized_kv",
          RotatingKVCache: "rotating", ArraysCache: "arrays", ChunkedKVCache: "chunked", CacheList: "cache_list"}
_CUTTABLE = {"kv", "concat_kv", "quantized_kv"}
_STRUCTURE = {"quantized_kv": ("bits", "group_size"), "rotating": ("max_size", "keep"), "chunked": ("chunk_size",)}
_QPARTS = ("keys.0", "keys.1", "keys.2", "values.0", "values.1", "values.2")


class StateMismatchError(ValueError):
    """Arrays that do not fit the model's cache (or the state they claim to be)."""


class UnsupportedCacheError(TypeError):
    """A cache class this module does not know how to capture exactly."""


class NotCuttableError(ValueError):
    """A prefix restore asked of a model whose cache cannot be cut by token."""


# -- small parts: kinds, units, array conversion ----------------------------


def _kind(c: Any, where: str) -> str:
    # Exact type, not isinstance: a subclass may keep state we would silently drop.
    kind = _KINDS.get(type(c))
    if kind is None:
        raise UnsupportedCacheError(f"{where}: cache class {type(c).__module__}.{type(c).__name__} is not supported")
    return kind


def _units(cache: list) -> list[tuple[str, int, int | None, Any]]:
    """(name, layer, member or None, leaf cache) for every leaf cache, in order."""
    out = []
    for i, c in enumerate(cache):
        if _kind(c, f"layers.{i}") != "cache_list":
            out.append((f"layers.{i}", i, None, c))
            continue
        for j, member in enumerate(c.caches):
            if _kind(member, f"layers.{i}.{j}") == "cache_list":
                raise UnsupportedCacheError(f"layers.{i}.{j}: nested CacheList is not supported")
            out.append((f"layers.{i}.{j}", i, j, member))
    return out


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _tensor(a: mx.array) -> Tensor:
    # np.array copies just the (possibly strided) slice: nothing else is materialized.
    if a.dtype == mx.bfloat16:
        return Tensor("BF16", np.ascontiguousarray(np.array(a.view(mx.uint16))))
    return Tensor.of(np.array(a))


def _array(t: Tensor) -> mx.array:
    a = mx.array(t.array)
    return a.view(mx.bfloat16) if t.dtype == "BF16" else a


def _ints(*values: int, dtype: type = np.int64) -> Tensor:
    return Tensor.of(np.array(values, dtype=dtype))


def _take_ints(arrays: dict[str, Tensor], name: str, n: int) -> list[int]:
    t = arrays.pop(name, None)
    if t is None or t.array.shape != (n,) or t.array.dtype.kind not in "iu":
        found = None if t is None else f"{t.dtype}{list(t.array.shape)}"
        raise StateMismatchError(f"{name}: expected {n} integers, found {found}")
    return [int(x) for x in t.array]


# -- layout ------------------------------------------------------------------


def _shape_facts(kind: str, c: Any) -> dict[str, Any]:
    """Heads, head dims and dtype read from a cache that holds arrays (None where empty)."""
    if kind == "arrays":
        return {"arrays": [None if a is None else {"shape": list(a.shape), "dtype": _dtype_name(a.dtype)}
                           for a in c.cache] if not c.empty() else None}
    if c.keys is None:
        return {"kv_heads": None, "k_head_dim": None, "v_head_dim": None, "dtype": None}
    if kind == "quantized_kv":  # head dim = scale groups x group size; dtype is the scales'
        (kd, ks, _), (_, vs, _) = c.keys, c.values
        return {"kv_heads": kd.shape[1], "k_head_dim": ks.shape[-1] * c.group_size,
                "v_head_dim": vs.shape[-1] * c.group_size, "dtype": _dtype_name(ks.dtype)}
    return {"kv_heads": c.keys.shape[1], "k_head_dim": c.keys.shape[-1],
            "v_head_dim": c.values.shape[-1], "dtype": _dtype_name(c.keys.dtype)}


def _describe(c: Any, where: str, probed: Any | None) -> dict[str, Any]:
    kind = _kind(c, where)
    if kind == "cache_list":
        members = [_describe(m, f"{where}.{j}", probed.caches[j] if probed is not None else None)
                   for j, m in enumerate(c.caches)]
        return {"kind": kind, "cuttable": all(m["cuttable"] for m in members), "caches": members}
    entry: dict[str, Any] = {"kind": kind, "cuttable": kind in _CUTTABLE}
    entry.update({p: getattr(c, p) for p in _STRUCTURE.get(kind, ())})
    if kind == "arrays":
        entry["size"] = len(c.cache)
    if probed is None:  # shapes are unknowable before a token has gone through the model
        entry.update({k: None for k in _shape_facts(kind, _blank(c))})
    else:
        entry.update(_shape_facts(kind, probed))
    return entry


def _blank(c: Any) -> Any:
    """An empty cache of the same kind and structural parameters as c."""
    kind = _kind(c, "cache")
    return {"kv": lambda: KVCache(), "concat_kv": lambda: ConcatenateKVCache(),
            "quantized_kv": lambda: QuantizedKVCache(group_size=c.group_size, bits=c.bits),
            "rotating": lambda: RotatingKVCache(max_size=c.max_size, keep=c.keep),
            "arrays": lambda: ArraysCache(len(c.cache)), "chunked": lambda: ChunkedKVCache(c.chunk_size),
            "cache_list": lambda: CacheList(*(_blank(m) for m in c.caches))}[kind]()


def layout(cache: list, *, model: Any | None = None) -> list[dict]:
    """One JSON-able dict per layer: kind, cuttable, structural parameters, shape facts.

    Kinds: "kv", "concat_kv", "quantized_kv" (+ bits, group_size), "rotating"
    (+ max_size, keep), "chunked" (+ chunk_size), "arrays" (+ size, and
    "arrays": per-entry {shape, dtype} or None), "cache_list" (+ "caches": the
    members' dicts). Shape facts (kv_heads, k_head_dim, v_head_dim, dtype) are
    None unless `model` is given: they cannot be read from an empty cache, so
    they come from one lazy, never-evaluated forward pass of token 0 through
    empty caches of the same kinds. The cache's own arrays are never read, so
    the result does not depend on how many tokens it has processed.
    Raises UnsupportedCacheError for unknown cache classes.
    """
    probe = None
    if model is not None:
        probe = [_blank(c) for c in cache]
        model(mx.array([[0]], dtype=mx.int32), cache=probe)  # lazy: shapes without compute, never evaluated
    return [_describe(c, f"layers.{i}", probe[i] if probe is not None else None) for i, c in enumerate(cache)]


def cuttable(cache: list) -> bool:
    """True when every unit can be cut by token, so a stored prefix can start a new cache."""
    return all(_kind(c, name) in _CUTTABLE for name, _, _, c in _units(cache))


def cache_nbytes(cache: list) -> int:
    """Bytes the cache's arrays hold now, step-allocated buffers included (what memory budgets see)."""
    return sum(c.nbytes for _, _, _, c in _units(cache))


# -- capture -----------------------------------------------------------------


def _cut(name: str, c: Any, start: int, stop: int) -> dict[str, Tensor]:
    """Tokens [start, stop) of one cuttable unit; only that slice is materialized."""
    if stop > c.offset:
        raise StateMismatchError(f"{name}: tokens [{start}, {stop}) asked, the cache holds {c.offset}")
    if isinstance(c, QuantizedKVCache):
        out = {f"{name}.{part}.{k}": _tensor(a[..., start:stop, :])
               for part in ("keys", "values") for k, a in enumerate(getattr(c, part))}
        out[f"{name}.quant"] = _ints(c.group_size, c.bits, dtype=np.int32)
        return out
    return {f"{name}.keys": _tensor(c.keys[..., start:stop, :]), f"{name}.values": _tensor(c.values[..., start:stop, :])}


def capture_block(cache: list, index: int, block_tokens: int) -> dict[str, Tensor]:
    """Tokens [index*B, (index+1)*B) of every cuttable unit (names in the module docstring).

    Non-cuttable units contribute nothing. Materializes only this block's
    slices. Raises StateMismatchError if the cache holds fewer tokens.
    """
    start, stop = index * block_tokens, (index + 1) * block_tokens
    out: dict[str, Tensor] = {}
    for name, _, _, c in _units(cache):
        if _kind(c, name) in _CUTTABLE:
            out.update(_cut(name, c, start, stop))
    return out


def _whole(name: str, kind: str, c: Any) -> dict[str, Tensor]:
    """The whole state of one non-cuttable unit, meta state as small int arrays."""
    out: dict[str, Tensor] = {}
    if kind == "rotating":
        out[f"{name}.ring"] = _ints(c.offset, c._idx, c.keep, c.max_size)
        if c.keys is not None:  # the ring as held: capacity and rotation both matter
            out.update({f"{name}.keys": _tensor(c.keys), f"{name}.values": _tensor(c.values)})
    elif kind == "chunked":
        out[f"{name}.chunk"] = _ints(c.offset, c.start_position, c.chunk_size)
        if c.keys is not None:
            k, v = c.keys_and_values()
            out.update({f"{name}.keys": _tensor(k), f"{name}.values": _tensor(v)})
    else:  # arrays
        out.update({f"{name}.arrays.{k}": _tensor(a) for k, a in enumerate(c.cache) if a is not None})
        for attr in ("left_padding", "lengths"):
            if getattr(c, attr) is not None:
                out[f"{name}.{attr}"] = _tensor(getattr(c, attr))
    return out


def capture_tail(cache: list, n_tokens: int, block_tokens: int) -> dict[str, Tensor]:
    """Everything not in full blocks: the partial block of cuttable units, the whole
    state of the others, and the meta state restore needs (names in the module docstring).

    Raises StateMismatchError when a unit that counts tokens does not hold n_tokens.
    """
    full = n_tokens // block_tokens * block_tokens
    out = {"meta": _ints(STATE_FORMAT, n_tokens, block_tokens)}
    for name, _, _, c in _units(cache):
        kind = _kind(c, name)
        if kind != "arrays" and c.offset != n_tokens:  # recurrent state has no token count to check
            raise StateMismatchError(f"{name}: cache holds {c.offset} tokens, capture asked for {n_tokens}")
        if kind in _CUTTABLE:
            out[f"{name}.offset"] = _ints(c.offset)
            if full < n_tokens:
                out.update(_cut(name, c, full, n_tokens))
        else:
            out.update(_whole(name, kind, c))
    return out


# -- restore -----------------------------------------------------------------


class _Filler:
    """Builds one cuttable unit from slices, in place in step-allocated buffers.

    The slot from make_prompt_cache decides what fits: a KVCache slot takes
    plain or quantized slices (a daemon may quantize KV; the slices say how),
    a QuantizedKVCache slot only quantized, a ConcatenateKVCache only plain.
    """

    def __init__(self, name: str, slot: Any, total: int) -> None:
        self.name, self.slot, self.total = name, slot, total
        self.buffers: dict[str, mx.array] = {}
        self.quant: list[int] | None = None
        self.filled = 0

    def _parts(self, arrays: dict[str, Tensor]) -> tuple[str, ...]:
        quantized = f"{self.name}.keys.0" in arrays
        allowed = {KVCache: (False, True), QuantizedKVCache: (True,), ConcatenateKVCache: (False,)}[type(self.slot)]
        if quantized not in allowed or (self.buffers and quantized != (self.quant is not None)):
            raise StateMismatchError(f"{self.name}: {'quantized' if quantized else 'plain'} KV does not fit "
                                     f"a {type(self.slot).__name__} (or earlier slices)")
        if quantized:
            quant = _take_ints(arrays, f"{self.name}.quant", 2)
            if self.quant not in (None, quant):
                raise StateMismatchError(f"{self.name}: quantization {quant} after {self.quant}")
            self.quant = quant
        return _QPARTS if quantized else ("keys", "values")

    def put(self, arrays: dict[str, Tensor], count: int) -> None:
        """Append `count` tokens of this unit, popping its names from `arrays`."""
        for part in self._parts(arrays):
            t = arrays.pop(f"{self.name}.{part}", None)
            if t is None:
                raise StateMismatchError(f"{self.name}.{part}: missing")
            a = _array(t)
            buf = self.buffers.get(part)
            if buf is None:
                step = 1 if isinstance(self.slot, ConcatenateKVCache) else KVCache.step
                shape = (*a.shape[:-2], -(-self.total // step) * step, a.shape[-1])
                buf = self.buffers[part] = mx.zeros(shape, a.dtype)
            want = (*buf.shape[:-2], count, buf.shape[-1])
            if a.ndim != buf.ndim or a.shape != want or a.dtype != buf.dtype:
                raise StateMismatchError(f"{self.name}.{part}: expected {_dtype_name(buf.dtype)}{list(want)}, "
                                         f"found {_dtype_name(a.dtype)}{list(a.shape)}")
            buf[..., self.filled : self.filled + count, :] = a
        self.filled += count

    def pending(self) -> list[mx.array]:
        return list(self.buffers.values())

    def finish(self) -> Any:
        """The filled cache object (a new QuantizedKVCache when the slices were quantized)."""
        if self.filled != self.total:
            raise StateMismatchError(f"{self.name}: {self.filled} tokens restored, {self.total} expected")
        if self.quant is not None:
            c = QuantizedKVCache(group_size=self.quant[0], bits=self.quant[1])
            c.keys = tuple(self.buffers[f"keys.{k}"] for k in range(3))
            c.values = tuple(self.buffers[f"values.{k}"] for k in range(3))
        else:
            c = type(self.slot)()
            c.keys, c.values = self.buffers.get("keys"), self.buffers.get("values")
        c.offset = self.total
        return c


def _restore_whole(name: str, kind: str, c: Any, tail: dict[str, Tensor], n_tokens: int) -> None:
    """Fill one non-cuttable unit in place from the tail."""
    def both() -> tuple[mx.array, mx.array]:
        k, v = tail.pop(f"{name}.keys", None), tail.pop(f"{name}.values", None)
        if k is None or v is None or k.array.shape[:-1] != v.array.shape[:-1]:
            raise StateMismatchError(f"{name}: keys/values missing or of different lengths")
        return _array(k), _array(v)

    if kind == "rotating":
        offset, idx, keep, max_size = _take_ints(tail, f"{name}.ring", 4)
        if (keep, max_size, offset) != (c.keep, c.max_size, n_tokens):
            raise StateMismatchError(f"{name}: ring keep/max_size/offset {keep}/{max_size}/{offset}, "
                                     f"model expects {c.keep}/{c.max_size}/{n_tokens}")
        if offset:
            c.keys, c.values = both()
            if not 0 <= idx <= c.keys.shape[2]:
                raise StateMismatchError(f"{name}: ring index {idx} outside its {c.keys.shape[2]} rows")
        c.offset, c._idx = offset, idx
    elif kind == "chunked":
        offset, start, chunk = _take_ints(tail, f"{name}.chunk", 3)
        if (chunk, offset) != (c.chunk_size, n_tokens):
            raise StateMismatchError(f"{name}: chunk_size/offset {chunk}/{offset}, model expects {c.chunk_size}/{n_tokens}")
        if offset:
            filler = _Filler(name, KVCache(), offset - start)
            filler.put(tail, offset - start)
            mx.eval(filler.pending())
            c.keys, c.values = filler.buffers["keys"], filler.buffers["values"]
        c.offset, c.start_position = offset, start
    else:
        c.cache = [_array(tail.pop(f"{name}.arrays.{k}")) if f"{name}.arrays.{k}" in tail else None
                   for k in range(len(c.cache))]
        for attr in ("left_padding", "lengths"):
            setattr(c, attr, _array(tail.pop(f"{name}.{attr}")) if f"{name}.{attr}" in tail else None)


def _fill_blocks(cache: list, blocks: Iterable[dict[str, Tensor]], n_blocks: int, block_tokens: int,
                 total: int) -> list[tuple[int, int | None, _Filler]]:
    fillers = [(i, j, _Filler(name, c, total)) for name, i, j, c in _units(cache)
               if _kind(c, name) in _CUTTABLE]
    count = 0
    for count, block in enumerate(blocks, start=1):
        if count > n_blocks:
            raise StateMismatchError(f"more than the {n_blocks} blocks {total} tokens make")
        block = dict(block)  # names are popped as they fit; leftovers do not fit this model
        for _, _, f in fillers:
            f.put(block, block_tokens)
        # One eval per block (not per layer): writes land now, so this block's host copy can go.
        mx.eval([buf for _, _, f in fillers for buf in f.pending()])
        if block:
            raise StateMismatchError(f"block {count - 1} holds arrays this model's cache has no place for: {sorted(block)}")
    if count != n_blocks:
        raise StateMismatchError(f"{count} blocks given, {n_blocks} expected for {total} tokens")
    return fillers


def _place(cache: list, i: int, j: int | None, c: Any) -> None:
    if j is None:
        cache[i] = c
    else:
        members = list(cache[i].caches)
        members[j] = c
        cache[i].caches = tuple(members)


def restore(model: Any, blocks: Iterable[dict[str, Tensor]], tail: dict[str, Tensor],
            n_tokens: int, block_tokens: int) -> list:
    """A fresh cache (make_prompt_cache(model)) holding n_tokens, filled from blocks + tail.

    `blocks` is consumed one at a time, in order (n_tokens // block_tokens of
    them); each is copied into preallocated buffers before the next is read.
    The model continues exactly as the captured cache would: bit-identical
    logits. Raises StateMismatchError (naming the unit, expected vs found) when
    the arrays, their count or the meta state do not fit the model's cache.
    """
    tail = dict(tail)
    fmt, n, b = _take_ints(tail, "meta", 3)
    if (fmt, n, b) != (STATE_FORMAT, n_tokens, block_tokens):
        raise StateMismatchError(f"tail meta (format, tokens, block) {(fmt, n, b)}, "
                                 f"expected {(STATE_FORMAT, n_tokens, block_tokens)}")
    cache = make_prompt_cache(model)
    n_full = n_tokens // block_tokens
    fillers = _fill_blocks(cache, blocks, n_full, block_tokens, n_tokens)
    for i, j, f in fillers:
        (offset,) = _take_ints(tail, f"{f.name}.offset", 1)
        if offset != n_tokens:
            raise StateMismatchError(f"{f.name}: tail says {offset} tokens, restore asked for {n_tokens}")
        if n_tokens > n_full * block_tokens:
            f.put(tail, n_tokens - n_full * block_tokens)
            mx.eval(f.pending())
        _place(cache, i, j, f.finish())
    for name, _, _, c in _units(cache):
        if _kind(c, name) not in _CUTTABLE:
            _restore_whole(name, _kind(c, name), c, tail, n_tokens)
    if tail:
        raise StateMismatchError(f"tail holds arrays this model's cache has no place for: {sorted(tail)}")
    return cache


def restore_prefix(model: Any, blocks: Iterable[dict[str, Tensor]], n_blocks: int, block_tokens: int) -> list:
    """A fresh cache holding exactly n_blocks * block_tokens tokens from `blocks` (no tail).

    For prefix-cache hits. Raises NotCuttableError if the model's cache has a
    unit that cannot be cut by token, StateMismatchError as `restore` does.
    """
    cache = make_prompt_cache(model)
    if not cuttable(cache):
        kinds = sorted({_kind(c, name) for name, _, _, c in _units(cache)} - _CUTTABLE)
        raise NotCuttableError(f"this model's cache has {', '.join(kinds)} layers; a prefix cannot be restored")
    total = n_blocks * block_tokens
    for i, j, f in _fill_blocks(cache, blocks, n_blocks, block_tokens, total):
        _place(cache, i, j, f.finish())
    return cache

