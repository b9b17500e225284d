"""A process that writes snapshots into a store (for the kill -9 and two-process tests).

usage: python -m tests.helpers.store_writer ROOT SEED COUNT   (COUNT -1: until killed)

Sessions s0..s2 get snapshots of a shared 8-token prefix plus random tokens, so
blocks are both new and reused. Every fifth write also writes a "scratch"
session, deletes it and runs gc, so kills land inside gc as well.

`write_until_killed` is the same writer for a process forked from a warm parent
(multiprocessing's forkserver, with this module preloaded): the kill -9 test
starts dozens of writers, and a fresh interpreter's imports would be most of
each one's time.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection

from kvwake.store import Store
from testkit.kvdata import BUNDLE, write_snapshot


def write(root: str, seed: int, count: int, say: Callable[[str], None]) -> None:
    """Write `count` snapshots (-1: until killed), saying "ready" once the store is open, then each id."""
    store = Store(root, block_tokens=4, keep_history=1000)
    store.register_bundle(BUNDLE, {"model": "test-a"})
    rng = random.Random(seed)
    say("ready")
    n = 0
    while count < 0 or n < count:
        tokens = list(range(1, 9)) + [rng.randrange(50) for _ in range(rng.randrange(0, 24))]
        info = write_snapshot(store, f"s{rng.randrange(3)}", tokens)
        say(info.id)
        if n % 5 == 4:
            write_snapshot(store, f"scratch-{seed}", [rng.randrange(50) for _ in range(13)])
            store.delete_session(f"scratch-{seed}")
            store.gc(budget_bytes=0, keep_history=1000)
        n += 1
    store.close()


def write_until_killed(root: str, seed: int, conn: Connection) -> None:
    """The writer in a forked process: "ready" goes to `conn`; the ids are not needed (the store holds them)."""

    def say(line: str) -> None:
        if line == "ready":
            conn.send(line)

    write(root, seed, -1, say)


def main() -> None:
    write(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
