"""Decode attention over pages, alone: the paged kernel beside MLX's fused attention over a padded batch.

usage: python bench/paged_decode.py [--rows 1,8,16,32] [--contexts 1024,12288,32768] [--check] [--variants] [--decoder]
                                   [--out bench/out]

For each rows x context (every row that long, its pages scattered over the pool
in random order): the time of one decode step's attention, `--layers` calls
(one per layer) evaluated together, for
- `paged`: `paged_attention.decode_attention` (the CUDA kernel on CUDA, the
  gather path elsewhere), over a page table and lengths;
- `padded`: `mx.fast.scaled_dot_product_attention` over each row's KV held
  contiguous in one [rows, kv_heads, context, head_dim] batch, with the array
  mask a left-padded batch passes (all true here: the rows are equally long),
  and without a mask;
beside the bytes the step must read (every row's K and V, every layer), the
read rate each path reached, and the roofline: those bytes at the copy speed
measured in the same run (a large array copied, its read plus written bytes
over the time). A read-only kernel can pass that rate (docs/benchmarks.md,
"Paged decode attention (issue 51)"). The calls cycle over enough
distinct pools that one step's KV does not sit in the GPU's L2 cache.

`--variants`: the kernel at other spans and threads per token (CUDA).
`--decoder` (CUDA): the paged kernel as the decoder calls it (spans of ROW_SPLIT, each row's pages in order, as a
session takes them) and the row kernel (`row_attention`, the decoder's default path) over the same KV held per row.
`--check`: the kernel against the gather path on ragged rows (bf16 and fp32,
several head shapes): the largest absolute difference of each.

Shape: Llama-3-8B's attention (32 layers, 32 query heads over 8 KV heads of
128, bf16) unless told. Results go to <out>/paged_decode.json;
docs/benchmarks.md ("Paged decode attention (issue 51)") holds the numbers.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.lib import machine, save  # noqa: E402
from kvwake.daemon.model import paged_attention  # noqa: E402

PAGE = 128
L2_SPAN = 1 << 29  # bytes of KV one step cycles over at least: several times any GPU's L2


def copy_speed(gib: int = 2) -> float:
    """Bytes per second of a large copy (read plus written)."""
    x = mx.random.normal((gib << 28,)).astype(mx.bfloat16)  # gib GiB of bf16
    mx.eval(x)
    for _ in range(2):
        mx.eval(x * 1)
    start = time.perf_counter()
    for _ in range(5):
        mx.eval(x * 1)
    return 2 * x.nbytes * 5 / (time.perf_counter() - start)


def timed(step: Any, repeats: int) -> float:
    """Seconds per call of `step` (a function returning arrays), after two warm-up calls."""
    for _ in range(2):
        mx.eval(step())
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(step())
    return (time.perf_counter() - start) / repeats


def pools_for(rows: int, context: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> int:
    """How many distinct layers' KV a step cycles over: enough to pass L2_SPAN, at most the real layers."""
    layer = 2 * rows * context * kv_heads * head_dim * dtype.size
    return max(2, -(-L2_SPAN // layer))


def paged_inputs(rows: int, context: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, rng: random.Random
                 ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """A pool of exactly the rows' pages, each row's pages at random places, and its table and lengths."""
    per_row = -(-context // PAGE)
    order = list(range(rows * per_row))
    rng.shuffle(order)
    shape = (kv_heads, rows * per_row * PAGE, head_dim)
    keys, values = (mx.random.normal(shape).astype(dtype) for _ in range(2))
    table = mx.array([order[r * per_row:(r + 1) * per_row] for r in range(rows)], mx.int32)
    return keys, values, table, mx.full((rows,), context, mx.int32)


def measure(rows: int, context: int, args: argparse.Namespace, speed: float) -> dict[str, Any]:
    dtype, d, hkv, hq = mx.bfloat16, args.head_dim, args.kv_heads, args.q_heads
    rng = random.Random(rows * 7 + context)
    n = min(args.layers, pools_for(rows, context, hkv, d, dtype))
    queries = mx.random.normal((rows, hq, d)).astype(dtype)
    scale = d ** -0.5
    paged = [paged_inputs(rows, context, hkv, d, dtype, rng) for _ in range(n)]
    mx.eval(queries, paged)

    def paged_step() -> list[mx.array]:
        return [paged_attention.decode_attention(queries, *paged[i % n], scale, PAGE) for i in range(args.layers)]

    t_paged = timed(paged_step, args.repeats)
    extra: dict[str, float] = {}
    if args.decoder:  # as the decoder calls them: spans of ROW_SPLIT, a row's pages in order as sessions take them
        ordered = [(k, v, mx.arange(rows * t.shape[1], dtype=mx.int32).reshape(rows, -1), lengths)
                   for k, v, t, lengths in paged]
        extra["paged_decoder_ms"] = timed(lambda: [paged_attention.kernel_attention(
            queries, *ordered[i % n], scale, PAGE, split=paged_attention.ROW_SPLIT) for i in range(args.layers)],
            args.repeats)
        del ordered
    del paged
    contiguous = [tuple(mx.random.normal((rows, hkv, context, d)).astype(dtype) for _ in range(2)) for _ in range(n)]
    mask = mx.ones((rows, 1, 1, context), mx.bool_)
    q4 = queries[:, :, None]
    mx.eval(contiguous, mask)

    def padded_step(with_mask: bool) -> list[mx.array]:
        return [mx.fast.scaled_dot_product_attention(q4, *contiguous[i % n], scale=scale,
                                                     mask=mask if with_mask else None) for i in range(args.layers)]

    t_masked = timed(lambda: padded_step(True), args.repeats)
    t_plain = timed(lambda: padded_step(False), args.repeats)
    if args.decoder:  # the row kernel over the same KV held per row (the decoder's default path)
        starts, full = mx.zeros((rows,), mx.int32), mx.full((rows,), context, mx.int32)
        extra["row_ms"] = timed(lambda: [paged_attention.row_attention(queries, *contiguous[i % n], starts, full, scale)
                                         for i in range(args.layers)], args.repeats)
    del contiguous
    read = 2 * args.layers * rows * context * hkv * d * dtype.size
    roofline = read / speed  # the step's bytes moved at the copy's rate (its read and written bytes together)
    result = {"rows": rows, "context": context, "pools_cycled": n, "bytes_read": read,
              "roofline_ms": round(roofline * 1e3, 3), "paged_ms": round(t_paged * 1e3, 3),
              "padded_masked_ms": round(t_masked * 1e3, 3), "padded_ms": round(t_plain * 1e3, 3),
              "paged_fraction_of_roofline": round(roofline / t_paged, 3),
              **{k: round(v * 1e3, 3) for k, v in extra.items()},
              "read_tb_per_s": {"paged": round(read / t_paged / 1e12, 2), "padded_masked": round(read / t_masked / 1e12, 2),
                                "padded": round(read / t_plain / 1e12, 2)}}
    print(result, flush=True)
    return result


def check() -> list[dict[str, Any]]:
    """The kernel against the gather path on ragged rows, several shapes and both dtypes."""
    out = []
    rng = random.Random(5)
    for hq, hkv, d, page in ((32, 8, 128, 128), (16, 2, 128, 16), (8, 8, 64, 32), (28, 4, 128, 64)):
        for dtype in (mx.bfloat16, mx.float32):
            lengths = [1, 77, page, 3000, 12_345, 0, 511]
            per_row = [-(-n // page) for n in lengths]
            width = max(per_row)
            order = list(range(sum(per_row) + 3))
            rng.shuffle(order)
            table, at = [], 0
            for n in per_row:
                table.append(order[at:at + n] + [0] * (width - n))
                at += n
            keys, values = (mx.random.normal((hkv, len(order) * page, d)).astype(dtype) for _ in range(2))
            queries = mx.random.normal((len(lengths), hq, d)).astype(dtype)
            args = (queries, keys, values, mx.array(table, mx.int32), mx.array(lengths, mx.int32), d ** -0.5, page)
            ref = paged_attention.gather_attention(*args).astype(mx.float32)
            for split in (None, 64):
                got = paged_attention.kernel_attention(*args, split=split).astype(mx.float32)
                error = mx.abs(got - ref).max().item()
                row = {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "page": page, "dtype": str(dtype),
                       "split": split or "auto", "max_abs_error": error}
                print(row, flush=True)
                out.append(row)
    return out


def variants(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The kernel at other spans and threads per token than its defaults, at a long single row and a
    wide long batch (what the defaults were picked against)."""
    out = []
    dtype, d, hkv, hq = mx.bfloat16, args.head_dim, args.kv_heads, args.q_heads
    for rows, context in ((1, 32768), (32, 12288)):
        rng = random.Random(rows)
        n = min(args.layers, pools_for(rows, context, hkv, d, dtype))
        paged = [paged_inputs(rows, context, hkv, d, dtype, rng) for _ in range(n)]
        queries = mx.random.normal((rows, hq, d)).astype(dtype)
        mx.eval(queries, paged)
        for tpt in (8, 16):
            for split in (None, 256, 1024, 4096):
                def step() -> list[mx.array]:
                    return [paged_attention.kernel_attention(queries, *paged[i % n], d ** -0.5, PAGE, split=split,
                                                             threads_per_token=tpt) for i in range(args.layers)]
                row = {"rows": rows, "context": context, "threads_per_token": tpt, "split": split or "auto",
                       "ms": round(timed(step, args.repeats) * 1e3, 3)}
                print(row, flush=True)
                out.append(row)
        del paged
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,8,16,32")
    parser.add_argument("--contexts", default="1024,12288,32768")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--variants", action="store_true", help="also the kernel at other spans and threads per token")
    parser.add_argument("--decoder", action="store_true", help="also the paged kernel as the decoder calls it (spans "
                        "of ROW_SPLIT, pages in order) and the row kernel over the same KV per row (CUDA)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = parser.parse_args()
    report: dict[str, Any] = {"machine": machine(), "shape": {k: getattr(args, k) for k in
                                                              ("layers", "q_heads", "kv_heads", "head_dim")}}
    if args.check:
        report["check"] = check()
        save(report, args.out, "paged_decode.json")
    speed = copy_speed()
    report["copy_bytes_per_s"] = speed
    print(f"copy: {speed / 1e12:.2f} TB/s (read + written)", flush=True)
    report["steps"] = []
    for rows in map(int, args.rows.split(",")):
        for context in map(int, args.contexts.split(",")):
            report["steps"].append(measure(rows, context, args, speed))
            save(report, args.out, "paged_decode.json")
    if args.variants:
        report["variants"] = variants(args)
        save(report, args.out, "paged_decode.json")


if __name__ == "__main__":
    main()
