"""Probe: what a model's weight load does to another model's decode steps on the same GPU (issue 53's p99 gap).

One thread runs decode-like steps without pause (`--layers` layers of two bf16 products of `--rows` rows, a few
elementwise ops each: a decode step's reads and launches), each step evaluated before the next, as an engine
thread does; another thread reads a file of 32 MiB bf16 tensors (`--gib` GiB, made once) one way at a time:

- `none`: no load (the steps alone, between the others);
- `io`: the file's bytes read into host memory, nothing on the GPU (the disk and the page cache alone);
- `mlx`: `mx.load` and each tensor evaluated (model/weights.py's way: MLX reads into malloc'd memory and copies
  it with cudaMemcpyAsync from pageable memory);
- `unified`: each tensor read into a numpy array, made an MLX array (managed memory) and copied by a GPU op
  (the pages migrate on the GPU's faults);
- `mapped`: each tensor read into a staging slot of managed memory kept on the host and mapped for the GPU
  (kv/devplanes.py's ring), then copied by a GPU op reading it in place.

Each way runs `--rounds` times, the file's pages dropped from the page cache before each (`cold`) or read once
before (`warm`, `--warm`). Per way: the load's seconds and the steps during it (p50, p99, max) against the steps
alone. One JSON line per way and round."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench/lib.py, from this checkout

from bench.lib import pct  # noqa: E402
from kvwake.daemon.kv import devplanes  # noqa: E402
from kvwake.daemon.model.kernel_cache import safetensors_header  # noqa: E402

PIECE = 32 << 20


def make_file(path: str, gib: float) -> list[tuple[str, int, int]]:
    """(name, offset, bytes) of each tensor in the safetensors file `path`, made once."""
    n = max(1, int(gib * (1 << 30)) // PIECE)
    if not os.path.exists(path):
        tensors = {f"t{i}": mx.random.normal((PIECE // 2 // 4096, 4096)).astype(mx.bfloat16) for i in range(n)}
        mx.save_safetensors(path, tensors)
        del tensors
    header, base = safetensors_header(Path(path))
    return sorted(((k, base + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
                   for k, v in header.items()), key=lambda t: t[1])


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_through(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def load(way: str, path: str, tensors: list[tuple[str, int, int]], kept: list) -> None:
    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        if way == "mlx":
            arrays = mx.load(path)
            for name, _, _ in tensors:
                mx.eval(arrays[name])
                kept.append(arrays[name])
            return
        if way == "mapped":
            slot, view, release = devplanes.staging((PIECE,))
        buf = np.empty(PIECE, np.uint8)
        with open(path, "rb", buffering=0) as f:
            for _, offset, nbytes in tensors:
                f.seek(offset)
                if way == "io":
                    f.readinto(memoryview(buf)[:nbytes])
                elif way == "unified":
                    host = np.empty(nbytes, np.uint8)
                    f.readinto(memoryview(host))
                    out = mx.array(host).view(mx.uint16) | 0
                    mx.eval(out)
                    kept.append(out)
                else:
                    f.readinto(memoryview(view)[:nbytes])
                    out = slot[:nbytes].view(mx.uint16) | 0
                    mx.eval(out)
                    kept.append(out)
        if way == "mapped":
            release()


def steps(weights: list[tuple[mx.array, mx.array]], rows: int, stop: threading.Event, times: list[float]) -> None:
    x = mx.random.normal((rows, weights[0][0].shape[1])).astype(mx.bfloat16)
    with mx.stream(mx.new_stream(mx.default_device())):
        while not stop.is_set():
            began = time.perf_counter()
            h = x
            for w1, w2 in weights:
                a = h @ w1.T
                a = a * mx.sigmoid(a)
                h = h + (a @ w2.T) * 0.01
                h = h * mx.rsqrt(mx.mean(h * h, axis=-1, keepdims=True) + 1e-5)
            mx.eval(h)
            times.append((time.perf_counter() - began) * 1000)


def summary(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {}
    return {"n": len(ms), "p50": round(statistics.median(ms), 2), "p99": pct(ms, 0.99), "max": round(max(ms), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", default="/tmp/load_interference.safetensors")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inner", type=int, default=14336)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--ways", default="none,io,mlx,unified,mapped")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warm", action="store_true", help="the file in the page cache before each load")
    ap.add_argument("--alone-s", type=float, default=1.5)
    args = ap.parse_args()

    tensors = make_file(args.file, args.gib)
    weights = [((mx.random.normal((args.inner, args.hidden)) * 0.02).astype(mx.bfloat16),
                (mx.random.normal((args.hidden, args.inner)) * 0.02).astype(mx.bfloat16)) for _ in range(args.layers)]
    mx.eval(weights)
    times: list[float] = []
    stop = threading.Event()
    stepper = threading.Thread(target=steps, args=(weights, args.rows, stop, times), daemon=True)
    stepper.start()
    time.sleep(2.0)  # the steps' kernels built
    for rnd in range(args.rounds):
        for way in args.ways.split(","):
            if args.warm:
                read_through(args.file)
            else:
                drop_cache(args.file)
            time.sleep(args.alone_s / 2)
            mark = len(times)
            time.sleep(args.alone_s)
            alone = times[mark:]
            kept: list = []
            mark = len(times)
            began = time.perf_counter()
            if way == "none":
                time.sleep(2.0)
            else:
                load(way, args.file, tensors, kept)
            seconds = time.perf_counter() - began
            during = times[mark:]
            del kept
            a, d = summary(alone), summary(during)
            print(json.dumps({"way": way, "round": rnd, "cache": "warm" if args.warm else "cold",
                              "load_s": round(seconds, 3), "gib": round(sum(t[2] for t in tensors) / (1 << 30), 2),
                              "alone": a, "during": d,
                              "p99_over_p50_alone": round(d["p99"] / a["p50"], 2) if a and d else None}), flush=True)
    stop.set()
    stepper.join()


if __name__ == "__main__":
    main()
