"""Python's switch interval while a model loads beside other models' decoding.

MLX lets the GIL go in every eval and the engine thread takes it back after;
a decode step does that a few times, and the event loop that streams its
tokens takes it too. A model loading beside it runs Python for a while (the
model's modules built, its tokenizer and chat template read), and a thread
that wants the GIL back from running Python waits out the switch interval
(5 ms by default) each time, so the steps of a decoding model may grow by a
few intervals while another model loads. While any model loads, the interval
is `load_switch_ms` where it is set (off by default: no run has shown it
helps yet; docs/benchmarks.md, "Several models"); the loader then gives the
GIL up that much more often, which costs it little.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

__all__ = ["while_loading"]

_lock = threading.Lock()
_loading = 0  # loads in progress (the interval is set while any is)
_before = 0.005  # the interval before the first of them


@contextlib.contextmanager
def while_loading(switch_ms: float) -> Iterator[None]:
    """Inside: Python's switch interval is `switch_ms` (0: left as it is), restored after the last load
    that set it ends."""
    global _loading, _before
    if not switch_ms:
        yield
        return
    with _lock:
        if _loading == 0:
            _before = sys.getswitchinterval()
            sys.setswitchinterval(switch_ms / 1000)
        _loading += 1
    try:
        yield
    finally:
        with _lock:
            _loading -= 1
            if _loading == 0:
                sys.setswitchinterval(_before)
