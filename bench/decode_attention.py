"""Decode steps on CUDA: MLX's cuDNN attention against its vector kernel, by context length.

MLX on CUDA decodes one token with cuDNN when the keys are a slice of a cache buffer whose capacity is
a multiple of 256 (mlx-lm's KVCache grows by 256), with one cuDNN graph per (batch, capacity) built on
first use; otherwise with its vector kernel (no build). This times, in one process, one session's decode
step with the cache's capacity a multiple of 256 (cuDNN) and not (vector), alternating, at each context
length: the first step at a capacity (the graph build, for cuDNN) and the median of the steady steps.

usage: python bench/decode_attention.py --model /tmp/m8b [--contexts 1024,4096,16384,32768] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def filled_cache(model, context: int, capacity: int) -> list:
    """A KVCache per layer holding `context` tokens of random KV in a buffer of `capacity` tokens."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for c in cache:
        heads, dim = model.args.num_key_value_heads, model.args.hidden_size // model.args.num_attention_heads
        c.keys = (mx.random.normal((1, heads, capacity, dim)) * 0.1).astype(mx.bfloat16)
        c.values = (mx.random.normal((1, heads, capacity, dim)) * 0.1).astype(mx.bfloat16)
        c.offset = context
    mx.eval([c.keys for c in cache] + [c.values for c in cache])
    return cache


def steps(model, cache: list, n: int) -> list[float]:
    times, token = [], mx.array([[42]], dtype=mx.uint32)
    for _ in range(n):
        t0 = time.perf_counter()
        logits = model(token, cache=cache)
        mx.eval(logits)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "decode_attention.json"))
    a = ap.parse_args()
    import mlx_lm
    from suite import machine

    model, _ = mlx_lm.load(a.model)
    steps(model, filled_cache(model, 300, 300 + 100), 3)  # kernels of both kinds built once
    rows = []
    for context in [int(x) for x in a.contexts.split(",")]:
        row: dict = {"context": context}
        for kind, capacity in (("cudnn", context + 256), ("vector", context + 100)):
            times = steps(model, filled_cache(model, context, capacity), a.steps)
            row[kind] = {"capacity": capacity, "first_ms": round(times[0] * 1000, 1),
                         "steady_ms": round(statistics.median(times[3:]) * 1000, 2)}
        row["vector_over_cudnn"] = round(row["vector"]["steady_ms"] / row["cudnn"]["steady_ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"machine": machine(), "model": a.model, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
