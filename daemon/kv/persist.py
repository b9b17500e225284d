"""Continuous persistence: a hot session's full blocks are written as they fill, not only when it sleeps.

A full block never changes once filled (blocks are content-addressed by their
token prefix), so it can be made durable at once. The engine offers a session
after each prefill chunk and each append, the daemon after each generate call
(`offer`: no MLX work, no waiting; a call's end is committed even without a new
block, so the reply is kept with the conversation); one background thread, the driver, takes the offered
sessions in turn and commits a checkpoint of each (pipeline.checkpoint): a
snapshot of its first k*B tokens, the later tokens recorded as pending. The
checkpoint becomes the session's head, so after `kill -9` the session wakes
from it; each checkpoint replaces the session's previous one in its own commit
(the snapshot history keeps one running checkpoint, not one per block), and the
final sleep replaces the last one (`settle` hands it over).

Where the work runs: the driver's MLX work is two short engine-thread jobs per
span of new blocks (read the session and schedule the device-to-host copy;
then, a decode step or more later, take the host arrays), encoding and writing
go to the pool under a quarter of its byte budget, and SQLite to the driver.
A decoding session waits for at most one such job between two steps.

Only models whose caches can be cut by token persist (a recurrent or sliding
window state is whole in the tail and changes every token). Blocks filled by a
generate call are offered when the call ends: while it decodes, its KV is in
the decoder's batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvwake.daemon.kv import pipeline
from kvwake.daemon.kv.context import KvContext, Mlx, direct
from kvwake.daemon.session_state import Session

__all__ = ["Persister"]

log = logging.getLogger("kvwake.persist")


@dataclass
class _Track:
    """What the driver knows of one session: tokens whose blocks a commit made durable, and its own
    latest checkpoint (the snapshot the next commit replaces; None once a sleep replaced it)."""

    tokens: int = 0
    checkpoint: str | None = None
    total: int = -1  # all tokens (KV and pending) its head records; -1: not known


class Persister:
    """The driver thread, the offered sessions (in order, each once) and what is known of each."""

    def __init__(self, ctx: KvContext, enabled: bool) -> None:
        self.ctx = ctx
        self.enabled = enabled and ctx.cuttable
        self.reason = ("on" if self.enabled else
                       "off (setting persist = false)" if not enabled else
                       "off (the model's cache cannot be cut by token)")
        self._cond = threading.Condition()
        self._queue: OrderedDict[str, tuple[Session, Mlx, bool]] = OrderedDict()
        self._tracks: dict[str, _Track] = {}
        self._running: str | None = None
        self._closed = False
        self.counters = {"checkpoints": 0, "checkpoint_blocks": 0, "checkpoint_bytes": 0, "checkpoints_moved": 0,
                         "checkpoint_failures": 0, "checkpoint_ms": 0.0}
        self._thread = threading.Thread(target=self._run, name="kvwake-persist", daemon=True)
        if self.enabled:
            self._thread.start()

    # -- the engine's and the daemon's side ----------------------------------

    def offer(self, session: Session, mlx: Mlx, turn: bool = False) -> None:
        """The session may have new full blocks: check it soon (returns at once). `turn`: a call ended, so
        its state is worth a commit even without a new block (the reply is kept). `mlx` must run on the
        engine thread from another thread: with `direct` (an in-process engine) nothing is persisted."""
        if not self.enabled or mlx is direct:
            return
        with self._cond:
            if self._closed:
                return
            queued = self._queue.get(session.id)
            self._queue[session.id] = (session, mlx, turn or (queued is not None and queued[2]))
            self._cond.notify_all()

    def settle(self, session_id: str) -> str | None:
        """Drop the session's offer and wait for its running checkpoint; returns its latest checkpoint (what
        a sleep replaces). After this, until the next offer, nothing of this session is written."""
        with self._cond:
            self._queue.pop(session_id, None)
            while self._running == session_id:
                self._cond.wait()
            track = self._tracks.get(session_id)
            return track.checkpoint if track else None

    def stored(self, session_id: str, tokens: int) -> None:
        """The session's head (a sleep's or the one it woke from, no checkpoint of ours) holds its first `tokens`."""
        with self._cond:
            self._tracks[session_id] = _Track(tokens // self.ctx.block_tokens * self.ctx.block_tokens)

    def forget(self, session_id: str) -> None:
        """The session is deleted or replaced (a wake of another snapshot): nothing more of it is written."""
        self.settle(session_id)
        with self._cond:
            self._tracks.pop(session_id, None)

    def status(self) -> dict[str, object]:
        with self._cond:
            return {"enabled": self.enabled, "state": self.reason, "queued": len(self._queue),
                    "running": self._running is not None,
                    **{k: round(v, 3) if isinstance(v, float) else v for k, v in self.counters.items()}}

    def close(self) -> None:
        """Stop after the checkpoint running now; offers still queued are dropped (a shutdown sleeps them)."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    # -- the driver ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                session_id, (session, mlx, turn) = self._queue.popitem(last=False)
                self._running = session_id
                track = self._tracks.setdefault(session_id, _Track())
            try:
                self._checkpoint(session, mlx, track, turn)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _checkpoint(self, session: Session, mlx: Mlx, track: _Track, turn: bool) -> None:
        started, seen = time.perf_counter(), {"total": -1}

        def wanted(blocks: int, total: int) -> bool:  # new full blocks, or a call's end that changed the session
            seen["total"] = total
            return blocks > track.tokens or (turn and total != track.total)

        try:
            info = pipeline.checkpoint(self.ctx, session, mlx, supersede=track.checkpoint, wanted=wanted)
        except pipeline.Moved:
            self.counters["checkpoints_moved"] += 1
            track.tokens, track.total = 0, -1  # its cache was cut: the next offer commits what it holds then
            return
        except Exception as exc:  # the session stays hot and whole; its next offer tries again
            self.counters["checkpoint_failures"] += 1
            track.tokens, track.total = 0, -1
            log.warning("checkpoint failed; the session keeps its last one",
                        extra={"session": session.id, "error": repr(exc)})
            return
        if info is None:
            return
        session.head = info.id
        track.tokens, track.checkpoint, track.total = info.n_tokens, info.id, seen["total"]
        c = self.counters
        c["checkpoints"] += 1
        c["checkpoint_blocks"] += info.new_blocks
        c["checkpoint_bytes"] += info.written_bytes
        c["checkpoint_ms"] += (time.perf_counter() - started) * 1000
        log.debug("checkpoint", extra={"session": session.id, "snapshot_id": info.id, "tokens": info.n_tokens,
                                       "new_blocks": info.new_blocks})
