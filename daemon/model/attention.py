"""Prefill attention in plain ops on CUDA, where the fused kernel costs a graph build per new shape.

MLX on CUDA runs a prefill chunk's attention (query length > 1) through a cuDNN
graph cached by (query length, key length). Every agent turn prefills its new
tokens at a new offset, so every turn pays a fresh graph build. Measured with
`bench/prefill_shapes.py` (docs/decisions.md, "Engine": prefill attention in
plain ops on CUDA): a short chunk at a new offset runs faster in plain ops
(matmul, softmax: no per-shape build) than fused with its graph's build, though
slower than fused once the graph is cached. Not for long prompts' chunks: with
them plain, a long prefill took longer than fused, and slowed a decoding
neighbour more, once the fused graphs were built. So the engine uses it only
for a chunk shorter than its prefill step (a turn's input, a prompt's last
piece: key lengths never seen), of at most `PLAIN_MAX_QUERIES` tokens.
Past CUDNN_MIN keys, where plain ops cost more than a build, such a chunk runs fused
at a shape turns share instead (`bucketed_attention`: queries padded to a power
of two or of 64 over the whole buffer, masked), built once per buffer capacity.

So `plain_prefill(model)` swaps the model module's `scaled_dot_product_attention`
for one that computes softmax(q k^T * scale + causal mask) v in plain ops, for
the duration of one prefill chunk on the engine thread (the only thread that
runs MLX). Scores, softmax and the weighted sum are float32 (the scores take
H x L x K x 4 bytes), as the fused kernels compute them: above `PLAIN_MAX_BYTES`
the fused kernel runs as before, as it does for quantized KV, attention sinks
and array masks. Only where MLX would build cuDNN graphs (CUDA): on the CPU
MLX already runs attention in plain ops (in the input dtype), and Metal's
kernels are not built per shape.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kvwake.daemon.kv import capacity as kvcapacity
from kvwake.daemon.kv import cudart
from kvwake.daemon.kv.paged_cache import PagedKVCache
from kvwake.daemon.model import path_costs

__all__ = ["BUCKET_MIN_QUERIES", "BUCKET_STEP", "KEY_BUCKET_MIN", "KEY_BUCKET_SHARE", "LIKELY_BUCKETS",
           "PADDED_MASK_BYTES", "PLAIN_MAX_BYTES", "PLAIN_MAX_QUERIES", "PathCosts", "attention_module", "bucket_shape", "bucket_wanted",
           "bucketed_attention", "bucketed_prefill", "cuda_graphs", "decode_warm_capacities", "fused_shape",
           "key_bucket", "key_ladder", "on_cuda", "padded_attention", "padded_shape",
           "plain_attention", "plain_prefill", "plain_warm_shapes", "query_bucket", "query_buckets", "swapped",
           "measure_ahead", "text_model", "wanted", "warm_bucket", "warm_decode", "warm_plain"]

# MLX on CUDA keeps the cuDNN graphs of its fused attention in an LRU of MLX_CUDA_SDPA_CACHE_SIZE (256) and
# counts every miss for the life of the process: past twice the capacity, each new shape raises "Cache
# thrashing is happening" (mlx/backend/cuda/lru_cache.h, 0.32). A daemon meets a new (query, key) length at
# most turns, so on CUDA the prefill-cancel tests (prefills stopped at any chunk) failed with it after a
# few hundred (docs/history/benchmarks-journal.md, "The test suite on the GPU machine"). Unless set, the daemon allows
# 1<<16 graphs (a miss count of 131k before MLX raises); the graphs are plans, kept on the host. Read when
# MLX first runs attention on a thread: set at import.
SDPA_GRAPHS = 1 << 16
os.environ.setdefault("MLX_CUDA_SDPA_CACHE_SIZE", str(SDPA_GRAPHS))

# A session decoding alone over a buffer on the 256-token grid decodes on CUDA through a cuDNN graph per
# (batch, capacity), built the first time a step meets it (kv/capacity.py: below CUDNN_MIN buffers stay off
# the grid, so only those from there on are). The daemon's warm-up decodes once off the grid (the vector
# kernel) and once at CUDNN_MIN (cuDNN's decode kernels compiled), off the request path.
def decode_warm_capacities() -> tuple[int, ...]:
    return kvcapacity.capacity(1024), kvcapacity.CUDNN_MIN

PLAIN_MAX_BYTES = 256 << 20  # float32 scores of one chunk's attention, per layer
PLAIN_MAX_QUERIES = 256  # longer chunks (a long prompt's 512-token ones) are faster fused, graph build included
# PathCosts' probe (a turn's chunk of queries, the best of two runs) and key lengths: the kernel warmer's too
PROBE_QUERIES, PROBE_REPEATS = path_costs.PROBE_QUERIES, path_costs.PROBE_REPEATS
# A turn's longer chunk pads its keys to a multiple of the largest power of two <= keys / KEY_BUCKET_SHARE (at
# least KEY_BUCKET_MIN): its graph is shared by turns whose keys fall within the step (`padded_attention`)
KEY_BUCKET_MIN = 1024
PADDED_MASK_BYTES = 64 << 20  # the largest additive mask a paged row pads to (`padded_shape`)
KEY_BUCKET_SHARE = 8


def key_ladder(context: int | None) -> list[int]:
    """Key lengths PathCosts measures at: 1k to 128k by fours, up to the model's context (32k when unknown)."""
    return path_costs.key_ladder(context)


