"""Turns one at a time: where turns do not pack, a turn's prefill runs to its first token before the next starts.

Where a forward pass costs what its tokens cost (the CPU: docs/decisions.md, "Turns one at a time where a
pass costs its tokens"), packing the turns that come together saves nothing, and taking their jobs as they
are queued ran the first chunk of every turn, then the rest of every turn: every first token waited for all
the turns' prefill. Here the jobs a turn queues through its own runner (`EngineThread.calls_of`: its
`Arrival`) wait in the turn's queue; the engine thread takes the current turn's jobs, and the next turn's (in
the order their first jobs came) once the current one is over: its call joined the decoder (the turn lands;
the scheduler gives a joined call its first token before any turn's next job), or it queued nothing for
QUIET_S (a turn waiting on something else keeps the others waiting that long at most). While turns' jobs
wait, the calls decoding meanwhile take a step at least every `first_s` (Tuning.prefill_first_ms), as
mlx_lm.server prefills what waits before its next decode step. Jobs queued with no turn, or with one that is
over, are the scheduler's plain ones (first come, first served), and run while the current turn is between
two jobs: the engine does not idle for it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from kvwake.daemon.timing import Latency

__all__ = ["QUIET_S", "TurnOrder"]

# A current turn that queues nothing for this long loses its place. Between two jobs its worker thread makes a hop,
# and between its last job and its call's join one through the event loop, which a busy machine can make long
# (docs/decisions.md, "Turns one at a time where a pass costs its tokens", has the figures)
QUIET_S = 0.25
# Calls decoding meanwhile wait for the current turn's next job this long at most (its worker's hop, well under it:
# docs/decisions.md): a turn busy elsewhere (a grammar compiled for its call, the store asked between two chunks)
# does not hold their steps up to `first_s`
HOP_S = 0.02
QUIETS_KEPT = 256  # the latest quiet times `quiet` keeps


class TurnOrder:
    """The jobs of turns in progress, by turn (an `Arrival`); the engine thread takes them one turn at a time
    (module docstring). `first_s`: how long at most the turns' jobs go before other calls' decode steps (0: a
    step between every two jobs, as plain jobs have). Thread-safe: jobs are put from the turns' worker
    threads."""

    def __init__(self, first_s: float = 0.0) -> None:
        self.first_s = first_s
        self._lock = threading.Lock()
        self._queued: dict[Any, deque[Any]] = {}  # by turn, in the order their first jobs came
        self.current: Any = None
        self._quiet_since: float | None = None  # when the current turn was first found with nothing queued
        self.quiet = Latency(QUIETS_KEPT)  # ms the engine found the current turn between two jobs, each time
        self.let_go = 0  # current turns that lost their place (quiet for QUIET_S)

    def put(self, turn: Any, job: Any) -> bool:
        """Queue `job` as `turn`'s; False when the turn is over (its caller queues the job as a plain one)."""
        with self._lock:
            if turn.over:
                return False
            self._queued.setdefault(turn, deque()).append(job)
            return True

    def end(self, turn: Any) -> list[Any]:
        """`turn` is over (its first token is the decoder's, or it failed): the jobs it left queued (none
        normally), to run as plain ones; the next turn is taken next."""
        with self._lock:
            turn.over = True
            if self.current is turn:
                self._quieted()
                self.current = None
            return list(self._queued.pop(turn, ()))

    def take(self) -> Any:
        """The next job to run: the current turn's; or, when it is over or quiet for QUIET_S while other turns'
        jobs wait, the first queued of the turn whose first job came first. None when there is none, or the
        current turn is between two jobs (see `wait_s`)."""
        with self._lock:
            if self.current is not None:
                jobs = self._queued.get(self.current)
                if jobs:
                    self._quieted()
                    return jobs.popleft()
                now = time.monotonic()
                self._quiet_since = self._quiet_since or now
                if now - self._quiet_since < QUIET_S or not self._others_wait():
                    return None
                self._queued.pop(self.current, None)  # its place lost; a later job queues it again, last
                self._quieted()
                self.current, self.let_go = None, self.let_go + 1
            for turn, jobs in list(self._queued.items()):
                if jobs:
                    self.current = turn
                    return jobs.popleft()
                del self._queued[turn]
            return None

    def _quieted(self) -> None:
        """The current turn's quiet time (if any) ends: kept in `quiet`."""
        if self._quiet_since is not None:
            self.quiet.add((time.monotonic() - self._quiet_since) * 1000)
            self._quiet_since = None

    def status(self) -> dict[str, Any]:
        """For `status.engine_thread.turns`: the quiet times between a current turn's jobs, and how many were
        let go."""
        with self._lock:
            return {"quiet": self.quiet.summary(), "let_go": self.let_go}

    def _others_wait(self) -> bool:
        """Whether other turns than the current one have jobs queued (the lock held)."""
        return any(jobs for turn, jobs in self._queued.items() if turn is not self.current)

    def hop_left_s(self) -> float:
        """How much longer calls decoding meanwhile wait for the current turn's next job (HOP_S from the moment it
        was found with nothing queued; `take` starts that)."""
        with self._lock:
            return HOP_S - (0.0 if self._quiet_since is None else time.monotonic() - self._quiet_since)

    def wait_s(self) -> float | None:
        """How long the engine thread may wait for a job before looking here again: the current turn's quiet
        time left while other turns' jobs wait; None when nothing waits here."""
        with self._lock:
            if not self._others_wait():
                return None
            if self._quiet_since is None:
                return 0.0
            return max(0.0, QUIET_S - (time.monotonic() - self._quiet_since))

    def count(self) -> int:
        """Jobs queued here."""
        with self._lock:
            return sum(len(jobs) for jobs in self._queued.values())

    def drain(self) -> list[Any]:
        """Every job queued here, taken out (the engine stopped)."""
        with self._lock:
            jobs = [job for queued in self._queued.values() for job in queued]
            self._queued, self.current = {}, None
            return jobs
