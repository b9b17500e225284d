"""Capture an mlx-lm prompt cache as store blocks plus a tail, and restore it exactly.

A prompt cache is the list `make_prompt_cache(model)` returns, one cache object
per layer. A `CacheList` layer holds several caches; each leaf cache is a
*unit*, named `layers.{i}` (a plain layer) or `layers.{i}.{j}` (member j of the
CacheList at layer i). Units of the kinds "kv", "concat_kv" and "quantized_kv"
can be cut by token: block k holds tokens [k*B, (k+1)*B) of every such unit.
Everything else (ring buffers, recurrent state, chunked attention) is whole in
the tail. Arrays travel as `kvwake.store.format.codec.Tensor`; bf16 is moved bit for
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

import copy
from collections.abc import Callable
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
)

from kvwake.daemon.kv import devplanes, paged_cache
from kvwake.daemon.kv.paged_cache import PagedKVCache
from kvwake.store.format.codec import Planed, Tensor

__all__ = [
    "STATE_FORMAT",
    "NotCuttableError",
    "StateMismatchError",
    "UnsupportedCacheError",
    "cache_nbytes",
    "CUTTABLE",
    "QPARTS",
    "array_of",
    "capture_block",
    "bytes_per_token",
    "capture_blocks",
    "capture_planed",
    "capture_span",
    "capture_tail",
    "Deferred",
    "block_tail",
    "defer_blocks",
    "defer_planed",
    "check_meta",
    "copy_prefix",
    "cuttable",
    "kind_of",
    "layout",
    "restore_whole",
    "take_ints",
    "units",
]

STATE_FORMAT = 1  # version of the naming scheme above; stored in the tail's "meta"
# A paged layer (kv/paged_cache.py) reads as a KVCache: `keys`, `values` [1, kv_heads, offset, head_dim], `offset`
KINDS = {KVCache: "kv", PagedKVCache: "kv", ConcatenateKVCache: "concat_kv", QuantizedKVCache: "quantized_kv",
          RotatingKVCache: "rotating", ArraysCache: "arrays", ChunkedKVCache: "chunked", CacheList: "cache_list"}
CUTTABLE = {"kv", "concat_kv", "quantized_kv"}
_STRUCTURE = {"quantized_kv": ("bits", "group_size"), "rotating": ("max_size", "keep"), "chunked": ("chunk_size",)}
QPARTS = ("keys.0", "keys.1", "keys.2", "values.0", "values.1", "values.2")


class StateMismatchError(ValueError):
    """Arrays that do not fit the model's cache (or the state they claim to be)."""


class UnsupportedCacheError(TypeError):
    """A cache class this module does not know how to capture exactly."""


class NotCuttableError(ValueError):
    """A prefix restore asked of a model whose cache cannot be cut by token."""


# -- small parts: kinds, units, array conversion ----------------------------


def kind_of(c: Any, where: str) -> str:
    # Exact type, not isinstance: a subclass may keep state we would silently drop.
    kind = KINDS.get(type(c))
    if kind is None:
        raise UnsupportedCacheError(f"{where}: cache class {type(c).__module__}.{type(c).__name__} is not supported")
    return kind


def units(cache: list) -> list[tuple[str, int, int | None, Any]]:
    """(name, layer, member or None, leaf cache) for every leaf cache, in order."""
    out = []
    for i, c in enumerate(cache):
        if kind_of(c, f"layers.{i}") != "cache_list":
            out.append((f"layers.{i}", i, None, c))
            continue
        for j, member in enumerate(c.caches):
            if kind_of(member, f"layers.{i}.{j}") == "cache_list":
                raise UnsupportedCacheError(f"layers.{i}.{j}: nested CacheList is not supported")
            out.append((f"layers.{i}.{j}", i, j, member))
    return out


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def array_of(t: Tensor | mx.array) -> mx.array:
    """A stored array on the device (a device array as it is: a ring joined there, kv/window_stage.py)."""
    if isinstance(t, mx.array):
        return t
    a = mx.array(t.array)
    return a.view(mx.bfloat16) if t.dtype == "BF16" else a


def _ints(*values: int, dtype: type = np.int64) -> Tensor:
    return Tensor.of(np.array(values, dtype=dtype))


