"""A wake's staging ring by how its memory is made: cost to make, to fill from the CPU, to join on the GPU, and real wakes.

usage: python bench/ring_upload.py [--gib 4] [--threads 16] [--variants device,host,mapped]
                                   [--model PATH --tokens 32768 --synthetic KV.npz --codecs planes-zstd,raw
                                    --pieces 262144 --repeat 3]
                                   [--json OUT]

Part 1, no model: for each `devplanes.STAGING` variant, a ring (devplanes.Ring, the 8B shape's
blocks: 64 tensors of [1, 8, 128, 128] bf16, 16 MiB a block) takes --gib GiB of blocks span after
span: the pool's threads copy each block's planes into the slot (what a decoder writes, without
the decoding), then the GPU joins the span (devplanes.join, evaluated). Timed apart (fill, join,
the first spans untimed) and overlapped as a wake runs them (fill up to `slots` spans ahead).

Part 2, with --model: a synthetic session of --tokens (bench/capture_kv.py's KV, tiled) is slept
once per codec, then woken --repeat times per variant and staged piece size (rounds alternate
them; RAM tier emptied, page cache warm; the first round untimed), and mlx-lm's load_prompt_cache + first token of the same KV once.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from kvwake.daemon.kv import devplanes  # noqa: E402

TENSORS, BLOCK_SHAPE = 64, (1, 8, 128, 128)
WARM_SPANS = 2


def synthetic(variant: str, gib: float, threads: int) -> dict[str, float]:
    devplanes.STAGING = variant
    per_token = TENSORS * BLOCK_SHAPE[1] * BLOCK_SHAPE[3]
    plane_bytes = per_token * BLOCK_SHAPE[2]
    block_bytes = 2 * plane_bytes
    blocks = int(gib * 2**30) // block_bytes
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 256, (8, plane_bytes), np.uint8) for _ in range(2)]
    t0 = time.perf_counter()
    ring = devplanes.Ring(blocks, 2, plane_bytes, block_bytes)
    make = time.perf_counter() - t0
    spans = [(first, min(ring.span, blocks - first)) for first in range(0, blocks, ring.span)]

    def fill(k: int) -> None:
        for p, row in enumerate(ring.rows(k, True)):
            np.copyto(row, src[p][k % 8])

    def join(first: int, count: int) -> None:
        mx.eval(devplanes.join(ring.planes(first, count), "BF16", TENSORS, BLOCK_SHAPE))

    fill_s = join_s = 0.0
    timed = 0
    with cf.ThreadPoolExecutor(threads) as pool:
        for i, (first, count) in enumerate(spans):
            t0 = time.perf_counter()
            list(pool.map(fill, range(first, first + count)))
            t1 = time.perf_counter()
            join(first, count)
            t2 = time.perf_counter()
            if i >= WARM_SPANS:
                fill_s, join_s, timed = fill_s + t1 - t0, join_s + t2 - t1, timed + count
        # Overlapped, as kv/pipeline.py's _restore_blocks runs a wake.
        t0 = time.perf_counter()
        pending: dict[int, list[cf.Future]] = {}
        for s in range(min(ring.slots, len(spans))):
            first, count = spans[s]
            pending[s] = [pool.submit(fill, k) for k in range(first, first + count)]
        for s, (first, count) in enumerate(spans):
            cf.wait(pending.pop(s))
            join(first, count)
            if s + ring.slots < len(spans):
                f2, c2 = spans[s + ring.slots]
                pending[s + ring.slots] = [pool.submit(fill, k) for k in range(f2, f2 + c2)]
        overlapped = time.perf_counter() - t0
    ring.close()
    del ring
    mx.clear_cache()
    timed_bytes = timed * block_bytes
    from kvwake.daemon.kv import cudart

    out = {"variant": variant, "advice_available": bool(cudart._advise), "make_ms": make * 1000, "span_blocks": spans[0][1],
           "fill_GBps": timed_bytes / fill_s / 1e9, "join_GBps": timed_bytes / join_s / 1e9,
           "overlapped_GBps": blocks * block_bytes / overlapped / 1e9}
    print(f"{variant:>7}: make {out['make_ms']:.0f} ms, fill {out['fill_GBps']:.2f} GB/s, join {out['join_GBps']:.2f}"
          f" GB/s, overlapped {out['overlapped_GBps']:.2f} GB/s ({blocks} blocks of {block_bytes >> 20} MiB; cudaMemAdvise {out['advice_available']})", flush=True)
    return out


def wakes(model: str, tokens: int, kv_file: str, codecs: list[str], variants: list[str], pieces: list[int],
          repeat: int) -> list[dict]:
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from kvwake.daemon.session import Session
    from kvwake.store.format import codec as codec_module
    from suite import first_token, open_engine, synthetic_session, timed_wake, tokens_of

    rows = []
    started = time.perf_counter()

    def step(what: str) -> None:
        print(f"  [{time.perf_counter() - started:7.1f} s] {what}", flush=True)

    for codec in codecs:
        with tempfile.TemporaryDirectory() as tmp:
            engine = open_engine(model, Path(tmp), codec)
            ids = tokens_of(engine, tokens)
            s = Session("w")
            synthetic_session(engine, s, ids, kv_file)
            step(f"{codec}: synthetic session of {tokens} tokens")
            f = Path(tmp) / "mlx.safetensors"
            save_prompt_cache(str(f), s.cache)
            step("saved with mlx-lm")
            slept = engine.sleep(s)
            del s
            step(f"slept: {slept['raw_bytes'] / 1e9:.2f} GB")
            loads = []
            for _ in range(2):
                t0 = time.perf_counter()
                cache = load_prompt_cache(str(f))
                mx.eval([c.state for c in cache])
                load = time.perf_counter() - t0
                loads.append((load, load + first_token(engine, Session("m", tokens=list(ids), processed=len(ids) - 1,
                                                                     cache=cache))))
                del cache
            load, load_ft = loads[-1]
            step(f"mlx-lm load {load * 1000:.0f} ms, + first token {load_ft * 1000:.0f} ms")
            combos = [(v, piece) for v in variants for piece in pieces]
            times: dict = {c: [] for c in combos}
            fts: dict = {c: [] for c in combos}
            for i in range(repeat + 1):  # rounds alternate the combinations; the first warms each, untimed
                for combo in combos:
                    devplanes.STAGING, codec_module.STAGE_PIECE_BYTES = combo
                    wake, ft = timed_wake(engine, "w")
                    if i:
                        times[combo].append(wake)
                        fts[combo].append(ft)
            for (variant, piece) in combos:
                wake, ft = statistics.median(times[variant, piece]), statistics.median(fts[variant, piece])
                row = {"codec": engine.store.codec, "variant": variant, "piece_bytes": piece, "tokens": tokens,
                       "raw_bytes": slept["raw_bytes"], "wake_s": wake, "wake_GBps": slept["raw_bytes"] / wake / 1e9,
                       "wake_first_token_s": ft, "mlx_load_s": load, "mlx_load_first_token_s": load_ft,
                       "ratio": ft / load_ft, "all": times[variant, piece]}
                rows.append(row)
                print(f"{row['codec']:>11} {variant:>7} {piece >> 10:>6} KiB: wake {wake * 1000:.0f} ms "
                      f"({row['wake_GBps']:.2f} GB/s), wake+1st {ft * 1000:.0f} ms vs mlx-lm load+1st "
                      f"{load_ft * 1000:.0f} ms ({row['ratio']:.2f}x); all {[round(t * 1000) for t in times[variant, piece]]}",
                      flush=True)
            engine.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--variants", default="device,host,mapped")
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--synthetic")
    ap.add_argument("--codecs", default="planes-zstd,raw")
    ap.add_argument("--pieces", default=str(256 << 10), help="staged pieces' bytes to compare (codec.STAGE_PIECE_BYTES)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    variants = args.variants.split(",")
    out: dict = {"device": str(mx.default_device()), "synthetic": [synthetic(v, args.gib, args.threads)
                                                                    for v in variants if args.gib]}
    if args.model:
        out["wakes"] = wakes(args.model, args.tokens, args.synthetic, args.codecs.split(","), variants,
                            [int(p) for p in args.pieces.split(",")], args.repeat)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
