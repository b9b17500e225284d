"""A process that writes snapshots into a store (for the kill -9 and two-process tests).

usage: python -m tests.helpers.store_writer ROOT SEED COUNT   (COUNT -1: until killed)

Sessions s0..s2 get snapshots of a shared 8-token prefix plus random tokens, so
blocks are both new and reused. Every fifth write also writes a "scratch"
session, deletes it and runs gc, so kills land inside gc as well.
"""

from __future__ import annotations

import random
import sys

from kvwake.store import Store
from testkit.kvdata import BUNDLE, write_snapshot


def main() -> None:
    root, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = Store(root, block_tokens=4, keep_history=1000)
    store.register_bundle(BUNDLE, {"model": "test-a"})
    rng = random.Random(seed)
    print("ready", flush=True)
    n = 0
    while count < 0 or n < count:
        tokens = list(range(1, 9)) + [rng.randrange(50) for _ in range(rng.randrange(0, 24))]
        info = write_snapshot(store, f"s{rng.randrange(3)}", tokens)
        print(info.id, flush=True)
        if n % 5 == 4:
            write_snapshot(store, f"scratch-{seed}", [rng.randrange(50) for _ in range(13)])
            store.delete_session(f"scratch-{seed}")
            store.gc(budget_bytes=0, keep_history=1000)
        n += 1
    store.close()


if __name__ == "__main__":
    main()
