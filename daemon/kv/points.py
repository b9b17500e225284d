"""Restore points: taken while a prefill passes a block boundary, stored with the blocks that lead to them.

A model with sliding-window or recurrent layers cannot cut its cache by token,
so a stored prefix needs, besides its blocks, the state of those layers at the
prefix's end: a restore point (store/points.py stores it; docs/decisions.md,
"Restore points (issue 52)", says where they are taken and why). This module is
the taking:

- `next_stop`: the planner ends a prefill chunk at the next wanted boundary
  (model/scheduler/prefill.py asks), so the cache holds exactly that prefix;
  except where every layer but the plain ones is a sliding window's ring
  (Gemma's): a chunk runs on past the boundaries, and the cache there is cut
  from the chunk's (`cut_at`: a ring grown by a chunk still holds the window
  of every boundary the chunk passed);
- `take`: after a chunk, on the caller's thread: when the cache stands at a
  wanted boundary (or passed it, cut), the blocks the store lacks (asked of the index there) and
  the point are copied to the host, a span of blocks per engine-thread job
  and the point in one (what a tail holds at a block boundary:
  cache_blocks.capture_tail; the prefill waits meanwhile), and written
  on the driver thread (a prefix-only write of the blocks, unpinned, then the
  point; the writer is opened and committed there: the store's lock is held
  by one thread). With `direct` (an in-process engine) the write is done
  before `take` returns. Points cut from a chunk are held at once and copied
  to the host later, in the engine's idle time (`_take_later`): eight turns
  that come at once reach their first tokens before any point's copies;
- `check_fits`: before a point is used (kv/prefixhit.py), its state against
  the shapes and dtypes of the model's cache.

Nothing here fails an append: a point that cannot be written is logged and
counted, and the prefill goes on.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from kvwake.daemon.kv import cache_blocks, window_rows
from kvwake.daemon.kv.cache_blocks import StateMismatchError
from kvwake.daemon.kv.context import KvContext, Mlx, direct
from kvwake.daemon.kv.paged_cache import PagedKVCache
from kvwake.daemon.session_state import Session
from kvwake.store import chain_keys
from kvwake.store.format.codec import Tensor

__all__ = ["DEFERRED_SHARE", "POINT_EVERY", "PointTaker", "back_to_held", "check_fits", "compact_rings", "cut_at", "end_trail", "held_bytes",
           "held_copy", "hold", "last_marks", "stops"]

log = logging.getLogger("kvwake.points")

POINT_EVERY = 64  # a long prefill takes a point every this many blocks, besides those `stops` names
SCAN = 4096  # tokens read at a time, from the end back, for the last message marker
MARKS_KEPT = 1024  # sessions whose prefill's last marks are kept (one entry each)
SPAN_BLOCKS = 16  # blocks copied to the host in one engine-thread job
MAX_DEFERRED = 64  # cut points whose host copies wait for the engine's idle time; more are copied at once
DEFERRED_SHARE = 8  # and the arrays they keep alive meanwhile at most this share of what KV may take (1/8)


def stops(tokens: Sequence[int], lo: int, upto: int, block_tokens: int, marks: frozenset[int] = frozenset(),
          every: int = POINT_EVERY, opened: Sequence[int] | None = None) -> list[int]:
    """The block boundaries in [lo, upto] where a prefill of `tokens` to `upto` takes a point: its last one;
    the ones at or before the last two tokens of `marks` (the chat template's message opener: the last
    message's and the generation prompt's; for a first request, the one after the system prompt, so the
    next conversation that shares all but the last message finds a point there); and each multiple of
    `every` blocks. At most three, and one per `every` blocks: a real model's point weighs as many blocks
    (docs/decisions.md, "Restore points (issue 52)"). `opened`: `last_marks(tokens, upto, marks)`, when the
    caller has it (the same for every chunk of a prefill)."""
    b = block_tokens
    wanted = {upto // b * b, *range(-(-lo // (every * b)) * every * b, upto + 1, every * b)}
    found = last_marks(tokens, upto, marks) if opened is None else opened
    wanted.update(mark // b * b for mark in found)
    return sorted(int(w) for w in wanted if 0 < w and lo <= w <= upto)


def last_marks(tokens: Sequence[int], upto: int, marks: frozenset[int], count: int = 2) -> list[int]:
    """The positions of the last `count` tokens of `marks` in tokens[:upto + 1], read back from the end SCAN
    at a time (a prompt's last message is near its end)."""
    wanted, found, end = np.asarray(sorted(marks)), [], upto + 1
    while marks and end > 0 and len(found) < count:
        start = max(0, end - SCAN)
        at = np.flatnonzero(np.isin(np.asarray(tokens[start:end]), wanted))
        found += [start + int(i) for i in at[::-1][: count - len(found)]]
        end = start
    return found


class PointTaker:
    """The points of one loaded model: where its prefills stop, the copies, the driver that writes them.

    Enabled for a model whose cache does not cut by token but has plain-attention layers (their blocks
    lead to a point); a model of recurrent layers alone has no blocks to key a point by.
    """

    def __init__(self, ctx: KvContext, probe: list, enabled: bool = True, marks: frozenset[int] = frozenset(),
                 window_blocks: bool = False, held: bool = True, cut: bool = True) -> None:
        """`marks`: the chat template's message opener (model/chat.py, `ChatTemplate.message_marks`);
        `window_blocks`: sliding-window rings' rows stored in the blocks, a point over them a marker
        (kv/window_rows.py); `held`: each session keeps its latest point on the device too (`hold`); `cut`:
        a model whose only uncuttable layers are rings takes its points from chunks that ran past them
        (`cut_at`) rather than stopping its chunks there."""
        self.ctx, self.marks, self.held = ctx, marks, held
        self.window_names = window_rows.window_names(probe) if window_blocks else frozenset()
        self.enabled = enabled and not ctx.cuttable and any(
            cache_blocks.kind_of(c, name) in cache_blocks.CUTTABLE for name, _, _, c in cache_blocks.units(probe))
        self.cuts = self.enabled and cut and all(type(c) is KVCache or (type(c) is RotatingKVCache and not c.keep)
                                                 for c in probe)
        # the longest window: the blocks before a point its marker's rows may lie in
        self.window_tokens = max((c.max_size for c in probe if type(c) is RotatingKVCache), default=0)
        # the engine thread's idle-job runner once it runs the model (None in process): cut points' host copies
        self.idle_of: Callable[[], Callable[[Callable[[], Any]], None] | None] = lambda: None
        self._deferred = 0  # points whose host copies wait for an idle job
        self._deferred_bytes = 0  # the bytes of the arrays their cuts keep alive (at most, counted as they were cut)
        self.defer_bytes: int | None = None  # the most they may keep alive (`set_room`)
        # those points, until written
        self._pending: dict[int, _Waiting] = {}
        self._closed = threading.Event()
        self._driver = ThreadPoolExecutor(1, thread_name_prefix="kvwake-points") if self.enabled else None
        self._lock = threading.Lock()
        # session id -> (its token list, upto, the last marks): read once a prefill, not once a chunk
        self._marks: OrderedDict[str, tuple[list[int], int, list[int]]] = OrderedDict()
        self.counters = {"points_taken": 0, "points_written": 0, "point_blocks_written": 0, "point_failures": 0,
                         "points_marked": 0, "points_joined": 0, "held_points_used": 0, "held_point_tokens": 0}

    def next_stop(self, session: Session, upto: int) -> int | None:
        """The first wanted boundary after the session's processed tokens and before `upto` (a chunk ends
        there), or None (always, where points are cut from the chunks that pass them)."""
        if self.cuts:
            return None
        later = self._stops(session, session.processed + 1, upto)
        return next((w for w in later if w < upto), None)

    def _stops(self, session: Session, lo: int, upto: int) -> list[int]:
        """`stops` of the session's prefill to `upto`, its last marks read once (engine or caller's thread)."""
        with self._lock:
            known = self._marks.get(session.id)
            if known is None or known[0] is not session.tokens or known[1] != upto:
                known = (session.tokens, upto, last_marks(session.tokens, upto, self.marks))
                self._marks[session.id] = known
                self._marks.move_to_end(session.id)
                while len(self._marks) > MARKS_KEPT:
                    self._marks.popitem(last=False)
        return stops(session.tokens, lo, upto, self.ctx.block_tokens, self.marks, opened=known[2])

    def take(self, session: Session, upto: int, mlx: Mlx, since: int | None = None) -> Future | None:
        """After a prefill chunk (caller's thread): take and store the point where the session's cache
        stands, when a prefill to `upto` wants one there; where points are cut (`cuts`), each wanted boundary
        the chunk from `since` passed, in order (the last one held). Returns the last write's Future (done
        already with `direct`), or None when no point is taken.

        The store is asked on this thread; the device work of every point of the chunk (the cuts, the held
        copies, the blocks the store lacks and the points on the host) is one engine job, after one job per
        span of a long prompt's first blocks: eight turns that come at once each wait one job for their
        points, not one a step for each of their copies (a decoding neighbour's step comes between jobs). In the
        daemon, points cut from a chunk wait for none of the copies: held at once, copied in idle time
        (`_take_later`)."""
        if not self.enabled or session.cache is None:
            return None
        position, cut = session.processed, self.cuts and since is not None
        if cut:
            # the prefill's wanted boundaries (asked with its `upto`: a chunk's end is not its last) the chunk passed
            ats = [at for at in self._stops(session, since + 1, upto) if at <= position]
        else:
            ats = [position] if position in self._stops(session, position, upto)[:1] else []
        if not ats:
            return None
        idle = self.idle_of() if cut and mlx is not direct and self._driver is not None else None
        try:
            keys = chain_keys(self.ctx.bundle.hash, session.tokens[: ats[-1]], self.ctx.block_tokens)
            plans = [self._plan(session.tokens[:at], keys[: at // self.ctx.block_tokens]) for at in ats]
            if idle is not None:
                return self._take_later(session, ats, plans, mlx, idle)
            needed = sorted({k for plan in plans if plan is not None for k in plan[2]})
            copied: dict[int, dict] = {}  # plain layers' blocks: the same in the session's cache as in a cut
            for first, count in _runs(needed[:-SPAN_BLOCKS], SPAN_BLOCKS):  # a job a span: a neighbour waits one
                copied.update(mlx(lambda first=first, count=count: self._copy_blocks(session.cache, first, count)))
            taken = mlx(lambda: [self._take_at(session, at, plan, copied, cut, self._holds(session, at, ats))
                                 for at, plan in zip(ats, plans)])
        except Exception as exc:  # the index or the copies failed: the prefill goes on without these points
            self._failed(position, exc)
            return None
        done = None
        for at, plan, got in zip(ats, plans, taken):
            if plan is None or got is None:  # stored already (held all the same), or a ring that holds it not
                continue
            work = (session.tokens[:at], plan[0][-1], got)
            if mlx is direct or self._driver is None:
                done = Future()
                done.set_result(self._handed(*work))
            else:
                done = self._driver.submit(self._handed, *work)
        return done

    def _take_later(self, session: Session, ats: list[int], plans: list, mlx: Mlx,
                    idle: Callable[[Callable[[], Any]], None]) -> Future | None:
        """`take` in the daemon, where points are cut: the cuts and the held copies now, in one job (on the
        device: the next turn may go back to them); each point's host copies later, an idle job of the engine
        thread each (once nothing decodes: every turn of a round reached its first token and its reply), then
        written. The cuts are slices of the session's arrays (`cut_at`): what they read stays as it was, and
        alive, meanwhile. More than MAX_DEFERRED waiting, or their arrays past `defer_bytes`: taken at once, as in
        process. The Future returned is the last point's write, done once its idle job ran."""
        try:
            cuts, pinned = mlx(lambda: ([self._hold_at(session, at, True, self._holds(session, at, ats)) for at in ats],
                                        _array_bytes(session.cache)))
        except Exception as exc:  # the cuts or the copies failed: the prefill goes on without these points
            self._failed(session.processed, exc)
            return None
        done = None
        for at, plan, cache in zip(ats, plans, cuts):
            if plan is None or cache is None:
                continue
            tokens = session.tokens[:at]
            with self._lock:  # the cuts of one chunk keep the same arrays alive: counted with its first
                later = self._deferred < MAX_DEFERRED and not self._closed.is_set() and (
                    self.defer_bytes is None or self._deferred_bytes + pinned <= self.defer_bytes)
                if later:
                    self._deferred += 1
                    self._deferred_bytes += pinned
            if later:
                done = self._defer(session.id, tokens, at, plan, cache, pinned, idle)
                pinned = 0
                continue
            try:
                got = mlx(lambda at=at, plan=plan, cache=cache: self._copies_after_shallower(cache, at, plan))
            except Exception as exc:
                self._failed(at, exc)
                continue
            done = self._driver.submit(self._handed, tokens, plan[0][-1], got)
        return done

    def _defer(self, owner: str, tokens: list[int], position: int, plan: tuple, cut: list, pinned: int,
               idle: Callable[[Callable[[], None]], None]) -> Future:
        """Caller's thread: the point's host copies queued as an idle job of the engine thread (kept for `hurry`,
        which may run them sooner, the session `owner`'s or all), handed to the driver once made: the driver
        holds only writes that are ready, so waiting for one point's write waits for no other's idle job. The
        Future of its write (False: given up, or failed)."""
        written: Future = Future()
        key = id(written)
        held = {"cut": cut}  # dropped by whichever runs first: the job, or `give_up`

        def release() -> bool:
            """Let the cut go (once): its arrays no longer count as waiting."""
            if held.pop("cut", None) is None:
                return False
            with self._lock:
                self._deferred -= 1
                self._deferred_bytes -= pinned
            return True

        writes = _writes(plan)

        def job() -> None:  # on the engine thread, once: through `hurry`, a deeper point's job, or `later`
            cache = held.get("cut")
            if cache is None:
                return
            self._make_shallower(position, writes)  # their blocks written first, with their rows
            try:
                got = self._copies(cache, position, plan, {})
            except Exception as exc:  # a point is an optimisation, not the prefill's result
                self._failed(position, exc)
                got = None
            if not release():
                return
            try:
                handed = self._driver.submit(self._handed, tokens, plan[0][-1], got) if got is not None else None
            except RuntimeError:  # the driver has shut down: the engine is closing
                handed = None
            if handed is None:
                written.set_result(False)
            else:
                handed.add_done_callback(lambda f: written.set_result(
                    not f.cancelled() and f.exception() is None and bool(f.result())))

        def later() -> None:
            """The idle job: a shallower waiting point that writes one of its blocks goes first, as an idle job
            of its own (each idle job one point's copies: a turn that comes meanwhile waits for one alone), this
            one queued again behind it."""
            if held.get("cut") is None:
                return
            if self._shallower(position, writes):
                idle(later)
                return
            job()

        def drop() -> None:  # `give_up`: the engine thread has stopped, the job will never run
            if release():
                written.set_result(False)

        with self._lock:
            self._pending[key] = _Waiting(owner, position, job, drop, written, writes, held)
        written.add_done_callback(lambda _: self._forget(key))
        idle(later)
        return written

    def _shallower(self, position: int, writes: frozenset[str]) -> list[_Waiting]:
        """The waiting points before `position` whose copies are still to be made and that write one of the
        blocks `writes`, shallowest first. A point's cut holds a ring's rows from its own window on, so a block's
        first writer should be the shallowest point past it: a block stored without the rows a marker reads makes
        that point whole (`_settled`)."""
        with self._lock:
            shallower = [w for w in self._pending.values() if w.position < position and "cut" in w.held
                         and not w.writes.isdisjoint(writes)]
        return sorted(shallower, key=lambda w: w.position)

    def _make_shallower(self, position: int, writes: frozenset[str]) -> None:
        """Engine thread: the waiting points `_shallower` names, made and handed to the driver (it writes in
        order), before the point at `position` is."""
        for w in self._shallower(position, writes):
            w.job()

    def _copies_after_shallower(self, cache: list, position: int, plan: tuple) -> tuple[dict, list | None, dict]:
        """Engine thread: `_copies` of a point taken at once (past the deferral's bounds), the shallower waiting
        points that write one of its blocks made first."""
        self._make_shallower(position, _writes(plan))
        return self._copies(cache, position, plan, {})

    def _forget(self, key: int) -> None:
        with self._lock:
            self._pending.pop(key, None)

    def _handed(self, tokens: list[int], key: str, got: tuple[dict, list | None, dict]) -> bool:
        """Driver thread (or the caller's, in process): a point copied to the host (`_copies`), written."""
        blocks, _, point = got
        return self._write(tokens, blocks, key, point)

    def _plan(self, tokens: list[int], keys: list[str]) -> tuple[list[str], dict, list[int], frozenset[int]] | None:
        """Caller's thread, for a point closing `tokens` (`keys`: their chain keys, a chunk's deepest point's cut
        to these): (the keys, the blocks the store holds, the blocks it lacks, those it holds without window rows
        near the end), or None when the point is stored."""
        store, bundle, b = self.ctx.store, self.ctx.bundle.hash, self.ctx.block_tokens
        if store.point_refs(keys[-1:], bundle):
            return None
        usable = store.usable_blocks(keys, tokens)  # the blocks the store holds are not copied
        needed = [i for i, key in enumerate(keys) if key not in usable]
        near = range(max(0, len(keys) - self.window_tokens // b - 2), len(keys))  # a marker's window's blocks
        bare = frozenset(k for k in near if self.window_names and keys[k] in usable and not window_rows.carries_rows(
            store.block_specs(usable[keys[k]]), self.window_names))
        return keys, usable, needed, bare

    def _take_at(self, session: Session, position: int, plan: tuple | None, copied: dict[int, dict],
                 cut: bool, held: bool) -> tuple[dict, list | None, dict] | None:
        """Engine thread: the point at `position` (the cache cut there, or standing there), held when `held`, and,
        when `plan` says the store lacks it, (its blocks the store lacks, its marker's window, the point) on the
        host."""
        cache = self._hold_at(session, position, cut, held)
        return None if cache is None or plan is None else self._copies(cache, position, plan, copied)

    def _holds(self, session: Session, position: int, ats: list[int]) -> bool:
        """Whether the point at `position`, one of a chunk's `ats`, is held: points are held, and it is the chunk's
        deepest (a session holds its latest alone), or the session leads a shared prefill (its waiters copy
        whichever lies within their tokens)."""
        return self.held and (position == ats[-1] or session.point_trail is not None)

    def _hold_at(self, session: Session, position: int, cut: bool, held: bool) -> list | None:
        """Engine thread: the cache at `position` (cut there, or the session's standing there), held when `held`;
        None where a ring does not hold it (a one-token chunk rotates it in place)."""
        cache = cut_at(session.cache, position, self.ctx.block_tokens) if cut else session.cache
        if cache is not None and held:
            hold(session, position, cache)
        return cache

    def _copies(self, cache: list, position: int, plan: tuple, copied: dict[int, dict]) -> tuple[dict, list | None, dict]:
        """Engine thread: (the blocks of `plan` the store lacks, the marker's window, the point) of `cache` standing at
        `position`, on the host; `copied`: blocks copied already (taken from there)."""
        keys, _, needed, bare = plan
        for first, count in _runs([k for k in needed if k not in copied], SPAN_BLOCKS):
            copied.update(self._copy_blocks(cache, first, count))
        blocks = {k: copied[k] for k in needed}
        window = self._window(cache, position, bare)
        if self.window_names:  # the rings' rows go in the blocks the store lacks; a point is a marker over them
            for k, rows in self._window_rows(cache, blocks).items():
                blocks[k] = {**blocks[k], **rows}
        point = self._point(cache, position, window)
        self._count("points_taken")
        self._count("points_marked", int(bool(window)))
        return blocks, window, point

    def _window(self, cache: list, position: int, bare: frozenset[int]) -> list | None:
        """The rings' spans when the point at `position` can be a marker (kv/window_rows.py): the rings hold
        their blocks' rows, and the blocks of them the store holds already carry theirs (`bare`: those that
        do not); else None."""
        if not self.window_names:
            return None
        window = window_rows.spans(cache, position, self.ctx.block_tokens)
        if window is None or not window_rows.worth_it(window, self.ctx.block_tokens):
            return None
        if any(k in bare for k in window_rows.blocks_of(window, self.ctx.block_tokens)):
            return None  # stored without them (a sleep's, or before): the point keeps its rings
        return window

    def _window_rows(self, cache: list, blocks: dict[int, dict]) -> dict[int, dict]:
        """Engine thread: the rings' rows of every block to be written whose rows they all hold, on the host:
        the marker's window and any block before it the chunk still holds, so a later point whose window
        reaches back into these blocks finds them with rows (none for a window shorter than a block)."""
        held, ks = window_rows.held_blocks(cache, self.ctx.block_tokens)
        ks = [k for k in ks if k in blocks]
        if not ks or not window_rows.worth_it(held, self.ctx.block_tokens):
            return {}
        return window_rows.defer_rows(held, ks, self.ctx.block_tokens).host()

    def _point(self, cache: list, position: int, window: list | None) -> dict[str, Tensor]:
        """Engine thread: the point's state on the host; its rings' rows left out where `window` marks them."""
        elsewhere = frozenset(s.name for s in window or ())
        point = compact_rings(cache_blocks.capture_tail(cache, position, self.ctx.block_tokens,
                                                        rings_cut=True, rows_elsewhere=elsewhere))
        return window_rows.marker(point, window) if window else point

    def _copy_blocks(self, cache: list, first: int, count: int) -> dict[int, dict]:
        """Engine thread: host copies of blocks first .. first+count-1 (copies: the cache goes on growing)."""
        span = cache_blocks.defer_blocks(cache, first, count, self.ctx.block_tokens, own=True).host()
        return {first + k: arrays for k, arrays in enumerate(span)}

    def _write(self, tokens: list[int], blocks: dict, key: str, point: dict) -> bool:
        """Driver thread: the blocks the store lacks (a prefix-only commit), then the point closing `key`;
        False when it failed (logged: the prefill it came from goes on)."""
        store, bundle = self.ctx.store, self.ctx.bundle.hash
        try:
            with store.writer(None, bundle, tokens) as writer:
                gone = [i for i in writer.needed if i not in blocks]
                if gone:  # evicted by gc since the copies were made: the point would close nothing stored
                    raise LookupError(f"blocks {gone[:4]} of the {len(tokens)} tokens left the store")
                for i in writer.needed:
                    writer.add_block(i, blocks[i])
                info = writer.commit()
                late = [k for k in window_rows.marked_blocks(point, self.ctx.block_tokens)
                        if k in blocks and k not in writer.needed]
            written = store.write_point(bundle, key, len(tokens), self._settled(tokens, blocks, point, late))
        except Exception as exc:  # a point is an optimisation, not the prefill's result
            self._failed(len(tokens), exc)
            return False
        self._count("point_blocks_written", info.new_blocks)
        self._count("points_written", int(written))
        return written

    def _settled(self, tokens: list[int], blocks: dict, point: dict, late: list[int]) -> dict:
        """Driver thread: the point as it can be stored. A marker's window blocks that another writer stored
        after the take (`late`: ours were not written) may lack the rows; then the point is made whole from
        the rows we copied and those the store holds (StateMismatchError when neither has them)."""
        if not late:
            return point
        store, b = self.ctx.store, self.ctx.block_tokens
        keys = chain_keys(self.ctx.bundle.hash, tokens, b)
        stored = store.usable_blocks(keys, tokens)  # all the keys: a block's tokens are found by its place
        if all(keys[k] in stored and window_rows.carries_rows(store.block_specs(stored[keys[k]]), self.window_names)
               for k in late):
            return point
        self._count("points_joined")
        return window_rows.assemble(point, b, lambda k: blocks[k] if window_rows.carries_rows(
            blocks.get(k, {}), self.window_names) else store.read_block(stored[keys[k]]))

    def _failed(self, position: int, exc: Exception) -> None:
        self._count("point_failures")
        log.warning("restore point not stored", extra={"tokens": position, "error": repr(exc)})

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def stored_after(self, tokens: list[int], after: int, upto: int) -> bool:
        """Whether the store holds a point of `tokens` closing a block past `after` and at most `upto` (a reply's
        point, model/reply_points.py: deeper than a session's held point, so a resend parting after it is
        served from the store, as before held points)."""
        b = self.ctx.block_tokens
        if upto // b <= after // b:
            return False
        keys = chain_keys(self.ctx.bundle.hash, tokens[: upto // b * b], b)[after // b :]
        return bool(self.ctx.store.point_refs(keys, self.ctx.bundle.hash))

    def count_held(self, tokens: int) -> None:
        """A session went back to its held point of `tokens` (Appending._adopt)."""
        self._count("held_points_used")
        self._count("held_point_tokens", tokens)

    def set_room(self, kv_bytes: int) -> None:
        """What KV may take now (the engine's room): the cuts of waiting points keep at most DEFERRED_SHARE of it
        alive."""
        self.defer_bytes = kv_bytes // DEFERRED_SHARE

    def hurry(self, mlx: Mlx, owner: str | None = None) -> None:
        """Caller's thread: the copies of the points waiting for the engine's idle time made now, through `mlx`
        (a job each), and every point handed to the driver written: a sleep's snapshot goes with the points
        its session's prefills took (the remote tier sends them together). `owner`: that session's points alone
        (a sleep's: another session's copies are not its wait, but for those shallower than its own that write
        one of their blocks, made first: `_shallower`), else every waiting point and every write handed before
        the call; not the points a turn cuts meanwhile. Made from the shallowest point on."""
        if self._driver is None:
            return
        with self._lock:
            pending = sorted(self._pending.values(), key=lambda w: w.position)
        waiting = [(w.job, w.written) for w in pending if owner in (None, w.owner)]
        handed = self._driver.submit(lambda: None) if owner is None else None  # behind every write ready now
        for job, _ in waiting:
            mlx(job)
        for _, written in waiting:
            written.result()
        if handed is not None:
            handed.result()

    def flush(self) -> None:
        """Wait for the points handed to the driver so far, and for those waiting for the engine's idle time (cut
        points' copies: nothing decoding; a caller on a turn's way uses `hurry`)."""
        with self._lock:
            waiting = [w.written for w in self._pending.values()]
        for written in waiting:
            written.result()
        if self._driver is not None:
            self._driver.submit(lambda: None).result()

    def status(self) -> dict[str, object]:
        with self._lock:
            return {"enabled": self.enabled, "every_blocks": POINT_EVERY, **self.counters, "points_waiting": self._deferred,
                    "points_waiting_bytes": self._deferred_bytes}

    def give_up(self) -> None:
        """The engine thread has stopped: points still waiting for an idle job are given up (their writes end, and
        so do the waits for them: a reply point's `flush`)."""
        self._closed.set()
        with self._lock:
            drops = [w.drop for w in self._pending.values()]
        for drop in drops:
            drop()

    def close(self) -> None:
        self.give_up()
        if self._driver is not None:
            self._driver.shutdown(wait=True)


TRAIL_KEPT = 8  # points a shared prefill's leader holds for its waiters (a 10k-token prompt takes 3 or 4)
# Layers whose trim rewinds them to any token (a ring trims only until it wraps: it is copied, as recurrent
# layers are)
ALWAYS_TRIMMED = (KVCache, QuantizedKVCache, PagedKVCache)
_UNSIGNED = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


class _Waiting(NamedTuple):
    """A point whose host copies wait for the engine's idle time (`PointTaker._defer`)."""

    owner: str  # the session whose prefill took it
    position: int
    job: Callable[[], None]  # its copies (the shallower points' first), then its write handed to the driver
    drop: Callable[[], None]  # gives it up (the engine thread has stopped)
    written: Future  # its write's
    writes: frozenset[str]  # the chain keys of the blocks it writes (those the store lacked at its take)
    held: dict  # its cut under "cut" until its copies are made or it is given up


def _writes(plan: tuple) -> frozenset[str]:
    """The chain keys of the blocks a point's plan (`PointTaker._plan`) writes: those the store lacked."""
    keys, _, needed, _ = plan
    return frozenset(keys[i] for i in needed)


class _Members(list):
    """A CacheList's held members (falcon_h1: attention and a recurrent state in one layer): None for those
    trimmed, a copy for the others."""


def hold(session: Session, position: int, cache: list | None = None) -> None:
    """Engine thread, the session's cache at `position` (a restore point, just taken; `cache`: that cache cut
    from the session's, `cut_at`): keep a device copy of each
    layer no token cut rewinds (sliding-window rings, recurrent states; None for the others) as the session's
    `held_point`, replacing the one before; while it leads a shared prefill, in its trail too. The copies are
    evaluated here, so the cache's next update finds its buffers referenced by it alone (updated in place)."""
    arrays: list[mx.array] = []
    layers = [_held(c, arrays) for c in (session.cache if cache is None else cache)]
    mx.eval(arrays)
    session.held_point = (position, layers)
    if session.point_trail is not None:  # it leads a shared prefill: its waiters copy from these
        session.point_trail.append((position, layers))
        del session.point_trail[:-TRAIL_KEPT]


def _held(c, arrays: list[mx.array]):
    if type(c) in ALWAYS_TRIMMED:
        return None
    if isinstance(c, CacheList):
        return _Members(_held(m, arrays) for m in c.caches)
    return _copied(c, arrays)


def _array_bytes(cache: list) -> int:
    """Bytes of the keys and values a cache's KV layers hold: what a cut of it may keep alive while it waits."""
    return sum(a.nbytes for c in cache for a in (getattr(c, "keys", None), getattr(c, "values", None))
               if isinstance(a, mx.array))


def cut_at(cache: list, position: int, block_tokens: int) -> list | None:
    """Engine thread: the cache as it stood at `position` (a boundary a prefill chunk passed), as views of the
    session's arrays (nothing copied, nothing evaluated), or None when a ring does not hold it.

    A plain layer is the same buffer up to `position`. A ring that a chunk grew (mlx-lm's RotatingKVCache:
    `_update_concat` keeps the window's last rows before the chunk, in token order, and appends the chunk's)
    holds every row from the window before the chunk's start to its end. Cut, it holds its rows up to
    `position` from the start of the block of the window's first token there (what a point's rows in blocks
    read, kv/window_rows.py), in token order (`_idx` the rows held): the state a chunk stopped at `position`
    leaves, but for rows before the window, which no update reads (its next one keeps the window's last rows,
    as `compact_rings` says) -- so a chunk's whole length is not held again in each held point. Only Gemma's
    kind of ring (`keep` 0, in token order) is cut; a model with a recurrent layer stops its chunks at the
    boundaries instead (`PointTaker.cuts`)."""
    out = []
    for c in cache:
        if type(c) is KVCache:
            if c.offset < position:
                return None
            made = copy.copy(c)
            # slices, not the session's arrays themselves: mlx-lm updates a KVCache's array object in place
            # (`keys[..., a:b, :] = ...`), and a later turn that trims this cache and writes over these tokens
            # would change what a deferred point copies (a slice keeps the array it read)
            made.keys, made.values, made.offset = c.keys[..., :position, :], c.values[..., :position, :], position
        elif type(c) is RotatingKVCache and not c.keep:
            held = window_rows.token_rows(c)  # (first token, rows), row r holding token first + r
            # the rows up to `position` must hold a full window before it (or every token from the first), as
            # a chunk stopped there would: a ring holding fewer would grow wrongly at its next update
            if held is None or held[0] > max(0, position - c.max_size) or position > c.offset:
                return None
            lo = max(held[0], max(0, position - c.max_size) // block_tokens * block_tokens) - held[0]
            made = copy.copy(c)
            made.keys, made.values = c.keys[..., lo : position - held[0], :], c.values[..., lo : position - held[0], :]
            made.offset, made._idx = position, position - held[0] - lo
        else:
            return None
        out.append(made)
    return out


def held_copy(session: Session, n_tokens: int) -> tuple[list | None, int]:
    """Engine thread: (a new cache holding the session's state at the deepest point of its trail within its first
    `n_tokens`: the plain layers' tokens and the held layers copied, evaluated; that point's tokens), or
    (None, 0) when its trail holds none there. The session keeps its own."""
    trail = [p for p in session.point_trail or () if p[0] <= min(n_tokens, session.processed)]
    if session.cache is None or not trail:
        return None, 0
    position, layers = max(trail, key=lambda p: p[0])
    cut = [i for i, layer in enumerate(layers) if layer is None]  # cut together: a paged cache's layers share
    plain = dict(zip(cut, cache_blocks.copy_prefix([session.cache[i] for i in cut], position)))  # one table
    arrays: list[mx.array] = []

    def copy_of(c, layer):
        if isinstance(layer, _Members):
            return CacheList(*(cache_blocks.copy_prefix([m], position)[0] if h is None else _copied(h, arrays)
                               for m, h in zip(c.caches, layer, strict=True)))
        return _copied(layer, arrays)

    cache = [plain[i] if layer is None else copy_of(c, layer)
             for i, (c, layer) in enumerate(zip(session.cache, layers, strict=True))]
    mx.eval(arrays)
    return cache, position


def end_trail(session: Session) -> None:
    """Engine thread: the session leads no shared prefill any more: the copies only its trail held are freed."""
    session.point_trail = None


def back_to_held(session: Session) -> int:
    """Engine thread: the session's cache set back to its `held_point` (taken: the copies become the cache's
    layers, the others trimmed to its position); returns that position."""
    position, layers = session.held_point
    session.held_point = None
    if session.point_trail:  # its copies become the cache's: no waiter may copy them from here on
        session.point_trail = [p for p in session.point_trail if p[1] is not layers]
    drop = session.processed - position
    for i, layer in enumerate(layers):
        if layer is None:
            session.cache[i].trim(drop)
        elif isinstance(layer, _Members):
            members = list(session.cache[i].caches)
            for j, held in enumerate(layer):
                if held is None:
                    members[j].trim(drop)
                else:
                    members[j] = held
            session.cache[i] = CacheList(*members)
        else:
            session.cache[i] = layer
    session.processed = position
    return position


def held_bytes(session: Session) -> int:
    """Bytes of the session's held point and of its trail's others (0 when it holds none)."""
    if session.held_point is None and not session.point_trail:  # every session of a cuttable model: asked often
        return 0
    held = [session.held_point] if session.held_point is not None else []
    kept = {id(layers): layers for _, layers in [*held, *(session.point_trail or ())]}
    copies = [c for layers in kept.values() for layer in layers if layer is not None
              for c in (layer if isinstance(layer, _Members) else [layer]) if c is not None]
    return cache_blocks.cache_nbytes(copies)


def _copied(value, arrays: list[mx.array]):
    """A copy of a cache layer (or of one of its attributes) whose arrays are new buffers holding the same bits
    (copied as unsigned integers of their width: a float's NaN payload kept too), each added to `arrays`;
    mlx-lm's cache objects copied attribute by attribute."""
    if isinstance(value, mx.array):
        bits = _UNSIGNED[value.dtype.size]
        made = (value.view(bits) * 1).view(value.dtype)
        arrays.append(made)
        return made
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v, arrays) for v in value)
    if hasattr(value, "is_trimmable"):  # a cache layer
        made = copy.copy(value)
        for name, v in vars(value).items():
            setattr(made, name, _copied(v, arrays))
        return made
    return value


def compact_rings(point: dict[str, Tensor]) -> dict[str, Tensor]:
    """The point with each ring buffer cut to the rows its next update reads: after a prefill chunk of S
    tokens mlx-lm's RotatingKVCache holds up to max_size - 1 + S rows in token order (`_idx` = rows); its
    next update (a chunk, or a decode step) keeps only the `keep` first and the last rows up to max_size,
    and its masks read no more. So the ring is stored as that update would cut it (`_idx` = max_size, the
    state `_trim` leaves), a few windows' bytes instead of a chunk's; the state a restore makes of it then
    updates to the same arrays as the ring it was cut from."""
    out = dict(point)
    for name in [n for n in point if n.endswith(".ring")]:
        unit = name[: -len(".ring")]
        offset, idx, keep, max_size = (int(x) for x in point[name].array)
        keys, values = point.get(f"{unit}.keys"), point.get(f"{unit}.values")
        rows = keys.array.shape[2] if keys is not None else 0
        if rows <= max_size or idx != rows:
            continue  # not grown past its size by a chunk (or rotated in place by single tokens): as held
        for part, t in ((f"{unit}.keys", keys), (f"{unit}.values", values)):
            cut = np.concatenate([t.array[:, :, :keep], t.array[:, :, rows - (max_size - keep):]], axis=2)
            out[part] = Tensor(t.dtype, cut)
        out[name] = Tensor.of(np.array([offset, max_size, keep, max_size], dtype=np.int64))
    return out


def check_fits(point: dict[str, Tensor], kv_layout: list[dict]) -> None:
    """Raise StateMismatchError, naming the array, when a point's state is not of the shapes and dtypes the
    model's cache holds (`kv_layout`: the bundle's, cache_blocks.layout with the model). A restore checks a
    ring's structure, but mlx-lm's ArraysCache knows no shapes: a recurrent state of another shape restored
    and then failed the forward pass, or ran with a state the model never made. Rows of a ring vary with
    the prefill; its heads, head dims and dtype do not."""
    for name, facts in _layout_units(kv_layout):
        if facts["kind"] == "arrays":
            for k, want in enumerate(facts.get("arrays") or []):
                got = point.get(f"{name}.arrays.{k}")
                if (want is None) != (got is None) or (got is not None and (
                        list(got.array.shape) != want["shape"] or _dtype_name(got) != want["dtype"])):
                    raise StateMismatchError(f"{name}.arrays.{k}: {_spec(got)} is not the model's {want}")
        elif facts["kind"] in ("rotating", "chunked") and f"{name}.keys" in point:
            for part, dim in (("keys", "k_head_dim"), ("values", "v_head_dim")):
                got = point.get(f"{name}.{part}")
                if got is None or _array(got).ndim != 4 or _dtype_name(got) != facts["dtype"] or \
                        (_array(got).shape[1], _array(got).shape[3]) != (facts["kv_heads"], facts[dim]):
                    raise StateMismatchError(f"{name}.{part}: {_spec(got)} is not KV of the model's "
                                             f"{facts['kv_heads']} heads of {facts[dim]} {facts['dtype']}")


def _layout_units(kv_layout: list[dict]) -> list[tuple[str, dict]]:
    """(unit name, its layout facts) in cache_blocks.units' naming: layers.i, or layers.i.j in a CacheList."""
    out = []
    for i, facts in enumerate(kv_layout):
        members = facts.get("caches") if facts["kind"] == "cache_list" else None
        out += [(f"layers.{i}.{j}", m) for j, m in enumerate(members)] if members else [(f"layers.{i}", facts)]
    return out


def _dtype_name(t: Tensor | mx.array) -> str:
    """A stored array's dtype as MLX names it (the layout's names); a device array's (a ring joined there)."""
    if isinstance(t, mx.array):
        return str(t.dtype).rsplit(".", 1)[-1]
    return "bfloat16" if t.dtype == "BF16" else t.array.dtype.name


def _array(t: Tensor | mx.array) -> np.ndarray | mx.array:
    return t if isinstance(t, mx.array) else t.array


def _spec(t: Tensor | mx.array | None) -> str:
    return "nothing" if t is None else f"{_dtype_name(t)}{list(_array(t).shape)}"


def _runs(indices: list[int], most: int) -> list[tuple[int, int]]:
    """Sorted block indices as (first, count) runs of consecutive ones, each of at most `most`."""
    runs: list[tuple[int, int]] = []
    for i in sorted(indices):
        if runs and runs[-1][0] + runs[-1][1] == i and runs[-1][1] < most:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
