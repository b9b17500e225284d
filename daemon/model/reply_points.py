"""A restore point inside a reply: taken after a generate call whose reply crossed a block boundary.

A prefill takes restore points where it stops (kv/points.py); a reply is decoded, one token at a time,
and takes none. So a client that resends a conversation whose re-rendered reply parts from the
generated one (docs/decisions.md, "Restore points (issue 52)") fell back to the prompt's last point,
before the whole reply. After such a call this takes one point: at the last block boundary the reply
crossed, made by restoring the deepest stored point before it and prefilling the reply's tokens up to
the boundary into a scratch session (its prefill takes the point there, as any prefill does, and writes
the blocks the store lacks with it). Re-prefilled rather than captured from the decoding cache: a hit
through the point is held to a plain prefill of the same tokens, and a prefill computes what a prefill
computes.

The bound: one point per reply, at its last boundary (none when the reply crossed none, or the store
has that point already), a re-prefill of at most `MAX_SPAN_BLOCKS` blocks (a longer reply takes none;
the prompt's points still serve), and at most `MAX_WAITING` replies waiting for theirs (more are
skipped, counted). In the daemon it runs on a thread of its own, its MLX work as idle jobs of the
engine thread (a restore's upload slices, then a prefill chunk each: they run while nothing else
waits or decodes, so a request waits for one of them at most, and a daemon kept busy takes its reply
points in its pauses); in process (no engine thread) before the call returns. Nothing here fails a
call: a point that cannot be taken is logged.
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as WaitedOut
from typing import Any

from kvwake.daemon.jobs import Mlx, direct
from kvwake.daemon.kv import prefixhit
from kvwake.daemon.kv.points import POINT_EVERY
from kvwake.daemon.session_state import Session
from kvwake.errors import CancelledError
from kvwake.store.format.keys import chain_keys

__all__ = ["MAX_SPAN_BLOCKS", "ReplyPoints", "reply_boundary"]

log = logging.getLogger("kvwake.points")

MAX_SPAN_BLOCKS = POINT_EVERY  # the most blocks re-prefilled for one reply's point
MAX_WAITING = 64  # replies whose points wait for the engine's idle time; more are skipped
_scratch_ids = itertools.count()


def reply_boundary(reply_start: int | None, processed: int, block_tokens: int) -> int | None:
    """The block boundary a point is wanted at after a reply: the last one the cache holds (`processed`
    tokens), when it lies past the last one the prompt's prefill reached (its cache held reply_start - 1
    tokens); None otherwise."""
    if reply_start is None:
        return None
    last, prompt_last = processed // block_tokens * block_tokens, (reply_start - 1) // block_tokens * block_tokens
    return last if last > prompt_last else None


class ReplyPoints:
    """The reply points of one loaded model (`engine`: its Engine; enabled with its restore points)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.enabled = engine.points.enabled
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvwake-reply-points") if self.enabled else None
        self._closed, self._lock, self._waiting = threading.Event(), threading.Lock(), 0
        self.counters = {"reply_points": 0, "reply_point_tokens": 0, "reply_points_skipped": 0}

    def offer(self, session: Session, reply_start: int | None, engine_thread: Any = None) -> Future | None:
        """After a call ended whose reply began at token `reply_start` (the caller's thread): take the point
        the reply wants, its MLX work as jobs of `engine_thread` (model/thread.py) in the background; None:
        in process, before returning. Returns the work's Future (True: a point was stored), or None."""
        at = reply_boundary(reply_start, session.processed, self.engine.block_tokens) if self.enabled else None
        if at is None:
            return None
        tokens = list(session.tokens[: at + 1])  # a later turn may change the session: its tokens now
        if engine_thread is None or self._thread is None:
            done: Future = Future()
            done.set_result(self._take(session.id, tokens, at, direct))
            return done
        with self._lock:
            if self._waiting >= MAX_WAITING:
                self.counters["reply_points_skipped"] += 1
                return None
            self._waiting += 1
        return self._thread.submit(self._take, session.id, tokens, at, self._jobs_of(engine_thread))

    def _jobs_of(self, engine_thread: Any) -> Mlx:
        """The runner of this thread's MLX work: an idle job of the engine thread each, given up once `close`
        was called and the job has not started (an engine thread stopped first never runs it)."""
        def run(fn: Any) -> Any:
            future: Future = Future()

            def job() -> None:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - raised to the waiting thread
                        future.set_exception(exc)

            engine_thread.idle(job)
            while True:
                try:
                    return future.result(timeout=0.1)
                except WaitedOut:
                    if self._closed.is_set() and future.cancel():
                        raise CancelledError("the engine stopped before a reply point's job ran") from None

        return run

    def _take(self, session_id: str, tokens: list[int], at: int, mlx: Mlx) -> bool:
        try:
            return self.take(session_id, tokens, at, mlx)
        except Exception as exc:  # a point is an optimisation: the reply it came after is whole
            log.warning("reply point not taken", extra={"session": session_id, "tokens": at, "error": repr(exc)})
            return False
        finally:
            if mlx is not direct:
                with self._lock:
                    self._waiting -= 1

    def take(self, session_id: str, tokens: list[int], at: int, mlx: Mlx) -> bool:
        """Store the point at block boundary `at` of `tokens`: restore the deepest stored point before it,
        prefill tokens[point:at] into a scratch session (its prefill takes the point at `at`). False when
        the store has it, or no stored point lies within MAX_SPAN_BLOCKS blocks before it."""
        engine, b = self.engine, self.engine.block_tokens
        bundle = engine.bundle.hash
        engine.points.flush()  # the prompt's points, handed to the driver as it was prefilled: written now
        keys = chain_keys(bundle, tokens[:at], b)
        near = engine.store.point_refs(keys[-MAX_SPAN_BLOCKS:], bundle)
        if keys[-1] in near:
            return False
        if not near:  # none to start from within the span: not worth a restore
            self._count("reply_points_skipped")
            return False
        cache, held = prefixhit.point_prefix(engine.kv, tokens, mlx, counted=False)
        if cache is None or at - held > MAX_SPAN_BLOCKS * b:
            self._count("reply_points_skipped")
            return False
        scratch = Session(f"reply-point-{next(_scratch_ids)}:{session_id}", tokens=tokens, cache=cache, processed=held)
        engine.prefill(scratch, at, mlx)
        if mlx is not direct:  # its write handed to the points' driver: done when this is
            engine.points.flush()
        self._count("reply_points")
        self._count("reply_point_tokens", at - held)
        return True

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def status(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters, "reply_points_waiting": self._waiting}

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
