"""Diagnostic (session 25): where a host copy dropped under `state.drop_hosted` goes when the drop raises.

On the H200 tests/test_pipeline.py's drop test found 256 KiB in MLX's buffer cache after a failed drop (the
dropped array's size), where a drop that returns leaves none. This replays the test's steps in variants,
five times each, and prints MLX's cache memory at each point: the daemon's drop_hosted as it is, and with
candidate changes (a stream sync before the limit is given back; the cache cleared after a failure).

Session 25 on the H200: the variants below left 0 bytes in the cache every time (3 each, fail or not, no
unified-memory call first). Session 26 on the H200, `as_the_test`: 0 bytes right after every drop, 256 KiB
100 ms later, in all three calls (even the unified-memory one): the array's last reference was MLX-CUDA's
worker thread's, let go after the drop. Settled first (a sync and 50 ms after the evaluation): 256 KiB,
0, 0, right after and later alike. The test now settles its array (tests/test_pipeline.py).

usage: python bench/drop_probe.py
"""
from __future__ import annotations

import contextlib
import gc
import json
import time

import mlx.core as mx


def drop_hosted(drop, variant: str, seen: list) -> None:
    limit = mx.set_cache_limit(0)
    failed = False
    try:
        drop()
    except BaseException:
        failed = True
        seen.append(("raised, limit 0", mx.get_cache_memory()))
        if variant == "sync":
            mx.synchronize()
        if variant == "gc":
            gc.collect()
        raise
    finally:
        seen.append(("before the limit is given back", mx.get_cache_memory()))
        mx.set_cache_limit(limit)
        if failed and variant == "clear":
            mx.clear_cache()
        seen.append(("after", mx.get_cache_memory()))


def once(fail: bool, variant: str) -> dict:
    held = [mx.arange(1 << 16)]
    mx.eval(held)
    mx.clear_cache()
    steps: list = []

    def drop() -> None:
        held.clear()
        steps.append(("cleared, limit 0", mx.get_cache_memory()))
        if fail:
            raise OSError("the drop failed")
    limit = mx.set_cache_limit(1 << 30)
    try:
        with contextlib.suppress(OSError):
            drop_hosted(drop, variant, steps)
        steps.append(("caught", mx.get_cache_memory()))
    finally:
        mx.set_cache_limit(limit)
    steps.append(("end", mx.get_cache_memory()))
    return {"fail": fail, "variant": variant, "steps": steps}


def as_the_test(settle: float = 0.0) -> list[tuple[int, int]]:
    """The test's three calls in its order, through the daemon's own state.drop_hosted (the first: unified
    memory, the dropped array into the cache): MLX's cache right after each call and 100 ms later (grown
    later: a reference MLX-CUDA's worker thread let go after the drop returned). `settle` s after the
    array's evaluation (with a stream sync first) lets that worker run its tasks before the drop."""
    from kvwake.daemon.kv import state

    was, out = state._discrete, []
    try:
        for discrete, fail in ((False, False), (True, False), (True, True)):
            state._discrete = lambda discrete=discrete: discrete
            held = [mx.arange(1 << 16)]
            mx.eval(held)
            if settle:
                mx.synchronize()
                time.sleep(settle)
            mx.clear_cache()

            def drop(held=held, fail=fail) -> None:
                held.clear()
                if fail:
                    raise OSError("the drop failed")
            limit = mx.set_cache_limit(1 << 30)
            try:
                with contextlib.suppress(OSError):
                    state.drop_hosted(drop)
            finally:
                mx.set_cache_limit(limit)
            right_after = mx.get_cache_memory()
            time.sleep(0.1)
            out.append((right_after, mx.get_cache_memory()))
    finally:
        state._discrete = was
    return out


def main() -> None:
    print(json.dumps({"device": str(mx.default_device())}))
    for _ in range(5):  # the test's order (it failed on the H200: [>= 262144, 0, 262144])
        print(json.dumps({"as the test": as_the_test()}), flush=True)
    for _ in range(5):  # the same, 50 ms after each array's evaluation (MLX-CUDA's worker done by then)
        print(json.dumps({"as the test, settled": as_the_test(0.05)}), flush=True)
    for variant in ("as is", "sync", "gc", "clear"):
        for fail in (False, True):
            for _ in range(3):
                print(json.dumps(once(fail, variant)), flush=True)


if __name__ == "__main__":
    main()
