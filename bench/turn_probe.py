"""Where a lone agent's short turn over a long context goes, in process (a probe, not a benchmark).

usage: python bench/turn_probe.py --model DIR [--tokens 74500] [--turn 131] [--reply 10] [--turns 6]
                                  [--paged false,true] [--profile 3]

A session manager over the model (as tests/test_manager.py makes one, the engine warmed as a daemon's), a
session of `--tokens` random tokens, then `--turns` turns: `--turn` tokens appended, `--reply` tokens
generated. Each turn's append and first token in ms; for turn `--profile` the engine thread's jobs under
cProfile (its top functions by own and by cumulative time).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kvwake.daemon.config import Settings, Tuning  # noqa: E402
from kvwake.daemon.model import memory  # noqa: E402
from kvwake.daemon.model.engine import Engine  # noqa: E402
from kvwake.daemon.model.generation import GenerateParams  # noqa: E402
from kvwake.daemon.model.provider import ModelProvider  # noqa: E402
from kvwake.daemon.model.thread import EngineThread  # noqa: E402
from kvwake.daemon.sessions.manager import SessionManager  # noqa: E402
from kvwake.store import Store  # noqa: E402


async def run(args: argparse.Namespace, paged: bool, warm: str, folder: Path) -> None:
    store = Store(folder / "store", block_tokens=128)
    thread = EngineThread()
    t0 = time.perf_counter()
    limits = thread.submit(memory.apply_limits).result()  # the defaults, as a daemon sets them unless configured
    engine = thread.submit(lambda: Engine(store, folder, args.model, limits=limits, warm=False,
                                          tuning=Tuning(paged_kv=paged))).result()
    thread.attach(engine.decoder, engine.planner)
    thread.submit(engine.wait_kernels).result()
    jobs = thread.submit(engine.warm_jobs).result()
    names = [getattr(j, "__qualname__", type(j).__qualname__) for j in jobs]
    chosen = [j for j, name in zip(jobs, names, strict=True)
              if warm == "all" or (warm == "paths" and "PathCosts" in name)]
    for job in chosen:
        thread.submit(job).result()
    print(f"paged={paged} warm={warm}: engine {time.perf_counter() - t0:.1f} s, warm jobs run {len(chosen)} of "
          f"{len(jobs)} ({sorted(set(names))}), paths measured: {engine.planner.paths is not None}", flush=True)
    manager = SessionManager(ModelProvider.of(engine, thread), Settings(socket=folder / "s.sock", data_dir=folder))
    rng = random.Random(0)
    vocab = min(engine.vocab_size, 100_000)
    await manager.create("lone")
    t = time.perf_counter()
    await manager.append("lone", tokens=[rng.randrange(vocab // 4, vocab) for _ in range(args.tokens)])
    print(f"  cold append {args.tokens}: {1000 * (time.perf_counter() - t):.0f} ms", flush=True)
    params = GenerateParams(max_tokens=args.reply)
    for turn in range(2, args.turns + 2):
        await manager.generate("lone", params, None, lambda: False)
        profile = cProfile.Profile() if turn == args.profile else None
        if profile is not None:
            thread.submit(profile.enable).result()
        t = time.perf_counter()
        got = await manager.append("lone", tokens=[rng.randrange(vocab // 4, vocab) for _ in range(args.turn)])
        append_ms = 1000 * (time.perf_counter() - t)
        first: list[float] = []
        t = time.perf_counter()

        def on_event(event: object) -> None:
            if not first:
                first.append(1000 * (time.perf_counter() - t))
        await manager.generate("lone", GenerateParams(max_tokens=1), on_event, lambda: False)
        if profile is not None:
            thread.submit(profile.disable).result()
        print(f"  turn {turn}: append {append_ms:.1f} ms (prefilled {got.get('prefilled')}), one token "
              f"{1000 * (time.perf_counter() - t):.1f} ms", flush=True)
        if profile is not None:
            for key in ("tottime", "cumulative"):
                out = io.StringIO()
                pstats.Stats(profile, stream=out).sort_stats(key).print_stats(28)
                print("\n".join(line[:170] for line in out.getvalue().splitlines()[6:40]))
    thread.stop()
    engine.close()
    store.close()


def reference(args: argparse.Namespace) -> None:
    """mlx-lm alone: a plain KVCache of `--tokens`, then a `--turn`-token forward over it (trimmed back), as
    mlx-lm computes it (its causal fused attention), medians of five after one untimed."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    model, _ = load(args.model)
    cache = make_prompt_cache(model)
    rng = random.Random(1)
    vocab = min(model.args.vocab_size, 100_000)
    tokens = [rng.randrange(vocab // 4, vocab) for _ in range(args.tokens)]
    for start in range(0, args.tokens, 2048):
        model(mx.array(tokens[start:start + 2048])[None], cache=cache)
        mx.eval([c.state for c in cache])
    turn = mx.array([rng.randrange(vocab // 4, vocab) for _ in range(args.turn)])[None]
    times = []
    for _ in range(6):
        t = time.perf_counter()
        mx.eval(model(turn, cache=cache))
        times.append(1000 * (time.perf_counter() - t))
        trim_prompt_cache(cache, args.turn)
    times = sorted(times[1:])
    print(f"mlx-lm alone: a {args.turn}-token forward over {args.tokens}: {times[2]:.1f} ms (of {times})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=74_500)
    parser.add_argument("--turn", type=int, default=131)
    parser.add_argument("--reply", type=int, default=10)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--paged", default="false,true")
    parser.add_argument("--profile", type=int, default=3)
    parser.add_argument("--warm", default="none,all", help="warm jobs run before the turns: none, all, paths")
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    if args.reference:
        reference(args)
    for paged in args.paged.split(","):
        for warm in args.warm.split(","):
            with tempfile.TemporaryDirectory() as folder:
                asyncio.run(run(args, paged == "true", warm, Path(folder)))


if __name__ == "__main__":
    main()
