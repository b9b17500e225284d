"""A long prefill beside a decoding call: whole chunks, chunks in layer slices, or smaller chunks.

usage: python bench/prefill_slices.py [--model tiny|PATH] [--prefill 4096] [--layers 8] [--hidden 256]

In process, on the engine thread as the daemon runs it: one session decodes (greedy) while another
appends --prefill tokens from a worker thread (mlx = the engine thread's call). Modes:
  chunks     --step-token chunks, each one engine job (kvwake before slices)
  slices     --step-token chunks, a slice of layers per job while the call decodes (model/prefillslices.py)
  small      --small-token chunks, each one job
Reports the prefill's wall time and the decoding call's gaps (ms between its tokens) during the
prefill: p50, p99, max, and the p50 of its gaps alone. `--model tiny` makes a random llama with
--layers layers of width --hidden (tests/tinymodel.py). One JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from kvwake.daemon.model.engine import Engine  # noqa: E402
from kvwake.daemon.model.generation import GenerateParams  # noqa: E402
from kvwake.daemon.model.thread import EngineThread  # noqa: E402
from kvwake.daemon.session import Session  # noqa: E402
from kvwake.store import Store  # noqa: E402


def pct(values: list[float], q: float) -> float | None:
    return round(sorted(values)[min(len(values) - 1, int(q * len(values)))], 2) if values else None


def run(engine: Engine, thread: EngineThread, prefill: int, tag: str) -> dict:
    talker = Session(f"{tag}-talker")
    engine.append(talker, text="Tell the long story of the migration.", mlx=thread.call)
    call = thread.call(lambda: engine.start_call(talker, GenerateParams(max_tokens=1 << 20)))
    stamps: list[float] = []
    add = call.output.add
    call.output.add = lambda token: stamps.append(time.perf_counter()) or add(token)  # type: ignore[method-assign]
    thread.call(lambda: engine.decoder.join(call))
    while len(stamps) < 64:
        time.sleep(0.01)
    alone_until = time.perf_counter()
    reader = Session(f"{tag}-reader")
    tokens = [(i * 37 + 5) % 200 + 20 for i in range(prefill + 1)]
    began = time.perf_counter()
    engine.append(reader, tokens=tokens, mlx=thread.call)
    ended = time.perf_counter()
    stop = threading.Event()
    call.output.should_stop = stop.is_set
    stop.set()
    call.future.result(timeout=600)
    gaps = [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])]
    alone = [g for g, t in zip(gaps, stamps[1:]) if t < alone_until]
    during = [g for g, t in zip(gaps, stamps[1:]) if began < t < ended]
    return {"prefill_s": round(ended - began, 3), "gap_alone_p50_ms": pct(alone, 0.5),
            "gap_during_p50_ms": pct(during, 0.5), "gap_during_p99_ms": pct(during, 0.99),
            "gap_during_max_ms": round(max(during), 2) if during else None, "samples_during": len(during),
            "p99_during_over_p50_alone": round(pct(during, 0.99) / statistics.median(alone), 2)
            if during and alone else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--step", type=int, default=512)
    ap.add_argument("--small", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--modes", default="chunks,slices,small")
    a = ap.parse_args()
    import mlx.core as mx

    work = Path(tempfile.mkdtemp(prefix="kvwake-slices-"))
    if a.model == "tiny":  # float32: the CPU has no fast bfloat16 matmul
        from tests.tinymodel import make_model_dir

        model = make_model_dir(work / "tiny", num_hidden_layers=a.layers, hidden_size=a.hidden,
                               intermediate_size=4 * a.hidden, max_position_embeddings=1 << 17, dtype=mx.float32)
    else:
        model = Path(a.model)
    for mode in a.modes.split(","):
        store = Store(work / f"store-{mode}", block_tokens=128)
        engine = Engine(store, work, model, prefill_step=a.small if mode == "small" else a.step)
        engine.planner.slice_prefill = mode == "slices"
        thread = EngineThread()
        thread.attach(engine.decoder, engine.planner)
        try:
            run(engine, thread, min(a.prefill, 1024), f"warm-{mode}")  # kernels and slice costs measured once
            row = {"mode": mode, "prefill_tokens": a.prefill, **run(engine, thread, a.prefill, mode),
                   "device": str(mx.default_device())}
        finally:
            thread.stop()
            engine.close()
            store.close()
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
