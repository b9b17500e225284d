"""A decoding session's steps where its KV buffer grows: all layers in one step, or one layer a step ahead.

usage: python bench/decode_growth.py [--model tiny|PATH] [--prompt 200] [--tokens 600] [--rounds 3] [--json OUT]

In process, one Engine: a session of --prompt tokens generates --tokens tokens alone (Solo, as a lone
agent decodes), round after round with kv/capacity.py's GROW_AHEAD off (every layer grows in the step
that meets the full buffer, mlx-lm's way) and on (a layer a step before it fills), alternating. Each
step is timed (Solo.step: it feeds a token and waits for the one before); reported per mode: the median
step, the longest, the p99, and where the last layer's buffer grew (the step, its time and the next's:
a growth's work is computed with the step after the one that queued it). On the H100 the step
that met a 264-token buffer took 16-37 ms against 4-7 (bench/batching.py's prefill row, session 16);
this isolates it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def run(engine, prompt: list[int], tokens: int, ahead: bool, name: str) -> dict:  # noqa: ANN001
    from step_spikes import timed_solo

    from kvwake.daemon.kv import capacity

    def buffer(call) -> int:  # noqa: ANN001  (the last layer's buffer tokens after the step)
        layer = next((c for c in reversed(call.cache) if getattr(c, "keys", None) is not None), None)
        return layer.keys.shape[2] if layer is not None else 0

    capacity.GROW_AHEAD = ahead
    steps = timed_solo(engine, prompt, tokens, name, buffer)
    ms = [m for m, _ in steps]
    # a step returns the token fed the step before (it waits for it): a growth's cost shows in the step after
    grew = [(i, round(steps[i][0], 2), round(steps[i + 1][0], 2) if i + 1 < len(steps) else None)
            for i in range(1, len(steps)) if steps[i][1] != steps[i - 1][1]]
    ordered = sorted(ms)
    return {"grow_ahead": ahead, "steps": len(ms), "median_ms": round(statistics.median(ms), 3),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
            "max_ms": round(max(ms), 3), "top5_ms": [round(m, 2) for m in ordered[-5:][::-1]],
            "buffer_changes": grew}


def main() -> None:
    from batching import bench_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    import mlx.core as mx

    from kvwake.daemon.model.engine import Engine
    from kvwake.store import Store

    with tempfile.TemporaryDirectory() as work:
        model = bench_model(a.model, Path(work))
        store = Store(Path(work) / "store")
        engine = Engine(store, Path(work), model)
        prompt = [(i * 37) % 200 + 20 for i in range(a.prompt)]
        run(engine, prompt, 64, True, "warm")  # kernels and buffers of every shape seen
        rows = []
        for r in range(a.rounds):
            for ahead in (False, True):
                row = run(engine, prompt, a.tokens, ahead, f"r{r}-{int(ahead)}")
                rows.append(row)
                print(json.dumps(row), flush=True)
        engine.close()
        store.close()
    out = {"device": str(mx.default_device()), "model": a.model, "prompt": a.prompt, "tokens": a.tokens,
           "rows": rows}
    for ahead in (False, True):
        mine = [r for r in rows if r["grow_ahead"] == ahead]
        out[f"{'ahead' if ahead else 'all_at_once'}_median_of_max_ms"] = statistics.median(r["max_ms"] for r in mine)
        out[f"{'ahead' if ahead else 'all_at_once'}_median_step_ms"] = statistics.median(r["median_ms"] for r in mine)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
