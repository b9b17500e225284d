"""Prefill attention in plain ops on CUDA, where the fused kernel costs a graph build per new shape.

MLX on CUDA runs a prefill chunk's attention (query length > 1) through a cuDNN
graph cached by (query length, key length). Every agent turn prefills its new
tokens at a new offset, so every turn pays a fresh graph build. Measured on the
H100 machine (8B shape, `bench/prefill_shapes.py`): a 35-token chunk over 7.5k
cached tokens took 75-95 ms at a new offset and 14-17 ms once its graph was
cached; in plain ops (matmul, softmax: no per-shape build) 24-65 ms. Same
picture for 200-token chunks over 2k (56-94 ms fused and new, 23-37 ms plain).
Not for long prompts' chunks: with them plain, a 7.5k-token prefill took
1.99 s against 1.30 s fused (512-token chunks), and beside a decoding session
an 8k prefill in 128-token chunks took 3.0 s plain against 1.5 s fused (p99
gap 135 ms against 87) once the fused graphs were built. So the engine uses
it only for a chunk shorter than its prefill step (a turn's input, a prompt's
last piece: key lengths never seen), of at most `PLAIN_MAX_QUERIES` tokens.

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
import sys
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

__all__ = ["PLAIN_MAX_BYTES", "PLAIN_MAX_QUERIES", "plain_attention", "plain_prefill", "wanted"]

# MLX on CUDA keeps the cuDNN graphs of its fused attention in an LRU of MLX_CUDA_SDPA_CACHE_SIZE (256) and
# counts every miss for the life of the process: past twice the capacity, each new shape raises "Cache
# thrashing is happening" (mlx/backend/cuda/lru_cache.h, 0.32). A daemon meets a new (query, key) length at
# most turns, so on the H100 the prefill-cancel tests (prefills stopped at any chunk) failed with it after a
# few hundred. Unless set, the daemon allows 1<<16 graphs (a miss count of 131k before MLX raises); the
# graphs are plans, kept on the host. Read when MLX first runs attention on a thread: set at import.
SDPA_GRAPHS = 1 << 16
os.environ.setdefault("MLX_CUDA_SDPA_CACHE_SIZE", str(SDPA_GRAPHS))

PLAIN_MAX_BYTES = 256 << 20  # float32 scores of one chunk's attention, per layer
PLAIN_MAX_QUERIES = 256  # longer chunks (a long prompt's 512-token ones) are faster fused, graph build included


def wanted() -> bool:
    """Plain prefill attention where it pays: MLX on CUDA (KVWAKE_PLAIN_PREFILL=0 turns it off)."""
    if os.environ.get("KVWAKE_PLAIN_PREFILL", "1") == "0":
        return False
    return mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


def plain_attention(fused: Any) -> Any:
    """mlx-lm's `scaled_dot_product_attention` signature, in plain ops for causal or unmasked chunks."""
    def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                  mask: Any, sinks: mx.array | None = None) -> mx.array:
        b, heads, q_len, _ = queries.shape
        k_len = keys.shape[2]
        causal = isinstance(mask, str) and mask == "causal"
        if (not 1 < q_len <= PLAIN_MAX_QUERIES or hasattr(cache, "bits") or sinks is not None or not (mask is None or causal)
                or heads * q_len * k_len * 4 > PLAIN_MAX_BYTES):  # one query: MLX's vector kernel, no graph
            return fused(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        kv_heads = keys.shape[1]
        # Scores in float32 from float32 inputs, as the fused kernels keep them: bf16 scores (a 2^-8
        # step) would move the softmax. Grouped-query heads by reshape, not by repeating the keys.
        q = (queries.astype(mx.float32) * scale).reshape(b, kv_heads, heads // kv_heads, q_len, -1)
        scores = q @ keys[:, :, None].astype(mx.float32).swapaxes(-1, -2)
        if causal:  # query i sits at key position k_len - q_len + i and sees keys up to it
            rows = mx.arange(k_len - q_len, k_len)[:, None]
            scores = mx.where(mx.arange(k_len)[None] <= rows, scores, -mx.inf)
        out = mx.softmax(scores, axis=-1) @ values[:, :, None].astype(mx.float32)  # float32 throughout
        return out.reshape(b, heads, q_len, -1).astype(values.dtype)
    return attention


@contextlib.contextmanager
def plain_prefill(model: Any) -> Iterator[None]:
    """For one prefill chunk: the model's module computes attention with `plain_attention`."""
    module = sys.modules.get(type(model).__module__)
    fused = getattr(module, "scaled_dot_product_attention", None)
    if fused is None:  # a model that does not take attention from mlx-lm's base: left as it is
        yield
        return
    module.scaled_dot_product_attention = plain_attention(fused)
    try:
        yield
    finally:
        module.scaled_dot_product_attention = fused
