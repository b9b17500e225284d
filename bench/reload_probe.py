"""Where a reloaded model's first wake goes (issue 53): in one process, the daemon's own unload and load of a model
(`stop_model`, `free_stopped`, `start_model`: each engine on an engine thread of its own), with one of their steps
left out or changed at a time, and the wake's phases timed.

The daemon's unloaded turn waited on the device far longer for its wake's joins than the same wake on the warm
engine, and probes of the join alone did not (docs/benchmarks.md, "Several models", S43). Per variant:

  warm        the session's wake on the engine that made it (its blocks from disk)
  reloaded    the first wake on the engine loaded after that one was unloaded
  again       the same wake once more on the reloaded engine

Variants: `none` (the daemon's way), `cached` (the unload's pass leaving MLX's cache as the stopped model left it:
the daemon's way before session 45), `kept` (the old model still referred to while the new one loads and wakes,
and freed after: the daemon's way before its unload freed the old weights), `warmer` (kernel warmer processes
started again at the load, as before a reload started none: model/kernel_cache.py `_done`), `settle` (the wake 2 s
after the load rather than at once).

usage: python bench/reload_probe.py --model PATH [--tokens 10000] [--variants none,kept,warmer,settle]
                                    [--restore-mode staged|direct]

Prints one JSON line per variant: the three wakes' ms and phases (`joins_eval`: the joins' waits for the device;
none where restores decode in place, the CPU's default: `--restore-mode staged` there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ("none", "cached", "kept", "warmer", "settle")


def wake(engine: Any, sid: str) -> dict[str, Any]:
    """Engine thread: the session woken from disk (the RAM tier emptied), timed, then slept again."""
    engine.ram_tier.__init__(engine.ram_tier.budget)
    t0 = time.perf_counter()
    session, info = engine.wake(sid)
    ms = (time.perf_counter() - t0) * 1000
    engine.sleep(session)
    return {"ms": round(ms, 1), "phases_ms": info.get("phases_ms")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=10000)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--restore-mode", choices=("staged", "direct"), default=None,
                    help="how restores fill buffers (tuning restore_mode; default: the machine's)")
    args = ap.parse_args()
    import mlx.core as mx

    from bench.suite import tokens_of
    from kvwake.daemon.config import ModelSpec, Settings, Tuning
    from kvwake.daemon.kv.restore_buffers import auto_codecs
    from kvwake.daemon.model import kernel_cache
    from kvwake.daemon.model.loader import free_stopped, start_model, stop_model
    from kvwake.daemon.model.provider import LoadedModel
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    spec = ModelSpec("main", str(Path(args.model).expanduser().resolve()))
    with tempfile.TemporaryDirectory(prefix="kvwake-reload-") as work:
        root = Path(work)
        settings = Settings(socket=root / "s.sock", data_dir=root, model=spec.source,
                            tuning=Tuning(restore_mode=args.restore_mode))
        store = Store(root / "store", block_tokens=128, auto_among=auto_codecs(args.restore_mode))
        model = LoadedModel(*start_model(settings, store, spec, None), "main")  # sets MLX's limits
        limits = model.engine.limits
        session = Session("long")

        def make(engine: Any) -> None:
            engine.append(session, tokens=tokens_of(engine, args.tokens))
            engine.sleep(session)
            wake(engine, session.id)  # the kernels of a wake this size, compiled once

        model.thread.call(lambda: make(model.engine))
        for variant in args.variants.split(","):
            warm = model.thread.call(lambda: wake(model.engine, session.id))
            stop_model(model)
            old = model if variant == "kept" else None
            del model
            if old is None:
                free_stopped(clear=variant != "cached")
            cached_bytes = mx.get_cache_memory()  # what the next engine's arrays may be handed
            if variant == "warmer":
                kernel_cache._done.clear()  # as before: the reload starts the folder's warmers again (nor noted
                shutil.rmtree(Path(os.environ.get("MLX_PTX_CACHE_DIR", "/nonexistent")) / kernel_cache.NOTES_DIR,
                              ignore_errors=True)  # on the machine: the next start notes them again)
            t0 = time.perf_counter()
            engine, thread = start_model(settings, store, spec, limits)
            thread.call(engine.wait_kernels)  # the daemon's first job on a new engine thread (model/loader.py)
            load_s = time.perf_counter() - t0
            model = LoadedModel(engine, thread, "main")
            del engine, thread
            if variant == "settle":
                time.sleep(2.0)
            at_wake = mx.get_cache_memory()
            reloaded = model.thread.call(lambda: wake(model.engine, session.id))
            again = model.thread.call(lambda: wake(model.engine, session.id))
            if old is not None:
                del old
                free_stopped()
            print(json.dumps({"variant": variant, "load_s": round(load_s, 2), "cached_bytes": cached_bytes,
                              "cached_bytes_at_wake": at_wake, "warm": warm, "reloaded": reloaded,
                              "again": again}), flush=True)
        stop_model(model)
        store.close()


if __name__ == "__main__":
    main()
