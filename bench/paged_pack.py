"""Where a pack of agents' turns goes over paged KV against contiguous caches (issue 51): one forward pass of N
turns, each over its own history that shares a long prefix with the others, in one process.

usage: python bench/paged_pack.py --model PATH [--sessions 8] [--shared 10240] [--own 450] [--turn 368]
                                  [--repeat 3] [--modes plain,paged,pages] [--out bench/out]

Each session's cache holds random KV (no prefill: the pass's cost does not depend on the values): `shared`
tokens every session holds alike (paged: one copy, its blocks published and mapped by the others; plain: a
copy in each session's KVCache) and `own` + 9 i tokens of its own (so the rows' shapes differ, as a fleet's
do). Then `repeat` packs of `turn` new tokens a row, each row's attention at the padded shape the engine gives a
pack whose rows' shapes differ (model/attention.py `padded_attention`). Timed apart, per mode: the pack, and
reading every row's K and V of every layer as the pack's attention is given them (a slice of a KVCache's buffer;
`paged`: a gather of a table's tokens, then padded; `pages`: its pages gathered whole to the padded length),
evaluated alone; and writing every row's next turn of K and V alone, with how far MLX's peak rose meanwhile (an
update not made in place copies its whole buffer or pool). The modes alternate, twice.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from bench.decode_rows import layer_shape, page_pool  # noqa: E402
from bench.lib import machine, save  # noqa: E402
from kvwake.daemon.kv import paged_cache  # noqa: E402
from kvwake.daemon.model import attention, packing  # noqa: E402
from kvwake.daemon.model.engine import Engine  # noqa: E402
from kvwake.store import Store  # noqa: E402

BUNDLE = "ab" * 32
SETTLE_S = float(os.environ.get("PAGED_PACK_SETTLE_S", "0"))


def random_kv(engine: Engine, tokens: int) -> list[tuple[mx.array, mx.array]]:
    heads, dim = layer_shape(engine)
    return [tuple(mx.random.normal((1, heads, tokens, dim)).astype(mx.bfloat16) * 0.5 for _ in range(2))
            for _ in engine.model.layers]


def caches(engine: Engine, mode: str, sessions: int, shared: int, own: int, room: int) -> list[list]:
    """`sessions` caches: `shared` tokens alike, then `own` + 9 i of each one's own."""
    prefix = random_kv(engine, shared)
    pool = page_pool(engine, sessions, shared + own + 9 * sessions, room) if mode != "plain" else None
    made, ids = [], list(range(shared))
    for i in range(sessions):
        cache = engine.kv.make_cache()
        if pool is not None:
            cache = paged_cache.paged_cache(pool, cache)
            if i and paged_cache.map_prefix(cache, ids, BUNDLE) * engine.kv.block_tokens < shared:
                raise RuntimeError("the shared prefix was not mapped")
        if i == 0 or pool is None:
            for layer, (k, v) in zip(cache, prefix, strict=True):
                layer.update_and_fetch(k, v)
        for layer, (k, v) in zip(cache, random_kv(engine, own + 9 * i), strict=True):
            layer.update_and_fetch(k, v)
        if pool is not None and i == 0:
            paged_cache.publish(cache, ids + [0] * (own + 9 * i), BUNDLE)
        mx.eval([c.state for c in cache])
        made.append(cache)
    return made


def pack_ms(engine: Engine, rows: list[list], turn: int) -> tuple[float, float]:
    """(ms of the pack, of which building its graph on the host: the Python of every row's every layer)."""
    tokens = [mx.random.randint(10, 1000, (turn,)).tolist() for _ in rows]
    paths = [attention.padded_attention if attention.padded_shape(cache, turn) else (lambda fused: fused)
             for cache in rows]
    mx.synchronize()
    began = time.perf_counter()
    packing.forward(engine.model, list(zip(tokens, rows, strict=True)), paths)
    built = time.perf_counter()
    mx.eval([paged_cache.state_arrays(cache) for cache in rows])  # as the engine evaluates a chunk
    mx.synchronize()
    return (time.perf_counter() - began) * 1000, (built - began) * 1000


