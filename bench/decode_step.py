"""Diagnostic: one decode step's time, alone (generate_step) and batched (GenerationBatch), with and
without an attention mask, for batch sizes B; equal-length prompts, so no row is padded.

usage: python bench/decode_step.py --model PATH [--batches 1,8] [--context 1000] [--steps 64]
"""
from __future__ import annotations

import argparse
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import GenerationBatch, StopSequences, generate_step
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=64)
    a = ap.parse_args()
    model, tok = mlx_lm.load(a.model)

    def cache_for(seed: int) -> list:
        c = make_prompt_cache(model)
        prompt = mx.random.randint(0, 500, (a.context,), key=mx.random.key(seed))
        model(prompt[None], cache=c)
        mx.eval([x.state for x in c])
        return c

    def timed(steps) -> float:
        for _ in range(8):
            steps()
        mx.synchronize()
        t = time.perf_counter()
        for _ in range(a.steps):
            steps()
        mx.synchronize()
        return (time.perf_counter() - t) / a.steps * 1000

    gen = generate_step(mx.array([1]), model, prompt_cache=cache_for(0), max_tokens=-1)
    print(f"generate_step B=1: {timed(lambda: next(gen)):.2f} ms/step", flush=True)
    masked = BatchKVCache.make_mask
    for unmasked in (False, True):
        if unmasked:  # valid here only: no row is padded
            BatchKVCache.make_mask = lambda self, N, **kw: None if N == 1 else masked(self, N, **kw)
        for b in [int(x) for x in a.batches.split(",")]:
            caches = [cache_for(i) for i in range(b)]
            merged = [layer.merge([c[i] for c in caches]) for i, layer in enumerate(caches[0])]
            batch = GenerationBatch(model, list(range(b)), mx.array([1] * b), merged, [[] for _ in range(b)],
                                    [None] * b, greedy_sampler, [()] * b, [StopSequences()] * b, [1 << 30] * b)
            ms = timed(batch.next)
            print(f"GenerationBatch B={b} mask={'none' if unmasked else 'array'}: {ms:.2f} ms/step, "
                  f"{b * 1000 / ms:.0f} tok/s", flush=True)
    BatchKVCache.make_mask = masked
    for chunk in (64, 256):  # prefill chunks at new offsets: the first pass meets each shape first
        for attempt in ("first", "again"):
            c = cache_for(0)
            times = []
            for _ in range(8):
                t = time.perf_counter()
                model(mx.random.randint(0, 500, (1, chunk)), cache=c)
                mx.eval([x.state for x in c])
                times.append((time.perf_counter() - t) * 1000)
            print(f"prefill chunk {chunk} at offsets {a.context}+k*{chunk} ({attempt}): "
                  + " ".join(f"{x:.1f}" for x in times) + " ms", flush=True)


if __name__ == "__main__":
    main()
