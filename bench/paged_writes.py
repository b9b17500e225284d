"""A decode step's KV writes and attention, alone: pages (a scatter into the pool) against a batch's buffers (a slice).

usage: python bench/paged_writes.py [--rows 8,32] [--context 12288] [--layers 32] [--steps 24] [--out bench/out]

A probe for the paged decode step's cost over the row kernel's (docs/benchmarks.md, "Paged KV in the fleet").
Per step, for every layer, as the decoder's two paths do it:
- `pool`: each row's new token's K and V written into its page's slot (`PagePool.write`: an update of the pools
  [kv_heads, slots, head_dim] at an int32 array of slots, one scatter along the slots), the pool holding the
  rows' pages and a fifth more (as a pool does); `setitem`: the same written as `pool[:, slots] = k` (what
  `PagePool.write` did before: MLX builds index arrays for the heads too);
- `batch`: the same tokens written into a merged batch's buffers [rows, kv_heads, capacity, head_dim] at one
  slot (mlx-lm's `BatchKVCache`: an update of a slice);
each alone (`*_write`) and followed by the layer's attention over what it wrote (`*_step`: the paged kernel over
the page table, the row kernel over the buffers; CUDA only). Reported per step: ms (evaluated step by step),
`encode_ms` (the host's `async_eval` of the step: the kernels launched) and MLX's peak memory over what the arrays
hold (a write that copies its pool instead of updating it in place shows there as a pool's bytes or more).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.lib import machine, save  # noqa: E402
from kvwake.daemon.kv import cudart  # noqa: E402
from kvwake.daemon.model import paged_attention  # noqa: E402

PAGE = 256


def run(step: Callable[[int], list[mx.array]], steps: int) -> dict[str, float]:
    """ms per step evaluated one by one, the encode's ms (median), MLX's peak over the active memory."""
    for i in range(3):
        mx.eval(step(i))
    mx.synchronize()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    encode, began = [], time.perf_counter()
    for i in range(3, 3 + steps):
        out = step(i)
        t = time.perf_counter()
        mx.async_eval(out)
        encode.append(time.perf_counter() - t)
        mx.eval(out)
    ms = (time.perf_counter() - began) * 1000 / steps
    return {"ms": round(ms, 3), "encode_ms": round(statistics.median(encode) * 1000, 3),
            "peak_over_mb": round((mx.get_peak_memory() - held) / 1e6, 1)}


def measure(rows: int, context: int, layers: int, steps: int, heads: tuple[int, int, int]) -> dict[str, Any]:
    q_heads, kv_heads, dim = heads
    dtype = mx.bfloat16
    pages_per_row = -(-(context + steps + 8) // PAGE)
    slots = (rows * pages_per_row * 6 // 5 + 1) * PAGE
    pool_k = [mx.zeros((kv_heads, slots, dim), dtype) for _ in range(layers)]
    pool_v = [mx.zeros((kv_heads, slots, dim), dtype) for _ in range(layers)]
    table = mx.arange(rows * pages_per_row, dtype=mx.int32).reshape(rows, pages_per_row)
    capacity = pages_per_row * PAGE
    buf_k = [mx.zeros((rows, kv_heads, capacity, dim), dtype) for _ in range(layers)]
    buf_v = [mx.zeros((rows, kv_heads, capacity, dim), dtype) for _ in range(layers)]
    new = mx.random.normal((rows, kv_heads, 1, dim)).astype(dtype)
    queries = mx.random.normal((rows, q_heads, dim)).astype(dtype)
    mx.eval(pool_k, pool_v, buf_k, buf_v, new, queries, table)
    scale, starts = dim ** -0.5, mx.zeros((rows,), mx.int32)
    attend = cudart.on_cuda()

    def pool_step(i: int, with_attention: bool, setitem: bool = False) -> list[mx.array]:
        at = mx.array([r * pages_per_row * PAGE + context + i for r in range(rows)], mx.int32)
        lengths = mx.full((rows,), context + i + 1, mx.int32)
        k = new[:, :, 0].transpose(1, 0, 2)  # as PagedBatchKVCache.update_and_fetch hands them to PagePool.write
        outs = []
        for layer in range(layers):
            if setitem:
                pool_k[layer][:, at] = k
                pool_v[layer][:, at] = k
            else:
                pool_k[layer] = mx.put_along_axis(pool_k[layer], at[None, :, None], k, axis=1)
                pool_v[layer] = mx.put_along_axis(pool_v[layer], at[None, :, None], k, axis=1)
            if with_attention:
                outs.append(paged_attention.kernel_attention(queries, pool_k[layer], pool_v[layer], table, lengths,
                                                             scale, PAGE, split=paged_attention.ROW_SPLIT))
        return outs + pool_k + pool_v

    def batch_step(i: int, with_attention: bool) -> list[mx.array]:
        at = context + i
        lengths = mx.full((rows,), at + 1, mx.int32)
        outs = []
        for layer in range(layers):
            buf_k[layer][..., at:at + 1, :] = new
            buf_v[layer][..., at:at + 1, :] = new
            if with_attention:
                outs.append(paged_attention.row_attention(queries, buf_k[layer], buf_v[layer], starts, lengths, scale,
                                                          max_tokens=at + 1))
        return outs + buf_k + buf_v

    result: dict[str, Any] = {"rows": rows, "context": context, "pool_mb": round(pool_k[0].nbytes / 1e6, 1),
                              "buffer_mb": round(buf_k[0].nbytes / 1e6, 1)}
    variants = [("pool_write", lambda i: pool_step(i, False)), ("setitem_write", lambda i: pool_step(i, False, True)),
                ("batch_write", lambda i: batch_step(i, False))]
    if attend:
        variants += [("pool_step", lambda i: pool_step(i, True)), ("setitem_step", lambda i: pool_step(i, True, True)),
                     ("batch_step", lambda i: batch_step(i, True))]
    for _ in range(2):  # alternated: drift shows
        for name, step in variants:
            for key, value in run(step, steps).items():
                result.setdefault(f"{name}_{key}", []).append(value)
    print(result, flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--context", type=int, default=12288)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head size")
    ap.add_argument("--out", default="bench/out")
    a = ap.parse_args()
    heads = tuple(int(h) for h in a.heads.split(","))
    results = [measure(int(r), a.context, a.layers, a.steps, heads) for r in a.rows.split(",")]
    save({"machine": machine(), "heads": heads, "results": results}, a.out, "paged_writes.json")


if __name__ == "__main__":
    main()
