"""The GIL, watched: how late a thread that asks for it every millisecond gets it, and what held it
(`status.gil`, on when the tuning knob gil_watch_ms is set: the latest gil_watch_kept waits that long are
kept, with every thread's stack).

MLX lets the GIL go in every eval, and the engine thread takes it back after: a thread holding it through
a long native call (a copy that pages managed memory in, a tokenizer's single `encode`, `bytes()` of a
large buffer) holds every decode step meanwhile, and the engine's record of slow work shows only a long
step. A sleeping thread that wakes late by more than Python's switch interval waited for such a call:
whichever thread held it has just let it go, so its stack, taken at once, shows where (the line of the
call that held it, or the one after it that let the GIL go). A diagnostic (the watcher takes the GIL a
thousand times a second), off unless asked for; bench/batching.py's prefill row keeps the waits during
the prefill.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import tempfile
import threading
import time
from collections import deque
from typing import Any

from kvwake.daemon.config import Tuning, load_tuning, tuning_from_environment
from kvwake.daemon.timing import Latency

__all__ = ["GilWatch", "from_environment", "from_tuning"]

log = logging.getLogger("kvwake.gilwatch")
TICK_S = 0.001
FRAMES = 4  # innermost frames kept per thread
THREAD_LINE = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
FRAME_LINE = re.compile(r'^\s+File "(.+)", line (\d+) in (.+)$')


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
        dump = tempfile.TemporaryFile()
        while not self._stop.is_set():
            asked = time.perf_counter()
            time.sleep(TICK_S)
            late_ms = (time.perf_counter() - asked - TICK_S) * 1000
            self.ticks += 1
            self.late.add(late_ms)
            if late_ms >= self.over_ms:
                try:
                    threads = stacks(dump)
                except Exception as exc:  # a dump that fails (the temporary file's disk full) loses the stacks only
                    threads = {"(stacks unavailable)": [f"{type(exc).__name__}: {exc}"]}
                self.over.append({"at": round(time.time(), 4), "late_ms": round(late_ms, 2), "threads": threads})
        dump.close()

    def summary(self) -> dict[str, Any]:
        """{"over_ms", "kept", "ticks", "late": {count, p50_ms, p99_ms, max_ms} of the latest wakes, "waits": the
        latest `kept` waits of over_ms or more: [{at (Unix time of its end), late_ms, threads: {name: frames}}]}."""
        return {"over_ms": self.over_ms, "kept": self.over.maxlen, "ticks": self.ticks, "late": self.late.summary(),
                "waits": list(self.over)}


def stacks(dump: Any) -> dict[str, list[str]]:
    """Every other thread's innermost FRAMES frames ("file:line function", innermost first), by thread name
    (with its id where names repeat: anyio's workers share one). Read from faulthandler's dump of every
    thread into `dump` (a file with a descriptor), not from frame objects: a frame held here would keep a
    function's locals alive past its return, and free them (MLX arrays among them) on this thread."""
    dump.seek(0)
    dump.truncate()
    faulthandler.dump_traceback(dump, all_threads=True)
    dump.seek(0)
    names: dict[int, str] = {}
    for t in threading.enumerate():
        if t.ident is not None:
            names[t.ident] = t.name
    repeated = {n for n in names.values() if list(names.values()).count(n) > 1}
    out: dict[str, list[str]] = {}
    frames: list[str] | None = None
    for line in dump.read().decode("utf-8", "replace").splitlines():
        head = THREAD_LINE.match(line)
        if head:
            current, ident = head.group(1) == "Current thread", int(head.group(2), 16)
            name = names.get(ident, hex(ident))
            frames = None if current else out.setdefault(f"{name} {hex(ident)}" if name in repeated else name, [])
        elif frames is not None and len(frames) < FRAMES and (frame := FRAME_LINE.match(line)):
            frames.append(f"{os.path.basename(frame.group(1))}:{frame.group(2)} {frame.group(3)}")
    return out


def from_environment() -> GilWatch | None:
    """`from_tuning` of what the environment alone says (KVWAKE_GIL_WATCH_MS, KVWAKE_GIL_WATCH_KEPT), for a
    caller that holds no Settings."""
    return from_tuning(load_tuning(tuning_from_environment()))


def from_tuning(tuning: Tuning) -> GilWatch | None:
    """A watch for the tuning's gil_watch_ms (the wait to keep, ms) keeping its gil_watch_kept latest waits, or
    None when gil_watch_ms is None (off; Tuning has refused values that are not above 0)."""
    if tuning.gil_watch_ms is None:
        return None
    return GilWatch(tuning.gil_watch_ms, kept=tuning.gil_watch_kept)
