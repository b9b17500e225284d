"""Probe: a 4-bit model's products of 1-32 rows (a batch decoding) three ways, on the 8B shape (CUDA).

For each weight of the 8B shape and each count of rows: ms a product by MLX's vector kernel (in pieces of up
to 7 rows from 8 rows: the kernel takes fewer than 8), dequantized (model/quantized.py's way from VECTOR_ROWS),
and by kvwake's kernel (model/quantized_kernel.py, up to its ROWS); a decode step's worth (32 layers and the
head) each way; whether a row's result in pieces and by the kernel is the bits of that row alone; and the
kernel's largest difference from a float32 product of the dequantized weight, beside MLX's dequantized
product's. One JSON line a count of rows."""

from __future__ import annotations

import json
import time

import mlx.core as mx

from kvwake.daemon.model import quantized_kernel

SHAPES = {"q": (4096, 4096), "kv": (1024, 4096), "o": (4096, 4096), "gate": (14336, 4096), "down": (4096, 14336),
          "head": (128256, 4096)}
PER_LAYER = {"q": 1, "kv": 2, "o": 1, "gate": 2, "down": 1}
PIECE = 7


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        mx.eval(fn())
    mx.synchronize()
    began = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - began) / reps * 1000


def main() -> None:
    mx.random.seed(0)
    weights = {}
    for name, (n, k) in SHAPES.items():
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        weights[name] = mx.quantize(w, group_size=64, bits=4)
        mx.eval(weights[name])
        del w

    def qmm(x, q):
        return mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=4)

    def pieces(x, q):
        rows = x.shape[0]
        n = -(-rows // PIECE)
        cuts = [rows * i // n for i in range(n + 1)]
        return mx.concatenate([qmm(x[a:b], q) for a, b in zip(cuts, cuts[1:])]) if n > 1 else qmm(x, q)

    def dequantized(x, q):
        return x @ mx.dequantize(*q, group_size=64, bits=4).astype(x.dtype).T

    def kernel(x, q):
        return quantized_kernel.kernel_product(x, *q)

    for rows in (1, 2, 7, 8, 16, 32):
        line = {"rows": rows}
        for name, q in weights.items():
            x = mx.random.normal((rows, SHAPES[name][1])).astype(mx.bfloat16)
            ways = (("pieces", pieces), ("dequantized", dequantized), ("kernel", kernel))
            for way, fn in ways if rows <= quantized_kernel.ROWS else ways[:2]:
                line[f"{name}_{way}_ms"] = round(timed(lambda: [fn(x, q) for _ in range(10)]) / 10, 4)
            if name == "gate":
                whole = pieces(x, q)
                alone = [qmm(x[r:r + 1], q) for r in range(rows)]
                line["rows_alone_same_bits"] = all(bool(mx.array_equal(a[0], whole[r])) for r, a in enumerate(alone))
                if rows <= quantized_kernel.ROWS:
                    full = kernel(x, q)
                    line["kernel_rows_alone_same_bits"] = all(
                        bool(mx.array_equal(kernel(x[r:r + 1], q)[0], full[r])) for r in range(rows))
                    dense = mx.dequantize(*q, group_size=64, bits=4).astype(mx.float32)
                    ref = x.astype(mx.float32) @ dense.T
                    line["kernel_max_diff"] = round(float(mx.abs(full.astype(mx.float32) - ref).max()), 5)
                    line["dequantized_max_diff"] = round(
                        float(mx.abs(dequantized(x, q).astype(mx.float32) - ref).max()), 5)
        for way in ("pieces", "dequantized", "kernel") if rows <= quantized_kernel.ROWS else ("pieces", "dequantized"):
            line[f"step_{way}_ms"] = round(32 * sum(line[f"{k}_{way}_ms"] * c for k, c in PER_LAYER.items())
                                           + line[f"head_{way}_ms"], 2)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