def take_ints(arrays: dict[str, Tensor], name: str, n: int) -> list[int]:
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
    kind = kind_of(c, where)
    if kind == "cache_list":
        members = [_describe(m, f"{where}.{j}", probed.caches[j] if probed is not None else None)
                   for j, m in enumerate(c.caches)]
        return {"kind": kind, "cuttable": all(m["cuttable"] for m in members), "caches": members}
    entry: dict[str, Any] = {"kind": kind, "cuttable": kind in CUTTABLE}
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
    kind = kind_of(c, "cache")
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
    return all(kind_of(c, name) in CUTTABLE for name, _, _, c in units(cache))


def copy_prefix(cache: list, n_tokens: int) -> list:
    """A new cache holding the first `n_tokens` of a cuttable `cache` (which stays as it is).

    MLX arrays are values: the copy's slices never see the source's later writes. Evaluated on return
    (engine thread). Raises NotCuttableError for a layer that cannot be cut by token. A paged cache's copy
    lists the same pages (no KV copied; kv/paged_cache.fork).
    """
    if paged_cache.is_paged(cache):  # a model's plain layers paged beside others cannot be cut by token
        if not all(isinstance(c, PagedKVCache) for c in cache):
            kinds = sorted({type(c).__name__ for c in cache if not isinstance(c, PagedKVCache)})
            raise NotCuttableError(f"a cache with {', '.join(kinds)} layers cannot give its first {n_tokens} tokens")
        return paged_cache.fork(cache, n_tokens)

    def cut(c: Any, where: str) -> Any:
        if isinstance(c, CacheList):
            return CacheList(*(cut(m, f"{where}.{j}") for j, m in enumerate(c.caches)))
        if kind_of(c, where) not in CUTTABLE or c.offset < n_tokens:
            raise NotCuttableError(f"{where}: a {type(c).__name__} holding {c.offset} tokens cannot give {n_tokens}")
        twin = copy.copy(c)  # same class and settings (quantization bits, group size)
        if isinstance(c, QuantizedKVCache):
            twin.keys, twin.values = (tuple(a[..., :n_tokens, :] for a in part) for part in (c.keys, c.values))
        else:
            twin.keys, twin.values = c.keys[..., :n_tokens, :], c.values[..., :n_tokens, :]
        twin.offset = n_tokens
        return twin

    copied = [cut(c, f"layers.{i}") for i, c in enumerate(cache)]
    mx.eval([c.state for c in copied])
    return copied


def cache_nbytes(cache: list) -> int:
    """Bytes the cache's arrays hold now, step-allocated buffers included (what memory budgets see)."""
    return sum(c.nbytes for _, _, _, c in units(cache))


