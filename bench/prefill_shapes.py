"""What a short prefill chunk costs at a new cache offset (every agent turn is one), by attention path.

usage: python bench/prefill_shapes.py MODEL [--context 7500] [--chunk 35] [--turns 6] [--costs 1024,4096,...]
                                       [--paths causal,array,plain,steps,causal,bucket]

A cache of --context random tokens, then --turns chunks of --chunk tokens, each at a new offset (as
each turn of a conversation is), timed one by one, evaluated. Paths:
  causal   mlx-lm as it is: mask "causal" into mx.fast.scaled_dot_product_attention
  array    the same kernel given an explicit additive mask array (KVCache.make_mask(return_array=True))
  plain    attention in plain ops (daemon/model/attention.py, what kvwake prefills with on CUDA)
  steps    the chunk fed one token at a time (the decode kernel), for reference
  bucket   the fused kernel at the chunk's query bucket over the whole buffer (attention.bucketed_attention,
           what kvwake runs a short chunk at past kv/capacity.py's CUDNN_MIN): one graph per bucket and
           capacity, with the daemon's CUDA buffer growth installed
MLX on CUDA builds a cuDNN graph per (query length, key length) for fused prefill attention; this
measures whether the other paths avoid that per-turn cost. Prints one JSON line per path.
--costs: also the table the engine chooses a short chunk's path by (attention.PathCosts, one layer, 128
queries) at these key lengths, and what it picks for a --chunk chunk at each.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.models import cache as cache_mod
from mlx_lm.models import llama

from kvwake.daemon.kv import capacity
from kvwake.daemon.model.attention import PathCosts, bucketed_attention, plain_attention


def run(model, context: int, chunk: int, turns: int, path: str) -> list[float]:
    prompt_cache = cache_mod.make_prompt_cache(model)
    tokens = mx.random.randint(0, 1000, (context + chunk * turns,)).astype(mx.uint32)
    for start in range(0, context, 512):
        model(tokens[start:min(context, start + 512)][None], cache=prompt_cache)
        mx.eval([c.state for c in prompt_cache])
    times = []
    for turn in range(turns):
        piece = tokens[context + turn * chunk: context + (turn + 1) * chunk]
        mx.synchronize()
        t0 = time.perf_counter()
        if path == "steps":
            for i in range(chunk):
                model(piece[i:i + 1][None], cache=prompt_cache)
                mx.eval([c.state for c in prompt_cache])
        else:
            out = model(piece[None], cache=prompt_cache)
            mx.eval(out, [c.state for c in prompt_cache])
        mx.synchronize()
        times.append(round((time.perf_counter() - t0) * 1000, 1))
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=7500)
    ap.add_argument("--chunk", type=int, default=35)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--costs", default="")
    ap.add_argument("--paths", default="causal,array,plain,steps,causal")
    a = ap.parse_args()
    model, _ = mlx_lm.load(a.model)
    if a.costs:
        paths = PathCosts.measure(model, [int(k) for k in a.costs.split(",")])
        for k, plain, fused, extra in paths.table:
            chunk_plain, chunk_fused = paths.costs(a.chunk, k)
            print(json.dumps({"keys": k, "layer_ms": {"plain": round(plain * 1e3, 3), "fused": round(fused * 1e3, 3),
                                                      "fused_new_shape_extra": round(extra * 1e3, 3)},
                              "chunk": a.chunk, "chunk_ms": {"plain": round(chunk_plain * 1e3, 1),
                                                             "fused_new": round(chunk_fused * 1e3, 1)},
                              "picks": "plain" if chunk_plain < chunk_fused else "fused",
                              "device": str(mx.default_device())}), flush=True)
    fast_sdpa, make_mask = llama.scaled_dot_product_attention, cache_mod.KVCache.make_mask
    for path in a.paths.split(","):
        llama.scaled_dot_product_attention = plain_attention(fast_sdpa) if path == "plain" else \
            bucketed_attention(fast_sdpa) if path == "bucket" else fast_sdpa
        (capacity.install if path == "bucket" else capacity.uninstall)()
        cache_mod.KVCache.make_mask = (
            (lambda self, n, return_array=False, window_size=None: make_mask(self, n, return_array=True, window_size=window_size))
            if path == "array" else make_mask)
        times = run(model, a.context, a.chunk, a.turns, path)
        print(json.dumps({"path": path, "context": a.context, "chunk": a.chunk, "ms_per_turn": times,
                          "device": str(mx.default_device())}), flush=True)


if __name__ == "__main__":
    main()
