"""Whether a span's join on the device depends on where and by which thread its rows were made (docs/decisions.md,
"Blocks read ahead onto the device: tried, reverted"): the join of a span of 8B-shaped blocks timed on one thread,
its rows made (a) by that thread, (b) by reader threads that have ended, (c) by reader threads still alive; (d) on a
thread that never ran MLX before (a reloaded model's engine thread is a new one), twice; and (e) read from a mapped
staging slot as a wake's ring holds them.

usage: python bench/device_image_probe.py [--blocks 80] [--span 8] [--readers 4]

Prints one JSON line per way: ms per span's join (p50, max) and in all, and the device bandwidth they imply.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import mlx.core as mx
import numpy as np

from kvwake.daemon.kv import devplanes
from kvwake.daemon.model.loader import release_mlx_streams

TENSORS, LEAD, B, DIM = 64, (1, 8), 128, 128  # the 8B shape's blocks: 32 layers' keys and values
ROW = TENSORS * 8 * B * DIM * 2  # a bf16 block's bytes (its planes one after another)


def make_rows(n: int) -> list[mx.array]:
    """n rows as the reader makes them: random bytes into a mapped slot, copied to the device by a GPU op."""
    array, view, release = devplanes.staging((ROW,))
    rows = []
    rng = np.random.default_rng(len(threading.enumerate()))
    noise = rng.integers(0, 255, ROW, dtype=np.uint8)
    try:
        for i in range(n):
            view[:] = noise
            view[:8] = i
            row = array | 0
            mx.eval(row)
            rows.append(row)
    finally:
        release()
    return rows


def by_readers(n: int, readers: int, keep_alive: bool) -> tuple[list[mx.array], list[threading.Event]]:
    out: list[list[mx.array]] = [[] for _ in range(readers)]
    done, hold = [threading.Event() for _ in range(readers)], threading.Event()

    def work(i: int) -> None:
        out[i] = make_rows(n // readers)
        done[i].set()
        if keep_alive:
            hold.wait()
        release_mlx_streams()  # a thread's MLX streams go with it, by it (model/loader.py)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(readers)]
    for t in threads:
        t.start()
    for d in done:
        d.wait()
    if not keep_alive:
        for t in threads:
            t.join()
    return [r for rows in out for r in rows], [hold]


def join_spans(rows: list[mx.array] | None, n: int, span: int, slot: mx.array | None = None) -> list[float]:
    times = []
    for first in range(0, n, span):
        t0 = time.perf_counter()
        data = mx.stack(rows[first : first + span]) if rows is not None else slot
        whole = devplanes.join(devplanes.planes_of(data, 2), "BF16", TENSORS, (*LEAD, B, DIM))
        pieces = [whole[t] for t in range(TENSORS)]
        mx.eval(pieces)
        times.append((time.perf_counter() - t0) * 1000)
    return times


def report(way: str, times: list[float], n: int) -> None:
    total = sum(times)
    print(json.dumps({"way": way, "blocks": n, "span_ms_p50": round(statistics.median(times), 2),
                      "span_ms_max": round(max(times), 2), "total_ms": round(total, 1),
                      "gb_s": round(n * ROW / total / 1e6, 1)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=80)
    ap.add_argument("--span", type=int, default=8)
    ap.add_argument("--readers", type=int, default=4)
    args = ap.parse_args()
    n, span = args.blocks, args.span
    join_spans(make_rows(span), span, span)  # kernels loaded
    for way in ("same thread", "readers ended", "readers alive", "same thread again"):
        if way.startswith("same"):
            rows, holds = make_rows(n), []
        else:
            rows, holds = by_readers(n, args.readers, way == "readers alive")
        report(way, join_spans(rows, n, span), n)
        for h in holds:
            h.set()
        del rows
    # a thread that never ran MLX before (as a reloaded model's new engine thread), its joins twice
    rows = make_rows(n)
    on_new: list[tuple[str, list[float]]] = []

    def fresh() -> None:
        on_new.append(("a new thread's first joins", join_spans(rows, n, span)))
        on_new.append(("the new thread's joins again", join_spans(rows, n, span)))
        release_mlx_streams()

    t = threading.Thread(target=fresh)
    t.start()
    t.join()
    for way, times in on_new:
        report(way, times, n)
    del rows
    array, view, release = devplanes.staging((span, ROW))  # a ring's slot: the GPU reads the host's memory
    view[:] = 7
    report("mapped slot (a ring)", join_spans(None, n, span, array), n)
    release()


if __name__ == "__main__":
    main()
