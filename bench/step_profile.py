"""Where a batched decode step's time goes: the daemon's decoder in process against mlx-lm's BatchGenerator.

usage: python bench/step_profile.py [--model tiny|default|PATH] [--sessions 8,16] [--tokens 96]
                                    [--temperature 0] [--rounds 3] [--between none|clear|gc] [--top 25]
                                    [--out bench/out]

For each N, --rounds times (alternating): mlx-lm's `BatchGenerator` decodes N prompts (steady state:
the steps that return all N rows), then the engine's batched decoder (the daemon's code, in process:
no RPC, no event loop) decodes N fresh calls of the same prompts and length, timed per step
(`Decoder.step()`, after WARMUP); medians of the rounds' mean steps. `--limits-ab`: each round also
times the decoder under the daemon's MLX memory and cache limits (model/memory.py), then restores
MLX's defaults. `--engine-thread`: each round also times a second engine made and stepped on an
`EngineThread` under those limits, as the daemon runs its own (no RPC, no event loop): what is left
between it and the daemon is the daemon's serving. Then the decoder once more under
cProfile. Reported: each one's mean step (ms) and tokens/s, their ratio, and the
profiled decoder's time split by where it is spent (mlx-lm's batch step, the calls' outputs:
detokenizing, stop strings, events; masks; the rest), with the top functions by own time. The
profile slows Python, so its split is read as shares, the unprofiled step as the figure.
Results: <out>/step_profile.json.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import mlx.core as mx  # noqa: E402
from batching import batch_generator_steps, bench_model, prompts, save  # noqa: E402
from structured import timed_steps  # noqa: E402

from kvwake.daemon.model.engine import Engine  # noqa: E402
from kvwake.daemon.model import memory  # noqa: E402
from kvwake.daemon.model.generation import GenerateParams  # noqa: E402
from kvwake.daemon.model.thread import EngineThread  # noqa: E402
from kvwake.daemon.serve import _release_mlx_streams  # noqa: E402
from kvwake.daemon.session import Session  # noqa: E402
from kvwake.store import Store  # noqa: E402

# Where a function's cumulative time is counted (the first pattern its file:function matches).
PARTS = {"batch step (mlx-lm)": "generate.py:next", "outputs (detokenize, stops, events)": "generation.py:add",
         "masks": "masks.py:prefetch"}


WARMUP = 4


class ThreadedEngine:
    """An engine as the daemon has it (daemon/serve.py): made on an `EngineThread`, MLX's limits set there,
    every MLX call on that thread; no RPC, no event loop."""

    def __init__(self, work: Path, model: Path, defaults: tuple[int, int]) -> None:
        self.thread, self.defaults = EngineThread(on_exit=_release_mlx_streams), defaults
        self.store = Store(work / "threaded-store", block_tokens=16)
        self.engine = self.thread.call(lambda: Engine(self.store, work / "threaded", model, max_batch=64))
        self.engine.tokenizer.eos_token_ids = []

    def steps(self, n: int, tokens: int, temperature: float, tag: str) -> list[float]:
        """Step times of n calls, under the daemon's MLX limits (MLX's defaults again afterwards: the
        limits are the process's)."""
        self.thread.call(memory.apply_limits)
        try:
            return self.thread.call(lambda: timed_steps(self.engine.decoder,
                                                        decoder_calls(self.engine, n, tokens, temperature, tag)))
        finally:
            mx.set_memory_limit(self.defaults[0])
            mx.set_cache_limit(self.defaults[1])

    def close(self) -> None:
        self.thread.call(self.engine.close)
        self.thread.stop()
        self.store.close()


def decoder_calls(engine: Engine, n: int, tokens: int, temperature: float, tag: str) -> list:
    calls = []
    for i, text in enumerate(prompts(n)):
        s = Session(f"{tag}-{i}")
        engine.append(s, tokens=engine.tokenizer.encode(text))
        calls.append(engine.start_call(s, GenerateParams(max_tokens=tokens, temperature=temperature, seed=i)))
    return calls


