"""Where a restore point's copies to the host go: each part of `PointTaker._copies`, timed alone.

usage: python3 bench/point_copies.py MODEL [--tokens 10709] [--turn 500] [--repeats 5] [--window-blocks]

Issue 52's hybrid fleet on the GPU machine showed a turn's point copies taking far longer on the engine thread
than their few blocks' bytes take at the copy speed (docs/benchmarks.md, "Restore points"), so they were moved
to the engine's idle time. This cuts one such point apart, in process: an Engine on MODEL prefills a
prompt of `--tokens`, then a turn of `--turn` more in one chunk that passes a block boundary; at that boundary
the cut (`points.cut_at`), the held copy (`points.hold`), the blocks the store lacks (`_copy_blocks`), the rings'
rows (`_window_rows`, with `--window-blocks`) and the point itself (`_point`) are each timed alone, best of
`--repeats`, with the bytes each brings to the host. Prints one JSON line per part.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.lib import machine  # noqa: E402
from kvwake.daemon.config import Tuning  # noqa: E402
from kvwake.daemon.kv import points  # noqa: E402
from kvwake.daemon.model.engine import Engine  # noqa: E402
from kvwake.daemon.session_state import Session  # noqa: E402
from kvwake.store import Store, chain_keys  # noqa: E402


def host_bytes(value) -> int:
    """Bytes of the numpy arrays (or Tensors) in what a part returned."""
    if isinstance(value, dict):
        return sum(host_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(host_bytes(v) for v in value)
    array = getattr(value, "array", value)
    return int(getattr(array, "nbytes", 0))


def timed(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        mx.synchronize()
        began = time.perf_counter()
        out = fn()
        mx.synchronize()
        best = min(best, time.perf_counter() - began)
    return best * 1000, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=10709, help="the prompt before the turn (the fleet's first)")
    ap.add_argument("--turn", type=int, default=500, help="the turn's tokens, fed in one chunk")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--window-blocks", action="store_true", help="the rings' rows in the blocks (as the fleet ran)")
    a = ap.parse_args()
    print(json.dumps({"machine": machine()}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        engine = Engine(store, Path(tmp), a.model, tuning=Tuning(window_blocks=a.window_blocks, held_points=True))
        try:
            vocab = engine.tokenizer.vocab_size
            tokens = [(i * 7919 + 13) % (vocab - 2) + 1 for i in range(a.tokens + a.turn)]
            session = Session("probe")
            engine.append(session, tokens=tokens[: a.tokens])
            engine.points.flush()
            b = store.block_tokens
            before = session.processed
            session.tokens = list(tokens)
            # the turn in one chunk (no point taken meanwhile: `take` is what is timed here, part by part)
            engine.model(mx.array([tokens[before : len(tokens) - 1]]), cache=session.cache)
            mx.eval([c.state for c in session.cache])
            session.processed = len(tokens) - 1
            at = session.processed // b * b
            taker = engine.points
            plan = taker._plan(tokens[:at], chain_keys(taker.ctx.bundle.hash, tokens[:at], b))
            if plan is None:
                raise SystemExit(f"the store holds the point at {at} already: nothing to copy")
            parts = {}
            parts["cut"], cut = timed(lambda: points.cut_at(session.cache, at, b), a.repeats)
            parts["hold"], _ = timed(lambda: points.hold(session, at, cut), a.repeats)
            needed = plan[2]
            if not needed or needed != list(range(needed[0], needed[-1] + 1)):
                raise SystemExit(f"blocks the store lacks at {at}: {needed[:8]}: not one run")
            parts["copy_blocks"], blocks = timed(lambda: taker._copy_blocks(cut, needed[0], len(needed)), a.repeats)
            parts["window_rows"], rows = timed(lambda: taker._window_rows(cut, blocks), a.repeats)
            window = taker._window(cut, at, plan[3])
            parts["point"], point = timed(lambda: taker._point(cut, at, window), a.repeats)
            parts["all"], got = timed(lambda: taker._copies(cut, at, plan, {}), a.repeats)
            sizes = {"copy_blocks": host_bytes(blocks), "window_rows": host_bytes(rows), "point": host_bytes(point),
                     "all": host_bytes(got)}
            for name, ms in parts.items():
                print(json.dumps({"part": name, "ms": round(ms, 3), "host_bytes": sizes.get(name),
                                  "blocks": len(needed), "at": at, "window_blocks": a.window_blocks}), flush=True)
        finally:
            engine.close()
            store.close()


if __name__ == "__main__":
    main()
