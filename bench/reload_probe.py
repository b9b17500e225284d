"""Where a reloaded model's first wake goes (issue 53): in one process, as the daemon unloads a model and loads it
again for a turn, with what the unload and the load do around it switched off one at a time.

The daemon's unloaded turn waits on the device 4-5x longer for its wake's joins than the same wake on the warm
engine (docs/benchmarks.md, "Several models", S43); probes of the join alone, on fresh threads and from device
memory, did not show it. This drives kvwake's own Engine through the same steps as the daemon, each engine on a
thread of its own that ends with `release_mlx_streams` (an engine thread's exit), and times the wake's phases:

  warm        the session's wake on the engine that made it (its blocks from disk)
  reloaded    the first wake on the engine loaded after that one was closed (close, full collection,
              `clear_cache`, the old thread's streams released: `stop_model`'s steps)
  again       the same wake once more on the reloaded engine

once per variant, each leaving one step out: none (the daemon's way), `streams` (the old engine's thread stays
alive: no `clear_streams`), `thread` (the new engine on the old one's thread: no new thread, no `clear_streams`),
`collect` (no full collection), `cache` (no `clear_cache`), `warmer` (no kernel warmer processes at the load),
`settle` (the wake 2 s after the load rather than at once).

usage: python bench/reload_probe.py --model PATH [--tokens 10000] [--variants none,streams,thread,collect,cache,warmer,settle]

Prints one JSON line per variant: the three wakes' ms and phases (`joins_eval`: the joins' waits for the device).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ("none", "streams", "thread", "collect", "cache", "warmer", "settle")


class Lane:
    """A thread of its own for one engine's life (as an engine thread): `run` a function on it."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Callable[[], Any], list, threading.Event]] = []
        self.ready = threading.Condition()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            with self.ready:
                while not self.jobs:
                    self.ready.wait()
                fn, out, done = self.jobs.pop(0)
            if fn is None:
                done.set()
                return
            try:
                out.append(fn())
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                out.append(exc)
            done.set()

    def run(self, fn: Callable[[], Any] | None) -> Any:
        out: list = []
        done = threading.Event()
        with self.ready:
            self.jobs.append((fn, out, done))
            self.ready.notify()
        done.wait()
        if out and isinstance(out[0], BaseException):
            raise out[0]
        return out[0] if out else None

    def end(self) -> None:
        self.run(None)
        self.thread.join()


def open_engine(store: Any, root: Path, model: str, warmer: bool, limits: Any, first: bool) -> Any:
    """An engine as `start_model` makes one: MLX's limits the first model set, staging made beside the load by the
    first model only (a model loaded on demand makes none)."""
    from kvwake.daemon.config import Tuning
    from kvwake.daemon.model.engine import Engine

    return Engine(store, root, model, warm=False, tuning=Tuning(kernel_warmer=warmer), limits=limits,
                  staging_beside_load=first)


def wake(engine: Any, sid: str) -> dict[str, Any]:
    """The session woken from disk (the RAM tier emptied), timed, then slept again (its cache dropped)."""
    engine.ram_tier.__init__(engine.ram_tier.budget)
    t0 = time.perf_counter()
    session, info = engine.wake(sid)
    ms = (time.perf_counter() - t0) * 1000
    engine.sleep(session)
    return {"ms": round(ms, 1), "phases_ms": info.get("phases_ms")}


def close(engine: Any, lane: Lane, variant: str) -> None:
    """`stop_model`'s steps for an engine on `lane` (its thread ends: its streams released), but `variant`'s."""
    import mlx.core as mx

    from kvwake.daemon.model.loader import release_mlx_streams

    lane.run(engine.close)
    if variant not in ("streams", "thread"):
        lane.run(release_mlx_streams)
        lane.end()
    if variant != "collect":
        gc.collect()
    if variant != "cache":
        mx.clear_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=10000)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    from bench.suite import tokens_of
    from kvwake.daemon.kv.restore_buffers import auto_codecs
    from kvwake.daemon.model import memory
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    with tempfile.TemporaryDirectory(prefix="kvwake-reload-") as work:
        root = Path(work)
        store = Store(root / "store", block_tokens=128, auto_among=auto_codecs())
        lane = Lane()
        limits = lane.run(memory.apply_limits)  # the daemon's: its cache limit bounds what MLX keeps of freed buffers
        engine = lane.run(lambda: open_engine(store, root, args.model, True, limits, True))
        lane.run(engine.wait_kernels)
        session = Session("long")

        def make() -> None:
            engine.append(session, tokens=tokens_of(engine, args.tokens))
            engine.sleep(session)
            wake(engine, session.id)  # the kernels of a wake this size, compiled once

        lane.run(make)
        for variant in args.variants.split(","):
            warm = lane.run(lambda: wake(engine, session.id))
            close(engine, lane, variant)
            kept = lane if variant == "streams" else None  # the old engine's thread, alive to the end
            lane = lane if variant == "thread" else Lane()
            t0 = time.perf_counter()
            engine = lane.run(lambda: open_engine(store, root, args.model, variant != "warmer", limits, False))
            load_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            lane.run(engine.wait_kernels)  # the daemon's first job on a new engine thread: the warmers' compiles
            kernels_s = time.perf_counter() - t0
            if variant == "settle":
                time.sleep(2.0)
            reloaded = lane.run(lambda: wake(engine, session.id))
            again = lane.run(lambda: wake(engine, session.id))
            print(json.dumps({"variant": variant, "load_s": round(load_s, 2), "kernels_s": round(kernels_s, 2),
                              "warm": warm, "reloaded": reloaded,
                              "again": again}), flush=True)
            if kept is not None:
                kept.end()
        lane.run(engine.close)
        store.close()


if __name__ == "__main__":
    main()