def fetch_ms(rows: list[list], turn: int) -> float:
    """Every row's every layer's K and V as the pack's attention reads them, evaluated (copies, so they run):
    plain, a slice of the buffer; paged, gathered by token; pages, gathered by page to the padded length."""
    mx.synchronize()
    began = time.perf_counter()
    out = []
    for cache in rows:
        for layer in cache:
            whole = layer.padded(attention.key_bucket(layer.offset + turn)) if hasattr(layer, "padded") else None
            k, v = whole if whole is not None else layer.fetch() if hasattr(layer, "fetch") else (
                layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :])
            out += [k * 1, v * 1]  # a slice's read as a gather's: one pass over the bytes
    mx.eval(out)
    mx.synchronize()
    return (time.perf_counter() - began) * 1000


def writes_ms(engine: Engine, rows: list[list], turn: int) -> tuple[float, float]:
    """Every row's `turn` new tokens of K and V written alone (a KVCache's buffer, a paged table's pages), evaluated:
    (ms, MB that MLX's peak rose by: an update that is not in place copies the whole buffer or pool)."""
    kv = [random_kv(engine, turn) for _ in rows]
    mx.eval(kv)
    mx.synchronize()
    time.sleep(SETTLE_S)  # the readers of the pools before (kept alive to their kernels' end) let go
    mx.reset_peak_memory()
    held = mx.get_active_memory()
    began = time.perf_counter()
    for cache, parts in zip(rows, kv, strict=True):
        for layer, (k, v) in zip(cache, parts, strict=True):
            layer.extend(k, v) if hasattr(layer, "extend") else layer.update_and_fetch(k, v)
    mx.eval([paged_cache.state_arrays(cache) for cache in rows])
    mx.synchronize()
    return (time.perf_counter() - began) * 1000, (mx.get_peak_memory() - held) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--shared", type=int, default=10240)
    ap.add_argument("--own", type=int, default=450)
    ap.add_argument("--turn", type=int, default=368)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="plain,paged,pages", help="plain: KVCache; paged: pages gathered by token "
                    "and padded; pages: gathered by page to the padded length")
    ap.add_argument("--out", default="bench/out")
    a = ap.parse_args()
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store", block_tokens=128)
        engine = Engine(store, Path(tmp), Path(a.model), max_batch=32)
        for mode in a.modes.split(",") * 2:  # alternating: drift shows
            rows = caches(engine, mode, a.sessions, a.shared, a.own, (a.repeat + 1) * a.turn)
            got = results.setdefault(mode, {"pack_ms": [], "fetch_ms": []})
            paged_cache.PAGE_GATHER = mode == "pages"
            got["fetch_ms"].append(fetch_ms(rows, a.turn))
            for _ in range(a.repeat):
                ms, build = pack_ms(engine, rows, a.turn)
                got["pack_ms"].append(ms)
                got.setdefault("pack_build_ms", []).append(build)
            got["fetch_ms"].append(fetch_ms(rows, a.turn))
            ms, mb = writes_ms(engine, rows, a.turn)
            got.setdefault("writes_ms", []).append(ms)
            got.setdefault("writes_peak_mb", []).append(mb)
            del rows
            mx.clear_cache()
        engine.close()
        store.close()
    line = {"sessions": a.sessions, "shared": a.shared, "own": a.own, "turn": a.turn,
            **{f"{mode}_{k}": [round(x, 1) for x in v] for mode, got in results.items() for k, v in got.items()},
            **{f"{mode}_pack_ms_median": round(statistics.median(got["pack_ms"]), 1) for mode, got in results.items()}}
    save({"machine": machine(), "results": [line]}, a.out, "paged_pack.json")


if __name__ == "__main__":
    main()
