"""Continuous persistence's capture of a session's blocks, from pages against from a buffer.

usage: python bench/paged_capture.py [--layers 32] [--tokens 16384] [--spans 16,64] [--rounds 8] [--out bench/out]

A probe for why a paged lone agent's turns waited on `checkpoint.capture_span` jobs where the unpaged ones waited
on none (docs/benchmarks.md, "The paged default on the GPU's suite"). One session's KV of
`--tokens` tokens (the 8B shape's heads: 8 x 128, bf16, `--layers` layers, random) is held twice: in a page pool
(`PagedKVCache`, its pages one run, as a cold prefill leaves them) and in per-layer buffers (`KVCache`). Spans of
blocks are then captured one after another as continuous persistence does, in each of `--forms`: `blocks`
(`cache_blocks.defer_blocks(..., own=True).host()`: each layer's span sliced or gathered, stacked, evaluated and
copied to host memory) and `planes` (`cache_blocks.defer_planed`: the same span made into byte planes on the
device, what a checkpoint takes on CUDA), and the parts timed apart: `lazy_ms` (building the span's arrays),
`eval_ms` (evaluating them on the device) and `host_ms` (their copy to host memory). The paged span is taken as the
capture takes it (a slice of the pool where its pages are one run); `paged_gather`, gathered by token as `blocks`
took it before; `paged_whole`, every token of the layer gathered and the span sliced from it, as `planes` took it
before. Reported: ms per span (median of `--rounds` spans) for each form, source and span size, and their ratios to
the buffer's.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.lib import machine, save  # noqa: E402
from kvwake.daemon.kv import cache_blocks, paged_cache  # noqa: E402
from kvwake.daemon.kv.pages import PageLayout, PagePool  # noqa: E402

HEADS, DIM, BLOCK, CHUNK = 8, 128, 16, 2048


def caches(layers: int, tokens: int, block: int = BLOCK) -> tuple[list, list]:
    """The same random KV of `tokens` tokens in pages of `block` tokens (one run, as a cold prefill leaves them) and
    in buffers (written a chunk at a time, every layer)."""
    layout = PageLayout(layers=layers, kv_heads=HEADS, head_dim=DIM, page_tokens=block, block_tokens=block,
                        dtype=mx.bfloat16)
    pages = -(-tokens // block) + 8
    pool = PagePool(layout, pages, pages)
    paged = paged_cache.paged_cache(pool, [KVCache() for _ in range(layers)])
    plain = [KVCache() for _ in range(layers)]
    for start in range(0, tokens, CHUNK):
        n = min(CHUNK, tokens - start)
        for paged_layer, plain_layer in zip(paged, plain, strict=True):
            k, v = (mx.random.normal((1, HEADS, n, DIM)).astype(mx.bfloat16) for _ in range(2))
            paged_layer.extend(k, v)
            plain_layer.update_and_fetch(k, v)
        mx.eval(pool.keys, pool.values, [c.keys for c in plain], [c.values for c in plain])
    return paged, plain


@contextlib.contextmanager
def taken(how: str) -> Iterator[None]:
    """A paged span taken `how`: "paged", as the capture takes it; "paged_gather", gathered by token even where its
    pages are one run (`PagedKVCache.span` before it read such a span as a slice of the pool); "paged_whole", the
    layer's every token gathered and the span sliced (`defer_planed` before it took the span alone)."""
    real = paged_cache.PagedKVCache.span
    if how == "paged_gather":
        paged_cache.PagedKVCache.span = lambda self, start, stop, view=False: real(self, start, stop)
    elif how == "paged_whole":
        paged_cache.PagedKVCache.span = lambda self, start, stop, view=False: (self.keys[..., start:stop, :],
                                                                               self.values[..., start:stop, :])
    try:
        yield
    finally:
        paged_cache.PagedKVCache.span = real


def capture(cache: list, first: int, span: int, form: str) -> dict[str, float]:
    """One span's capture in `form`, its parts timed (module docstring)."""
    t0 = time.perf_counter()
    deferred = (cache_blocks.defer_planed(cache, first, span, BLOCK) if form == "planes"
                else cache_blocks.defer_blocks(cache, first, span, BLOCK, own=True))
    t1 = time.perf_counter()
    mx.eval(deferred.lazy)
    t2 = time.perf_counter()
    deferred.host()
    t3 = time.perf_counter()
    return {"lazy_ms": (t1 - t0) * 1000, "eval_ms": (t2 - t1) * 1000, "host_ms": (t3 - t2) * 1000,
            "ms": (t3 - t0) * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--spans", default="16,64", help="blocks per span, comma-separated")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--forms", default="blocks,planes", help="capture forms, comma-separated (module docstring)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = ap.parse_args()
    paged, plain = caches(args.layers, args.tokens)
    rows: list[dict[str, Any]] = []
    for form, span in ((f, int(s)) for f in args.forms.split(",") for s in args.spans.split(",")):
        if span * args.rounds * BLOCK > args.tokens:
            raise SystemExit(f"{args.rounds} spans of {span} blocks need {span * args.rounds * BLOCK} tokens")
        before = "paged_whole" if form == "planes" else "paged_gather"
        timed: dict[str, list[dict[str, float]]] = {"paged": [], before: [], "plain": []}
        for r in range(args.rounds):  # the sources in turn, span after span
            for name, cache in (("plain", plain), ("paged", paged), (before, paged)):
                with taken(name):
                    timed[name].append(capture(cache, r * span, span, form))
        row: dict[str, Any] = {"form": form, "blocks": span, "bytes": 2 * args.layers * HEADS * DIM * 2 * span * BLOCK}
        for name, runs in timed.items():
            row[name] = {k: round(statistics.median(run[k] for run in runs), 3) for k in runs[0]}
        row["paged_over_plain"] = round(row["paged"]["ms"] / row["plain"]["ms"], 3)
        row["before_over_plain"] = round(row[before]["ms"] / row["plain"]["ms"], 3)
        rows.append(row)
        print(row, flush=True)
    save({"machine": machine(), "layers": args.layers, "tokens": args.tokens,
          "heads": [HEADS, DIM], "rows": rows}, args.out, "paged_capture.json")


if __name__ == "__main__":
    main()
