"""One layer's prefill attention of a turn's chunk on CUDA: at its own shape (causal) against the padded shape turns
share (model/attention.py `padded_attention`: queries to their bucket, keys copied into zeros of their bucket, an
array mask), each the first call at a shape (a cuDNN graph built) and steady. 8B shape (32 heads, 8 KV heads, 128
wide), bf16; ms per layer. JSON lines: python bench/padded_probe.py [--queries 480] [--keys 12000]."""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from kvwake.daemon.model import attention


def timed(f, repeats: int = 1) -> float:
    mx.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        mx.eval(f())
    mx.synchronize()
    return (time.perf_counter() - began) * 1000 / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queries", default="480,470,330")
    ap.add_argument("--keys", default="12000,12007,11500")
    a = ap.parse_args()
    fused = mx.fast.scaled_dot_product_attention
    for q_len, k_len in zip(map(int, a.queries.split(",")), map(int, a.keys.split(","))):
        q = mx.random.normal((1, 32, q_len, 128)).astype(mx.bfloat16)
        k, v = (mx.random.normal((1, 8, k_len, 128)).astype(mx.bfloat16) for _ in range(2))
        mx.eval(q, k, v)
        exact = lambda: fused(q, k, v, scale=128 ** -0.5, mask="causal")  # noqa: E731
        padded = lambda: attention.padded_attention(None)(q, k, v, None, 128 ** -0.5, "causal")  # noqa: E731
        row = {"queries": q_len, "keys": k_len, "padded_shape": [attention.query_bucket(q_len), attention.key_bucket(k_len)]}
        for name, f in (("exact", exact), ("padded", padded)):
            row[f"{name}_first_ms"] = round(timed(f), 2)
            row[f"{name}_steady_ms"] = round(timed(f, 10), 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