def bytes_per_token(cache: list) -> int:
    """Bytes one token takes in the cuttable units (what one block row costs; 0 before any prefill)."""
    total = 0
    for name, _, _, c in units(cache):
        if kind_of(c, name) in CUTTABLE and c.keys is not None:
            parts = [*c.keys, *c.values] if isinstance(c, QuantizedKVCache) else [c.keys, c.values]
            total += sum(a.nbytes // a.shape[-2] for a in parts)
    return total


# -- capture -----------------------------------------------------------------


class Deferred:
    """Arrays scheduled on the device, and how the host result is made of them (both on the engine thread).

    `schedule()` queues their evaluation (`mx.async_eval`: a device-to-host copy on CUDA) and returns at
    once; `host()` waits for it (nothing to wait for when a decode step or more ran in between) and
    makes the result from host arrays: on unified memory (CPU, Apple silicon) views of MLX's own
    memory, no copy; on CUDA a device copy first (the tensors stacked), then one transfer per copy
    (`_defer_units`).
    """

    def __init__(self, lazy: list[mx.array], make: Any) -> None:
        self.lazy, self.make = lazy, make

    def schedule(self) -> Deferred:
        mx.async_eval(self.lazy)
        return self

    def host(self) -> Any:
        mx.eval(self.lazy)
        return self.make([np.asarray(a) for a in self.lazy])


def _discrete() -> bool:
    """True where the KV lives apart from host memory (CUDA): a host copy is a copy, not a view."""
    return not (mx.default_device() == mx.cpu or mx.metal.is_available())


def drop_hosted(drop: Callable[[], Any]) -> None:
    """Engine thread: run `drop`, which lets host copies (`Deferred.host`'s) go, with MLX's buffer cache
    closed on a discrete GPU, so that what it frees goes back to the driver.

    There a host copy is managed memory that the CPU (the encoders) read last. MLX's cache does not tell
    managed buffers from device ones: back in it, the copy would become the next kernel output of about
    its size, a neighbour's decode step, written through page faults (bench/managed_reuse.py).

    It frees what `drop` lets go. An array evaluated a moment before is still held by MLX-CUDA's worker
    thread until that thread runs the stream's finished tasks, and what it lets go later goes to the cache
    (bench/drop_probe.py). A host copy is dropped after its blocks are encoded and written; how long after
    its evaluation that is, against the worker's lag, has not been measured."""
    if not _discrete():
        drop()
        return
    limit = mx.set_cache_limit(0)
    try:
        drop()
    finally:
        mx.set_cache_limit(limit)


def _host_bits(a: mx.array) -> mx.array:
    """`a` as its host copy holds it: bf16 as uint16 (numpy has no bfloat16)."""
    return a.view(mx.uint16) if a.dtype == mx.bfloat16 else a


def _lazy_cut(name: str, c: Any, start: int, stop: int, copied: bool = False) -> tuple[dict[str, mx.array],
                                                                                     dict[str, Tensor]]:
    """Tokens [start, stop) of one cuttable unit: its lazy slices, and its small facts (quantization). `copied`:
    the slices are copied before anything holds them (a view of a page pool may then be taken)."""
    if stop > c.offset:
        raise StateMismatchError(f"{name}: tokens [{start}, {stop}) asked, the cache holds {c.offset}")
    if isinstance(c, QuantizedKVCache):
        lazy = {f"{name}.{part}.{k}": a[..., start:stop, :] for part in ("keys", "values")
                for k, a in enumerate(getattr(c, part))}
        return lazy, {f"{name}.quant": _ints(c.group_size, c.bits, dtype=np.int32)}
    if isinstance(c, PagedKVCache):  # the span's tokens from its pages, not all the layer holds
        keys, values = c.span(start, stop, view=copied)
        return {f"{name}.keys": keys, f"{name}.values": values}, {}
    return {f"{name}.keys": c.keys[..., start:stop, :], f"{name}.values": c.values[..., start:stop, :]}, {}


def _defer_units(cache: list, start: int, stop: int, only: Any = None, own: bool = False,
                 extra: dict[str, mx.array] | None = None) -> Deferred:
    """Tokens [start, stop) of every cuttable unit (or of `only`): host arrays once `host()` runs.

    On unified memory (CPU, Apple silicon) they are views of the cache's buffers, unless `own`. While a
    view lives MLX cannot update that buffer in place and copies all of it at the cache's next update,
    so a cache that goes on growing is copied (`own`). On CUDA they are always copies: reading a slice
    of the cache itself would move its whole buffer to host memory. Copies are made one per dtype and
    shape (the tensors stacked): on CUDA each is a managed allocation and a transfer of its own.
    `extra`: more lazy arrays of these tokens, named, after the units' (window rows: kv/window_rows.py)."""
    lazy: dict[str, mx.array] = {}
    facts: dict[str, Tensor] = {}
    order: list[str] = []  # units in order, each unit's parts, then its quantization
    stacked = own or _discrete()
    for name, _, _, c in units(cache):
        if kind_of(c, name) in CUTTABLE and (only is None or c is only):
            slices, small = _lazy_cut(name, c, start, stop, copied=stacked)
            lazy.update(slices)
            facts.update(small)
            order += [*slices, *small]
    lazy.update(extra or {})
    order += list(extra or {})
    bits = {n: _host_bits(a) for n, a in lazy.items()}
    if stacked:  # one copy per dtype and shape, not one per tensor: on CUDA one host allocation and transfer
        kinds: dict[tuple, list[str]] = {}
        for n, a in bits.items():
            kinds.setdefault((a.dtype, tuple(a.shape)), []).append(n)
        groups = list(kinds.values())
        arrays = [mx.stack([bits[n] for n in group]) for group in groups]
    else:  # views of the cache, no copy
        groups, arrays = [[n] for n in bits], list(bits.values())

    def make(host: list[np.ndarray]) -> dict[str, Tensor]:
        views = {n: h[i] if stacked else h for group, h in zip(groups, host) for i, n in enumerate(group)}
        return {n: Tensor(_dtype_of(lazy[n]), views[n]) if n in lazy else facts[n] for n in order}

    return Deferred(arrays, make)


def _cut_units(cache: list, start: int, stop: int, only: Any = None) -> dict[str, Tensor]:
    """Tokens [start, stop) of every cuttable unit (or of `only`), as host arrays, evaluated in one go."""
    return _defer_units(cache, start, stop, only).host()


def _dtype_of(a: mx.array) -> str:
    return "BF16" if a.dtype == mx.bfloat16 else Tensor.of(np.zeros(0, _NP[a.dtype])).dtype


_NP = {mx.float16: np.float16, mx.float32: np.float32, mx.uint32: np.uint32, mx.int32: np.int32,
       mx.uint8: np.uint8, mx.int8: np.int8, mx.uint16: np.uint16, mx.int16: np.int16}


def defer_blocks(cache: list, first: int, count: int, block_tokens: int, own: bool = False,
                 extra: dict[str, mx.array] | None = None) -> Deferred:
    """Blocks first .. first+count-1 of every cuttable unit (names in the module docstring), deferred:
    `host()` gives what `capture_blocks` returns (`own`: as copies; `extra`: more arrays of the span's
    tokens; see `_defer_units`)."""
    span = _defer_units(cache, first * block_tokens, (first + count) * block_tokens, own=own, extra=extra)
    cut = span.make

    def make(host: list[np.ndarray]) -> list[dict[str, Tensor]]:
        whole = cut(host)
        return [{n: t if n.endswith(".quant") else Tensor(t.dtype, t.array[..., k * block_tokens : (k + 1) * block_tokens, :])
                 for n, t in whole.items()} for k in range(count)]

    return Deferred(span.lazy, make)


def capture_blocks(cache: list, first: int, count: int, block_tokens: int) -> list[dict[str, Tensor]]:
    """Blocks first .. first+count-1 of every cuttable unit (names in the module docstring).

    One evaluation for the whole span; each block's arrays are views of it
    (on unified memory, of the cache itself: nothing is copied until encoded).
    Non-cuttable units contribute nothing. Raises StateMismatchError if the
    cache holds fewer tokens.
    """
    return defer_blocks(cache, first, count, block_tokens).host()


def defer_planed(cache: list, first: int, count: int, block_tokens: int,
                 extra: dict[str, mx.array] | None = None) -> Deferred | None:
    """Blocks first .. first+count-1 as byte planes made on the device (devplanes.py), deferred, or None
    when the cache is not plain KV of one dtype and shape (quantized, mixed heads); `extra` as for
    `defer_blocks`, of that dtype and shape too."""
    start, stop = first * block_tokens, (first + count) * block_tokens
    names, arrays = [], []
    for name, _, _, c in units(cache):
        if kind_of(c, name) not in CUTTABLE:
            continue
        if isinstance(c, QuantizedKVCache):
            return None
        # the planes are copies: a paged span may be read in place (a layer's `keys` would gather all it holds)
        slices, _ = _lazy_cut(name, c, start, stop, copied=True)
        names += list(slices)
        arrays += list(slices.values())
    names += list(extra or {})
    arrays += list((extra or {}).values())
    split = devplanes.split_span(names, arrays, block_tokens, count) if arrays else None
    return Deferred(*split) if split is not None else None


def capture_planed(cache: list, first: int, count: int, block_tokens: int) -> list[Planed] | None:
    """Blocks first .. first+count-1 as byte planes made on the device (devplanes.py), or None
    when the cache is not plain KV of one dtype and shape (quantized, mixed heads)."""
    deferred = defer_planed(cache, first, count, block_tokens)
    return deferred.host() if deferred is not None else None


def block_tail(cache: list, n_tokens: int, block_tokens: int) -> dict[str, Tensor]:
    """The tail of a snapshot of the first `n_tokens` (a whole number of blocks) of a cuttable cache that
    may hold more: its meta state and offsets (what `capture_tail` makes at a block boundary). No MLX work."""
    if n_tokens % block_tokens:
        raise ValueError(f"{n_tokens} tokens are not a whole number of {block_tokens}-token blocks")
    out = {"meta": _ints(STATE_FORMAT, n_tokens, block_tokens)}
    for name, _, _, c in units(cache):
        if kind_of(c, name) not in CUTTABLE:
            raise NotCuttableError(f"{name}: a {type(c).__name__} cannot be cut at {n_tokens} tokens")
        if c.offset < n_tokens:
            raise StateMismatchError(f"{name}: cache holds {c.offset} tokens, a tail of {n_tokens} asked")
        out[f"{name}.offset"] = _ints(n_tokens)
    return out


def capture_span(cache: list, start: int, stop: int) -> dict[str, Tensor]:
    """Tokens [start, stop) of every cuttable unit, named like a block (a short last block)."""
    return _cut_units(cache, start, stop)


def capture_block(cache: list, index: int, block_tokens: int) -> dict[str, Tensor]:
    """Block `index` alone (capture_blocks of one)."""
    return capture_blocks(cache, index, 1, block_tokens)[0]


def _whole(name: str, kind: str, c: Any, rings_cut: bool = False, rows_elsewhere: bool = False
           ) -> dict[str, Tensor | mx.array]:
    """The whole state of one non-cuttable unit, meta state as small int arrays; its arrays lazy (`_to_host`
    evaluates every unit's at once, then copies them).
    `rings_cut`: a ring grown past its size by a prefill chunk is cut on the device to the rows its next
    update reads (points.compact_rings says which), so only those move to the host.
    `rows_elsewhere`: a ring's meta state only, its rows left out (a point's marker: kv/window_rows.py)."""
    out: dict[str, Tensor | mx.array] = {}
    if kind == "rotating":
        keys, values, idx = c.keys, c.values, c._idx
        if rings_cut and keys is not None and keys.shape[2] > c.max_size and idx == keys.shape[2]:
            rows, keep = keys.shape[2], c.keep
            keys, values = (mx.concatenate([a[:, :, :keep], a[:, :, rows - (c.max_size - keep):]], axis=2)
                            for a in (keys, values))
            idx = c.max_size
        out[f"{name}.ring"] = _ints(c.offset, idx, c.keep, c.max_size)
        if keys is not None and not rows_elsewhere:  # the ring as held: capacity and rotation both matter
            out.update({f"{name}.keys": keys, f"{name}.values": values})
    elif kind == "chunked":
        out[f"{name}.chunk"] = _ints(c.offset, c.start_position, c.chunk_size)
        if c.keys is not None:
            k, v = c.keys_and_values()
            out.update({f"{name}.keys": k, f"{name}.values": v})
    else:  # arrays
        out.update({f"{name}.arrays.{k}": a for k, a in enumerate(c.cache) if a is not None})
        for attr in ("left_padding", "lengths"):
            if getattr(c, attr) is not None:
                out[f"{name}.{attr}"] = getattr(c, attr)
    return out


def _to_host(state: dict[str, Tensor | mx.array]) -> dict[str, Tensor]:
    """`state`'s arrays evaluated together (one wait, not one per layer), then copied to the host: numpy's
    copy of just each (possibly strided) array, bf16 as its uint16 bits (numpy has no bfloat16)."""
    bits = {k: _host_bits(a) for k, a in state.items() if isinstance(a, mx.array)}
    mx.eval(list(bits.values()))
    return {k: a if k not in bits else Tensor("BF16", np.ascontiguousarray(np.array(bits[k])))
            if a.dtype == mx.bfloat16 else Tensor.of(np.array(bits[k])) for k, a in state.items()}


def capture_tail(cache: list, n_tokens: int, block_tokens: int, rings_cut: bool = False,
                 rows_elsewhere: frozenset[str] = frozenset()) -> dict[str, Tensor]:
    """Everything not in full blocks: the partial block of cuttable units, the whole
    state of the others, and the meta state restore needs (names in the module docstring).
    `rings_cut`: rings as a point keeps them; `rows_elsewhere`: units whose ring rows are left out (`_whole`).

    Raises StateMismatchError when a unit that counts tokens does not hold n_tokens.
    """
    full = n_tokens // block_tokens * block_tokens
    for name, _, _, c in units(cache):
        if kind_of(c, name) != "arrays" and c.offset != n_tokens:  # recurrent state has no token count to check
            raise StateMismatchError(f"{name}: cache holds {c.offset} tokens, capture asked for {n_tokens}")
    # The partial block first, all units together: one run of one dtype for plain KV, like a full
    # block's (a GPU restore joins it the same way); then offsets, then the other units' state.
    out = {"meta": _ints(STATE_FORMAT, n_tokens, block_tokens)}
    if full < n_tokens:
        out.update(_cut_units(cache, full, n_tokens))
    whole: dict[str, Tensor | mx.array] = {}
    for name, _, _, c in units(cache):
        kind = kind_of(c, name)
        if kind in CUTTABLE:
            out[f"{name}.offset"] = _ints(c.offset)
        else:
            whole.update(_whole(name, kind, c, rings_cut, name in rows_elsewhere))
    out.update(_to_host(whole))
    return out


# -- restore helpers (the restore itself is restore_buffers.py) -------------------------


def check_meta(tail: dict[str, Tensor], n_tokens: int, block_tokens: int | None) -> None:
    """Pop the tail's meta state and check it describes n_tokens (and block_tokens, when given)."""
    fmt, n, b = take_ints(tail, "meta", 3)
    if (fmt, n) != (STATE_FORMAT, n_tokens) or block_tokens not in (None, b):
        raise StateMismatchError(f"tail meta (format, tokens, block) {(fmt, n, b)}, "
                                 f"expected {(STATE_FORMAT, n_tokens, block_tokens)}")


def restore_whole(name: str, kind: str, c: Any, tail: dict[str, Tensor], n_tokens: int) -> None:
    """Fill one non-cuttable unit in place from the tail, popping its names."""
    def both() -> tuple[mx.array, mx.array]:
        k, v = tail.pop(f"{name}.keys", None), tail.pop(f"{name}.values", None)
        if k is None or v is None:
            raise StateMismatchError(f"{name}: keys/values missing")
        keys, values = array_of(k), array_of(v)
        if keys.shape[:-1] != values.shape[:-1]:
            raise StateMismatchError(f"{name}: keys/values of different lengths")
        return keys, values

    if kind == "rotating":
        offset, idx, keep, max_size = take_ints(tail, f"{name}.ring", 4)
        if (keep, max_size, offset) != (c.keep, c.max_size, n_tokens):
            raise StateMismatchError(f"{name}: ring keep/max_size/offset {keep}/{max_size}/{offset}, "
                                     f"model expects {c.keep}/{c.max_size}/{n_tokens}")
        if offset:
            c.keys, c.values = both()
            if not 0 <= idx <= c.keys.shape[2]:
                raise StateMismatchError(f"{name}: ring index {idx} outside its {c.keys.shape[2]} rows")
        c.offset, c._idx = offset, idx
    elif kind == "chunked":
        offset, start, chunk = take_ints(tail, f"{name}.chunk", 3)
        if (chunk, offset) != (c.chunk_size, n_tokens):
            raise StateMismatchError(f"{name}: chunk_size/offset {chunk}/{offset}, model expects {c.chunk_size}/{n_tokens}")
        if offset:
            k, v = both()
            if k.shape[2] != offset - start:
                raise StateMismatchError(f"{name}: {k.shape[2]} rows, chunk state says {offset - start}")
            step = KVCache.step
            rows = -(-(offset - start) // step) * step
            pad = [(0, 0)] * (k.ndim - 2) + [(0, rows - k.shape[2]), (0, 0)]
            c.keys, c.values = mx.pad(k, pad), mx.pad(v, pad)
        c.offset, c.start_position = offset, start
    else:
        c.cache = [array_of(tail.pop(f"{name}.arrays.{k}")) if f"{name}.arrays.{k}" in tail else None
                   for k in range(len(c.cache))]
        for attr in ("left_padding", "lengths"):
            setattr(c, attr, array_of(tail.pop(f"{name}.{attr}")) if f"{name}.{attr}" in tail else None)