def wanted() -> bool:
    """Plain prefill attention where it pays: MLX on CUDA (docs/decisions.md, "Engine": prefill attention in
    plain ops on CUDA)."""
    return on_cuda()


def bucket_wanted() -> bool:
    """Short chunks over long caches at shared shapes (`bucketed_attention`) where MLX builds a graph per
    shape: where plain prefill is wanted (docs/decisions.md, "Many agents at once (issue 24)": a short chunk
    over a buffer past 16k runs fused at a shared shape)."""
    return wanted()


def on_cuda() -> bool:
    """MLX runs on CUDA here (where it builds kernels and attention graphs per shape)."""
    return cudart.on_cuda()


def cuda_graphs() -> bool | None:
    """Whether MLX records CUDA graphs in this process (`MLX_USE_CUDA_GRAPHS`, read as MLX reads it: C's atoi, so
    "0", "false" or "" is off, unset is on); None where MLX does not run on CUDA. The daemon leaves MLX's
    default (docs/decisions.md, "Many agents at once (issue 24)"); `status().generation.cuda_graphs` says which it runs."""
    if not on_cuda():
        return None
    value = os.environ.get("MLX_USE_CUDA_GRAPHS")
    if value is None:
        return True
    number = re.match(r"\s*([+-]?[0-9]+)", value, re.ASCII)
    return number is not None and int(number.group(1)) != 0


