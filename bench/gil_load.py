"""Probe: what a load's Python does to another thread's decode steps, per switch interval (issue 53's gap).

On the H200 a second model's load stops the main model's streams twice, ~29 ms each against ~12-15 ms steps: at
its start (the modules built) and at its end (the engine's set-up), every stream at once (docs/benchmarks.md,
"Several models", S45). Both are Python on the loading thread; the decoding engine thread takes the GIL back
after each eval and waits out Python's switch interval (5 ms) behind it, and loses it mid-step to the loader
after as long. This probe runs the same two things in one process: a thread stepping a model's decode without
pause (one token a step, evaluated, its token read back, as the engine thread does), and a loading thread that
builds a model's modules from a config (mlx-lm's classes, lazily: what `load_model(lazy=True)` does before the
weights) every `--every-ms`, each build as the daemon's loads run (model/switching.py: the collector off, the
interval set: `load_switch_ms`). Per switch interval in `--intervals` (ms; alternated over `--rounds`): the steps
alone and while a build runs (p50, p99, max) and the builds' own ms. One JSON line per interval and round.

usage: python bench/gil_load.py [--decode PATH] [--shape llama8b|llama1b] [--intervals 5,0.5] [--rounds 3]
                                [--seconds 4] [--every-ms 150]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.lib import pct  # noqa: E402
from kvwake.daemon.model import switching  # noqa: E402

# the loaded model's shapes (../shared/gpu/make_model.py's): only the modules are built, no weights
SHAPES = {"llama8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
                          num_key_value_heads=8),
          "llama1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
                          num_key_value_heads=8)}


def build(shape: str) -> float:
    """Loading thread: the model's modules from its config, as a lazy load makes them; the ms it took."""
    from mlx_lm.utils import _get_classes

    config = dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                  vocab_size=128256, **SHAPES[shape])
    began = time.perf_counter()
    model_class, args_class = _get_classes(config=config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.bfloat16)  # as load_model does: every parameter touched once more
    del model
    return (time.perf_counter() - began) * 1000


def run(decode: Path, shape: str, interval_ms: float, seconds: float, every_ms: float) -> dict:
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(decode))
    cache = make_prompt_cache(model)
    token = mx.array([[1]], dtype=mx.uint32)
    mx.eval(model(mx.arange(64, dtype=mx.uint32)[None], cache=cache))
    steps: list[tuple[float, float]] = []  # (ended at, ms since the last step ended)
    builds: list[tuple[float, float]] = []  # (began at, ended at)
    stop = threading.Event()

    def decoding() -> None:
        nonlocal token
        last = time.perf_counter()
        while not stop.is_set():
            logits = model(token, cache=cache)
            token = mx.argmax(logits[:, -1], axis=-1, keepdims=True).astype(mx.uint32)
            mx.eval(token)
            token.item()  # read back, as a step's tokens are
            now = time.perf_counter()
            steps.append((now, (now - last) * 1000))
            last = now
            if cache[0].offset > 2048:  # keep the step's cost flat
                for c in cache:
                    c.trim(c.offset - 64)
        mx.synchronize()
        mx.clear_streams()  # this thread's stream, destroyed by it (model/loader.py `release_mlx_streams`)

    def loading() -> None:
        build(shape)  # imports and classes warm before the measured builds
        while not stop.wait(every_ms / 1000):
            began = time.perf_counter()
            with switching.while_loading(interval_ms):  # as the daemon loads: the collector off, the interval set
                build(shape)
            builds.append((began, time.perf_counter()))

    threads = [threading.Thread(target=decoding), threading.Thread(target=loading)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    steps = steps[5:]  # the first steps settle

    def during(at: float, ms: float) -> bool:  # the step overlapped a build
        return any(b <= at and at - ms / 1000 <= e for b, e in builds)

    inside = [ms for at, ms in steps if during(at, ms)]
    alone = [ms for at, ms in steps if not during(at, ms)]
    built = [(e - b) * 1000 for b, e in builds]
    return {"interval_ms": interval_ms, "steps_alone": len(alone), "steps_during": len(inside),
            "alone_p50_ms": pct(alone, 0.5), "alone_p99_ms": pct(alone, 0.99),
            "during_p50_ms": pct(inside, 0.5), "during_p99_ms": pct(inside, 0.99),
            "during_max_ms": round(max(inside), 2) if inside else None,
            "during_max_over_alone_p50": round(max(inside) / pct(alone, 0.5), 2) if inside and alone else None,
            "builds": len(built), "build_ms_p50": pct(built, 0.5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", default=None, help="the decoding model's folder (default: a tiny llama, made here)")
    ap.add_argument("--shape", default="llama8b", choices=SHAPES)
    ap.add_argument("--intervals", default="5,0.5")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--every-ms", type=float, default=150.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvwake-gil-") as work:
        decode = Path(args.decode) if args.decode else None
        if decode is None:
            from testkit.tinymodel import make_model_dir

            decode = make_model_dir(Path(work) / "decode", num_hidden_layers=16)
        for _ in range(args.rounds):
            for interval in (float(x) for x in args.intervals.split(",")):
                print(json.dumps(run(decode, args.shape, interval, args.seconds, args.every_ms)), flush=True)


if __name__ == "__main__":
    main()
