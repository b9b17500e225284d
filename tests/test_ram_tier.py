"""The RAM tier's single-flight reads: one restore reads a block others want, they take its arrays."""

from __future__ import annotations

import threading

import numpy as np

from kvwake.daemon.kv.ram_tier import RamTier
from kvwake.store import Tensor


def block(value: int) -> dict[str, Tensor]:
    return {"layers.0.keys": Tensor("U16", np.full((1, 2, 4, 8), value, np.uint16))}


def test_a_block_being_read_is_waited_for_and_taken_not_read_again():
    tier = RamTier(1 << 20)
    reads, started, go = [], threading.Event(), threading.Event()
    got: dict[str, object] = {}

    def restore(name: str) -> None:
        with tier.wanting(["k"]) as wants:
            arrays, flight = tier.take("k")
            if flight is not None:
                reads.append(name)
                started.set()
                go.wait(5)
                arrays = block(7)
                tier.land("k", flight, arrays if tier.shared("k") else None)
            got[name] = arrays
            wants.done("k")

    first = threading.Thread(target=restore, args=("first",))
    first.start()
    assert started.wait(5)
    second = threading.Thread(target=restore, args=("second",))
    second.start()
    while tier.shared("k") is False:  # the second restore said it wants the block
        pass
    go.set()
    first.join(5), second.join(5)
    assert reads == ["first"]
    assert got["second"] is got["first"]


def test_a_block_landed_for_others_is_held_past_the_budget_until_the_last_one_takes_it():
    tier = RamTier(budget_bytes=16)  # smaller than the block: the LRU keeps nothing
    with tier.wanting(["k"]) as a, tier.wanting(["k"]) as b:
        arrays, flight = tier.take("k")
        assert arrays is None and tier.shared("k")
        tier.land("k", flight, block(3))
        a.done("k")
        held, none = tier.take("k")
        assert none is None and int(held["layers.0.keys"].array[0, 0, 0, 0]) == 3
        b.done("k")
    assert len(tier) == 0 and tier.get("k") is None


def test_when_the_reader_fails_a_waiter_reads_the_block_itself():
    tier = RamTier(1 << 20)
    result: dict[str, object] = {}
    _, flight = tier.take("k")

    def waiter() -> None:
        arrays, mine = tier.take("k")  # waits for the first flight, then leads its own
        result["flight"] = mine
        result["arrays"] = arrays
        if mine is not None:
            tier.land("k", mine, None)

    t = threading.Thread(target=waiter)
    t.start()
    tier.land("k", flight, None)  # the first read failed
    t.join(5)
    assert result["arrays"] is None and result["flight"] is not None and result["flight"] is not flight
