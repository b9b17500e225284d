"""Sessions sharing a long prompt with `paged_kv` on and off: the KV bytes they hold and the blocks their wakes read.

usage: kvwake bench paged-wakes (or python bench/paged_wakes.py) [--shared 9300] [--own 450] [--sessions 8]
       [--block 128] [--wide] [--out bench/out]

A random-weight llama (testkit.tinymodel, its context widened to hold the prompt; `--wide`: more and wider KV
layers), one engine per mode (`--tune paged_kv` off, on), each with a store of its own and the daemon's
session manager, in process on this machine (a wake beside a hot woken session takes its blocks, as the
daemon's does). In each:
1. `--sessions` sessions, each the shared prompt of `--shared` tokens and `--own` tokens of its own, appended
   one after another (off: the others copy the first's prompt from its cache; on: they map its published
   pages); the hot KV then (what `status` reports as `memory.hot_kv_bytes`: the sessions' unpaged KV and the
   page pool's pages, a shared page once);
2. all but the first sleep and wake one by one, the first hot: each wake's blocks read (from disk or the RAM
   tier) and mapped or taken (`blocks_shared`), their time, and the most bytes MLX held meanwhile above
   what it held before;
3. all sleep, then all wake one by one (a restart's wakes, none hot): the same counts; the hot KV after;
4. (paged, into pages) all asleep, the first woken alone and put back to sleep, ROUNDS times by each path
   by turns (straight into pages, through buffers): every block read; median ms, and the bytes MLX and the
   host (tracemalloc) held at most above what they held, in one more wake by each path.
With `paged_kv` on it runs twice: wakes restoring straight into pages (kv/page_restore.py, "on") and through
contiguous buffers copied into pages after (the path it replaced, "on_through_buffers").
Results go to <out>/paged_wakes.json; docs/benchmarks.md ("Paged wakes and the bytes of a shared prompt
(issue 51)", "Paged wakes straight into pages (h-pw)") holds the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402

import mlx.core as mx  # noqa: E402

from kvwake.daemon.config import Settings, Tuning  # noqa: E402
from kvwake.daemon.kv import page_restore  # noqa: E402
from kvwake.daemon.model.engine import Engine  # noqa: E402
from kvwake.daemon.model.provider import ModelProvider  # noqa: E402
from kvwake.daemon.model.thread import EngineThread  # noqa: E402
from kvwake.daemon.sessions.manager import SessionManager  # noqa: E402
from kvwake.store import Store  # noqa: E402
from testkit.tinymodel import make_model_dir  # noqa: E402

ROUNDS = 7  # wakes alone by each path, taken by turns
WIDE = {"num_hidden_layers": 8, "num_key_value_heads": 8, "num_attention_heads": 8, "hidden_size": 512,
        "intermediate_size": 256}  # `--wide`: enough KV a token that a wake's copies weigh more than its per-block work


async def wakes(m: SessionManager, names: list[str], host: bool = False) -> dict[str, float]:
    """Wake `names` one by one: blocks read, blocks mapped or taken, ms summed, and the most bytes MLX held
    during the wakes above what it held before them (`mlx_peak_over_bytes`: the restores' MLX buffers and
    staging, and the pages they took where the pool grew). `host`: also the most bytes Python and numpy
    allocated meanwhile above what they held (`host_peak_over_bytes`, tracemalloc's: host rows, decoders'
    scratch), which slows the wakes (their ms are not comparable with untraced ones)."""
    read = shared = 0
    await m.released()
    if host:
        tracemalloc.start()
    before = m.thread.call(lambda: (mx.reset_peak_memory(), mx.get_active_memory())[1])
    started = time.perf_counter()
    for name in names:
        info = await m.wake(name)
        read += info["blocks_from_disk"] + info["blocks_from_memory"]
        shared += info["blocks_shared"]
    out = {"blocks_read": read, "blocks_shared": shared, "ms": round((time.perf_counter() - started) * 1000, 1),
           "mlx_peak_over_bytes": m.thread.call(mx.get_peak_memory) - before}
    if host:
        out["host_peak_over_bytes"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return out


async def alone(m: SessionManager, names: list[str], rounds: int) -> dict[str, dict]:
    """All asleep, `names[0]` woken alone (every block read) and put back to sleep `rounds` times untraced and
    once traced (`wakes`' `host`), through contiguous buffers and straight into pages by turns: the median
    and every ms, and the peaks over (MLX's, the host's, their sum)."""
    for name in names:
        await m.sleep(name)
    seen: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(rounds + 1):
        for into_pages in (False, True):
            page_restore.ENABLED = into_pages
            seen[into_pages].append(await wakes(m, names[:1], host=r == rounds))
            await m.sleep(names[0])
    page_restore.ENABLED = True
    out = {}
    for into_pages, runs in seen.items():
        traced, timed = runs[-1], runs[:-1]
        out["into_pages" if into_pages else "through_buffers"] = {
            "blocks_read": traced["blocks_read"], "ms_median": statistics.median(r["ms"] for r in timed),
            "ms_all": [r["ms"] for r in timed], "mlx_peak_over_bytes": traced["mlx_peak_over_bytes"],
            "host_peak_over_bytes": traced["host_peak_over_bytes"],
            "peak_over_bytes": traced["mlx_peak_over_bytes"] + traced["host_peak_over_bytes"]}
    return out


async def hot_kv(m: SessionManager) -> int:
    """`status`'s `memory.hot_kv_bytes` once what was let go is freed."""
    await m.released()
    m.thread.call(lambda: m.engine.pages.pool.drain() if m.engine.pages is not None else None)
    return m.hot_bytes()


async def steps(m: SessionManager, prompts: list[list[int]]) -> dict:
    names = [f"s{i}" for i in range(len(prompts))]
    started = time.perf_counter()
    for name, ids in zip(names, prompts):
        await m.create(name)
        await m.append(name, tokens=ids)
    out = {"append_ms": round((time.perf_counter() - started) * 1000, 1), "hot_kv_bytes": await hot_kv(m)}
    for name in names[1:]:
        await m.sleep(name)
    out["woken_beside_one_hot"] = {**await wakes(m, names[1:]), "hot_kv_bytes": await hot_kv(m)}
    for name in names:
        await m.sleep(name)
    out["woken_none_hot"] = {**await wakes(m, names), "hot_kv_bytes": await hot_kv(m)}
    if m.engine.pages is not None and page_restore.ENABLED:
        out["woken_alone"] = await alone(m, names, ROUNDS)
    return out


def run_mode(model_dir: Path, root: Path, paged: bool, prompts: list[list[int]], block: int,
             into_pages: bool = True) -> dict:
    """One engine on a thread of its own and its session manager, in process (as the daemon runs them).
    `into_pages` False: paged wakes restore into contiguous buffers first (kv/page_restore.ENABLED)."""
    page_restore.ENABLED = into_pages
    folder = root / (("paged" if into_pages else "paged-buffers") if paged else "plain")
    store, thread = Store(folder / "store", block_tokens=block), EngineThread()
    engine = thread.submit(lambda: Engine(store, folder, model_dir, tuning=Tuning(paged_kv=paged), warm=False)).result()
    m = SessionManager(ModelProvider.of(engine, thread), Settings(socket=folder / "s.sock", data_dir=folder))
    try:
        return {**anyio.run(steps, m, prompts), "blocks_per_session": (len(prompts[0]) - 1) // block}
    finally:
        thread.stop()
        engine.close()
        store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=int, default=9300)
    parser.add_argument("--own", type=int, default=450)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--wide", action="store_true",
                        help="8 layers of 8 KV heads of 64 (16 KiB of KV a token) in place of the tiny shape")
    args = parser.parse_args(argv)
    shared = [(i * 37 + 11) % 200 + 20 for i in range(args.shared)]
    prompts = [shared + [(i * 7 + k) % 90 + 5 for k in range(args.own)] for i in range(args.sessions)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_model_dir(root / "model", max_position_embeddings=2 * (args.shared + args.own),
                                   **(WIDE if args.wide else {}))
        result = {"shared": args.shared, "own": args.own, "sessions": args.sessions, "block": args.block,
                  "wide": args.wide,
                  "off": run_mode(model_dir, root, False, prompts, args.block),
                  "on_through_buffers": run_mode(model_dir, root, True, prompts, args.block, into_pages=False),
                  "on": run_mode(model_dir, root, True, prompts, args.block)}
    result["hot_kv_ratio"] = round(result["on"]["hot_kv_bytes"] / result["off"]["hot_kv_bytes"], 4)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paged_wakes.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
