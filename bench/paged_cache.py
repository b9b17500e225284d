"""Paged caches against mlx-lm's KVCache on this machine: a prefill, decode steps, and the bytes that sessions
sharing a prompt hold.

usage: python bench/paged_cache.py [--context 2048] [--steps 32] [--sessions 8] [--out bench/out]

A random-weight llama (testkit.tinymodel, widened: `--hidden`, `--layers`; 4 query heads per KV head, bf16),
one session alone:
- prefill: `--context` tokens in chunks of 512, into a KVCache and into paged caches (kv/paged_cache.py,
  pages of 128 tokens): one whose pages are one run (read as a slice of the pools), one whose pages are out
  of order (gathered); the wall time of each, evaluated chunk by chunk;
- decode: `--steps` single-token steps after it, ms per step (each evaluated), in rounds taken in turn.
Then `--sessions` sessions over one prompt of `--context` tokens, each with a 32-token turn of its own: the
bytes their KVCaches hold (today: each its own buffers) against the bytes of the pages the pool holds (the
first prefills and publishes the prompt, the others map it and prefill their turn).
Results go to <out>/paged_cache.json; docs/benchmarks.md ("Paged caches on the CPU") holds the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvwake.daemon.kv import cache_blocks  # noqa: E402
from kvwake.daemon.kv.pages import PageLayout, PagePool  # noqa: E402
from kvwake.daemon.kv.paged_cache import map_prefix, page_layout, paged_cache, publish  # noqa: E402
from testkit.tinymodel import make_model_dir  # noqa: E402

CHUNK, PAGE, BUNDLE = 512, 128, "ee" * 32


def feed(model, cache: list, ids: list[int], chunk: int) -> float:
    """Feed `ids` in chunks, each evaluated; seconds."""
    started = time.perf_counter()
    for at in range(0, len(ids), chunk):
        mx.eval(model(mx.array([ids[at : at + chunk]]), cache=cache)[:, -1])
    return time.perf_counter() - started


def one_session(model, layout: PageLayout, pages: int, ids: list[int], steps: int,
                rounds: int = 4) -> dict[str, float]:
    """Each kind once untimed (MLX's first calls of a shape), then timed: the prefill, then decode steps in
    `rounds` rounds taken in turn (the machine's other work falls on all alike). Kinds: `kvcache`; `paged`,
    its pages one run (read as a slice of the pools); `gathered`, its pages out of order (each layer
    gathers its tokens every pass, as a session mapping a shared prefix does)."""
    scattered = PagePool(layout, pages)
    scattered.free.reverse()  # pages taken from the last down: no two in a row
    makers = {"kvcache": lambda: make_prompt_cache(model),
              "paged": lambda: paged_cache(PagePool(layout, pages), make_prompt_cache(model)),
              "gathered": lambda: paged_cache(scattered, make_prompt_cache(model))}
    for make in makers.values():
        feed(model, make(), ids[:CHUNK] + ids[:steps], CHUNK)
    caches = {name: make() for name, make in makers.items()}
    out = {f"{name}_prefill_ms": round(feed(model, cache, ids, CHUNK) * 1000, 1) for name, cache in caches.items()}
    spent = dict.fromkeys(caches, 0.0)
    per = max(1, steps // rounds)
    for r in range(rounds):
        for name, cache in caches.items():
            spent[name] += feed(model, cache, ids[r * per : (r + 1) * per], 1)
    out.update({f"{name}_step_ms": round(s * 1000 / (per * rounds), 3) for name, s in spent.items()})
    assert caches["paged"][0].session.run_start() is not None and caches["gathered"][0].session.run_start() is None
    return out


def shared_bytes(model, pool: PagePool, ids: list[int], sessions: int) -> dict[str, int]:
    private, paged = 0, []
    for n in range(sessions):
        turn = [(7 * n + k) % 256 for k in range(32)]
        plain = make_prompt_cache(model)
        feed(model, plain, ids + turn, CHUNK)
        private += cache_blocks.cache_nbytes(plain)
        cache = paged_cache(pool, make_prompt_cache(model))
        done = map_prefix(cache, ids, BUNDLE)
        feed(model, cache, ids[done:] + turn, CHUNK)
        publish(cache, ids + turn, BUNDLE)
        paged.append(cache)
    return {"kvcache_bytes": private, "paged_bytes": pool.bytes_held()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = parser.parse_args(argv)
    heads = args.hidden // 64
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model_dir(Path(tmp) / "model", hidden_size=args.hidden, num_hidden_layers=args.layers,
                                intermediate_size=2 * args.hidden, num_attention_heads=heads,
                                num_key_value_heads=max(1, heads // 4))
        model, _ = load(str(folder))
    blank = make_prompt_cache(model)
    layout = page_layout(blank, cache_blocks.layout(blank, model=model), PAGE, PAGE)
    pages = (args.sessions + 1) * (-(-(args.context + 64) // PAGE) + 1)
    ids = [(31 * k + 7) % 256 for k in range(args.context)]
    result = {"device": str(mx.default_device()), "context": args.context, "hidden": args.hidden,
              "layers": args.layers, **one_session(model, layout, pages, ids, args.steps),
              **shared_bytes(model, PagePool(layout, pages), ids, args.sessions), "sessions": args.sessions}
    result["paged_of_kvcache_bytes"] = round(result["paged_bytes"] / result["kvcache_bytes"], 3)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paged_cache.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
