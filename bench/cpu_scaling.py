"""Probe: why a wake's verified reads stop scaling on many cores (issue 50, point 7).

On a many-core host the resume bench's decode of a session's blocks over every core reached a few times one core's
rate, not the cores' count (docs/benchmarks.md, "Wake on the CPU"). This times the same block work on 1, 2, 4, ...
threads, several ways, so the part that does not scale shows: each block a file of a 1B-shaped block (16 layers of K and V, 8 heads x 64, 128
tokens, bf16: 4 MiB raw), planes-zstd, verified, decoded into each thread's own arrays:

- `memory`: `decode_into` from bytes already in memory (the codec alone: zstd, the planes' join, BLAKE3, Python);
- `mmap`: the file mapped, decoded, unmapped (the store's `Files.mapped`: a wake's way);
- `read`: the file read into each thread's own buffer, then decoded (no mapping);
- `kept`: every file mapped once beforehand, decoded where it is mapped (a block's map, page faults and unmap left
  out: what `mmap` pays beyond it is their share, which grows with the threads if the faults' and the unmaps' page-
  table work does; a wake reads each block once, so it would keep the faults even with its files kept mapped);
- `copy`: a numpy copy of the block's raw bytes (what memory alone allows a thread);
- `procs`: `memory` in processes instead of threads (forked, each with its own arrays): the same work without
  the GIL, whose hand-overs between a block's many C calls are what threads share.

GB/s of raw block bytes, best of `--rounds`; one JSON line per way and thread count, with its speed-up over one thread.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import mmap
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import numpy as np

from kvwake.store.format import codec

SHAPE = (1, 8, 128, 64)
NAMES = [f"layers.{layer}.{kv}" for layer in range(16) for kv in ("keys", "values")]
RAW = len(NAMES) * int(np.prod(SHAPE)) * 2


def make_blocks(folder: Path, count: int) -> list[Path]:
    """`count` block files of KV-like bf16 values (normal, channels scaled log-normally), made once."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        path = folder / f"{i}.kvb"
        if not path.exists():
            arrays = {}
            for name in NAMES:
                x = rng.standard_normal(SHAPE).astype(np.float32) * np.exp(rng.standard_normal(SHAPE[:2] + (1, 64)))
                arrays[name] = codec.Tensor("BF16", (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
            path.write_bytes(codec.encode(arrays, codec="planes-zstd").data)
        paths.append(path)
    return paths


_PROC: dict = {}  # a `procs` worker's blocks and arrays (forked from the parent's blocks)


def _proc_decode(i: int) -> None:
    if "dest" not in _PROC:
        _PROC["dest"] = {n: np.empty(SHAPE, np.uint16) for n in NAMES}
    codec.decode_into(_PROC["datas"][i], lambda name, dtype, shape: _PROC["dest"][name])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", type=Path, default=Path("/tmp/kvwake-cpu-scaling"))
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--threads", default=f"1,2,4,8,{os.cpu_count()}")
    ap.add_argument("--ways", default="copy,memory,procs,read,mmap,kept")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    paths = make_blocks(args.folder, args.blocks)
    datas = [p.read_bytes() for p in paths]
    _PROC["datas"] = datas
    local = threading.local()

    def mine() -> threading.local:
        if not hasattr(local, "dest"):
            local.dest = {n: np.empty(SHAPE, np.uint16) for n in NAMES}
            local.buf = bytearray(2 * RAW)
            local.src, local.out = np.ones(RAW, np.uint8), np.empty(RAW, np.uint8)
        return local

    def place(name: str, dtype: str, shape: tuple) -> np.ndarray:
        return local.dest[name]

    def way_copy(i: int) -> None:
        t = mine()
        np.copyto(t.out, t.src)

    def way_memory(i: int) -> None:
        mine()
        codec.decode_into(datas[i], place)

    def way_read(i: int) -> None:
        t = mine()
        with open(paths[i], "rb", buffering=0) as f:
            got = f.readinto(t.buf)
        codec.decode_into(memoryview(t.buf)[:got], place)

    def way_mmap(i: int) -> None:
        mine()
        with open(paths[i], "rb", buffering=0) as f:
            m = mmap.mmap(f.fileno(), os.fstat(f.fileno()).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        view = memoryview(m)
        try:
            codec.decode_into(view, place)
        finally:
            view.release()
            m.close()

    kept: list[memoryview] = []  # every file mapped once, for `kept` (mapped here, before any thread decodes)
    if "kept" in args.ways.split(","):
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                kept.append(memoryview(mmap.mmap(f.fileno(), os.fstat(f.fileno()).st_size, flags=mmap.MAP_SHARED,
                                                 prot=mmap.PROT_READ)))

    def way_kept(i: int) -> None:
        mine()
        codec.decode_into(kept[i], place)

    ways = {"copy": way_copy, "memory": way_memory, "read": way_read, "mmap": way_mmap, "kept": way_kept}
    for way in args.ways.split(","):
        one = None
        for n in [int(t) for t in args.threads.split(",")]:
            procs = way == "procs"
            with cf.ProcessPoolExecutor(n, mp_context=mp.get_context("fork")) if procs else \
                    cf.ThreadPoolExecutor(n) as pool:
                run = (lambda ids: list(pool.map(_proc_decode, ids, chunksize=4))) if procs else \
                    (lambda ids: list(pool.map(ways[way], ids)))
                run(list(range(len(paths))) * 2)  # each worker's arrays made, the files cached
                best = 0.0
                for _ in range(args.rounds):
                    began = time.perf_counter()
                    run(list(range(len(paths))) * 4)
                    best = max(best, 4 * len(paths) * RAW / (time.perf_counter() - began) / 1e9)
            one = one or best
            print(json.dumps({"way": way, "threads": n, "GBps": round(best, 3), "over_one": round(best / one, 2)}),
                  flush=True)


if __name__ == "__main__":
    main()
