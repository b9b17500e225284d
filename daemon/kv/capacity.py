"""How many tokens a KV cache's buffer holds: the growth of mlx-lm's KVCache, with CUDA's decode in mind.

mlx-lm's `KVCache` grows its buffers 256 tokens at a time. MLX on CUDA decodes
one query over such a cache through a cuDNN graph when the buffer holds a
multiple of 256 tokens (mlx/backend/cuda/scaled_dot_product_attention.cpp,
`use_cudnn_for_decoding`), and builds one graph per (batch, capacity) the first
time a step meets it; otherwise it takes its vector kernel, which builds
nothing. Measured with `bench/decode_attention.py` (docs/decisions.md, "Many agents at once (issue 24)";
figures in docs/history/benchmarks-journal.md, "Many agents at once, as fast as mlx-lm's own batch (issue 24)"): a new
capacity's graph stalled a lone session's step for far longer than a step, most below `CUDNN_MIN`; steady,
the vector kernel was as fast as cuDNN's for short buffers and slower for long ones. A daemon meets every
capacity of every session's growth, and restores its caches at whole steps: each was a stall.

So on CUDA (`install`) a buffer below `CUDNN_MIN` tokens holds `OFF_GRID` tokens
more than the next multiple of 256 (off the grid: the vector kernel, as fast
there and never built), and from `CUDNN_MIN` on a multiple of 256 (cuDNN, whose
builds cost less there than its faster steps save), grown by about a
`GROWTH`th of itself at a time (a power-of-two number of grid steps: 1,024
tokens at 16k, 4,096 at 64k) rather than 256: an agent's turn adds a few hundred
tokens, and over a long conversation every second or third turn met a
new capacity, its graph built before its first token. Grown geometrically, a turn
meets one far more rarely, and each growth's copy of the buffer is rarer too; the
buffer holds at most 1/GROWTH more than its tokens. Only the buffer's size
changes: the tokens in it, and so every result, are the same.
Elsewhere (the CPU, Metal) nothing is installed and growth is mlx-lm's own.

Whichever the rule, a lone decoding session's layers grow one a step before the buffer fills
(`grow_ahead`), not all in the step that finds it full, to the sizes their own growth gives.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

__all__ = ["CUDNN_MIN", "GROWTH", "OFF_GRID", "STEP", "capacity", "even_out", "grow_ahead", "grown",
           "install", "installed", "next_size", "uninstall"]

STEP = 256  # mlx-lm's KVCache.step, and the grid cuDNN's decode path looks for
CUDNN_MIN = 16384  # buffers from here on stay on the grid: cuDNN decodes them
OFF_GRID = 8  # tokens past the grid below CUDNN_MIN (a whole number of 16-byte rows for any dtype)
GROWTH = 16  # from CUDNN_MIN on, a buffer grows in steps of the largest power of two <= its tokens / GROWTH

_mlx_update_and_fetch = KVCache.update_and_fetch
_installed = False


def installed() -> bool:
    return _installed


def capacity(tokens: int) -> int:
    """The buffer a KVCache grows to for `tokens` tokens (mlx-lm's whole steps unless installed)."""
    whole = -(-tokens // STEP) * STEP
    if not _installed:
        return whole
    if whole < CUDNN_MIN:
        return whole + OFF_GRID
    step = max(STEP, 1 << max(0, (tokens // GROWTH).bit_length() - 1))
    return -(-tokens // step) * step


def grown(cache: Any, tokens: int) -> int:
    """The capacity `cache` (a KVCache) has once `tokens` more are fed to it."""
    prev, held = cache.offset, (cache.keys.shape[2] if cache.keys is not None else 0)
    if prev + tokens <= held:
        return held
    if _installed:
        return capacity(prev + tokens)
    base = prev if prev % cache.step else held  # mlx-lm: cut to the offset unless on a step, then whole steps
    return base + (cache.step + tokens - 1) // cache.step * cache.step


def _update_and_fetch(self: KVCache, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
    """KVCache.update_and_fetch with `capacity`'s growth; the same writes, the same views."""
    prev, n = self.offset, keys.shape[2]
    if self.keys is None or prev + n > self.keys.shape[2]:
        _regrow(self, capacity(prev + n), keys, values)
    self.offset += n
    self.keys[..., prev : self.offset, :] = keys
    self.values[..., prev : self.offset, :] = values
    return self.keys_and_values()


def _regrow(layer: KVCache, size: int, keys: mx.array, values: mx.array) -> None:
    """Give `layer` a buffer of `size` tokens holding its first `offset` (shapes and dtypes as `keys`, `values`)."""
    prev = layer.offset
    b, heads, _, k_dim = keys.shape
    new_k = mx.zeros((b, heads, size - prev, k_dim), keys.dtype)
    new_v = mx.zeros((b, heads, size - prev, values.shape[3]), values.dtype)
    if layer.keys is None or prev == 0:
        layer.keys, layer.values = new_k, new_v
    else:
        layer.keys = mx.concatenate([layer.keys[..., :prev, :], new_k], axis=2)
        layer.values = mx.concatenate([layer.values[..., :prev, :], new_v], axis=2)


def next_size(layer: KVCache) -> int:
    """The buffer `layer`'s own growth makes when its buffer is full and one more token comes."""
    held = layer.keys.shape[2]
    return capacity(held + 1) if _installed else held + layer.step  # mlx-lm: whole steps after a full buffer


def grow_ahead(cache: list) -> int | None:
    """Before a decode step: while the plain KV layers' buffers are within one token per layer of full,
    grow one of them (the first not grown yet) to the size its own growth would make once full. Returns
    its index among them, or None. (A call that ends inside that window has the others grown to the same
    size at once: `even_out`.)

    Growing is allocating two new buffers per layer and copying the tokens held; done all at once, it is
    one decode step that does it for every layer, a step several times its neighbours' length (docs/decisions.md,
    "Batched generation (issue 11)": the growth ahead of full). One layer a step, the same work is
    spread over the last steps before the buffer fills. Only the buffers grow earlier, to the sizes
    their own growth gives: the tokens in them, and so every result, are the same.
    """
    if not cache:
        return None
    last = cache[-1]  # the common case, in O(1): the last layer (the last to grow) has room for a token a layer
    if type(last) is KVCache and last.keys is not None and last.keys.shape[2] - last.offset >= len(cache):
        return None
    layers = [c for c in cache if type(c) is KVCache and c.keys is not None]
    if not layers or layers[-1].keys.shape[2] - layers[-1].offset >= len(layers):
        return None
    for i, layer in enumerate(layers):
        if layer.keys.shape[2] - layer.offset < len(layers):
            _regrow(layer, next_size(layer), layer.keys, layer.values)
            return i
    return None


def even_out(cache: list) -> None:
    """Grow the plain KV layers `grow_ahead` had not reached yet to the size it gave the others (a call that
    ended within a token per layer of a full buffer), so every layer's buffer is the same size again, as
    the engine's shapes (prefill graphs, turn buckets) are read off the first layer's. The work is queued
    (MLX is lazy): it runs with the cache's next use, not in the call's last step."""
    layers = [c for c in cache if type(c) is KVCache and c.keys is not None]
    size = max((c.keys.shape[2] for c in layers), default=0)
    for layer in layers:
        if layer.keys.shape[2] < size:
            _regrow(layer, size, layer.keys, layer.values)


def install() -> None:
    """Grow every KVCache of this process by `capacity` (the daemon on CUDA: one model, one engine)."""
    global _installed
    KVCache.update_and_fetch = _update_and_fetch
    _installed = True


def uninstall() -> None:
    """mlx-lm's own growth again."""
    global _installed
    KVCache.update_and_fetch = _mlx_update_and_fetch
    _installed = False
