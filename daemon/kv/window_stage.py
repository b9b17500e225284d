"""A marker point's window rows joined on the device, as a staged restore joins the global layers' blocks.

A hit through a marker point (kv/window_rows.py) rebuilds each sliding-window
ring from the rows its window blocks carry. Where restores stage (a GPU, or
`restore_mode` "staged"), each such block's run decodes into a pool thread's
scratch (`window_rows.WindowRun`); its plain part goes through the restore's
ring, and its window rows are copied here, still as byte planes (or raw bytes),
into one staging array in host-visible MLX memory (devplanes.staging): a row
per window block, the window names in the model's order. Once the blocks are
in, the engine thread joins the rows on the device in one pass
(devplanes.join) and cuts each ring's rows out of the result: the rings are
device arrays, with no join and no concatenation on the host and no upload of
a host point. Per window byte: one copy by the decoder's thread, one transfer
by the GPU's join.

A block whose rows did not come through a run staged here (the RAM tier gave
the block, or its run holds the window names in another order) makes the hit
take the host path (`window_rows.assemble`): the same arrays, slower.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Mapping

import mlx.core as mx
import numpy as np

from kvwake.daemon.kv import cache_blocks, devplanes
from kvwake.daemon.kv.window_rows import MARK, Held, WindowRun
from kvwake.store.format.codec import DTYPES

__all__ = ["KEEP_STAGING", "StagedRows", "drop_idle", "window_order"]

# Staging arrays of one shape kept idle between hits (mapped for the GPU once: a fresh one is an allocation
# the CPU writes zeros into, and on CUDA a registration of its pages): agents starting together restore
# through the same marker one after another. Each is a window's rows (docs/benchmarks.md gives a model's size).
KEEP_STAGING = 2
_idle: dict[tuple[int, int], list[tuple[mx.array, np.ndarray, Callable[[], None]]]] = {}
_idle_lock = threading.Lock()


def _take_staging(shape: tuple[int, int]) -> tuple[mx.array, np.ndarray, Callable[[], None]]:
    with _idle_lock:
        kept = _idle.get(shape)
        if kept:
            return kept.pop()
    return devplanes.staging(shape)


def _give_staging(shape: tuple[int, int], slot: tuple[mx.array, np.ndarray, Callable[[], None]]) -> None:
    with _idle_lock:
        kept = _idle.setdefault(shape, [])
        if len(kept) < KEEP_STAGING:
            kept.append(slot)
            return
    slot[2]()  # not kept: its mapping goes before MLX may reuse the memory


def drop_idle() -> None:
    """Release the staging kept between hits (its memory goes back to MLX): the engine's close."""
    with _idle_lock:
        stale = [slot for kept in _idle.values() for slot in kept]
        _idle.clear()
    for _, _, release in stale:
        release()


def window_order(cache: list, names: frozenset[str]) -> tuple[str, ...]:
    """The window names in the order a writer puts them in a block: the model's units, keys then values."""
    return tuple(f"{name}.{part}" for name, _, _, _ in cache_blocks.units(cache) for part in ("keys", "values")
                 if f"{name}.{part}" in names)


class StagedRows(Held):
    """`Held` for a staged restore: the window rows of blocks [first, first + count) staged as their runs hold
    them (`stage_run`, pool threads) and joined on the device (`rings`, engine thread)."""

    staged = True

    def __init__(self, first: int, count: int, block_tokens: int, order: tuple[str, ...],
                 specs: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        super().__init__(first, count, block_tokens, frozenset(order), specs, host=False)
        self.order = order
        self.dtype, self.shape = specs[order[0]]
        self.size = DTYPES[self.dtype][0].itemsize
        self.values = len(order) * math.prod(self.shape)  # a block's window values
        shape = (count, self.size * self.values)
        slot = _take_staging(shape)
        self.array, self.view = slot[0], slot[1]
        self._release = weakref.finalize(self, _give_staging, shape, slot)  # once: after the join, or when dropped
        self.kinds: dict[int, bool] = {}  # block (from first) -> staged as planes (True) or raw (False)

    @classmethod
    def of(cls, first: int, count: int, block_tokens: int, order: tuple[str, ...],
           specs: Mapping[str, tuple[str, tuple[int, ...]]]) -> StagedRows | None:
        """Staging for these names when they are all of one planar dtype and shape in `specs`; else None."""
        kinds = {specs.get(n) for n in order}
        if not order or None in kinds or len(kinds) != 1 or next(iter(kinds))[0] not in devplanes.PLANAR_DTYPES:
            return None
        return cls(first, count, block_tokens, order, specs)

    def stage_run(self, start: int, run: WindowRun) -> None:
        """Pool thread, after block start // B's run decoded into scratch: its window rows copied to its row
        here, as planes or raw bytes (nothing when the run is not these names of this dtype)."""
        k = start // self.b - self.first
        if not 0 <= k < self.count or run.names != self.order or run.size != self.size:
            return
        row = self.view[k]
        if run.planes:
            for dest, section in zip(devplanes.planes_of(row, self.size), run.sections):
                np.copyto(dest, section[run.plain : run.plain + self.values])
        else:
            np.copyto(row, run.sections[0][run.plain * self.size : (run.plain + self.values) * self.size])
        self.kinds[k] = run.planes

    def rings(self, point: Mapping) -> dict | None:
        """Engine thread: the marker point with each marked ring's keys and values as device arrays, cut from
        the staged rows joined on the device; None when a block was not staged here (the host path serves)."""
        if len(self.kinds) != self.count or len(set(self.kinds.values())) != 1:
            return None
        if self.kinds[0]:
            whole = devplanes.join(devplanes.planes_of(self.array, self.size), self.dtype, len(self.order), self.shape)
        else:
            whole = devplanes.join_raw(self.array, self.dtype, len(self.order), self.shape)
        joined = {name: whole[t] for t, name in enumerate(self.order)}
        out = dict(point)
        for name in [n for n in point if n.endswith("." + MARK)]:
            unit = name[: -len(MARK) - 1]
            first, rows = (int(x) for x in out.pop(name).array)
            start = first - self.first * self.b
            if start < 0 or start + rows > self.count * self.b or f"{unit}.keys" not in joined:
                return None
            for part in ("keys", "values"):  # its own buffer: a slice would hold the whole join
                out[f"{unit}.{part}"] = mx.contiguous(joined[f"{unit}.{part}"][..., start : start + rows, :])
        mx.eval([a for a in out.values() if isinstance(a, mx.array)])
        self._release()  # the join is done: the staging is free for the next hit
        return out
