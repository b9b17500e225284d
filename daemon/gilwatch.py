"""The GIL, watched: how late a thread that asks for it every millisecond gets it, and what held it
(`status.gil`, on when KVWAKE_GIL_WATCH_MS is set: the latest KVWAKE_GIL_WATCH_KEPT waits that long are
kept, 64 by default, with every thread's stack).

MLX lets the GIL go in every eval, and the engine thread takes it back after: a thread holding it through
a long native call (a copy that pages managed memory in, a tokenizer's single `encode`, `bytes()` of a
large buffer) holds every decode step meanwhile, and the engine's record of slow work shows only a long
step. A sleeping thread that wakes late by more than the switch interval (5 ms) waited for such a call:
whichever thread held it has just let it go, so its stack, taken at once, shows where (the line of the
call that held it, or the one after it that let the GIL go). A diagnostic (the watcher takes the GIL a
thousand times a second), off unless asked for; bench/batching.py's prefill row keeps the waits during
the prefill.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from typing import Any

from kvwake.daemon.phases import Latency

__all__ = ["GilWatch", "from_environment"]

log = logging.getLogger("kvwake.gilwatch")
TICK_S = 0.001
FRAMES = 4  # innermost frames kept per thread


class GilWatch:
    """A thread that sleeps TICK_S at a time; a wake later than `over_ms` is kept with every other thread's
    innermost frames (the last `kept`)."""

    def __init__(self, over_ms: float, kept: int = 64) -> None:
        self.over_ms = over_ms
        self.late = Latency(4096)
        self.over: deque[dict[str, Any]] = deque(maxlen=kept)
        self.ticks = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GilWatch:
        self._thread = threading.Thread(target=self._run, name="kvwake-gil-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            asked = time.perf_counter()
            time.sleep(TICK_S)
            late_ms = (time.perf_counter() - asked - TICK_S) * 1000
            self.ticks += 1
            self.late.add(late_ms)
            if late_ms >= self.over_ms:
                self.over.append({"at": round(time.time(), 4), "late_ms": round(late_ms, 2),
                                  "threads": stacks(skip=me)})

    def summary(self) -> dict[str, Any]:
        """{"over_ms", "ticks", "late": {count, p50_ms, p99_ms, max_ms} of the latest wakes, "waits": the
        latest waits of over_ms or more: [{at (Unix time of its end), late_ms, threads: {name: frames}}]}."""
        return {"over_ms": self.over_ms, "ticks": self.ticks, "late": self.late.summary(), "waits": list(self.over)}


def stacks(skip: int | None = None) -> dict[str, list[str]]:
    """Every thread's innermost FRAMES frames ("file:line function", innermost first), by thread name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out: dict[str, list[str]] = {}
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        frames: list[str] = []
        f: Any = frame
        while f is not None and len(frames) < FRAMES:
            frames.append(f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}")
            f = f.f_back
        out[names.get(ident, str(ident))] = frames
    return out


def from_environment() -> GilWatch | None:
    """A watch for KVWAKE_GIL_WATCH_MS (the wait to keep, ms), or None when it is not set (or not a number of
    ms above 0 with KVWAKE_GIL_WATCH_KEPT a count above 0: logged, and the daemon serves unwatched)."""
    over = os.environ.get("KVWAKE_GIL_WATCH_MS")
    if not over:
        return None
    kept = os.environ.get("KVWAKE_GIL_WATCH_KEPT", "64")
    try:
        watch = GilWatch(float(over), kept=int(kept))
    except ValueError:
        watch = None
    if watch is None or watch.over_ms <= 0 or (watch.over.maxlen or 0) <= 0:
        log.warning("not watching the GIL: KVWAKE_GIL_WATCH_MS=%r and KVWAKE_GIL_WATCH_KEPT=%r must be a number of "
                    "ms and a count, both above 0", over, kept)
        return None
    return watch
