"""MLX on the CPU: a round of agents' turns prefilled one at a time, in one pass, and apart on threads.

usage: python bench/rows_apart.py [--model tiny|PATH] [--rows 4] [--history 2400] [--new 380]
                                  [--threads 2,4,8,16] [--rounds 2]

Each of --rows sessions holds --history tokens; each turn feeds it --new more, through the engine's own packs
(model/parallel_rows.py, tuning prefill_threads; docs/decisions.md, "Turns apart on the CPU's cores"). Timed,
alternating, --rounds times: one at a time (each turn's finish, cumulative: the k-th turn's first token waits for
k prefills), the pack in one pass (prefill_threads 1, pack_prefill true), and apart on each --threads count. One
JSON line per way: ms until the last turn's prefill is done (the round's p95 first token, less the decode step),
and for one at a time the third of four (the p50). MLX is set to the CPU whatever the machine has.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from bench.lib import bench_model, machine  # noqa: E402
from kvwake.daemon.config import Tuning  # noqa: E402
from kvwake.daemon.jobs import Packed  # noqa: E402
from kvwake.daemon.model.engine import Engine  # noqa: E402
from kvwake.daemon.session_state import Session  # noqa: E402
from kvwake.store import Store  # noqa: E402


def round_ms(work: Path, model_dir: Path, tuning: Tuning, histories: list[list[int]], news: list[list[int]],
             apart: bool) -> list[float]:
    """ms from the round's start until each turn's prefill is done (packed: all at the pack's end)."""
    store = Store(work / f"store-{time.monotonic_ns()}", block_tokens=128)
    engine = Engine(store, work, model_dir, max_batch=8, tuning=tuning)
    try:
        sessions = []
        for i, history in enumerate(histories):
            s = Session(f"s{i}")
            engine.append(s, tokens=history)
            sessions.append(s)
        began = time.perf_counter()
        if not apart:
            done = []
            for s, new in zip(sessions, news):
                engine.append(s, tokens=new)
                done.append((time.perf_counter() - began) * 1000)
            return done
        jobs = []
        for s, new in zip(sessions, news):
            plan = engine.plan(s, tokens=new)
            jobs.append(Packed(engine._adopt_and_start, engine._start_turns, (s, plan, (None, 0), len(plan.target) - 1,
                                                                              None)))
        errors = [e for e in engine._start_turns(jobs) if isinstance(e, BaseException)]
        if errors:
            raise errors[0]
        return [(time.perf_counter() - began) * 1000] * len(sessions)
    finally:
        engine.close()
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--history", type=int, default=2400)
    ap.add_argument("--new", type=int, default=380)
    ap.add_argument("--threads", default="2,4,8,16")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(100, 250) for _ in range(n)]  # noqa: E731 - ids every test vocabulary has
    histories, news = [tokens(a.history) for _ in range(a.rows)], [tokens(a.new) for _ in range(a.rows)]
    ways = {"one at a time": (Tuning(restore_points=False), False),
            "one pass": (Tuning(pack_prefill=True, prefill_threads=1, restore_points=False), True),
            **{f"apart x{t}": (Tuning(prefill_threads=t, restore_points=False), True)
               for t in map(int, a.threads.split(","))}}
    got: dict[str, list[list[float]]] = {name: [] for name in ways}
    with tempfile.TemporaryDirectory() as work:
        model_dir = bench_model(a.model, Path(work))
        for _ in range(a.rounds):  # alternated: a machine's drift falls on every way alike
            for name, (tuning, apart) in ways.items():
                got[name].append(round_ms(Path(work), model_dir, tuning, histories, news, apart))
    print(json.dumps({"machine": machine(), "rows": a.rows, "history": a.history, "new": a.new}))
    for name, runs in got.items():
        best = min(runs, key=lambda r: r[-1])
        print(json.dumps({"way": name, "last_ms": round(best[-1], 1), "p50_turn_ms": round(sorted(best)[len(best) // 2], 1),
                          "runs_last_ms": [round(r[-1], 1) for r in runs]}), flush=True)


if __name__ == "__main__":
    main()
