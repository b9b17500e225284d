"""Diagnostic: what the first decode step after N calls join a running batch spends (issue 24, session 25).

A talker decodes alone in a batch (the daemon's decoder's own GenerationBatch helpers: joining.py); then N
sessions of a few hundred to a thousand tokens join in one merge, dead rows fill the batch to its slot size,
and the first pass runs. Timed apart, per admission: the merge in Python (lazy), the merged caches evaluated
(copies into the batch's arrays), the first pass, the steps after it; MLX's active, cached and peak memory
before and after. Admissions repeat with other lengths (a new batch length each time) and again with the same
lengths (shapes seen), then alternate the merge computed inside the first pass (the daemon before session 25)
and scheduled ahead of it (joining.schedule, the daemon's since).
The daemon's trace (session 24, H100) had the admitting step at 75-154 ms against 16-20 ms steady.

usage: python bench/admit_pass.py --model PATH [--rows 16] [--talker 1000] [--steps 8] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from kvwake.daemon.model import joining
from kvwake.daemon.model.joining import SLOTS, _unstepped, dead_rows, slot_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--talker", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    model, _ = mlx_lm.load(a.model)
    blanks = make_prompt_cache(model)

    def cache_for(n: int, seed: int) -> list:
        c = make_prompt_cache(model)
        for at in range(0, n, 512):
            part = mx.random.randint(0, 500, (min(512, n - at),), key=mx.random.key(seed * 1000 + at))
            model(part[None], cache=c)
            mx.eval([x.state for x in c])
        return c

    def joined(uids: list[int], caches: list[list]) -> object:
        merged = [first.merge([c[i] for c in caches]) for i, first in enumerate(caches[0])]
        return _unstepped(model, uids, merged, [[1] for _ in uids], [greedy_sampler] * len(uids),
                          [() for _ in uids], mx.array([1] * len(uids), dtype=mx.uint32))

    def memory() -> dict:
        return {"active_gb": round(mx.get_active_memory() / 1e9, 2), "cache_gb": round(mx.get_cache_memory() / 1e9, 2),
                "peak_gb": round(mx.get_peak_memory() / 1e9, 2)}

    def step_ms() -> float:
        t = time.perf_counter()
        batch.next()
        return (time.perf_counter() - t) * 1000

    uid = iter(range(1 << 30))
    batch = joined([next(uid)], [cache_for(a.talker, 0)])
    for _ in range(a.steps * 2):  # the lone talker, warm
        batch.next()
    steady = sorted(step_ms() for _ in range(a.steps))
    results = {"rows": a.rows, "talker": a.talker, "slots": list(SLOTS), "steady_alone_ms": steady}
    print(json.dumps({"steady_alone_ms": steady}), flush=True)
    # (what, lengths' seed, how the merge is computed): "apart" evaluated before the step (timed alone),
    # "in the pass" left to the step's pass (before session 25), "ahead" joining.schedule's async_eval (the
    # daemon's since); alternating, each admission at new lengths (a new batch length), one repeated
    trials = [("warm-up", 10, "apart"), ("new lengths", 11, "apart"), ("same lengths again", 11, "apart")]
    trials += [("new lengths", 12 + i, how) for i in range(6) for how in (("in the pass", "ahead")[i % 2],)]
    results["admissions"] = []
    for what, seed, how in trials:
        lengths = [300 + (seed * 37 + i * 53) % 700 for i in range(a.rows)]
        caches = [cache_for(n, seed * 100 + i) for i, n in enumerate(lengths)]
        mx.synchronize()
        before = memory()
        t0 = time.perf_counter()
        batch.extend(joined([next(uid) for _ in lengths], caches))
        n = len(batch.uids)
        size = slot_size(n, max(SLOTS))
        if size > n:
            batch.extend(dead_rows(model, [next(uid) for _ in range(size - n)], blanks))
        t1 = time.perf_counter()
        if how == "apart":
            mx.eval([c.state for c in batch.prompt_cache], batch._next_tokens)
        else:
            joining.ADMIT_AHEAD = how == "ahead"
            joining.schedule(batch)
        t2 = time.perf_counter()
        first = step_ms()
        after = sorted(step_ms() for _ in range(a.steps))
        row = {"what": what, "merge": how, "lengths": [min(lengths), max(lengths)], "batch": size,
               "merge_python_ms": round((t1 - t0) * 1000, 1), "merge_eval_ms": round((t2 - t1) * 1000, 1),
               "first_pass_ms": round(first, 1), "steps_after_ms": [round(x, 1) for x in after],
               "memory_before": before, "memory_after": memory()}
        results["admissions"].append(row)
        print(json.dumps(row), flush=True)
        batch.filter([0])  # the talker alone again
        mx.eval([c.state for c in batch.prompt_cache])
        del caches
        for _ in range(a.steps):
            batch.next()
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "admit_pass.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
