"""Capture a real KV cache of the default model into an .npz file.

The store's codec and block tests want real KV, not random numbers: this
runs a ChatML prompt of exactly ``--tokens`` tokens through the model in
chunks and saves what mlx-lm's cache holds.

    .venv/bin/python bench/capture_kv.py --tokens 512 --out /tmp/kvwake-kv-512.npz
    .venv/bin/python bench/capture_kv.py path/to/mlx-model-folder --tokens 128

With no model folder, the default model is converted once into
``<--data-dir>/models`` (see kvwake.daemon.model.convert.ensure_default_model).

File format (np.savez, uncompressed):
    layers.{i}.keys, layers.{i}.values   uint16 [1, kv_heads, tokens, head_dim]:
                                          the bf16 bit patterns (numpy has no
                                          bfloat16); view as bf16 to use
    tokens                               int32 [tokens]: the prompt's token ids
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np

SYSTEM = (
    "You are Wren, the archivist of a small coastal town. You answer questions "
    "about its history, its people and its weather plainly and briefly, and you "
    "say so when the records are silent."
)

# Natural English, varied so the KV is not periodic; cycled under numbered
# headings until the prompt is long enough.
PARAGRAPHS = (
    "The harbour was dug by hand in the winter of 1781, when the fishing fleet "
    "had grown too large for the old shingle beach. Forty families gave a day of "
    "work each week until the stone pier reached the deep channel, and the names "
    "of the masons are still cut into the last course of granite.",
    "In spring the town fills with the smell of tar and fresh paint. Boats are "
    "hauled up the slipway, scraped, caulked and launched again before the "
    "mackerel arrive, and children are paid in toffee to carry buckets of water "
    "from the pump by the chapel.",
    "The lighthouse keeper's logbooks run without a gap from 1843 to 1969. They "
    "record storms, wrecks and rescues, but also smaller things: the first "
    "swallows of the year, a whale seen off the point, a wedding on the quay, and "
    "the night the lamp failed and the keeper burned his own furniture to keep a "
    "fire on the gallery.",
    "Most houses on the hill were built from the ballast that trading ships left "
    "behind, which is why a grey cottage may have a doorstep of red Spanish "
    "sandstone and a chimney of yellow brick from the Low Countries.",
    "The school opened in 1874 with one teacher and sixty-two pupils. Attendance "
    "fell every September, when older boys went out with the herring boats, and "
    "the teacher's reports complain politely but often about the smell of fish "
    "in the classroom.",
    "Weather here changes quickly. A calm morning can turn to a gale by noon, and "
    "the old rule among the fishermen is simple: if the gulls sit on the church "
    "roof instead of the water, nobody should put to sea.",
    "During the war the town took in evacuees from the cities. Many of them had "
    "never seen the sea, and several stayed for the rest of their lives, marrying "
    "into local families and opening the bakery and the bicycle shop that still "
    "trade on the main street.",
)


def build_prompt(tokenizer, n_tokens: int) -> list[int]:
    """Token ids of a ChatML conversation, cut to exactly ``n_tokens``.

    The paragraph count doubles until the rendered text is long enough: one
    encode per doubling, so 20k-token prompts take as long as a few encodes.
    """
    count = 1
    while True:
        parts = [f"Part {i + 1}. {p}" for i, p in zip(range(count), itertools.cycle(PARAGRAPHS))]
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Summarise these notes from the archive:\n\n" + "\n\n".join(parts)},
        ]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
        count *= 2


def prefill(model, ids: list[int], chunk: int) -> list:
    """Run ``ids`` through ``model`` in chunks; return the filled cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for start in range(0, len(ids), chunk):
        model(mx.array(ids[start:start + chunk])[None], cache=cache)
        # Evaluate per chunk, as generation does, so memory stays bounded.
        mx.eval([c.keys for c in cache] + [c.values for c in cache])
    return cache


def cache_arrays(cache, n_tokens: int) -> dict[str, np.ndarray]:
    """Each layer's keys/values, trimmed to the offset, as uint16 bf16 bits."""
    import mlx.core as mx

    arrays: dict[str, np.ndarray] = {}
    for i, layer in enumerate(cache):
        if layer.offset != n_tokens:
            raise RuntimeError(f"layer {i}: cache offset {layer.offset} != {n_tokens} tokens")
        # mlx-lm 0.32: .state is the whole allocated buffer (steps of 256)
        # plus the offset; keys_and_values() is the part actually written.
        for name, array in zip(("keys", "values"), layer.keys_and_values()):
            if array.dtype != mx.bfloat16:
                raise RuntimeError(f"layer {i} {name} are {array.dtype}, expected bfloat16")
            arrays[f"layers.{i}.{name}"] = np.array(array.view(mx.uint16))
    return arrays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="mlx-lm model folder (default: the default model)")
    parser.add_argument("--data-dir", default="/tmp/kvwake-data",
                        help="where the default model is converted (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=512, help="prompt length (default: %(default)s)")
    parser.add_argument("--chunk", type=int, default=128, help="prefill chunk (default: %(default)s)")
    parser.add_argument("--out", help="output .npz (default: /tmp/kvwake-kv-<tokens>.npz)")
    args = parser.parse_args(argv)
    out = Path(args.out or f"/tmp/kvwake-kv-{args.tokens}.npz")

    from mlx_lm import load

    if args.model is None:
        from kvwake.daemon.model.convert import ensure_default_model

        model_dir = ensure_default_model(args.data_dir)
    else:
        model_dir = Path(args.model)
    model, tokenizer = load(str(model_dir))
    ids = build_prompt(tokenizer, args.tokens)
    start = time.perf_counter()
    cache = prefill(model, ids, args.chunk)
    seconds = time.perf_counter() - start
    arrays = cache_arrays(cache, len(ids))
    arrays["tokens"] = np.array(ids, dtype=np.int32)
    with out.open("wb") as f:  # np.savez(path) would append .npz to other names
        np.savez(f, **arrays)
    kv_bytes = sum(a.nbytes for name, a in arrays.items() if name.startswith("layers."))
    print(f"model {model_dir}")
    print(f"tokens {len(ids)}, layers {len(cache)}, "
          f"keys shape {list(arrays['layers.0.keys'].shape)}")
    print(f"kv bytes {kv_bytes:,} ({kv_bytes / len(ids):,.0f} per token), "
          f"file {out} {out.stat().st_size:,} bytes")
    print(f"prefill {seconds:.1f} s ({len(ids) / seconds:.1f} tokens/s, chunk {args.chunk})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
