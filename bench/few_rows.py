"""The linear layers' products for a few rows: model/few_rows.py's kernel against MLX's, on the 8B shape (CUDA).

usage: python bench/few_rows.py [--rows 1,2,4,8,16,32] [--sweep] [--out bench/out]

For each of the 8B shape's weights (q and o 4096 x 4096, k and v 1024 x 4096, gate and up 14336 x 4096, down
4096 x 14336, the head 128256 x 4096; bf16) and each count of rows: MLX's `x @ w.T` and the kernel's, ms a
product (the mean of 30 calls of 20 products each) and the weight's bytes over that time; then a decode step's
linear layers (32 layers and the head) each way, and the bound (the weights' bytes at --copy-gbs). First the
checks: the kernel's result against a float32 product (largest difference, beside MLX's own bf16 product's),
a row's result the same bits whatever the other rows and their count, odd column counts. `--sweep`: the
column runs a block (NT 2, 4) and warps a block (2, 4, 8) for each shape at 1 and 8 rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.lib import machine, save  # noqa: E402
from kvwake.daemon.model import few_rows  # noqa: E402

SHAPES = {"q": (4096, 4096), "kv": (1024, 4096), "o": (4096, 4096), "gate": (14336, 4096), "down": (4096, 14336),
          "head": (128256, 4096)}
PER_LAYER = {"q": 1, "kv": 2, "o": 1, "gate": 2, "down": 1}  # gate and up share a shape, k and v


def timed(fn, reps: int = 30) -> float:
    for _ in range(3):
        mx.eval(fn())
    mx.synchronize()
    began = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - began) / reps * 1000


def checks(weights: dict[str, mx.array]) -> list[dict]:
    out = []
    for name, w in [*weights.items(), ("odd", mx.random.normal((1000, 4096)).astype(mx.bfloat16) * 0.02),
                    ("odd2", mx.random.normal((20, 96)).astype(mx.bfloat16) * 0.02)]:
        x = mx.random.normal((few_rows.ROWS, w.shape[1])).astype(mx.bfloat16)
        ref = x.astype(mx.float32) @ w.astype(mx.float32).T
        full = few_rows.kernel_product(x, [w])[0]
        alone = [few_rows.kernel_product(x[m:m + 1], [w])[0] for m in (0, 7, 16, 31)]
        sevens = few_rows.kernel_product(x[:7], [w])[0]
        grouped = few_rows.kernel_product(x, [w, w[:8], w])
        mlx = x @ w.T
        mx.eval(ref, full, alone, sevens, mlx)
        scale = float(mx.abs(ref).max())
        row = {"shape": name, "n": w.shape[0], "k": w.shape[1],
               "kernel_max_diff": round(float(mx.abs(full.astype(mx.float32) - ref).max()), 5),
               "mlx_max_diff": round(float(mx.abs(mlx.astype(mx.float32) - ref).max()), 5), "ref_max": round(scale, 3),
               "rows_alone_same_bits": all(bool(mx.array_equal(a[0], full[m])) for a, m in zip(alone, (0, 7, 16, 31))),
               "first_7_same_bits": bool(mx.array_equal(sevens, full[:7])),
               "grouped_same_bits": all(bool(mx.array_equal(a, b)) for a, b in zip(grouped, (full, full[:, :8], full)))}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def overhead() -> list[dict]:
    """Each way's cost a product beyond its bytes: 500 products of 8 rows by a narrow weight (0.5 MB), the
    graph's building alone (the host's) and then their evaluation, microseconds a product."""
    x = mx.random.normal((8, 1, 4096)).astype(mx.bfloat16)
    w = (mx.random.normal((64, 4096)) * 0.02).astype(mx.bfloat16)
    mx.eval(x, w)
    out = []
    for name, fn in (("mlx", lambda: x @ w.T), ("kernel", lambda: few_rows.kernel_product(x, [w])[0]),
                     ("kernel_of_3", lambda: few_rows.kernel_product(x, [w, w, w])[0])):
        for _ in range(2):
            began = time.perf_counter()
            products = [fn() for _ in range(500)]
            built = time.perf_counter()
            mx.eval(products)
            ended = time.perf_counter()
        row = {"overhead": name, "build_us": round((built - began) / 500 * 1e6, 2),
               "eval_us": round((ended - built) / 500 * 1e6, 2)}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--copy-gbs", type=float, default=2470.0, help="the GPU's measured copy speed, GB/s")
    ap.add_argument("--out", default="bench/out")
    a = ap.parse_args()
    mx.random.seed(0)
    weights = {k: (mx.random.normal(s) * 0.02).astype(mx.bfloat16) for k, s in SHAPES.items()}
    mx.eval(weights)
    began = time.perf_counter()
    few_rows.build(mx.bfloat16)
    compile_s = round(time.perf_counter() - began, 2)
    print(json.dumps({"compile_s": compile_s}), flush=True)
    result = {"machine": machine(), "compile_s": compile_s, "overhead": overhead(), "checks": checks(weights),
              "rows": [], "sweep": []}
    for rows in [int(r) for r in a.rows.split(",")]:
        line: dict = {"rows": rows}
        for name, w in weights.items():
            x = mx.random.normal((rows, w.shape[1])).astype(mx.bfloat16)
            for way, fn in (("mlx", lambda: [x @ w.T for _ in range(20)]),
                            ("kernel", lambda: [few_rows.kernel_product(x, [w])[0] for _ in range(20)])):
                ms = timed(fn) / 20
                line[f"{name}_{way}_ms"] = round(ms, 4)
                line[f"{name}_{way}_tbs"] = round(w.nbytes / ms / 1e9, 2)
        for way in ("mlx", "kernel"):
            line[f"step_{way}_ms"] = round(32 * sum(line[f"{k}_{way}_ms"] * c for k, c in PER_LAYER.items())
                                           + line[f"head_{way}_ms"], 2)
        # the daemon's way: q, k and v in one launch, gate and up in one (model/few_rows.py's groups)
        x = mx.random.normal((rows, 4096)).astype(mx.bfloat16)
        xd = mx.random.normal((rows, 14336)).astype(mx.bfloat16)
        qkv, gu = [weights["q"], weights["kv"], weights["kv"]], [weights["gate"], weights["gate"]]
        layer = lambda: [*few_rows.kernel_product(x, qkv), *few_rows.kernel_product(x, [weights["o"]]),  # noqa: E731
                         *few_rows.kernel_product(x, gu), *few_rows.kernel_product(xd, [weights["down"]])]
        line["step_grouped_ms"] = round(timed(lambda: [y for _ in range(8) for y in layer()]) / 8 * 32
                                        + line["head_kernel_ms"], 2)
        step_bytes = 32 * sum(weights[k].nbytes * c for k, c in PER_LAYER.items()) + weights["head"].nbytes
        line["step_bound_ms"] = round(step_bytes / (a.copy_gbs * 1e9) * 1000, 2)
        line["kernel_over_mlx"] = round(line["step_mlx_ms"] / line["step_kernel_ms"], 2)
        print(json.dumps(line), flush=True)
        result["rows"].append(line)
    if a.sweep:
        for rows in (1, 8):
            for name, w in weights.items():
                x = mx.random.normal((rows, w.shape[1])).astype(mx.bfloat16)
                for nt in (2, 4):
                    for warps in (2, 4, 8):
                        ms = timed(lambda: [few_rows.kernel_product(x, [w], nt=nt, warps=warps)[0]
                                            for _ in range(20)]) / 20
                        row = {"rows": rows, "shape": name, "nt": nt, "warps": warps, "ms": round(ms, 4),
                               "tbs": round(w.nbytes / ms / 1e9, 2)}
                        print(json.dumps(row), flush=True)
                        result["sweep"].append(row)
    save(result, a.out, "few_rows.json")


if __name__ == "__main__":
    main()
