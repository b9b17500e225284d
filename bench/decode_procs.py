"""Probe: a wake's block reads by the pool's threads against worker processes (tuning decode_processes).

Each block a file of a 1B-shaped block (bench/cpu_scaling.py's: 16 layers of K and V, 8 heads x 64, 128 tokens,
bf16, planes-zstd: 4 MiB raw), in the page cache, decoded into its tokens' slice of one long buffer per tensor
(strided views, as a direct restore's `place` gives):

- `threads`: the file mapped and decoded into place by the reading thread (`StoreCore._read_verified`'s way);
- `procs`: the same read by one of `--procs` worker processes into shared staging, the thread then copying each
  tensor into place (`DecodeProcs.decode`, what the knob switches on).

Reports GB/s of raw block bytes (best of `--rounds`) and, at one thread, the milliseconds a block takes each
way: the processes' cost per block (pipes, staging, the copy) beside a verified read's.

`--wake TOKENS`: instead, whole wakes of a session of that many tokens through two engines on one store, a
random-weight model of the same KV shape on MLX's CPU, one engine with `--procs`' last count of worker
processes and one with none, in turn: each wake's ms and its `blocks` phase (best of `--rounds`).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_scaling import NAMES, RAW, SHAPE, make_blocks  # noqa: E402

from kvwake.store.decode_procs import DecodeProcs  # noqa: E402
from kvwake.store.files import StoreFiles  # noqa: E402
from kvwake.store.format.codec import decode_into, read_file_header  # noqa: E402


def wakes(tokens: int, n_procs: int, rounds: int, folder: Path) -> None:
    """Wakes of one slept session through an engine whose blocks worker processes decode and one whose threads do."""
    import mlx.core as mx

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from testkit.tinymodel import make_model_dir

    from kvwake.daemon.config import Tuning
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    mx.set_default_device(mx.cpu)
    model = folder / "model"
    if not (model / "config.json").exists():  # 16 layers of 8 KV heads x 64: a 1B model's KV, 4 MiB a block
        make_model_dir(model, hidden_size=256, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
                       num_hidden_layers=16, intermediate_size=256, max_position_embeddings=32768)
    store = Store(folder / f"store-{tokens}", block_tokens=128, codec="planes-zstd")
    engines = {n: Engine(store, folder, model, warm=False, tuning=Tuning(restore_mode="direct", decode_processes=n))
               for n in (0, n_procs)}
    try:
        s = Session("s")
        engines[0].append(s, tokens=[(i * 7) % 250 for i in range(tokens)])
        engines[0].sleep(s)
        best: dict[int, tuple[float, float]] = {}
        for r in range(rounds + 1):  # the first round starts the workers: not timed
            for n, engine in engines.items():
                woken, info = engine.wake("s")
                engine.release(woken)
                if r:
                    ms = (info["ms"], info["phases_ms"].get("blocks", 0.0))
                    best[n] = min(best.get(n, ms), ms)
        for n, (ms, blocks) in best.items():
            print(json.dumps({"wake_tokens": tokens, "procs": n, "blocks": tokens // 128, "ms": ms,
                              "blocks_ms": blocks, "threads": engines[n].pool.workers}), flush=True)
    finally:
        for engine in engines.values():
            engine.close()
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", type=Path, default=Path("/tmp/kvwake-cpu-scaling"))
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--procs", default="0,1,2", help="worker processes; 0: the threads decode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wake", type=int, default=0, help="tokens of a session woken whole (see above)")
    args = ap.parse_args()
    if args.wake:
        return wakes(args.wake, int(args.procs.split(",")[-1]), args.rounds, args.folder / "wake")
    paths = make_blocks(args.folder, args.blocks)
    files = StoreFiles(args.folder)
    digests = [read_file_header(p.read_bytes())[2] for p in paths]
    tokens = SHAPE[2]
    buffers = {n: np.zeros((*SHAPE[:2], tokens * len(paths), SHAPE[3]), np.uint16) for n in NAMES}

    def place_of(k: int):
        return lambda name, dtype, shape: buffers[name][..., k * tokens : (k + 1) * tokens, :]

    def by_thread(k: int) -> None:
        with files.mapped(paths[k].name) as data:
            _, _, actual = decode_into(data, place_of(k), max_raw_bytes=RAW + (1 << 16))
        assert actual == digests[k]

    for n_procs in [int(p) for p in args.procs.split(",")]:
        procs = DecodeProcs(n_procs) if n_procs else None

        def by_proc(k: int) -> None:
            _, _, actual = procs.decode(paths[k], digests[k], RAW + (1 << 16), place_of(k))
            assert actual == digests[k]

        read = by_proc if procs else by_thread
        try:
            for n_threads in [int(t) for t in args.threads.split(",")]:
                with cf.ThreadPoolExecutor(n_threads) as pool:
                    list(pool.map(read, range(len(paths))))  # workers started, files cached
                    best = 0.0
                    for _ in range(args.rounds):
                        began = time.perf_counter()
                        list(pool.map(read, range(len(paths))))
                        best = max(best, len(paths) * RAW / (time.perf_counter() - began) / 1e9)
                print(json.dumps({"procs": n_procs, "threads": n_threads, "GBps": round(best, 3),
                                  "ms_per_block": round(RAW / best / 1e6 * n_threads, 3)}), flush=True)
        finally:
            if procs is not None:
                procs.close()


if __name__ == "__main__":
    main()
