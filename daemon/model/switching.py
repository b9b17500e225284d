"""The interpreter while a model loads beside other models' decoding: its collector, its switch interval.

A load builds a model's modules, its tokenizer and its template: tens of
thousands of Python objects at once. Allocating them trips a full collection
of the garbage collector (generation 2), which walks every tracked object
of the process while every thread waits: a decoding model's streams all
stopped for that long, once a load (docs/benchmarks.md, "Several models").
So while any model loads the collector is off, and when the last load ends
what the process holds then is frozen (`gc.freeze`: the model's objects,
which live as long as it is loaded, moved where no later collection walks
them) before the collector is on again. What is garbage at that moment stays
with them (a load's reference cycles, once per load).

MLX lets the GIL go in every eval and the engine thread takes it back after;
a thread that wants it back from running Python waits out the switch interval
(5 ms by default) each time. `load_switch_ms` sets the interval while a model
loads (off by default: no run has shown it helps).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections.abc import Iterator

__all__ = ["while_loading"]

_lock = threading.Lock()
_loading = 0  # loads in progress (the collector is off, the interval set, while any is)
_before = 0.005  # the interval before the first of them
_collecting = True  # whether the collector was on before the first of them


@contextlib.contextmanager
def while_loading(switch_ms: float = 0.0) -> Iterator[None]:
    """Inside: the collector off, Python's switch interval `switch_ms` (0: left as it is); after the last load
    in progress ends, the process's objects frozen and both as they were."""
    global _loading, _before, _collecting
    with _lock:
        if _loading == 0:
            _before, _collecting = sys.getswitchinterval(), gc.isenabled()
            gc.disable()
            if switch_ms:
                sys.setswitchinterval(switch_ms / 1000)
        _loading += 1
    try:
        yield
    finally:
        with _lock:
            _loading -= 1
            if _loading == 0:
                gc.freeze()
                if _collecting:
                    gc.enable()
                sys.setswitchinterval(_before)
