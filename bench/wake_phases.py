"""Where a wake's time goes, phase by phase (a diagnostic for the device; prints one line per phase).

usage: python bench/wake_phases.py --model /tmp/m8b --tokens 8192
Prefills, sleeps, then repeats the wake's steps by hand with a clock and RSS reading between them,
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

    from kvwake.daemon.kv import devplanes
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
        buffers = kvfill.Buffers(engine.model, sample, engine.block_tokens, n, engine.block_tokens)
        mark(f"buffers ({buffers.mode}, planes staged: {bool(buffers.planes)})")
        batch = engine.pool.batch()
        for k, ref in enumerate(record.blocks):
            batch.reserve(ref.raw_bytes)
            batch.submit(ref.raw_bytes, lambda k=k, ref=ref, buffers=buffers: engine.store.read_block(
                ref, place=buffers.place(k * engine.block_tokens, engine.block_tokens), stage=buffers.stage(k)))
        batch.join()
        batch.raise_first()
        mark(f"decode {len(record.blocks)} blocks on {engine.pool.workers} threads")
        tail = dict(engine.store.read_tail(record, buffers.place(n // 128 * 128, n % 128)))
        mark("tail")
        if buffers.planes:
            up = [mx.array(p) for p in buffers.planes]
            mx.eval(up)
            mark("upload staged planes (mx.array + eval)")
            joined = devplanes.join(buffers.planes, buffers.dtypes[buffers.order[0]], len(buffers.order),
                                    buffers.block_shape)
            mx.eval(joined)
            mark("upload + join on the device")
            del up, joined
        buffers.check(buffers.take(tail), n // 128 * 128, n % 128, "tail")
        cache = buffers.finish(n, tail)
        mark("finish (upload, join, per-layer arrays, eval)")
        del cache, buffers
        mx.clear_cache()
        t0 = time.perf_counter()
        woken, info = engine.wake("s")
        print(f"  engine.wake: {1000 * (time.perf_counter() - t0):.1f} ms", flush=True)
        engine.close()
    print(f"max rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