def plain_attention(fused: Any, max_queries: int = PLAIN_MAX_QUERIES) -> Any:
    """mlx-lm's `scaled_dot_product_attention` signature, in plain ops for causal or unmasked chunks of
    2..`max_queries` queries.

    Queries go in pieces whose float32 scores take at most `PLAIN_MAX_BYTES` (one piece up to ~8k keys
    for 32 heads and 256 queries), so a short chunk over a long context runs plain too."""
    def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                  mask: Any, sinks: mx.array | None = None) -> mx.array:
        b, heads, q_len, _ = queries.shape
        k_len = keys.shape[2]
        causal = isinstance(mask, str) and mask == "causal"
        rows = PLAIN_MAX_BYTES // (heads * k_len * 4)  # query rows per piece
        if (not 1 < q_len <= max_queries or hasattr(cache, "bits") or sinks is not None or not (mask is None or causal)
                or rows < 1):  # one query: MLX's vector kernel, no graph
            return fused(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        kv_heads = keys.shape[1]
        # Scores in float32 from float32 inputs, as the fused kernels keep them: bf16 scores (a 2^-8
        # step) would move the softmax. Grouped-query heads by reshape, not by repeating the keys.
        q = (queries.astype(mx.float32) * scale).reshape(b, kv_heads, heads // kv_heads, q_len, -1)
        k32, v32 = keys[:, :, None].astype(mx.float32).swapaxes(-1, -2), values[:, :, None].astype(mx.float32)
        pieces = []
        for start in range(0, q_len, rows):
            end = min(q_len, start + rows)
            scores = q[..., start:end, :] @ k32
            if causal:  # query i sits at key position k_len - q_len + i and sees keys up to it
                at = mx.arange(k_len - q_len + start, k_len - q_len + end)[:, None]
                scores = mx.where(mx.arange(k_len)[None] <= at, scores, -mx.inf)
            pieces.append(mx.softmax(scores, axis=-1) @ v32)  # float32 throughout
        out = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-2)
        return out.reshape(b, heads, q_len, -1).astype(values.dtype)
    return attention


BUCKET_MIN_QUERIES = 16  # the smallest query bucket: a chunk of 2..16 queries pads to 16


BUCKET_STEP = 64  # past it, buckets are its multiples (a 131-token turn pads to 192, not 256)
LIKELY_BUCKETS = (128, 192, 64, 256, 32, 16)  # an agent turn's (a message, a tool's result), likeliest first


def query_bucket(queries: int) -> int:
    """The query length a short chunk's attention pads to: the next power of two up to BUCKET_STEP (at
    least BUCKET_MIN_QUERIES), then the next multiple of BUCKET_STEP."""
    if queries > BUCKET_STEP:
        return -(-queries // BUCKET_STEP) * BUCKET_STEP
    return max(BUCKET_MIN_QUERIES, 1 << (queries - 1).bit_length())


def query_buckets(queries: int) -> list[int]:
    """Every query bucket a chunk of 2..`queries` tokens pads to, the likeliest of an agent's turn first."""
    top = query_bucket(queries)
    buckets = sorted({query_bucket(q) for q in range(2, min(top, BUCKET_STEP) + 1)} |
                     set(range(2 * BUCKET_STEP, top + 1, BUCKET_STEP)))
    return sorted(buckets, key=lambda b: (LIKELY_BUCKETS.index(b) if b in LIKELY_BUCKETS else len(LIKELY_BUCKETS), b))


def bucket_shape(cache: list, tokens: int) -> tuple[int, int] | None:
    """The cuDNN graph a chunk of `tokens` fed to `cache` runs on through `bucketed_attention`: (the
    query bucket, the buffer's capacity once grown). None where the bucket would not be shared: not a
    plain KVCache, or a buffer below kv/capacity.py's CUDNN_MIN (where capacity moves every 256 tokens;
    only installed, on CUDA, is it coarser from there on)."""
    from mlx_lm.models.cache import KVCache

    c = cache[0] if cache else None
    if type(c) is not KVCache or not kvcapacity.installed() or c.offset + tokens < kvcapacity.CUDNN_MIN:
        return None
    return query_bucket(tokens), kvcapacity.grown(c, tokens)


def bucketed_attention(fused: Any) -> Any:
    """mlx-lm's `scaled_dot_product_attention` signature: a chunk's fused attention at a shape its turn
    shares with the next ones.

    MLX on CUDA keys its cuDNN prefill graph by the query and key lengths; a turn over a long context
    meets a new pair each time and builds again. Here the queries pad with zeros to `query_bucket` (a
    power of two to 64, then multiples of 64) and the keys are the cache's whole buffer (its capacity,
    grown by a sixteenth at a time past CUDNN_MIN), masked by an additive array: each query sees the
    keys a causal mask gives it, never a key past the cache's offset (zeros or a rewound token's, and
    they weigh exactly 0). The padded queries' rows are cut off. So turns within one capacity and
    bucket run one graph. The array mask makes cuDNN's kernel slower than the causal one at a known
    shape, and a turn still far cheaper than building each time (docs/decisions.md, "Many agents at once
    (issue 24)": a short chunk over a buffer past 16k runs fused at a shared shape).
    Plain KVCache layers only, causal or unmasked; anything else runs `fused`."""
    from mlx_lm.models.cache import KVCache

    masks: dict[tuple[int, int, int, bool, Any], mx.array] = {}  # one per chunk shape: every layer shares it

    def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                  mask: Any, sinks: mx.array | None = None) -> mx.array:
        causal = isinstance(mask, str) and mask == "causal"
        if (type(cache) is not KVCache or queries.shape[2] < 2 or sinks is not None or not (mask is None or causal)
                or not _own_keys(queries, keys, values, cache)):
            return fused(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        return _bucketed(queries, cache.keys, cache.values, keys.shape[2], scale, causal, masks)
    return attention


def key_bucket(keys: int) -> int:
    """The key length a turn's chunk pads its keys to (`padded_attention`): the next multiple of the largest
    power of two <= keys / KEY_BUCKET_SHARE, at least KEY_BUCKET_MIN (at most an eighth more keys)."""
    step = max(KEY_BUCKET_MIN, 1 << max(0, (keys // KEY_BUCKET_SHARE).bit_length() - 1))
    return -(-keys // step) * step


def padded_shape(cache: list, tokens: int) -> tuple[int, int] | None:
    """The cuDNN graph a chunk of `tokens` fed to `cache` runs on through `padded_attention`: (its query
    bucket, its key bucket). None where the first layer is not a plain KVCache or a paged one, or, for a KVCache,
    from CUDNN_MIN keys on: a copy of a long cache's keys per layer (400 MB a layer at 100k for the 8B shape) and
    its mask are not worth a graph's build there, where its chunks share the whole buffer's shape instead
    (`bucket_shape`). A paged layer has no buffer to share, and its attention reads a copy of its pages anyway
    (kv/paged_cache.py `fetch`): its chunks pad at any length whose mask stays within PADDED_MASK_BYTES (without
    it, each row of a pack of agents' turns built a graph of its own: docs/benchmarks.md, "Paged KV in the
    fleet")."""
    from mlx_lm.models.cache import KVCache

    c = cache[0] if cache else None
    paged = type(c) is PagedKVCache
    if not (type(c) is KVCache or paged) or (not paged and c.offset + tokens >= kvcapacity.CUDNN_MIN):
        return None
    shape = query_bucket(tokens), key_bucket(c.offset + tokens)
    # a padded row's additive mask is held for its whole pass: a long context's would take GBs across a pack
    if paged and shape[0] * shape[1] * c.session.pool.layout.dtype.size > PADDED_MASK_BYTES:
        return None
    return shape


def padded_attention(fused: Any) -> Any:
    """mlx-lm's `scaled_dot_product_attention` signature: a turn's chunk of more queries than plain ops take,
    fused at a shape other turns share: its queries padded to `query_bucket`, its keys and values copied
    into zeros of `key_bucket` length, an additive mask hiding the padding.

    Such a chunk (a tool's result, a user's message: 257 to 2,047 tokens on CUDA) over a cache below
    CUDNN_MIN ran fused at its own (queries, keys), a cuDNN graph built for it alone, one for each row of a pack
    of agents' turns whose histories differ (docs/benchmarks.md, "fleet": the pack's cost). The planner pads
    the rows of such a pack only (scheduler/prefill.py `_pack_chunk`).
    The copy (the row's keys and values once per layer, a few MB) is what sharing costs; padded keys weigh
    exactly 0. Causal or unmasked chunks of plain (non-quantized) KV without sinks; anything else runs
    `fused`."""
    masks: dict[tuple[int, int, int, bool, Any], mx.array] = {}  # one per row shape: every layer shares it

    def attention(queries: mx.array, keys: mx.array | None, values: mx.array | None, cache: Any, scale: float,
                  mask: Any, sinks: mx.array | None = None) -> mx.array:
        causal = isinstance(mask, str) and mask == "causal"
        simple = queries.shape[2] >= 2 and sinks is None and not hasattr(cache, "bits") and (mask is None or causal)
        if type(cache) is PagedKVCache:
            # a paged layer's pages gathered straight to the padded length; the keys passed (a gather by token), or
            # None from a pack (model/packing.py: `reads_pages`), then are not read
            k_len = cache.offset
            whole = cache.padded(key_bucket(k_len)) if simple and queries.dtype == cache.session.pool.layout.dtype \
                and (keys is None or keys.shape[2] == k_len) else None
            if whole is not None:
                return _bucketed(queries, *whole, k_len, scale, causal, masks)
            if keys is None:
                keys, values = cache.fetch()
        if not (simple and queries.dtype == keys.dtype == values.dtype):
            return fused(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        k_len = keys.shape[2]
        pad = [(0, 0), (0, 0), (0, key_bucket(k_len) - k_len), (0, 0)]
        return _bucketed(queries, mx.pad(keys, pad), mx.pad(values, pad), k_len, scale, causal, masks)
    attention.reads_pages = True  # a pack's paged rows need not fetch their keys for it
    return attention


def _own_keys(queries: mx.array, keys: mx.array, values: mx.array, cache: Any) -> bool:
    """The keys and values are the cache's first `offset` tokens as it holds them, in the queries' dtype: what
    the whole buffer stands for. A model that changes them after the cache's update (mlx-lm's plamo tiles
    the KV heads, stablelm casts to float32) runs the fused kernel on what it passes."""
    held = cache.keys
    return (held is not None and keys.shape == (*held.shape[:2], cache.offset, held.shape[3])
            and values.shape[:3] == keys.shape[:3] and values.shape == (*cache.values.shape[:2], cache.offset,
                                                                      cache.values.shape[3])
            and queries.dtype == keys.dtype == held.dtype == values.dtype == cache.values.dtype)


def _bucketed(queries: mx.array, keys: mx.array, values: mx.array, k_len: int, scale: float, causal: bool,
              masks: dict[tuple[int, int, int, bool, Any], mx.array]) -> mx.array:
    """Attention of `queries` (the chunk's last at key k_len - 1) over the first k_len of `keys` and
    `values` (whole buffers), run at (query_bucket, the buffers' length): see `bucketed_attention`."""
    b, heads, q_len, dim = queries.shape
    capacity, bucket = keys.shape[2], query_bucket(q_len)
    key = (q_len, k_len, capacity, causal, queries.dtype)
    additive = masks.get(key)
    if additive is None:
        # Query i (a padded one as the last real one) sees keys up to k_len - q_len + i, or all k_len.
        rows = mx.minimum(mx.arange(bucket), q_len - 1) + (k_len - q_len) if causal else mx.full((bucket,), k_len - 1)
        seen = mx.arange(capacity)[None] <= rows[:, None]
        additive = mx.where(seen, mx.array(0, queries.dtype), mx.array(-mx.inf, queries.dtype))[None, None]
        masks[key] = additive
    # Row-contiguous queries, padded or not: cuDNN's graph is keyed by their strides too.
    queries = mx.concatenate([queries, mx.zeros((b, heads, bucket - q_len, dim), queries.dtype)], axis=2) \
        if bucket > q_len else mx.contiguous(queries)
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=additive)
    return out[:, :, :q_len]


def warm_bucket(model: Any, bucket: int, capacity: int, like: mx.array | None = None) -> bool:
    """One layer's `bucketed_attention` at (bucket, capacity) on zeros of the model's attention shape: the
    cuDNN graph a short chunk over a buffer of that capacity runs on, built before a turn needs it (a
    build is a long stall for a turn). `like`: a layer's KV buffer, whose heads, head size and dtype
    the graph is built for (else the model's args and its first floating parameter's dtype). False when
    the model's args do not give its shape."""
    shape = PathCosts._shape(model)
    if shape is None:
        return False
    _, heads, kv_heads, head_dim, dtype = shape
    if like is not None:
        kv_heads, head_dim, dtype = like.shape[1], like.shape[3], like.dtype
    keys = mx.zeros((1, kv_heads, capacity, head_dim), dtype)
    queries = mx.zeros((1, heads, bucket, head_dim), dtype)
    mx.eval(_bucketed(queries, keys, keys, capacity, head_dim ** -0.5, True, {}))
    return True


def fused_shape(cache: list, tokens: int) -> tuple[int, int, int] | None:
    """What MLX's cuDNN graph for a chunk of `tokens` fed to `cache` is built for: (queries, keys, the
    buffer's capacity once grown for them; cuDNN's cache key holds the keys' strides, so a buffer of
    another capacity is another graph; a paged layer's attention reads a copy of its tokens, no longer than
    them). None when the first layer is neither a plain KVCache nor a paged one."""
    from mlx_lm.models.cache import KVCache

    c = cache[0] if cache else None
    if type(c) is PagedKVCache:
        return tokens, c.offset + tokens, c.offset + tokens
    if type(c) is not KVCache:
        return None
    return tokens, c.offset + tokens, kvcapacity.grown(c, tokens)


def plain_warm_shapes(prefill_step: int, context: int | None) -> list[tuple[int, int]]:
    """(queries, cached keys) the plain path is warmed at (`warm_plain`; its attention then runs over keys +
    queries). MLX on CUDA builds its kernels per class of shape, not per shape: a full chunk (aligned) and
    query counts and key lengths off every alignment (317 over 7,001: 7,318 keys; 129 over 2,049; 255 over
    16,387), in one, two and three pieces of scores for 32 heads. Measured with `bench/plain_first.py
    --first-only` (docs/decisions.md, "Many agents at once (issue 24)": the plain path warmed at unaligned
    shapes): a process's first unaligned chunk stayed slow after warm-ups at aligned shapes, whatever their
    number of pieces, and ran at its steady speed after the three unaligned shapes alone: alignment made
    the difference. Odd key lengths (the chunk's was even) were not measured apart.
    Shapes past the model's context are left out."""
    shapes = [(prefill_step, 4096), (317, 7001), (129, 2049), (255, 16387)]
    return [(q, k) for q, k in shapes if context is None or q + k <= context]


def warm_plain(model: Any, queries: int, keys: int) -> bool:
    """A chunk of `queries` tokens through the model on the plain path, over a cache of `keys` tokens whose
    buffers hold more than that, as a session's do (keys read from a slice of a larger buffer, so strided),
    its layers' caches evaluated as a chunk's slices are: every kernel of a real chunk's plain path built
    before a request needs them (`plain_warm_shapes` says at which shapes): unwarmed, the first plain slices
    beside a decoding call wait for NVRTC compiling them, many times a warm slice. The model is left
    as it was; False when its cache is not plain KV layers or its module takes attention from elsewhere than
    mlx-lm's base (nothing the plain path would run)."""
    if attention_module(model) is None:
        return False
    cache = _filled_cache(model, keys, kvcapacity.capacity(keys + queries))
    if cache is None:
        return False
    with plain_prefill(model, queries):
        model(mx.zeros((1, queries), dtype=mx.uint32), cache=cache)
        # The first layer whole (the second's keys and values are its output) builds every kernel the others
        # would, all layers having one shape: the rest of the graph is dropped unevaluated, so the job takes
        # about a layer's time, not a chunk's, and a request that comes meanwhile waits that much at most.
        mx.eval(cache[1].state if len(cache) > 1 else cache[0].state)
    return True


def _filled_cache(model: Any, tokens: int, capacity: int) -> list | None:
    """A fresh cache for `model` whose layers hold `tokens` tokens (zeros) in buffers of `capacity`; None
    when its cache is not plain KV layers."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    if not cache or not all(type(c) is KVCache for c in cache):
        return None
    mx.eval(model(mx.array([[0]], dtype=mx.uint32), cache=cache))  # each layer's buffer: its shape and dtype
    for c in cache:
        b, heads, _, dim = c.keys.shape
        c.keys = mx.zeros((b, heads, capacity, dim), c.keys.dtype)
        c.values = mx.zeros((b, heads, capacity, c.values.shape[-1]), c.values.dtype)
        c.offset = tokens
    return cache


def warm_decode(model: Any, capacity: int) -> bool:
    """One decode step of one row whose KV buffer holds `capacity` tokens, all of them used (on CUDA: the
    cuDNN decode graph for that capacity built, its kernels compiled). The model is left as it was; False
    when its cache is not plain KV layers (nothing to warm)."""
    # the step's token fills the buffer: its keys are a whole-capacity slice
    cache = _filled_cache(model, capacity - 1, capacity)
    if cache is None:
        return False
    mx.eval(model(mx.array([[0]], dtype=mx.uint32), cache=cache))
    return True


def plain_prefill(model: Any, max_queries: int = PLAIN_MAX_QUERIES) -> contextlib.AbstractContextManager[None]:
    """For one prefill chunk: the model's module computes attention with `plain_attention`."""
    return swapped(model, lambda fused: plain_attention(fused, max_queries))


def bucketed_prefill(model: Any) -> contextlib.AbstractContextManager[None]:
    """For one prefill chunk: the model's module computes attention with `bucketed_attention`."""
    return swapped(model, bucketed_attention)


def text_model(model: Any) -> Any:
    """The model whose layers run the text: `model` itself, or the language model a multimodal wrapper forwards
    to (mlx-lm's gemma3, the model type of Gemma 3's 4B, 12B and 27B checkpoints: `language_model`, a
    gemma3_text model)."""
    inner = getattr(model, "language_model", None)
    return inner if isinstance(inner, nn.Module) else model


def attention_module(model: Any) -> Any:
    """The module of `model`'s text model's class if it takes `scaled_dot_product_attention` from mlx-lm's base
    (what the plain and bucketed paths swap), else None."""
    module = sys.modules.get(type(text_model(model)).__module__)
    return module if getattr(module, "scaled_dot_product_attention", None) is not None else None


@contextlib.contextmanager
def swapped(model: Any, make: Callable[[Any], Any]) -> Iterator[None]:
    """The model's module's `scaled_dot_product_attention` replaced by make(it) while inside."""
    module = attention_module(model)
    if module is None:  # a model that does not take attention from mlx-lm's base: left as it is
        yield
        return
    fused = module.scaled_dot_product_attention
    module.scaled_dot_product_attention = make(fused)
    try:
        yield
    finally:
        module.scaled_dot_product_attention = fused


# PathCosts' rows measured in this process, by attention shape and probe, then by key length (`PathCosts.steps`)
_measured: dict[tuple[Any, ...], dict[int, tuple[int, float, float, float]]] = {}
_measured_lock = threading.Lock()


class PathCosts:
    """Which path a prefill chunk's attention should take, from measured costs at its key length.

    `measure` times one layer's attention of `queries` queries on random tensors of the model's
    attention shape, at a ladder of key lengths: plain ops, the fused kernel at a shape it ran
    before, and the fused kernel at a shape it never ran (on CUDA: the cuDNN graph build). A chunk
    of q queries over k keys then costs, for all `layers`, plain: layers x plain(k) x q / queries;
    fused: the same with fused(k), plus the build when its shape is new to this process (the caller
    knows: the engine records every shape it ran fused, `fused_shape`). Costs between two measured key
    lengths are interpolated, beyond the last scaled with k. `plain(q, k, new)` says which is cheaper.
    """

    def __init__(self, layers: int, queries: int, table: list[tuple[int, float, float, float]]) -> None:
        self.layers, self.queries = layers, queries
        self.table = sorted(table)  # (key length, plain s, fused s, fused first-shape extra s) per layer

    @classmethod
    def measure(cls, model: Any, key_lengths: list[int], queries: int = PROBE_QUERIES,
                repeats: int = PROBE_REPEATS) -> PathCosts | None:
        """Costs for `model`'s attention shape (None when its args do not give it)."""
        got: list[PathCosts | None] = []
        for step in cls.steps(model, key_lengths, got.append, queries, repeats):
            step()
        return got[0]

    @classmethod
    def known(cls, model: Any, key_lengths: list[int], queries: int = PROBE_QUERIES, repeats: int = PROBE_REPEATS,
              kept: bool = False, named: Any = None) -> PathCosts | None:
        """The costs at every one of `key_lengths` where this process measured them, or (`kept`) the machine's costs
        file holds them (model/path_costs.py; `named`: the dtype its rows are keyed by, the checkpoint's as
        `kernel_cache.weights_dtype` reads it, where it is not the measured one); else None."""
        shape = cls._shape(model)
        if shape is None:
            return None
        layers, *measure = shape
        rows = cls._rows((*measure, queries, repeats), kept, named)
        return cls(layers, queries, [rows[k] for k in key_lengths]) if all(k in rows for k in key_lengths) else None

    @staticmethod
    def _rows(key: tuple, kept: bool, named: Any = None) -> dict[int, tuple[int, float, float, float]]:
        """This process's rows for a measure's key, with (`kept`) the costs file's merged in first (read before the
        lock: other engines' measures do not wait on the file)."""
        stored = path_costs.stored_costs(PathCosts._file_key(key, named)) if kept else {}
        with _measured_lock:
            for k, row in stored.items():
                _measured.setdefault(key, {}).setdefault(k, (k, *row))
            return dict(_measured.get(key, {}))

    @staticmethod
    def _file_key(key: tuple, named: Any = None) -> str:
        heads, kv_heads, head_dim, dtype, queries, repeats = key
        return path_costs.costs_key(heads, kv_heads, head_dim, named or dtype, queries, repeats)

    @classmethod
    def steps(cls, model: Any, key_lengths: list[int], done: Callable[[PathCosts | None], Any],
              queries: int = PROBE_QUERIES, repeats: int = PROBE_REPEATS,
              kept: bool = False, named: Any = None) -> list[Callable[[], None]]:
        """`measure` as short jobs, one per key length (each a few of the fused kernel's graph builds); the
        last calls done(costs). Run in order, on the thread that runs the model.

        Once per process for an attention shape and key length (`_measured`): MLX keeps a fused graph for the
        process, so a second engine of the shape (a twin, a model reloaded after an unload, one of another context
        whose ladder shares lengths) measured no build at the probe's new shape, which the first had built, and
        took the fused kernel where the first took plain ops: the same chunk then ran on another path in each, to
        other bits (docs/decisions.md, "One measure of the attention paths per process"). `kept`: with the machine's
        costs file (model/path_costs.py): its rows taken as measured, and each row measured here kept there."""
        return cls.steps_for(cls._shape(model), key_lengths, done, queries, repeats, kept, named)

    @classmethod
    def steps_for(cls, shape: tuple[int, int, int, int, Any] | None, key_lengths: list[int],
                  done: Callable[[PathCosts | None], Any], queries: int = PROBE_QUERIES, repeats: int = PROBE_REPEATS,
                  kept: bool = False, named: Any = None) -> list[Callable[[], None]]:
        """`steps` for an attention shape (`_shape`'s: layers, heads, KV heads, head size, dtype)."""
        if shape is None:
            return [lambda: done(None)]
        layers, heads, kv_heads, head_dim, dtype = shape
        key = (heads, kv_heads, head_dim, dtype, queries, repeats)
        # `kept`: the machine's costs file's rows, and each row measured here kept there
        known = cls._rows(key, kept, named)
        missing = [k for k in key_lengths if k not in known]  # another context's ladder: only its own lengths

        def table() -> list[tuple[int, float, float, float]]:
            with _measured_lock:
                rows = _measured.get(key, {})
                return [rows[k] for k in key_lengths]

        def one(k: int, last: bool) -> None:
            row = (k, *_timed_paths(heads, kv_heads, head_dim, dtype, queries, k, repeats))
            with _measured_lock:  # two engines measuring at once: the first to finish a length is every one's
                row = _measured.setdefault(key, {}).setdefault(k, row)
            if kept:  # the row this process uses, whichever engine measured it
                path_costs.store_cost(cls._file_key(key, named), k, row[1:])
            if last:
                done(cls(layers, queries, table()))
        if not missing:
            return [lambda: done(cls(layers, queries, [known[k] for k in key_lengths]))]
        return [lambda k=k, last=i == len(missing) - 1: one(k, last) for i, k in enumerate(missing)]

    @staticmethod
    def _shape(model: Any) -> tuple[int, int, int, int, Any] | None:
        args = getattr(text_model(model), "args", None)
        dtype = next((v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)),
                     mx.float16)
        return PathCosts._args_shape(args, dtype, len(getattr(model, "layers", [])))

    @staticmethod
    def _args_shape(args: Any, dtype: Any, layers: int = 0) -> tuple[int, int, int, int, Any] | None:
        """(layers, heads, KV heads, head size, dtype) from a model's args (or a config's keys as attributes)."""
        shape = path_costs.attention_shape(lambda name: getattr(args, name, None))
        layers = getattr(args, "num_hidden_layers", None) or layers
        return (layers, *shape, dtype) if shape and layers else None

    def costs(self, q: int, k: int, new: bool = True) -> tuple[float, float]:
        """(plain, fused) seconds for a chunk of q queries over k keys, all layers; `new`: its fused
        graph would be built (a shape this process never ran fused)."""
        plain, fused, extra = self._at(k)
        scale = self.layers * q / self.queries
        return plain * scale, fused * scale + (extra if new else 0.0)

    def plain(self, q: int, k: int, new: bool = True, fused_at: tuple[int, int] | None = None) -> bool:
        """True when plain ops are cheaper for this chunk; `fused_at`: the (queries, keys) the fused kernel
        would run it at (`bucketed_attention`'s padded shape) when not (q, k)."""
        plain = self.costs(q, k)[0]
        fused = self.costs(*(fused_at or (q, k)), new)[1]
        return plain < fused

    def _at(self, k: int) -> tuple[float, float, float]:
        table = self.table
        if k <= table[0][0]:
            return table[0][1:]
        for (k0, *lo), (k1, *hi) in zip(table, table[1:]):
            if k <= k1:
                w = (k - k0) / (k1 - k0)
                return tuple(a + w * (b - a) for a, b in zip(lo, hi))  # type: ignore[return-value]
        last_k, plain, fused, extra = table[-1]
        return plain * k / last_k, fused * k / last_k, extra


def measure_ahead(config: dict[str, Any], dtype: Any, context: int | None) -> int:
    """The kernel warmer's "paths" part (model/kernel_cache.py): the costs `PathCosts.steps` measures, at the shape
    of the model `config` (its text config) describes and at every key length of its context's ladder, measured
    where the machine's costs file lacks them and kept there, for the engine to take before it serves. Returns
    how many rows were measured."""
    shape = PathCosts._args_shape(SimpleNamespace(**config), dtype)
    if shape is None:
        return 0
    ladder = key_ladder(context)
    known = PathCosts._rows((*shape[1:], PROBE_QUERIES, PROBE_REPEATS), kept=True)
    missing = [k for k in ladder if k not in known]
    for step in PathCosts.steps_for(shape, ladder, lambda costs: None, kept=True) if missing else ():
        step()
    return len(missing)


def _fast_sdpa(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
               sinks: mx.array | None = None) -> mx.array:
    """MLX's fused attention under mlx-lm's signature: what `plain_attention` falls back to off the model."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def _timed_paths(heads: int, kv_heads: int, head_dim: int, dtype: Any, queries: int, keys: int,
                 repeats: int) -> tuple[float, float, float]:
    """(plain, fused at a known shape, fused's extra at a new shape) seconds of one layer's attention."""
    fused = mx.fast.scaled_dot_product_attention
    plain = plain_attention(_fast_sdpa)
    # Own keys: MLX's global random state (what a caller may have seeded) is left as it was.
    k = mx.random.normal((1, kv_heads, keys, head_dim), key=mx.random.key(1)).astype(dtype)
    v = mx.random.normal((1, kv_heads, keys, head_dim), key=mx.random.key(2)).astype(dtype)
    mx.eval(k, v)

    def timed(fn: Any, q_len: int) -> float:
        q = mx.random.normal((1, heads, q_len, head_dim), key=mx.random.key(q_len)).astype(dtype)
        mx.eval(q)
        start = time.perf_counter()
        mx.eval(fn(q))
        return time.perf_counter() - start

    scale = head_dim ** -0.5
    run_plain = lambda q: plain(q, k, v, None, scale, "causal")  # noqa: E731
    run_fused = lambda q: fused(q, k, v, scale=scale, mask="causal")  # noqa: E731
    timed(run_plain, queries)  # kernels and buffers once, for both paths
    timed(run_fused, queries)
    first = timed(run_fused, queries + 1)  # a query length not run before: a new shape
    extra = max(0.0, first - timed(run_fused, queries + 1))
    plain_s = min(timed(run_plain, queries) for _ in range(repeats))
    fused_s = min(timed(run_fused, queries) for _ in range(repeats))
    return plain_s, fused_s, extra
