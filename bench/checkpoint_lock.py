"""A checkpoint's index transaction over a long conversation, and a request's lookup that waits on it.

usage: python bench/checkpoint_lock.py [--tokens 75000] [--block-tokens 128] [--checkpoints 8] [--turn 131]

A store holding one stateless session of --tokens tokens; then --checkpoints checkpoints of --turn more
tokens each, every one superseding the last (as continuous persistence commits after each turn), while a
thread looks the next request up (`Store.deepest_heads`, as a request's matching does) every 2 ms. Printed:
each checkpoint's whole time and its index transaction's (the time the store's index lock is held), and
the lookup's time alone against during the checkpoints (median, p90, max). For a before/after, run the
other tree with PYTHONPATH pointing at an install of it (docs/benchmarks.md, session 16).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=75000)
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--checkpoints", type=int, default=8)
    ap.add_argument("--turn", type=int, default=131)
    a = ap.parse_args()
    import kvwake.store
    from kvwake.store import Store
    from tests.kvdata import BUNDLE, write_snapshot

    print("store from", kvwake.store.__file__, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "s", block_tokens=a.block_tokens)
        store.register_bundle(BUNDLE, {"model": "bench"})
        rng = np.random.default_rng(0)
        tokens = [int(t) for t in rng.integers(0, 50000, a.tokens)]
        head = write_snapshot(store, "http-a", tokens, metadata={"mode": "chat"}).id
        store.ensure_session("http-a", {"origin": "http"})  # a stateless conversation, as the matcher looks for
        holds: list[float] = []
        transaction = store.transaction

        @contextlib.contextmanager
        def timed():
            with transaction() as db:
                began = time.perf_counter()
                yield db
            holds.append((time.perf_counter() - began) * 1000)

        store.transaction = timed
        want = np.asarray(tokens + [7] * a.turn, dtype=np.int64)

        def lookup() -> float:
            began = time.perf_counter()
            assert store.deepest_heads(BUNDLE, want, origin="http", mode="chat"), "the session was not found"
            return (time.perf_counter() - began) * 1000

        alone = [lookup() for _ in range(20)]
        during: list[float] = []
        done = threading.Event()

        def keep_looking() -> None:
            while not done.is_set():
                during.append(lookup())
                time.sleep(0.002)

        looker = threading.Thread(target=keep_looking)
        looker.start()
        for k in range(a.checkpoints):
            tokens = tokens + [int(x) for x in rng.integers(0, 50000, a.turn)]
            began = time.perf_counter()
            head = write_snapshot(store, "http-a", tokens, supersede=head, metadata={"mode": "chat"}).id
            print(f"checkpoint {k}: {(time.perf_counter() - began) * 1000:.1f} ms, transaction {holds[-1]:.1f} ms",
                  flush=True)
        done.set()
        looker.join()
        store.close()
    ordered = sorted(during)
    print(f"transaction median {statistics.median(holds):.1f} ms; lookup alone median "
          f"{statistics.median(alone):.2f} ms, during checkpoints median {statistics.median(during):.2f} "
          f"p90 {ordered[int(0.9 * len(ordered))]:.2f} max {ordered[-1]:.2f} ms ({len(during)} lookups)")


if __name__ == "__main__":
    main()