def split(profile: cProfile.Profile, top: int) -> dict[str, Any]:
    stats = pstats.Stats(profile)
    total = sum(row[2] for row in stats.stats.values())  # own time of everything: the profiled wall
    by_name = {f"{Path(file).name}:{line}:{name}": row for (file, line, name), row in stats.stats.items()}
    parts = {}
    for part, pattern in PARTS.items():
        file, name = pattern.split(":")
        parts[part] = round(sum(row[3] for key, row in by_name.items()
                                if key.startswith(file + ":") and key.endswith(":" + name)), 4)
    step = sum(row[3] for key, row in by_name.items() if key.startswith("decoder.py:") and key.endswith(":step"))
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][2])[:top]
    return {"profiled_s": round(total, 4), "decoder_step_s": round(step, 4), "parts_s": parts,
            "top_own_s": [{"function": key, "calls": row[1], "own_s": round(row[2], 4),
                           "cumulative_s": round(row[3], 4)}
                          for key, row in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sessions", default="8,16")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--limits-ab", action="store_true", help="also time the decoder under the daemon's MLX limits")
    ap.add_argument("--engine-thread", action="store_true",
                    help="also time the decoder of an engine made and stepped on an EngineThread, as the daemon's")
    ap.add_argument("--between", default="none", choices=["none", "clear", "gc"],
                    help="after each round: nothing, mx.clear_cache() (MLX's cached buffers freed), or gc.collect()")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    a = ap.parse_args()
    import mlx_lm

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = bench_model(a.model, work)
        loaded, tokenizer = mlx_lm.load(str(model))
        sizes = [int(x) for x in a.sessions.split(",")]
        report: dict[str, Any] = {"model": model.name, "device": str(mx.default_device()), "tokens": a.tokens,
                                  "between_rounds": a.between,
                                  "temperature": a.temperature, "rows": []}
        store = Store(work / "store", block_tokens=16)
        engine = Engine(store, work, model, max_batch=64)
        engine.tokenizer.eos_token_ids = []  # every call runs to --tokens: every step runs all N
        defaults = (mx.set_memory_limit(1 << 40), mx.set_cache_limit(1 << 40))  # each returns the limit it replaced
        mx.set_memory_limit(defaults[0])
        mx.set_cache_limit(defaults[1])
        mean_ms = lambda times: statistics.mean(times) * 1000  # noqa: E731
        threaded = ThreadedEngine(work, model, defaults) if a.engine_thread else None
        try:
            batch_generator_steps(loaded, tokenizer, max(sizes), 8, WARMUP)  # warms every shape up, both ways
            timed_steps(engine.decoder, decoder_calls(engine, max(sizes), 8, a.temperature, "warm"))
            if threaded is not None:
                threaded.steps(max(sizes), 8, a.temperature, "warm")
            runs: dict[int, dict[str, list[float]]] = {n: {"decoder": [], "batch_generator": []} for n in sizes}
            for r in range(a.rounds):  # alternating, so a drift of the machine's speed hits both alike
                report.setdefault("memory_per_round", []).append(Engine.mlx_memory())
                if a.between == "clear":
                    mx.clear_cache()
                elif a.between == "gc":
                    gc.collect()
                for n in sizes:
                    mlx_lm_steps = batch_generator_steps(loaded, tokenizer, n, a.tokens, WARMUP)
                    runs[n]["batch_generator"].append(mean_ms(mlx_lm_steps))
                    runs[n]["decoder"].append(mean_ms(timed_steps(engine.decoder, decoder_calls(
                        engine, n, a.tokens, a.temperature, f"t{n}-{r}"))))
                    if a.limits_ab:  # the decoder again under the daemon's MLX limits (memory.apply_limits)
                        memory.apply_limits()
                        runs[n].setdefault("decoder_daemon_limits", []).append(mean_ms(timed_steps(
                            engine.decoder, decoder_calls(engine, n, a.tokens, a.temperature, f"l{n}-{r}"))))
                        mx.set_memory_limit(defaults[0])
                        mx.set_cache_limit(defaults[1])
                    if threaded is not None:  # the decoder on an engine built and stepped on an EngineThread
                        runs[n].setdefault("decoder_engine_thread", []).append(
                            mean_ms(threaded.steps(n, a.tokens, a.temperature, f"e{n}-{r}")))
            for n in sizes:
                ms, mlx_lm_ms = statistics.median(runs[n]["decoder"]), statistics.median(runs[n]["batch_generator"])
                calls = decoder_calls(engine, n, a.tokens, a.temperature, f"p{n}")
                profile = cProfile.Profile()
                profile.enable()
                timed_steps(engine.decoder, calls)
                profile.disable()
                row = {"sessions": n, "decoder_step_ms": round(ms, 3), "decoder_tokens_per_s": round(n / ms * 1000, 1),
                       "batch_generator_step_ms": round(mlx_lm_ms, 3),
                       "batch_generator_tokens_per_s": round(n / mlx_lm_ms * 1000, 1),
                       "ratio": round(mlx_lm_ms / ms, 3), "profile": split(profile, a.top),
                       "runs_ms": {k: [round(x, 3) for x in v] for k, v in runs[n].items()}}
                print({k: v for k, v in row.items() if k != "profile"}, row["profile"]["parts_s"],
                      row["profile"]["decoder_step_s"], flush=True)
                report["rows"].append(row)
        finally:
            if threaded is not None:
                threaded.close()
            engine.close()
            store.close()
    save(report, a.out, "step_profile.json")


if __name__ == "__main__":
    main()
