"""A lone agent's turn over a long context, its attention alone: over pages against over a buffer.

usage: python bench/paged_turn.py [--layers 32] [--tokens 75000] [--queries 131] [--block 128] [--rounds 5]
                                  [--out bench/out]

Where a paged lone turn's time goes at an agent's length, where its chunk and first token came later than over a
buffer (docs/benchmarks.md, "The paged default's CUDA failures, found"). The same random KV of `--tokens` tokens (the 8B shape: 32 query heads over 8 KV heads of
128, bf16, `--layers` layers) is held in a page pool (pages of `--block` tokens, one run, as a cold prefill leaves
them) and in per-layer buffers (grown as the engine grows them: kv/capacity.py on CUDA). Timed, every layer's
attention evaluated together, medians of `--rounds` (the paths alternated):
- `chunk`: a turn's chunk of `--queries` queries at the context's end on the path the planner gives a lone turn
  past CUDNN_MIN keys: over pages `attention.padded_attention` (the pages copied whole to the key bucket,
  `PagedKVCache.padded`, then the masked fused kernel), over the buffer `attention.bucketed_attention` (the whole
  buffer, masked). `chunk_max_diff`: the largest difference between the two paths' outputs;
- `copy`: the pages' copy alone (`PagedKVCache.padded`), what a chunk attending over the pages in place would save;
- `step`: one decode step's attention for a call alone: over pages the paged kernel (CUDA; elsewhere the one-run
  slice into MLX's fused attention), over the buffer the row kernel (CUDA; elsewhere MLX's fused attention).
Beside each: the bytes of every layer's K and V and those bytes at PEAK_TB_S (the GPU machine's peak), `bound_ms`.
The chunk's projections, MLP and writes are left out: both paths have them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.lib import machine, save  # noqa: E402
from bench.paged_capture import DIM, HEADS, caches  # noqa: E402
from kvwake.daemon.kv import capacity as kvcapacity  # noqa: E402
from kvwake.daemon.model import attention, ragged_decode  # noqa: E402

QUERY_HEADS = 32
PEAK_TB_S = 4.8


def timed(run: Callable[[], list]) -> float:
    """ms of one evaluation of what `run` makes."""
    start = time.perf_counter()
    mx.eval(run())
    return (time.perf_counter() - start) * 1000


def paths(paged: list, plain: list, queries: int) -> dict[str, Callable[[], list]]:
    """Each timed path: what it makes for every layer (module docstring)."""
    scale = DIM ** -0.5
    q = mx.random.normal((1, QUERY_HEADS, queries, DIM), key=mx.random.key(1)).astype(mx.bfloat16)
    one = mx.random.normal((1, QUERY_HEADS, 1, DIM), key=mx.random.key(2)).astype(mx.bfloat16)
    padded = attention.padded_attention(scaled_dot_product_attention)
    bucketed = attention.bucketed_attention(scaled_dot_product_attention)
    kernel = attention.on_cuda()
    over_pages = ragged_decode.paged(scaled_dot_product_attention, kernel)
    over_buffer = ragged_decode.ragged(scaled_dot_product_attention) if kernel else scaled_dot_product_attention

    def own(c: Any) -> tuple[mx.array, mx.array]:
        return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]

    return {
        "chunk_paged": lambda: [padded(q, None, None, c, scale=scale, mask="causal") for c in paged],
        "chunk_plain": lambda: [bucketed(q, *own(c), c, scale=scale, mask="causal") for c in plain],
        "copy": lambda: [c.padded(attention.key_bucket(c.offset)) for c in paged],
        "step_paged": lambda: [over_pages(one, *c.fetch(), c, scale=scale, mask=None) for c in paged],
        "step_plain": lambda: [over_buffer(one, *own(c), c, scale=scale, mask=None) for c in plain],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=75000)
    ap.add_argument("--queries", type=int, default=131)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = ap.parse_args()
    if attention.on_cuda():  # as the engine: buffers on its grid, the row and paged kernels built
        kvcapacity.install()
        ragged_decode.build(QUERY_HEADS, HEADS, DIM, mx.bfloat16, page_tokens=args.block)
    paged, plain = caches(args.layers, args.tokens, args.block)
    runs = paths(paged, plain, args.queries)
    a, b = (mx.concatenate(runs[name](), axis=0).astype(mx.float32) for name in ("chunk_paged", "chunk_plain"))
    chunk_max_diff = mx.abs(a - b).max().item()
    for run in runs.values():  # compiles and graphs once, outside the timing
        timed(run)
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            ms[name].append(timed(run))
    nbytes = 2 * args.layers * HEADS * DIM * 2 * args.tokens
    row: dict[str, Any] = {"tokens": args.tokens, "layers": args.layers, "queries": args.queries, "block": args.block,
                           "bytes": nbytes, "bound_ms": round(nbytes / (PEAK_TB_S * 1e12) * 1000, 2),
                           **{f"{name}_ms": round(statistics.median(v), 2) for name, v in ms.items()},
                           "chunk_max_diff": chunk_max_diff}
    row["chunk_paged_over_plain"] = round(row["chunk_paged_ms"] / row["chunk_plain_ms"], 3)
    row["step_paged_over_plain"] = round(row["step_paged_ms"] / row["step_plain_ms"], 3)
    print(row, flush=True)
    save({"machine": machine(), "rows": [row], "samples_ms": ms}, args.out, "paged_turn.json")


if __name__ == "__main__":
    main()
