"""Does a host copy's memory, freed into MLX's buffer cache, slow the GPU work it is handed to next?

On MLX-CUDA, `np.asarray` of a device array moves its buffer to managed memory (a fresh
cudaMallocManaged and a copy). Freed, that buffer joins MLX's cache of free buffers, which does not
tell managed memory from device memory: the next kernel output of about its size gets it. If the
CPU read it last, its pages live on the host, and the kernel writes them through page faults.
A checkpoint makes such copies of every block it writes, between a neighbour's decode steps.

Each round, in one process, for each variant:
  base     the GPU op alone: `count` outputs of `mib` MiB, each evaluated and timed
  cached   first `count` host copies of that size, read by the CPU and dropped as MLX would
           (into its cache), then the op
  driver   the same, dropped with MLX's cache limit at 0 (freed to the driver), then the op
  unread   host copies dropped into the cache without the CPU reading them, then the op
Reported per variant (median over rounds): the first op's ms, the ops' p50 and max, the copies' ms,
the CPU's first and second read of them (page migration shows in the first), and the drop's ms.
With --steps N, then: N GPU steps timed while another thread reads fresh host copies, left to
migrate on the reads' faults (while-fault), or none made (while-none): does their migration stall
the GPU's work? Each also with every step ending in a token read by the CPU (-readback), as a decode
step ends. (A bulk move to the host first, cudaMemPrefetchAsync, was measured in session 19 at
9ff7bde and removed: the call held its caller 17.7 ms per 128 MiB.)

usage: python bench/managed_reuse.py [--mib 4] [--count 32] [--rounds 5] [--steps 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def ops(sources: list[mx.array]) -> list[float]:
    """One new output per source (about its size), each evaluated alone: what a decode step allocates."""
    times = []
    for x in sources:
        started = time.perf_counter()
        mx.eval(x + 1)
        times.append(_ms(started))
    return times


def round_of(variant: str, sources: list[mx.array]) -> dict[str, float]:
    out: dict[str, float] = {}
    mx.synchronize()
    mx.clear_cache()  # each variant from an empty cache: what one leaves there must not reach the next
    if variant != "base":
        started = time.perf_counter()
        copies = [x + 0 for x in sources]
        mx.eval(copies)
        hosted = [np.asarray(c) for c in copies]
        out["copy_ms"] = _ms(started)
        if variant != "unread":
            started = time.perf_counter()
            total = sum(int(h[::512].sum()) for h in hosted)  # touches every page (4 KiB = 1024 floats)
            out["read1_ms"] = _ms(started)
            started = time.perf_counter()
            total += sum(int(h[::512].sum()) for h in hosted)
            out["read2_ms"] = _ms(started)
        started = time.perf_counter()
        limit = mx.set_cache_limit(0) if variant == "driver" else None
        del hosted, copies
        if limit is not None:
            mx.set_cache_limit(limit)
        out["drop_ms"] = _ms(started)
    times = ops(sources)
    out.update(first_ms=times[0], p50_ms=statistics.median(times), max_ms=max(times))
    return out


def concurrent(mode: str, sources: list[mx.array], weights: mx.array, x: mx.array, steps: int,
               readback: bool, readers: int = 1) -> dict[str, float]:
    """GPU steps timed on this thread while another reads host copies (the encoders' pattern): `none` makes
    no copies, `fault` lets the reads migrate them page by page. `readback`: each step ends reading one
    token on the CPU, as a decode step does (its buffer is managed memory: the GPU writes it, then the CPU
    reads it, each through a fault), where the GPU's faults may queue behind the reads' migration."""
    import threading

    mx.synchronize()
    mx.clear_cache()
    out: dict[str, float] = {}
    hosted: list[np.ndarray] = []
    if mode != "none":
        copies = [s + 0 for s in sources]
        mx.eval(copies)
        hosted = [np.asarray(c) for c in copies]
    done: list[float] = []
    started_all = time.perf_counter()

    def read(part: list[np.ndarray]) -> None:
        sum(int(h[::512].sum()) for h in part)
        done.append(_ms(started_all))
    threads = [threading.Thread(target=read, args=(hosted[k::readers],)) for k in range(readers)]
    times = []
    for reader in threads:
        reader.start()
    for _ in range(steps):
        started = time.perf_counter()
        y = x
        for w in weights:
            y = mx.tanh(w @ y)
        if readback:  # as a decode step ends: one token read by the CPU (MLX's small managed buffers)
            mx.argmax(y[:, 0]).item()
        else:
            mx.eval(y)
        times.append(_ms(started))
    for reader in threads:
        reader.join()
    out.update(read_ms=max(done), step_p50_ms=statistics.median(times), step_max_ms=max(times),
               steps_over_2x=float(sum(t > 2 * statistics.median(times) for t in times)))
    del hosted
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=4.0)
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=0, help="GPU steps timed while the CPU reads host copies")
    parser.add_argument("--readers", type=int, default=1, help="threads reading the copies")
    parser.add_argument("--dim", type=int, default=8192, help="the steps' matrices: dim x dim")
    parser.add_argument("--json")
    args = parser.parse_args()
    n = int(args.mib * 2**20) // 4
    sources = [mx.random.normal((n,)) for _ in range(args.count)]
    mx.eval(sources)
    variants = ["base", "cached", "driver", "unread"]
    for v in variants:  # every path built once
        round_of(v, sources)
    rows: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            rows[v].append(round_of(v, sources))
    if args.steps:  # while the CPU reads the copies: a step of 16 matrix products, as a decode step is
        weights = [mx.random.normal((args.dim, args.dim)).astype(mx.bfloat16) for _ in range(16)]
        x = mx.random.normal((args.dim, 32)).astype(mx.bfloat16)
        mx.eval(weights, x)
        modes = [(m, r) for r in (False, True) for m in ("none", "fault")]
        for m, r in modes:
            concurrent(m, sources, weights, x, 3, r, args.readers)
            rows[f"while-{m}{'-readback' if r else ''}"] = []
        for _ in range(args.rounds):
            for m, r in modes:
                row = concurrent(m, sources, weights, x, args.steps, r, args.readers)
                rows[f"while-{m}{'-readback' if r else ''}"].append(row)
    result = {"device": str(mx.default_device()), "mib": args.mib, "count": args.count, "rounds": args.rounds,
              "readers": args.readers,
              "variants": {v: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
                           for v, rs in rows.items()}}
    for v, r in result["variants"].items():
        print(v, json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
