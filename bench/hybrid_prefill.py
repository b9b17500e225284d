"""A prompt's prefill through mlx-lm alone (no kvwake): a hybrid model against its plain-attention cousin.

usage: python3 bench/hybrid_prefill.py MODEL [MODEL...] [--tokens 10709] [--chunk 2048] [--repeats 3]

Issue 52's fleet on the GPU machine found the Gemma-3-4B shape's first prefill about ten times its cousin's
(docs/benchmarks.md, "Restore points", S35); here on the CPU kvwake's append matched mlx-lm's own prefill for
both. This times mlx-lm's own: the model over mlx-lm's caches in chunks, evaluated after each, best of
`--repeats`, so the GPU's figure can be told apart from kvwake's work. Prints one JSON line per model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.lib import machine  # noqa: E402


def prefill_s(model, tokens: list[int], chunk: int) -> float:
    cache = make_prompt_cache(model)
    mx.synchronize()
    began = time.perf_counter()
    for i in range(0, len(tokens), chunk):
        model(mx.array([tokens[i : i + chunk]]), cache=cache)
        mx.eval([c.state for c in cache])
    mx.synchronize()
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--tokens", type=int, default=10709, help="the prompt's length (the fleet's first prefill)")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print(json.dumps({"machine": machine()}), flush=True)
    for path in a.models:
        model, config = load_model(Path(path))
        vocab = config["vocab_size"]
        tokens = [(i * 7919 + 13) % (vocab - 2) + 1 for i in range(a.tokens)]
        prefill_s(model, tokens[: a.chunk], a.chunk)  # kernels built, not timed
        times = [prefill_s(model, tokens, a.chunk) for _ in range(a.repeats)]
        print(json.dumps({"model": path, "tokens": a.tokens, "chunk": a.chunk, "best_s": round(min(times), 3),
                          "runs_s": [round(t, 3) for t in times]}), flush=True)
        del model
        mx.clear_cache()


if __name__ == "__main__":
    main()
