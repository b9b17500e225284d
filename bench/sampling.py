"""Sampling rows in one op (RowsSampler) against row by row (mlx-lm's GenerationBatch), one run.

usage: python bench/sampling.py [--model tiny|PATH] [--sessions 8,16,32] [--tokens 64] [--rounds 3]
                                [--temperature 1.0] [--out bench/out]

For each N: N fresh sessions decode --tokens tokens together in the engine's batched decoder (the
daemon's code, in process), each seeded at --temperature (OpenAI's and Anthropic's default is 1, so
every HTTP call samples), with `Decoder.rows_sampling` on and off, alternating for --rounds rounds.
A step's time is wall time around `Decoder.step()` over the steps that ran all N calls, after the
first WARMUP; tokens/s = N / mean step. Both ways must give the same tokens (checked).
Results: <out>/sampling.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from batching import bench_model, save  # noqa: E402
from structured import timed_steps  # noqa: E402

from kvwake.daemon.model.engine import Engine  # noqa: E402
from kvwake.daemon.model.generation import GenerateParams  # noqa: E402
from kvwake.daemon.session import Session  # noqa: E402
from kvwake.store import Store  # noqa: E402

def run(engine: Engine, n: int, tokens: int, temperature: float, together: bool, tag: str) -> tuple[dict, list]:
    decoder = engine.decoder
    decoder.rows_sampling = together
    calls = []
    for i in range(n):
        s = Session(f"{tag}-{i}")
        engine.append(s, tokens=[(t * (i + 7)) % 200 + 3 for t in range(64)])
        calls.append(engine.start_call(s, GenerateParams(max_tokens=tokens, temperature=temperature, seed=i)))
    times = timed_steps(decoder, calls)
    decoder.rows_sampling = True
    mean = statistics.mean(times) if times else None
    return ({"step_ms": round(mean * 1000, 3) if mean else None, "tokens_per_s": round(n / mean, 1) if mean else None},
            [c.future.result().tokens for c in calls])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sessions", default="8,16,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = bench_model(a.model, work)
        store = Store(work / "store", block_tokens=16)
        engine = Engine(store, work, model, max_batch=64)
        engine.tokenizer.eos_token_ids = []  # calls end at --tokens: every step runs all N
        try:
            import mlx.core as mx

            report: dict[str, Any] = {"model": model.name, "device": str(mx.default_device()), "rows": []}
            sizes = [int(x) for x in a.sessions.split(",")]
            run(engine, max(sizes), 8, a.temperature, True, "warm-on")
            run(engine, max(sizes), 8, a.temperature, False, "warm-off")
            for n in sizes:
                runs: dict[str, list[dict]] = {"together": [], "row_by_row": []}
                for r in range(a.rounds):
                    on, on_tokens = run(engine, n, a.tokens, a.temperature, True, f"on-{n}-{r}")
                    off, off_tokens = run(engine, n, a.tokens, a.temperature, False, f"off-{n}-{r}")
                    assert on_tokens == off_tokens, f"{n} rows, round {r}: the two ways sampled different tokens"
                    runs["together"].append(on)
                    runs["row_by_row"].append(off)
                med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in runs.items()}
                row = {"sessions": n, "together_tokens_per_s": med["together"], "row_by_row_tokens_per_s": med["row_by_row"],
                       "ratio": round(med["together"] / med["row_by_row"], 3), "runs": runs}
                print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
                report["rows"].append(row)
        finally:
            engine.close()
            store.close()
    save(report, a.out, "sampling.json")


if __name__ == "__main__":
    main()
