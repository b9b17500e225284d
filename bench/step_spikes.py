"""Where a lone session's slow decode steps come from: kvwake's Solo steps against mlx-lm's own loop.

usage: python bench/step_spikes.py [--model tiny|PATH] [--prompt 200] [--tokens 1100] [--rounds 2] [--json OUT]

In process, one model, the daemon's MLX limits (model/memory.py apply_limits): a session of --prompt
tokens decodes --tokens tokens alone, in rounds that alternate four ways:
- `kvwake`: the engine's Solo steps (as a lone agent decodes in the daemon; no persistence in process);
- `mlx-lm`: mlx-lm's `generate_step` on the same model and prompt (greedy), its tokens read one by one,
  its caches growing mlx-lm's way (session 17's device run still had kv/capacity.py's growth here);
- each with Python's garbage collector off for the run (`-nogc`).
Each step is timed; reported per run: the median, the p99, the longest, every step over 2.5x the median
with its index (and the collections the collector ran meanwhile). On the H100 (session 17) a lone session's
steps had a median of 6.5-8 ms and maxima of 30-56 ms (bench/decode_growth.py), not at its buffer's
growth; the p99 targets (issue 24: <= 2x the median) need to know whether mlx-lm's loop has them too.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
SPIKE = 2.5  # a step this many times the run's median is named


def summary(name: str, ms: list[float], collections: int) -> dict:
    ordered = sorted(ms)
    median, p99 = statistics.median(ms), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    spikes = [(i, round(m, 2)) for i, m in enumerate(ms) if m > SPIKE * median]
    return {"run": name, "steps": len(ms), "median_ms": round(median, 3), "p99_ms": round(p99, 3),
            "p99_over_median": round(p99 / median, 2),
            "max_ms": round(max(ms), 3), "spikes": spikes, "gc_collections": collections}


class Collections:
    """Counts the collector's runs while open (gc.callbacks)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.n += 1

    def __enter__(self) -> Collections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def timed_solo(engine, prompt: list[int], tokens: int, name: str,  # noqa: ANN001
               probe: Callable[[Any], Any] | None = None) -> list[tuple[float, Any]]:
    """A new session of `prompt` generates `tokens` tokens alone (Solo, no EOS): each step's ms, with what
    `probe` says of the Solo call after it (bench/decode_growth.py: its buffer's size)."""
    from kvwake.daemon.model import calls
    from kvwake.daemon.model.generation import GenerateParams
    from kvwake.daemon.session import Session

    steps: list[tuple[float, Any]] = []
    real = calls.Solo.step

    def timed(self) -> int:  # noqa: ANN001
        t0 = time.perf_counter()
        token = real(self)
        steps.append(((time.perf_counter() - t0) * 1000, probe(self) if probe is not None else None))
        return token

    calls.Solo.step = timed
    try:
        s = Session(name)
        engine.append(s, tokens=prompt)
        no_eos = tuple((t, -100.0) for t in engine.tokenizer.eos_token_ids)
        engine.generate(s, GenerateParams(max_tokens=tokens, logit_bias=no_eos))
    finally:
        calls.Solo.step = real
    return steps


def kvwake_run(engine, prompt: list[int], tokens: int, name: str) -> list[float]:  # noqa: ANN001
    return [ms for ms, _ in timed_solo(engine, prompt, tokens, name)]


def mlx_run(model, prompt: list[int], tokens: int) -> list[float]:  # noqa: ANN001
    """mlx-lm's `generate_step`, greedy, `tokens` steps timed after the prompt's first token, with mlx-lm's
    own buffer growth (the Engine installs kv/capacity.py's on CUDA: taken out for the run)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from kvwake.daemon.kv import capacity

    def greedy(logprobs: mx.array) -> mx.array:
        return mx.argmax(logprobs, axis=-1)

    steps: list[float] = []
    installed = capacity.installed()
    capacity.uninstall()
    try:
        last = None
        for _ in generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=tokens + 1, sampler=greedy):
            now = time.perf_counter()
            if last is not None:  # the first yield is the prompt's prefill
                steps.append((now - last) * 1000)
            last = now
    finally:
        if installed:
            capacity.install()
    return steps


def main() -> None:
    from batching import bench_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=1100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    import mlx.core as mx

    from kvwake.daemon.model import memory
    from kvwake.daemon.model.engine import Engine
    from kvwake.store import Store

    limits = memory.apply_limits()
    with tempfile.TemporaryDirectory() as work:
        model = bench_model(a.model, Path(work))
        store = Store(Path(work) / "store")
        engine = Engine(store, Path(work), model, limits=limits)
        prompt = [(i * 37) % 200 + 20 for i in range(a.prompt)]
        kvwake_run(engine, prompt, 64, "warm")  # kernels and buffers of every shape seen
        mlx_run(engine.model, prompt, 64)
        rows = []
        for r in range(a.rounds):
            for name in ("kvwake", "mlx-lm", "kvwake-nogc", "mlx-lm-nogc"):
                gc.collect()
                if name.endswith("-nogc"):
                    gc.disable()
                try:
                    with Collections() as seen:
                        ms = (kvwake_run(engine, prompt, a.tokens, f"r{r}-{name}") if name.startswith("kvwake")
                              else mlx_run(engine.model, prompt, a.tokens))
                finally:
                    gc.enable()
                rows.append(summary(name, ms, seen.n))
                print(json.dumps(rows[-1]), flush=True)
        engine.close()
        store.close()
    out = {"device": str(mx.default_device()), "model": a.model, "prompt": a.prompt, "tokens": a.tokens,
           "rows": rows}
    for name in ("kvwake", "mlx-lm", "kvwake-nogc", "mlx-lm-nogc"):
        mine = [r for r in rows if r["run"] == name]
        out[name] = {k: statistics.median(r[k] for r in mine)
                     for k in ("median_ms", "p99_ms", "p99_over_median", "max_ms")}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
