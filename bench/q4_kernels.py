"""Probe: which of MLX's CUDA kernels a 4-bit model's products compile at first use, how long each compile takes,
and whether a miniature's products (the kernel warmer's) fill the cache the full widths read.

Each stage runs in a process of its own (MLX reads MLX_PTX_CACHE_DIR once): `mini` runs the products at the
miniature's widths, `full` at the 8B shape's, `fresh` the full widths on an empty cache, `rows` the full widths
at the rows where the tile kernel's time meets a dequantized product's; $STAGES picks them (default
"mini full fresh"). Prints one JSON line a product: rows, widths, first and second call ms, steady ms of MLX's
quantized product and of the weight dequantized then multiplied, the modules new in the cache after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = (1, 7, 8, 16, 64, 2048)


def _stage(name: str, widths: list[tuple[int, int]], rows_list: tuple[int, ...] = ROWS) -> None:
    import mlx.core as mx

    cache = Path(os.environ["MLX_PTX_CACHE_DIR"])
    for n, k in widths:
        w = mx.random.normal((n, k)).astype(mx.bfloat16)
        wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
        mx.eval(wq, scales, biases)
        for rows in rows_list:
            x = mx.random.normal((1, rows, k)).astype(mx.bfloat16)
            mx.eval(x)
            before = set(p.name for p in cache.rglob("*") if p.is_file())
            times = []
            for _ in range(2):
                t = time.perf_counter()
                mx.eval(mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4))
                times.append(round((time.perf_counter() - t) * 1e3, 2))
            t = time.perf_counter()
            mx.eval(x @ mx.dequantize(wq, scales, biases, group_size=64, bits=4).T)
            first_deq = round((time.perf_counter() - t) * 1e3, 2)
            t = time.perf_counter()
            for _ in range(5):
                mx.eval(x @ mx.dequantize(wq, scales, biases, group_size=64, bits=4).T)
            deq = round((time.perf_counter() - t) * 1e3 / 5, 2)
            t = time.perf_counter()
            for _ in range(5):
                mx.eval(mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4))
            qmm = round((time.perf_counter() - t) * 1e3 / 5, 2)
            new = sorted(set(p.name for p in cache.rglob("*") if p.is_file()) - before)
            print(json.dumps({"stage": name, "rows": rows, "n": n, "k": k, "first_ms": times[0], "second_ms": times[1],
                              "steady_qmm_ms": qmm, "dequant_first_ms": first_deq, "steady_dequant_ms": deq,
                              "new": new}), flush=True)


MINI = [(256, 256)]
FULL = [(4096, 4096), (14336, 4096)]

if __name__ == "__main__":
    if len(sys.argv) > 1:
        if sys.argv[1] == "rows":  # where the tile kernel's time passes a dequantize's
            _stage("rows", FULL, (64, 96, 128, 192, 256, 384, 512))
        else:
            _stage(sys.argv[1], {"mini": MINI, "full": FULL, "fresh": FULL[:1]}[sys.argv[1]])
        sys.exit(0)
    shared, fresh = tempfile.mkdtemp(), tempfile.mkdtemp()
    stages = [(name, shared if name in ("mini", "full") else fresh) for name in (os.environ.get("STAGES") or "mini full fresh").split()]
    for name, cache in stages:
        t = time.perf_counter()
        subprocess.run([sys.executable, __file__, name], env={**os.environ, "MLX_PTX_CACHE_DIR": cache}, check=False)
        print(json.dumps({"stage": name, "process_s": round(time.perf_counter() - t, 1)}), flush=True)
