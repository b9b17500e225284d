"""What a pack of turns costs against the same turns apart: whether gathering turns into one pack pays here.

usage: python bench/pack_cost.py [--model tiny|default|PATH] [--rows 4] [--history 2900] [--spread 0] [--new 380]
                                 [--repeats 3] [--shapes pack,...] [--by-rows] [--out bench/out]

Each of --rows sessions holds --history tokens; each turn feeds it --new more. Timed, in turn, --repeats
times: every turn in one pack (model/packing.py, the engine's packed prefill), the first turn alone and
the others as one pack (what the engine thread ran when the first turn's job was taken as it was queued),
and every turn alone. Where a pack costs what its rows cost apart, gathering turns into one pack cannot
bring their first tokens forward; where it costs less (a pass that reads every weight), it does
(docs/benchmarks.md, "fleet"). Also: one turn over an empty cache and over --history tokens (how much of a
turn's prefill is attention).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from bench.lib import bench_model, machine, save  # noqa: E402
from kvwake.daemon.model import packing  # noqa: E402

SHAPES = {"pack": lambda n: [list(range(n))], "1 + pack": lambda n: [[0], list(range(1, n))],
          "apart": lambda n: [[i] for i in range(n)]}


def caches(model: Any, histories: list[list[int]]) -> list[list[Any]]:
    out = []
    for history in histories:
        cache = make_prompt_cache(model)
        if history:
            model(mx.array(history)[None], cache=cache)
            mx.eval([layer.state for layer in cache])
        out.append(cache)
    return out


def timed(model: Any, histories: list[list[int]], news: list[list[int]], groups: list[list[int]]) -> float:
    """Seconds to feed each group of turns (a list of row indices) as one pass, one group after another."""
    held = caches(model, histories)
    start = time.perf_counter()
    for group in groups:
        if len(group) == 1:
            model(mx.array(news[group[0]])[None], cache=held[group[0]])
        else:
            packing.forward(model, [(news[i], held[i]) for i in group], [lambda fused: fused] * len(group))
        mx.eval([layer.state for i in group for layer in held[i]])
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--history", type=int, default=2900)
    ap.add_argument("--new", type=int, default=380)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    ap.add_argument("--spread", type=int, default=0, help="row i holds --history + i x this many tokens")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="which of pack, '1 + pack', apart to time")
    ap.add_argument("--by-rows", action="store_true",
                    help="a quantized model's products as the daemon takes them (model/quantized.py: a prefill's "
                         "weights dequantized, then multiplied), not MLX's tile kernels")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:  # the tiny model's folder lives while it is read
        model, _ = load(str(bench_model(a.model, Path(work))))
        if a.by_rows:
            from kvwake.daemon.model import quantized
            print("layers by rows:", quantized.install(model), flush=True)
        report = measure(model, a)
    save({"bench": "pack_cost", "machine": machine(), "model": a.model, **report}, a.out, "pack_cost.json")


def measure(model: Any, a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(100, 250) for _ in range(n)]  # noqa: E731 - ids every test vocabulary has
    # --spread: row i holds i x spread more tokens, as agents' histories differ (each row's attention then has
    # a shape of its own)
    histories = [tokens(a.history + i * a.spread) for i in range(a.rows)]
    news = [tokens(a.new) for _ in range(a.rows)]
    shapes = {name: SHAPES[name] for name in a.shapes.split(",")}
    ms: dict[str, list[float]] = {name: [] for name in shapes}
    for _ in range(a.repeats):  # alternated: a machine's drift falls on every shape alike
        for name, groups in shapes.items():
            ms[name].append(round(timed(model, histories, news, groups(a.rows)) * 1000, 1))
            print(name, ms[name][-1], "ms", flush=True)
    one = {f"over {n} tokens": round(timed(model, [tokens(n)], [news[0]], [[0]]) * 1000, 1) for n in (0, a.history)}
    return {"rows": a.rows, "history": a.history, "spread": a.spread, "new": a.new, "ms": ms, "one_turn_ms": one}

if __name__ == "__main__":
    main()
