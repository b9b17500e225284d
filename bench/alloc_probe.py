"""What a fresh device allocation costs MLX on this machine, against one its buffer cache serves: whether a wake
after a model's reload, whose joins and layout wait longer on the device than before the unload (docs/decisions.md,
"Blocks read ahead onto the device: tried, reverted"), pays for allocating afresh.

usage: python bench/alloc_probe.py [--gib 3] [--rounds 2]

Each line: how long MLX took to make and fill --gib arrays of 1 GiB (one op each, evaluated together) when its
buffers were allocated afresh (after `clear_cache`) and when its cache held freed ones of the same size; with the
daemon's cache limit (4 GiB), as a wake runs. Prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

GIB = 1 << 30


def fill(n: int) -> tuple[float, list[mx.array]]:
    t0 = time.perf_counter()
    out = [mx.full((GIB,), i + 1, mx.uint8) for i in range(n)]
    mx.eval(out)
    return (time.perf_counter() - t0) * 1000, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    mx.set_cache_limit(4 * GIB)
    fill(1)  # the fill kernel loaded, the stream made
    for r in range(args.rounds):
        mx.clear_cache()
        fresh_ms, out = fill(args.gib)
        del out
        cached_ms, out = fill(args.gib)
        del out
        print(json.dumps({"round": r, "gib": args.gib, "fresh_ms": round(fresh_ms, 1), "cached_ms": round(cached_ms, 1),
                          "fresh_gb_s": round(args.gib * GIB / fresh_ms / 1e6, 1),
                          "cache_bytes_after": mx.get_cache_memory()}))


if __name__ == "__main__":
    main()
