"""Several sessions' short prefill chunks in one forward pass: N agents' turns read the weights once.

Sixteen agents that send their next turn at once each prefill a short chunk
(a message, a tool's result: tens to a few hundred tokens). One at a time,
that is sixteen forward passes, each reading every weight, and beside a
decoding call sixteen times the jobs, each waiting for a decode step
(docs/decisions.md, "Many agents at once (issue 24)"). Packed,
the chunks are the rows of one batch: the projections and the MLP run once
over all rows, and each row's attention runs over its own session's cache,
as its chunk alone would (same function, same shapes).

How, without touching the model's code: the rows are right-padded to the
longest; each layer's cache is a `RowsLayer` that gives RoPE every row's
offset (MLX rotates each batch row from its own) and hands each row's new
keys and values (padding cut off) to that row's own cache; the model
module's `scaled_dot_product_attention` is swapped (as model/attention.py's
paths are) for one that runs each row's attention with the path the engine
chose for it (plain, bucketed or fused) and pads its output back. Padded
positions compute numbers nothing reads: no cache holds them.

Only for models whose attention is mlx-lm's standard shape (`PACKABLE`:
rotary offsets from `cache.offset`, keys and values passed from the cache's
update to the module's attention unchanged), over plain `KVCache` layers and
the ring buffers of sliding-window ones (Gemma 3: a ring's chunk is fed and
masked as it is alone, the mask made from the ring before its update, as the
model makes it). Recurrent layers never pack: a right-padded row would run its
padding through the state.
Exactness: each row's attention is its solo computation; the projections
and the MLP run at another matrix shape, whose kernels may round
differently, as batched decoding's do (docs/decisions.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from kvwake.daemon.kv.paged_cache import PagedKVCache
from kvwake.daemon.model import attention

__all__ = ["PACKABLE", "RowsLayer", "forward", "packable_model", "row_mask", "wanted"]

# mlx-lm model modules whose attention rotates by `cache.offset`, then passes `cache.update_and_fetch`'s keys
# and values to the module's `scaled_dot_product_attention` as they are (read in mlx-lm 0.32); mistral and
# the SmolLM family load as llama.
# gemma3_text too: its layers rotate by `cache.offset` and make their masks from the first layer of each kind
# (a ring's window mask, the global layers' causal one), which RowsLayer makes per row
PACKABLE = frozenset(f"mlx_lm.models.{name}" for name in
                     ("llama", "qwen2", "qwen3", "phi3", "olmo2", "starcoder2", "granite", "gemma3_text"))

Attention = Callable[..., mx.array]  # mlx-lm's scaled_dot_product_attention signature


# RoPE classes that rotate each batch row from its own offset (an array offset): mlx-lm's DynamicNTKScalingRoPE
# takes its base from a Python int offset (it raises on an array, and would scale by the padded length)
ROW_ROPES = frozenset({"RoPE", "Llama3RoPE", "YarnRoPE", "SuScaledRoPE", "ProportionalRoPE"})


def wanted(configured: bool | None = None) -> bool:
    """Whether turns that come at once pack: `configured` (the tuning knob pack_prefill) when given, else where a
    GPU computes (CUDA, Metal). There a pass's cost is mostly per pass (every weight read, launches, Python):
    a pack of n turns costs about one turn's pass. On the CPU a pass costs what its tokens cost, so a pack
    only makes each turn's first token wait for the others' prefill, and turns go one at a time instead
    (scheduler/turns.py; docs/decisions.md, "Turns one at a time where a pass costs its tokens")."""
    return configured if configured is not None else mx.default_device() != mx.cpu


def packable_model(model: Any) -> bool:
    """Whether `model`'s forward pass can take packed rows: its text model's module is in PACKABLE (Gemma 3's
    multimodal wrapper forwards to gemma3_text) and each of its RoPE modules takes one offset per row
    (ROW_ROPES)."""
    if type(attention.text_model(model)).__module__ not in PACKABLE or attention.attention_module(model) is None:
        return False
    ropes = {type(m).__name__ for _, m in model.named_modules() if type(m).__name__.endswith("RoPE")}
    return ropes <= ROW_ROPES


class RowsLayer:
    """One layer's caches of the packed rows, standing in for one cache in the model's forward pass.

    `offset`: every row's, for RoPE. `update_and_fetch` feeds row b's first `lengths[b]` keys and values to
    its own cache and keeps what that cache returns (`fetched`) for the swapped attention, with the mask its
    chunk alone would get (`masks`); the model gets its input back, so whatever shape code follows still
    runs."""

    def __init__(self, layers: Sequence[Any], lengths: Sequence[int]) -> None:
        self.layers, self.lengths = list(layers), list(lengths)
        self.fetched: list[tuple[mx.array, mx.array]] = []
        self.masks: list[Any] = []

    @property
    def offset(self) -> mx.array:
        return mx.array([layer.offset for layer in self.layers])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # before the update, as the model makes a mask before its layers run: a ring's window mask (an array
        # once the chunk reaches past what the ring holds, mlx-lm's RotatingKVCache.make_mask), a plain
        # layer's causal one
        self.masks = [row_mask(layer, n) for layer, n in zip(self.layers, self.lengths)]
        # Paged rows share a pool: every row writes before any reads. A read of the pool still pending when the
        # next row writes it would make that write copy the layer's whole pool (MLX updates an array in place
        # only when nothing else will read it), once per row and layer.
        # A paged row's K and V are fetched by its attention (None here): a path that reads the pages itself
        # (`reads_pages`) then builds no gather of them.
        paged = [isinstance(layer, PagedKVCache) for layer in self.layers]
        for b, (layer, n) in enumerate(zip(self.layers, self.lengths)):
            if paged[b]:
                layer.extend(keys[b : b + 1, :, :n], values[b : b + 1, :, :n])
        self.fetched = [None if paged[b] else layer.update_and_fetch(keys[b : b + 1, :, :n], values[b : b + 1, :, :n])
                        for b, (layer, n) in enumerate(zip(self.layers, self.lengths))]
        return keys, values


def row_mask(layer: Any, n: int) -> Any:
    """The mask a chunk of n tokens fed alone to `layer` is attended with: a ring's over its window (Gemma 3
    makes its sliding layers' mask from its first ring, window = the ring's size), else causal (None for one
    token)."""
    if hasattr(layer, "max_size"):
        return layer.make_mask(n, window_size=layer.max_size)
    return "causal" if n > 1 else None


def packed_attention(fused: Attention, rows: Sequence[Attention]) -> Attention:
    """The module's attention for a forward pass over RowsLayer caches: row b's queries (its real ones) over
    what its cache fetched, through `rows[b]` (its own path), zero-padded back to the batch's length."""

    def attend(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
               sinks: mx.array | None = None) -> mx.array:
        if not isinstance(cache, RowsLayer):
            return fused(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        length = queries.shape[2]
        out = []
        for b, (fetched, n, layer, path, masked) in enumerate(zip(cache.fetched, cache.lengths, cache.layers, rows,
                                                                   cache.masks)):
            # a paged row: its keys and values for the path, or None where the path reads the pages itself
            k, v = fetched or ((None, None) if getattr(path, "reads_pages", False) else layer.fetch())
            row = path(queries[b : b + 1, :, :n], k, v, layer, scale=scale, mask=masked, sinks=sinks)
            if n < length:
                row = mx.concatenate([row, mx.zeros((1, row.shape[1], length - n, row.shape[3]), row.dtype)], axis=2)
            out.append(row)
        return mx.concatenate(out, axis=0)
    return attend


def forward(model: Any, rows: Sequence[tuple[Sequence[int], Sequence[Any]]],
            paths: Sequence[Callable[[Attention], Attention]]) -> None:
    """Queue (lazily) one forward pass feeding row b's `tokens` to its `cache` (a list of KVCache and ring layers),
    its attention made by `paths[b]` from the module's fused one. The caches hold the result once their state
    is evaluated; the logits are never computed (nothing evaluates them)."""
    length = max(len(tokens) for tokens, _ in rows)
    batch = mx.array([list(tokens) + [0] * (length - len(tokens)) for tokens, _ in rows], dtype=mx.uint32)
    lengths = [len(tokens) for tokens, _ in rows]
    caches = [RowsLayer(layers, lengths) for layers in zip(*(cache for _, cache in rows))]
    with attention.swapped(model, lambda fused: packed_attention(fused, [make(fused) for make in paths])):
        model(batch, cache=caches)
