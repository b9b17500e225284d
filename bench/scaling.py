"""Which part of a verified read scales with threads on this machine (a diagnostic, not a benchmark).

usage: python bench/scaling.py [--threads 1,4,16] [--mb 8]
Times each building block of a block decode (zstd into new bytes vs into a reused
buffer, BLAKE3, numpy plane joins, fresh page-faulting allocations) on 1..N threads.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import time

import blake3
import numpy as np
import zstandard


def rate(fn, threads: int, nbytes: int, reps: int = 8) -> float:
    with cf.ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda _: fn(), range(threads)))
        t0 = time.perf_counter()
        list(ex.map(lambda _: fn(), range(threads * reps)))
        return nbytes * threads * reps / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,4,8,16")
    ap.add_argument("--mb", type=int, default=8)
    args = ap.parse_args()
    n = args.mb << 20
    rng = np.random.default_rng(0)
    hi = rng.integers(118, 126, n, dtype=np.uint8)
    params = zstandard.ZstdCompressionParameters.from_level(1, min_match=7, hash_log=6, search_log=1)
    frame = zstandard.ZstdCompressor(compression_params=params).compress(hi.tobytes())
    lo = rng.integers(0, 256, n, dtype=np.uint8)
    import threading
    local = threading.local()

    def buf(name, size, dtype=np.uint8):
        b = getattr(local, name, None)
        if b is None:
            b = np.empty(size, dtype)
            setattr(local, name, b)
        return b

    def z_new():
        zstandard.ZstdDecompressor().decompress(frame)

    def z_into():
        out = buf("z", n)
        with zstandard.ZstdDecompressor().stream_reader(frame) as r:
            r.readinto(memoryview(out))

    def b3():
        blake3.blake3(memoryview(hi)).digest()

    def join():
        u = buf("u", n, np.uint16)
        t = buf("t", n, np.uint16)
        for k in range(0, n, 131072):
            s = slice(k, k + 131072)
            np.left_shift(hi[s], 8, out=u[s], dtype=np.uint16)
            np.bitwise_or(u[s], lo[s], out=u[s])
            np.right_shift(u[s], 1, out=t[s])
            np.left_shift(u[s], 15, out=u[s])
            np.bitwise_or(u[s], t[s], out=u[s])

    def join_bytes():  # no casting ufuncs: bytes copied into the interleaved view, then uint16 ops
        u = buf("u", n, np.uint16)
        t = buf("t", n, np.uint16)
        d8 = u.view(np.uint8).reshape(-1, 2)
        for k in range(0, n, 131072):
            s = slice(k, k + 131072)
            np.copyto(d8[s, 1], hi[s])
            np.copyto(d8[s, 0], lo[s])
            np.right_shift(u[s], 1, out=t[s])
            np.left_shift(u[s], 15, out=u[s])
            np.bitwise_or(u[s], t[s], out=u[s])

    def u16_ops():  # same-dtype uint16 ufuncs only
        u = buf("u", n, np.uint16)
        t = buf("t", n, np.uint16)
        for k in range(0, n, 131072):
            s = slice(k, k + 131072)
            np.right_shift(u[s], 1, out=t[s])
            np.bitwise_or(u[s], t[s], out=u[s])

    def copy_u16():
        u = buf("u", n, np.uint16)
        t = buf("t", n, np.uint16)
        np.copyto(t, u)

    def fresh():
        a = np.empty(n, np.uint8)
        a[::4096] = 1

    for name, fn, nbytes in [("zstd -> new bytes", z_new, n), ("zstd -> reused buffer", z_into, n),
                             ("blake3", b3, n), ("plane join (uint16 out)", join, 2 * n),
                             ("plane join via bytes", join_bytes, 2 * n), ("uint16 ufuncs", u16_ops, 2 * n),
                             ("copyto uint16", copy_u16, 2 * n),
                             ("fresh allocation + touch", fresh, n)]:
        cells = [f"{t}t {rate(fn, t, nbytes):6.2f}" for t in map(int, args.threads.split(","))]
        print(f"{name:28s} GB/s: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
