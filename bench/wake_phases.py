"""Where a wake's time goes, phase by phase (a diagnostic for the device; prints one line per phase).

usage: python bench/wake_phases.py --model /tmp/m8b --tokens 8192
Prefills, sleeps, then repeats the wake's steps by hand with a clock and RSS reading between them
(decode and join span by span, one after the other: the real wake overlaps them; its time is last),
and times the host-to-device moves MLX offers (mx.array of a numpy array, then a first GPU use).
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e9


def main() -> None:
    import mlx.core as mx
    import numpy as np

    from kvwake.daemon.kv import fill as kvfill
    from kvwake.daemon.session import Session
    from suite import open_engine, tokens_of

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    clock = [time.perf_counter()]

    def mark(what: str) -> None:
        now = time.perf_counter()
        print(f"  {what:40s} {1000 * (now - clock[0]):9.1f} ms   rss {rss_gb():6.2f} GB   mlx active "
              f"{mx.get_active_memory() / 1e9:6.2f} cache {mx.get_cache_memory() / 1e9:6.2f} GB", flush=True)
        clock[0] = time.perf_counter()

    gib = np.full(1 << 30, 7, np.uint8)
    mark("1 GiB host array made")
    a = mx.array(gib)
    mark("mx.array(1 GiB numpy)")
    mx.eval(a)
    mark("eval of it")
    b = (a + 1).sum()
    mx.eval(b)
    mark("first GPU pass over it")
    b = (a + 2).sum()
    mx.eval(b)
    mark("second GPU pass over it")
    del a, b
    mx.clear_cache()
    with tempfile.TemporaryDirectory() as tmp:
        engine = open_engine(args.model, Path(tmp))
        ids = tokens_of(engine, args.tokens)
        s = Session("s")
        engine.append(s, tokens=ids)
        n = s.processed
        engine.sleep(s)
        mark(f"prefill + sleep of {n} tokens")
        record = engine.record(engine.store.latest_snapshot("s"))
        mark("record (verified index rows)")
        sample = engine.store.block_specs(record.blocks[0])
        mark("specs of block 0")
        b = engine.block_tokens
        buffers = kvfill.Buffers(engine.model, sample, b, n, b, tail_tokens=n % b)
        ring = f"{buffers.ring.span} blocks x {buffers.ring.slots} slots" if buffers.ring else "none"
        mark(f"buffers ({buffers.mode}, staging ring: {ring})")
        decode_s = join_s = 0.0
        for first, count in buffers.spans(len(record.blocks)):  # one phase after the other: a wake overlaps them
            t0 = time.perf_counter()
            batch = engine.pool.batch()
            for k in range(first, first + count):
                ref = record.blocks[k]
                batch.reserve(ref.raw_bytes)
                batch.submit(ref.raw_bytes, lambda k=k, ref=ref: engine.store.read_block(
                    ref, place=buffers.place(k * b, b), stage=buffers.stage(k)))
            batch.join()
            batch.raise_first()
            t1 = time.perf_counter()
            buffers.join_span(first, count)
            decode_s, join_s = decode_s + t1 - t0, join_s + time.perf_counter() - t1
        mark(f"decode {len(record.blocks)} blocks on {engine.pool.workers} threads ({1000 * decode_s:.0f} ms), "
             f"join span by span ({1000 * join_s:.0f} ms)")
        tail = dict(engine.store.read_tail(record, buffers.place(n // b * b, n % b), buffers.stage(None)))
        mark("tail")
        buffers.check(buffers.take(tail), n // b * b, n % b, "tail", staged=-1 in buffers.staged)
        cache = buffers.finish(n, tail)
        mark("finish (tail, one concatenation per tensor, eval)")
        del cache, buffers
        mx.clear_cache()
        t0 = time.perf_counter()
        woken, info = engine.wake("s")
        print(f"  engine.wake: {1000 * (time.perf_counter() - t0):.1f} ms", flush=True)
        engine.close()
    print(f"max rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
