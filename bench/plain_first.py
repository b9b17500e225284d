"""Why a prompt's last chunk is slow at its first attention on the plain path: kernels or first-touched memory.

usage: python bench/plain_first.py [--model tiny|PATH] [--context 7680] [--chunk 318] [--rounds 2] [--json OUT]
       python bench/plain_first.py --model PATH --first-only --warm none|random|model|shapes [--clear] [--json OUT]

In process, one model: a cache of --context tokens (prefilled in 512-token chunks), then a --chunk-token
chunk on the plain attention path (model/attention.py plain_prefill), its layers evaluated one at a time as
the engine's slices do, each timed. A slice of layer i evaluates that layer's keys and values, whose input is
layer i-1's output, so layer 1's time holds the chunk's first attention. On the H100 (session 17) that
one-layer slice took 15.9-18.9 ms against 3-5 ms for each later layer (docs/benchmarks.md). The variants,
each at a key length the process has not seen (the chunk one token longer each time), then once more at the
same length ("again"):
- `plain`: as the engine runs it;
- `touched`: a buffer the size of one piece's float32 scores made and freed first (MLX keeps it in its
  cache), so the scores need no fresh memory: if `plain`'s first attention is slow and this one is not, it
  was the memory's first touch; if both are, kernels built for the shape;
- `pieces`: the scores in pieces of at most 32 MiB (`PLAIN_MAX_BYTES`), small enough to come from buffers
  freed before.
Reported per run: layer 1's ms, the median of layers 2 and up, and their ratio. Session 18 (H100): after the
first run of the process (269 ms: kernels built), `plain` at a new key length took 3.96 ms, so neither new
memory nor a new length makes it slow; the `--first-only` runs below found what does.

`--first-only` (one process per variant: the engine pays it once per process): the daemon's start-up first
(`--warm`: none; `random`, the plain path warmed on contiguous random tensors at 512 queries over 4k and 16k
keys, as the engine did until session 18; `model`, attention.warm_plain through the model over a larger
buffer at 512 queries over the same keys; `shapes`, warm_plain at attention.plain_warm_shapes, as the engine
does now; all then decode warmed at attention.decode_warm_capacities()), `--clear`: MLX's cache of freed
buffers handed back (mx.clear_cache) after it, then the context, then one plain chunk, timed as above.
Session 18 (H100): 313-390 ms unwarmed, 204-215 `random`, 41-60 `model`, 4.5-5.4 ms with the three odd
shapes of plain_warm_shapes alone; `--clear` changed nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def layer_times(model, cache: list, tokens: list[int], variant: str) -> list[float]:  # noqa: ANN001
    """The chunk's forward pass queued on the plain path, then its cache layers evaluated one by one (ms)."""
    import mlx.core as mx

    from kvwake.daemon.model import attention

    n, keys = len(tokens), cache[0].offset + len(tokens)
    was = attention.PLAIN_MAX_BYTES
    if variant == "pieces":
        attention.PLAIN_MAX_BYTES = 32 << 20
    try:
        if variant == "touched":
            heads = model.args.num_attention_heads
            rows = min(n, attention.PLAIN_MAX_BYTES // (heads * keys * 4))
            scratch = mx.zeros((1, heads, rows, keys), dtype=mx.float32)
            mx.eval(scratch)
            del scratch  # back to MLX's cache, the size a piece's scores take
        with attention.plain_prefill(model, max(n, attention.PLAIN_MAX_QUERIES)):
            model(mx.array(tokens, dtype=mx.uint32)[None], cache=cache)
        times = []
        for layer in cache:
            t0 = time.perf_counter()
            mx.eval(layer.state)
            times.append((time.perf_counter() - t0) * 1000)
        return times
    finally:
        attention.PLAIN_MAX_BYTES = was
        for layer in cache:
            layer.trim(n)  # back to the context, for the next run


def warm(model, how: str, clear: bool) -> None:  # noqa: ANN001
    """The engine's start-up warm-ups of the plain path and of decoding (engine.py warm_jobs), as `how` says."""
    import mlx.core as mx

    from kvwake.daemon.model import attention

    if how == "none":
        return
    if how == "shapes":  # as the engine warms now: through the model at each class of shape
        for queries, keys in attention.plain_warm_shapes(512, None):
            attention.warm_plain(model, queries, keys)
    for keys in (4096, 16384) if how != "shapes" else ():
        if how == "model":
            attention.warm_plain(model, 512, keys)
            continue
        shape = attention.PathCosts._shape(model)  # session 17's warm_plain: contiguous random tensors
        _, heads, kv_heads, head_dim, dtype = shape
        q = mx.random.normal((1, heads, 512, head_dim), key=mx.random.key(3)).astype(dtype)
        k = mx.random.normal((1, kv_heads, keys, head_dim), key=mx.random.key(4)).astype(dtype)
        mx.eval(attention.plain_attention(attention._fast_sdpa, 512)(q, k, k, None, head_dim ** -0.5, "causal"))
    for capacity in attention.decode_warm_capacities():
        attention.warm_decode(model, capacity)
    if clear:
        mx.clear_cache()


def main() -> None:
    from batching import bench_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--context", type=int, default=7680)
    ap.add_argument("--chunk", type=int, default=318)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--first-only", action="store_true")
    ap.add_argument("--warm", choices=("none", "random", "model", "shapes"), default="none")
    ap.add_argument("--clear", action="store_true")
    a = ap.parse_args()
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kvwake.daemon.model import memory

    memory.apply_limits()
    with tempfile.TemporaryDirectory() as work:
        model, _ = load(str(bench_model(a.model, Path(work))))
        if a.first_only:
            warm(model, a.warm, a.clear)
        cache = make_prompt_cache(model)
        vocab = model.args.vocab_size
        context = [(i * 37 + 11) % (vocab - 2) + 1 for i in range(a.context)]
        for start in range(0, a.context, 512):
            model(mx.array(context[start : start + 512], dtype=mx.uint32)[None], cache=cache)
            mx.eval([c.state for c in cache])
        # The buffers grown past the longest chunk here, fused (no plain kernel used), then trimmed back: no
        # run below pays a growth, which only the first would (trim keeps the buffer)
        model(mx.array(context[: a.chunk + 2 * a.rounds * 3], dtype=mx.uint32)[None], cache=cache)
        mx.eval([c.state for c in cache])
        for layer in cache:
            layer.trim(a.chunk + 2 * a.rounds * 3)
        rows, length = [], a.chunk
        if a.first_only:
            chunk = [(i * 13 + 7) % (vocab - 2) + 1 for i in range(length)]
            ms = layer_times(model, cache, chunk, "plain")
            later = statistics.median(ms[2:]) if len(ms) > 2 else None  # a model of 2 layers has no later one
            rows.append({"warm": a.warm, "clear": a.clear, "chunk": length, "keys": a.context + length,
                         "layer0_ms": round(ms[0], 2), "layer1_ms": round(ms[1], 2),
                         "later_median_ms": later and round(later, 2),
                         "layer1_over_later": later and round(ms[1] / later, 2),
                         "mlx_cache_bytes": mx.get_cache_memory()})
            print(json.dumps(rows[-1]), flush=True)
            a.rounds = 0
        for r in range(a.rounds):
            for variant in ("plain", "touched", "pieces"):
                for when in ("first", "again"):
                    chunk = [(i * 13 + 7) % (vocab - 2) + 1 for i in range(length)]
                    ms = layer_times(model, cache, chunk, variant)
                    later = statistics.median(ms[2:]) if len(ms) > 2 else float("nan")
                    rows.append({"round": r, "variant": variant, "when": when, "chunk": length,
                                 "keys": a.context + length, "layer0_ms": round(ms[0], 2),
                                 "layer1_ms": round(ms[1], 2) if len(ms) > 1 else None,
                                 "later_median_ms": round(later, 2),
                                 "layer1_over_later": round(ms[1] / later, 2) if len(ms) > 2 else None})
                    print(json.dumps(rows[-1]), flush=True)
                length += 1  # a key length this process has not met, for the next variant's first run
    out = {"device": str(mx.default_device()), "model": a.model, "context": a.context, "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
