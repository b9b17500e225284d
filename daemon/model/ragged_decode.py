"""A batched decode step's attention by the flash-decoding kernel: each row's own tokens, no padding, no mask.

mlx-lm decodes rows of different lengths in a `BatchKVCache`: every row left-padded to the longest and an
array mask hiding the padding. On CUDA MLX's fused vector kernel takes no array mask, so a masked step runs
in unfused ops over every row's padded length; at agent-length contexts each row cost about ten times the
time its KV takes to read (docs/benchmarks.md, "Paged decode attention (issue 51)"). While the decoder steps
its batch, the model's attention runs `paged_attention.row_attention` over the batch's own buffers instead:
row r reads slots left_padding[r] .. the batch's end, nothing else, exactly what the mask let through.

A call decoding alone (a `KVCache`) takes the same kernel: a row's result does not depend on the other
rows (the spans are cut at fixed token counts of its own, `paged_attention.ROW_SPLIT`), so a call decodes
the same tokens batched or alone, as it did with the masked path. Only where it computes what the mask did:
plain KV layers (`BatchKVCache` or `KVCache` exactly: a sliding window's ring masks differently, quantized
KV has its own kernel), one query per row, no attention sinks; anything else takes the fused path as before.
CUDA only (`wanted`): on the CPU and Metal the fused path stays (the CPU's reference is bit-exact against
it; a Metal kernel is not written: paged_attention.py says why).

A batch over pages (kv/paged_batch.py: `PagedBatchKVCache`, rows' page tables, nothing merged) always
takes `paged`: its rows' tokens are in their sessions' pages, where no fused attention reads them. On CUDA
with the kernel wanted: `paged_attention.kernel_attention` over the page table, spans of ROW_SPLIT tokens,
and a paged call decoding alone (a `PagedKVCache`) takes the same kernel over its own table, so it decodes
the same tokens batched or alone; elsewhere the gather reference (`paged_attention.gather_rows`: each row
gathered, then MLX's fused attention, as a paged call alone computes it).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache, KVCache

from kvwake.daemon.kv import cudart, paged_cache
from kvwake.daemon.kv.paged_batch import PagedBatchKVCache
from kvwake.daemon.kv.paged_cache import PagedKVCache
from kvwake.daemon.kv.pages import PageStateError
from kvwake.daemon.model import attention
from kvwake.daemon.model.paged_attention import ROW_SPLIT, gather_rows, kernel_attention, row_attention

__all__ = ["build", "paged", "ragged", "shape_of", "wanted", "warm"]


def wanted(row_kernel: bool) -> bool:
    """Whether batched decode steps take the kernel: asked for (tuning `row_kernel`), and on CUDA."""
    return row_kernel and cudart.on_cuda()


def ragged(fused: Any) -> Any:
    """mlx-lm's `scaled_dot_product_attention` signature: the row kernel for a left-padded batch's decode
    step (module docstring), `fused` for anything else."""
    def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                  mask: Any, sinks: mx.array | None = None) -> mx.array:
        if (queries.shape[2] != 1 or type(cache) not in (BatchKVCache, KVCache) or sinks is not None
                or cache.keys is None or queries.dtype != cache.keys.dtype):
            return fused(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        if type(cache) is BatchKVCache:  # row r: its slots after its left padding, to the batch's end
            starts, end = cache.left_padding.astype(mx.int32), cache._idx
        else:  # a call alone: every slot to its offset (the same for every layer of a step: made once)
            end = cache.offset
            starts, lengths = _alone(queries.shape[0], end)
        try:
            out = row_attention(queries[:, :, 0], cache.keys, cache.values, starts,
                                end - starts if type(cache) is BatchKVCache else lengths, scale, max_tokens=end)
        except ValueError:  # a head shape the kernel does not take
            return fused(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        return out[:, :, None]
    return attention


_last_alone = threading.local()  # per engine thread: the last (rows, offset) and its arrays


def _alone(rows: int, offset: int) -> tuple[mx.array, mx.array]:
    """(starts, lengths) of `rows` rows alone holding `offset` tokens each: made once for the step's layers,
    which all ask for the same (made per layer, each was two small arrays a layer the kernel waited for)."""
    last = getattr(_last_alone, "made", None)
    if last is None or last[0] != (rows, offset):
        # lazy (computed once, in the first layer's pass): an eval here would wait for the queued steps
        starts = mx.zeros((rows,), mx.int32)
        lengths = mx.full((rows,), offset, mx.int32)
        last = _last_alone.made = ((rows, offset), starts, lengths)
    return last[1], last[2]


def paged(inner: Any, kernel: bool) -> Any:
    """mlx-lm's `scaled_dot_product_attention` signature: a paged batch's decode step over its rows' pages,
    and (`kernel`: on CUDA) a paged call alone by the same kernel (module docstring); `inner` for anything
    else. Raises PageStateError for what a paged batch cannot compute (more than one query, sinks)."""
    def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                  mask: Any, sinks: mx.array | None = None) -> mx.array:
        if isinstance(cache, PagedBatchKVCache):
            if queries.shape[2] != 1 or sinks is not None:
                raise PageStateError("a paged batch decodes one query a row, without attention sinks")
            rows = cache.rows
            out = _kernel(queries, cache.pool, cache.layer, rows.page_table(), rows.after, scale) if kernel else None
            if out is None:
                pool = cache.pool
                out = gather_rows(queries[:, :, 0], pool.keys[cache.layer], pool.values[cache.layer],
                                  rows.row_slots(), scale)[:, :, None]
            return out
        if (kernel and type(cache) is PagedKVCache and queries.shape[0] == queries.shape[2] == 1
                and sinks is None and queries.dtype == cache.session.pool.layout.dtype):
            out = _kernel(queries, cache.session.pool, cache.layer, cache.session.page_table(),
                          mx.array([cache.offset], mx.int32), scale)
            if out is not None:
                return out
        return inner(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    return attention


def _kernel(queries: mx.array, pool: Any, layer: int, table: mx.array, lengths: mx.array,
            scale: float) -> mx.array | None:
    """The paged kernel over `layer`'s pools in spans of ROW_SPLIT tokens ([rows, heads, 1, head_dim]);
    None for shapes it does not take (the caller gathers instead)."""
    try:
        out = kernel_attention(queries[:, :, 0], pool.keys[layer], pool.values[layer], table, lengths, scale,
                               pool.layout.page_tokens, split=ROW_SPLIT)
    except ValueError:
        return None
    return out[:, :, None]


def shape_of(model: Any) -> tuple[int, int, int, Any] | None:
    """(query heads, KV heads, head size, dtype) of the model's attention as the row kernel is built for
    them; None for a model whose arguments do not name its heads."""
    args = getattr(attention.text_model(model), "args", None)  # Gemma 3's wrapper: its text model's
    heads = getattr(args, "num_attention_heads", None)
    if heads is None:
        return None
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    dtype = next((v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)),
                 mx.bfloat16)
    return heads, kv_heads, head_dim, dtype


def build(heads: int, kv_heads: int, head_dim: int, dtype: Any, page_tokens: int | None = None,
          row: bool = True) -> bool:
    """Compile the row kernel for these heads and dtype (`row`), and with `page_tokens` the paged kernel for
    pages of that many tokens (a paged batch's): MLX compiles a custom kernel at its first call, which a first
    decode step would otherwise wait for, and keeps it for the process, whichever thread built it. Whether
    the row kernel takes the shape (False: not a shape it takes; a paged batch over a shape the paged kernel
    does not take gathers instead)."""
    queries = mx.zeros((2, heads, head_dim), dtype)
    keys = mx.zeros((2, kv_heads, 64, head_dim), dtype)
    try:
        if row:
            mx.eval(row_attention(queries, keys, keys, mx.array([0, 3], mx.int32), mx.array([64, 61], mx.int32), 1.0))
    except ValueError:
        return False
    if page_tokens:
        pools = mx.zeros((kv_heads, 2 * page_tokens, head_dim), dtype)
        with contextlib.suppress(ValueError):
            mx.eval(kernel_attention(queries, pools, pools, mx.array([[0], [1]], mx.int32),
                                     mx.array([page_tokens, 3], mx.int32), 1.0, page_tokens, split=ROW_SPLIT))
        mx.eval(paged_cache.gather_pages(pools, mx.array([1, 0], mx.int32), page_tokens,  # a padded chunk's copy
                                         mx.array([page_tokens + 3], mx.int32)))
    return True


def warm(model: Any, built: tuple[int, int, int, Any] | None = None, page_tokens: int | None = None,
         paged: tuple[tuple[int, int, int, Any], int] | None = None) -> bool:
    """The row kernel ready for the model (`build`), unless it was built already for its shape (`built`: the
    shape a build beside the weights' load took, model/kernel_cache.py), and the paged kernel for pages of
    `page_tokens` when given, unless built beside the load too (`paged`: its shape and pages). Whether the
    model takes the row kernel."""
    shape = shape_of(model)
    if shape is None:
        return False
    if paged == (shape, page_tokens):
        page_tokens = None
    if shape == built and not page_tokens:
        return True
    return build(*shape, page_tokens=page_tokens, row=shape != built)
