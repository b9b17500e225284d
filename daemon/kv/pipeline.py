"""Sleep and wake: the one pipeline the in-process engine and the daemon both run.

It takes a `KvContext` (context.py), never the engine: the store, the bundle,
the RAM tier, the pool and the few facts of the model's cache it needs.

Three kinds of work, each where it belongs:
- MLX work (cutting the cache into host views, allocating restore buffers,
  finishing the cache) runs through `mlx`, a callable that runs a function on
  the engine thread: `direct` in the in-process engine (the caller is that
  thread), `EngineThread.call` in the daemon. Each call is short, so other
  sessions' generation interleaves with a sleep or a wake.
- Encoding, digesting, decoding, file I/O and fsync run on a `Pool` of worker
  threads sized to the machine (all cores by default), bounded by bytes in
  flight rather than by a block count. All of it releases the GIL (zstd,
  BLAKE3, numpy, file I/O), so the pool scales with cores.
- The driver (the code below) runs in the caller's thread: the engine
  thread in-process, a worker thread in the daemon. It does the SQLite work.

Order is kept where it matters (a writer commits only once every block is
durable; a restore finishes only once every block is in place). The first
failure cancels the tasks not yet started and waits for those running: a
failed sleep leaves the session hot and its files removed (the writer
aborts); a failed wake leaves the session asleep and untouched.

Copies per byte. Sleep: on unified memory the workers read the cache's own
memory (strided views), so the only copies are the encoder's (byte planes,
compressed output) and the write to the page cache; on CUDA the GPU splits a
span into byte planes and they move to the host once (devplanes.py). Wake:
block files are mapped from the page cache and decoded a piece at a time,
each piece digested while in cache; on unified memory each piece is joined
into the final KV buffer (one write per byte); on CUDA the planes go into a
staging ring in MLX host-visible memory and each span is joined on the GPU as
soon as it is in, while the pool decodes the next spans (restore_buffers.py,
docs/history/benchmarks-journal.md "Copies per restored byte").
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx

from kvwake.daemon.kv import cache_blocks, page_restore, paged_cache, paged_wake, restore_buffers, window_rows
from kvwake.daemon.jobs import quick, unframed
from kvwake.daemon.kv.context import KvContext, Mlx
from kvwake.daemon.kv.pages import PagePool
from kvwake.daemon.kv.pool import Batch
from kvwake.daemon.kv.ram_tier import Wants
from kvwake.daemon.timing import Phases
from kvwake.daemon.session_state import Session
from kvwake.errors import CorruptBlockError, InternalError, InvalidParamsError, KvwakeError
from kvwake.store import BlockRef, SnapshotInfo, SnapshotRecord, SnapshotWriter

log = logging.getLogger("kvwake.pipeline")

__all__ = ["Moved", "block_specs", "checkpoint", "fill_block", "fill_spans", "release", "releasing", "sleep", "wake",
           "write_prefix"]

PREFIX_WAIT_S = 600.0  # a wake in flight that has not landed by then is not waited for: every block read
SPAN_SHARE = 4  # a sleep stages at most 1/SPAN_SHARE of the byte budget per engine-thread call
# A sleep keeps at most 1/SLEEP_SHARE of the session's KV in flight: a block in flight holds its
# host copy (GPU) and its encoded bytes, under twice its raw size, so RSS grows by less than the
# quarter of the KV that bounds it (docs/decisions.md, "Daemon").
SLEEP_SHARE = 8
RELEASE_JOB_S = 0.004  # a release's engine-thread job frees layers until it has run this long (one at least)


# -- sleep ---------------------------------------------------------------------


def _spans(needed: list[int], per_span: int, cut: int | None = None) -> list[tuple[int, int]]:
    """(first, count) runs of consecutive block indices, at most per_span long, none across block `cut`."""
    spans: list[tuple[int, int]] = []
    for i in needed:
        if spans and spans[-1][0] + spans[-1][1] == i and spans[-1][1] < per_span and i != cut:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        else:
            spans.append((i, 1))
    return spans


def defer_blocks(ctx: KvContext, cache: list, first: int, count: int, own: bool = False) -> cache_blocks.Deferred:
    """Blocks as host arrays (cache_blocks.py), or, KV on a discrete GPU, as byte planes made there, once hosted (MLX
    work). `own`: never views of the cache (it goes on growing: cache_blocks._defer_units). With
    `window_blocks`, the sliding-window rows the rings hold of these blocks go with them (kv/window_rows.py)."""
    rows = window_rows.span_rows(cache, first, count, ctx.block_tokens) if ctx.window_blocks else None
    if ctx.device_planes and ctx.store.codec == "planes-zstd":
        planed = cache_blocks.defer_planed(cache, first, count, ctx.block_tokens, extra=rows)
        if planed is not None:
            return planed
    return cache_blocks.defer_blocks(cache, first, count, ctx.block_tokens, own=own, extra=rows)


def _write_blocks(ctx: KvContext, w: SnapshotWriter, cache: Callable[[], list], mlx: Mlx, batch: Batch, held: list,
                  skip: int | None = None, own: bool = False) -> None:
    """Capture the writer's needed blocks a span at a time (engine thread) and encode and write them (pool).

    `cache()` gives the cache on the engine thread (it may raise: the caller's cache is gone); `own`:
    the blocks are copied out of it (a hot session's cache, which goes on growing). On
    unified memory a span is all of it (views of the cache cost nothing); on a GPU, or copied, a
    span's copy is a quarter of the batch budget. The first engine-thread call schedules the first
    span's copy; each later one takes a span scheduled by the call before and schedules the next
    (`Deferred`), so copies overlap the encoding and a call rarely waits for a transfer (a decode
    step or more runs between two calls while other sessions decode). Each block is admitted by
    the budget (its encoded bytes live until written). `held` keeps each span with its tasks;
    finished spans are dropped inside the next engine-thread call, the rest by the caller there
    too: MLX memory is freed on the thread that runs MLX.
    """
    todo = [i for i in w.needed if i != skip]
    if not todo:
        return
    def token_bytes() -> tuple[int, int | None]:  # and where the blocks with window rows start: a span's own
        c = cache()
        return cache_blocks.bytes_per_token(c), window_rows.first_held(c, ctx.block_tokens) if ctx.window_blocks else None
    per_token, rows_from = mlx(token_bytes)
    block_bytes = max(1, per_token * ctx.block_tokens)
    copied = ctx.device_planes or own  # spans of copies, not views: a span's copy is bounded
    per_span = max(1, batch.budget // SPAN_SHARE // block_bytes) if copied else len(todo)
    spans = _spans(todo, per_span, rows_from)
    scheduled: dict[int, cache_blocks.Deferred] = {}
    held.append(scheduled)

    def schedule(k: int) -> None:
        if k < len(spans):
            scheduled[k] = defer_blocks(ctx, cache(), *spans[k], own=own).schedule()

    def settle() -> None:  # spans whose writes are done let their host copies go
        held[:] = [h for h in held if not isinstance(h, tuple) or not all(f.done() for f in h[1])]

    def capture(k: int) -> list:  # the span scheduled by the call before; the next one scheduled
        cache_blocks.drop_hosted(settle)
        schedule(k + 1)
        return scheduled.pop(k).host()

    def schedule_first() -> None:  # engine jobs named for the engine thread's record of slow work
        schedule(0)

    mlx(schedule_first)
    for k, (first, _) in enumerate(spans):
        if batch.failed:
            return

        def capture_span(k: int = k) -> list:
            return capture(k)
        blocks = mlx(capture_span)
        futures: list[cf.Future] = []
        held.append((blocks, futures))
        for j, arrays in enumerate(blocks):
            batch.reserve(block_bytes)
            if batch.failed:
                batch.release(block_bytes)
                return
            futures.append(batch.submit(block_bytes, w.add_block, first + j, arrays))


def _dropping(held: list) -> Callable[[], None]:
    """The engine-thread job that empties `held` (spans and their host copies: `cache_blocks.drop_hosted`)."""
    def drop_held() -> None:
        cache_blocks.drop_hosted(held.clear)
    return drop_held


def _write_tail(ctx: KvContext, w: SnapshotWriter, session: Session, mlx: Mlx, batch: Batch, held: list) -> None:
    """Capture the session's tail (engine thread) and write it (pool); `held` alone keeps its host copies."""
    tail = mlx(lambda: cache_blocks.capture_tail(session.cache, session.processed, ctx.block_tokens))
    held.append(tail)
    if tail and not batch.failed:
        batch.submit(0, w.set_tail, tail)


def _sleep_budget(ctx: KvContext, session: Session) -> int:
    """Bytes a sleep may have in flight: an eighth of the session's KV, at least one block."""
    per_token = cache_blocks.bytes_per_token(session.cache) if session.cache is not None else 0
    return max(per_token * ctx.block_tokens, per_token * session.processed // SLEEP_SHARE, 1)


def sleep(ctx: KvContext, session: Session, mlx: Mlx, *, label: str | None = None, free: bool = True,
          supersede: str | None = None) -> dict[str, Any]:
    """Write the session's KV as a snapshot (and free it unless `free` is False: a checkpoint).

    Blocks the store holds already (continuous persistence wrote them as they filled, or another
    session did) are not written again: a sleep after persistence writes the tail and what was not
    yet persisted. `supersede`: the session's latest persistence checkpoint (persist.py), which this
    snapshot replaces in the same commit.

    Until the commit succeeds the session stays hot; on failure every file
    this sleep wrote is removed and the error is raised as itself. Returns the
    snapshot's id, tokens (its KV's), pending (input tokens kept without KV, restored by a wake),
    raw/stored/written bytes, new/reused blocks and ms.
    """
    started = time.perf_counter()
    if session.cache is None and session.processed:
        raise InternalError(f"session {session.id}: {session.processed} tokens processed but no cache to sleep; "
                            "not written (a snapshot without their KV could not be woken)", session_id=session.id)
    tokens = session.tokens[: session.processed]
    phases = Phases(started)
    with ctx.store.writer(session.id, ctx.bundle.hash, tokens, parent=session.head, label=label,
                          metadata=session.state(), supersede=supersede) as w:
        phases.mark("open")
        batch, held = ctx.pool.batch(_sleep_budget(ctx, session)), []
        try:
            if session.cache is not None:
                _write_blocks(ctx, w, lambda: session.cache, mlx, batch, held)
                phases.mark("blocks")
                _write_tail(ctx, w, session, mlx, batch, held)
                phases.mark("tail")
        finally:  # never leave a write running behind an aborting writer
            batch.join()
            if held:  # a session with no KV (a new one's first snapshot) waits for no engine job
                mlx(_dropping(held))
        phases.mark("written")
        batch.raise_first()
        info = w.commit()
        _mark_stored(session, w, mlx)
        phases.mark("commit")
        session.head = info.id
        result = {"snapshot_id": info.id, "tokens": info.n_tokens, "pending": len(session.pending),
                  "raw_bytes": info.raw_bytes,
                  "stored_bytes": info.stored_bytes, "new_blocks": info.new_blocks,
                  "reused_blocks": info.reused_blocks, "written_bytes": info.written_bytes,
                  "ms": round((time.perf_counter() - started) * 1000, 3), "phases_ms": phases.ms}
    if free:
        release(session, mlx)
    return result


class Moved(Exception):
    """The session moved on from the tokens a checkpoint was planned for (its cache was cut, changed or
    taken by the decoder): that checkpoint is dropped; the next one starts from the session as it is."""


def _look(ctx: KvContext, session: Session) -> tuple[list[int], dict[str, Any], dict, str | None] | None:
    """What a checkpoint records, read at one moment on the engine thread (where the session changes):
    its full blocks' tokens, its state with every later token pending, the tail of that many tokens,
    its head. None while its KV is not in its own cache (none yet, or decoding in a batch)."""
    n = session.processed // ctx.block_tokens * ctx.block_tokens
    if session.cache is None:
        return None
    recorded = session.state()
    recorded.update(messages=list(recorded["messages"]), metadata=dict(recorded["metadata"]),
                    pending=session.tokens[n:])
    return session.tokens[:n], recorded, cache_blocks.block_tail(session.cache, n, ctx.block_tokens), session.head


def checkpoint(ctx: KvContext, session: Session, mlx: Mlx, *, supersede: str | None,
               wanted: Callable[[int, int], bool] = lambda blocks, total: True) -> SnapshotInfo | None:
    """Commit the session's full blocks as a snapshot of its first k*B tokens, the rest of its tokens
    pending (what a wake of it restores: a session whose prefill stopped there). Blocks the store holds
    are reused, so only the blocks filled since the last checkpoint are captured and written.

    `supersede`: the last checkpoint, replaced in the same commit. `wanted(k*B, all tokens)` says
    whether the session as it is now is worth a commit; when not, nothing is done (None). Raises
    Moved when the session changed under it (nothing is left behind: the writer aborts).
    """
    seen = mlx(quick(lambda: _look(ctx, session)))  # no MLX work: not a step of a decoding neighbour's
    if seen is None or not wanted(len(seen[0]), len(seen[0]) + len(seen[1]["pending"])):
        return None
    tokens, recorded, tail, head = seen

    def cache() -> list:  # engine thread: the cache still holds these tokens
        if session.cache is None or session.processed < len(tokens) or session.tokens[: len(tokens)] != tokens:
            raise Moved(f"session {session.id} no longer holds the {len(tokens)} tokens planned")
        return session.cache

    def settled(fn: Callable[[], Any]) -> Any:  # an engine-thread job run between a prefill's chunks, not inside one
        def run() -> Any:
            try:
                return fn()
            except BaseException as exc:  # its frames' MLX arrays freed here, on the engine thread
                unframed(exc)
                raise

        def job() -> Any:
            return session.when_settled(run)
        # the slow-work record says which, run now or once the chunk in flight ends (Session.settle)
        job.__qualname__ = run.__qualname__ = f"checkpoint.{getattr(fn, '__name__', 'job')}"
        return mlx(job).result()

    with ctx.store.writer(session.id, ctx.bundle.hash, tokens, parent=head, metadata=recorded,
                          supersede=supersede) as w:
        batch, held = ctx.pool.batch(ctx.pool.inflight_bytes // SPAN_SHARE), []
        try:
            if w.needed:
                _write_blocks(ctx, w, cache, settled, batch, held, own=True)
        finally:
            batch.join()
            mlx(_dropping(held))
        batch.raise_first()
        if tokens:  # a snapshot of no KV has no tail, as a new session's first one
            w.set_tail(tail)  # meta state and offsets: a few bytes
        info = w.commit()
        _mark_stored(session, w, mlx)
        return info


def _mark_stored(session: Session, w: SnapshotWriter, mlx: Mlx) -> None:
    """After a commit: the pages the writer's own blocks were written from hold the store's bytes (a paged
    session's; kv/paged_wake.py), so a wake may map them."""
    written = w.own_blocks()
    if written and paged_cache.is_paged(session.cache):
        mlx(quick(lambda: paged_wake.mark_stored(session.cache, written)))


def _write_short(ctx: KvContext, w: SnapshotWriter, scratch: Session, short: int, mlx: Mlx, batch: Batch,
                 held: list) -> None:
    """Capture the last partial block, `short` (engine thread), and write it (pool); `held` alone keeps it."""
    arrays = mlx(lambda: cache_blocks.capture_span(scratch.cache, short * ctx.block_tokens, scratch.processed))
    held.append(arrays)
    batch.reserve(0)
    batch.submit(0, w.add_block, short, arrays)


def release(session: Session, mlx: Mlx) -> None:
    """Drop the session's KV and give MLX's cached buffers back (a sleep, a delete, a wake replacing it),
    on the engine thread, layer by layer: a decoding neighbour waits one short job, not the freeing of a
    whole cache (docs/decisions.md, "Daemon": a layer is the grain).

    The cache leaves the session in the first job (what runs after sees none; `processed` still says what
    the snapshot holds, and a sleep refuses such a session); each job then frees layers, one at a time,
    until it has run RELEASE_JOB_S (at least one layer: a big layer is a job of its own); a paged cache's
    table is freed last (the pages no other session lists go back to the pool). Without
    `mx.clear_cache`, freed buffers stay in MLX's cache (up to its limit), and on a discrete GPU the
    host-side copies a sleep made stay pinned, until a long session slept and woken twice runs the host
    out of memory (docs/history/benchmarks-journal.md, "GPU machine: before and after"). MLX memory goes
    back on the thread that runs MLX, never the event loop's.
    """
    layers = mlx(lambda: _take_cache(session))
    pools = {id(c.session.pool): c.session.pool for c in layers if isinstance(c, paged_cache.PagedKVCache)}
    while layers:
        mlx(lambda: _free_layers(layers, RELEASE_JOB_S))
    for pool in pools.values():  # the table the last layer's finalizer queued, freed now: its pages count no more
        mlx(pool.drain)


def _take_cache(session: Session) -> list:
    layers, session.cache = list(session.cache or []), None
    held = [session.held_point] if session.held_point is not None else []
    for _, copies in {id(p[1]): p for p in [*held, *(session.point_trail or ())]}.values():
        layers += [c for c in copies if c is not None]  # its held copies freed with the layers, each once
    session.held_point = None
    if session.point_trail is not None:
        session.point_trail = []
    return layers


def _free_layers(layers: list, seconds: float) -> None:
    """Engine thread: free layers from the end of `layers` (the only references to them) for about `seconds`,
    at least one."""
    started = time.perf_counter()
    while layers:
        del layers[-1]
        mx.clear_cache()
        if time.perf_counter() - started >= seconds:
            return


def write_prefix(ctx: KvContext, scratch: Session, mlx: Mlx) -> SnapshotInfo:
    """Store (and pin) every token of a scratch session's cache; returns the commit's SnapshotInfo.

    The caller has prefilled all of scratch.tokens (the pending last token too). The last partial
    block is stored as a short block (a child of the last full one): a later request that starts
    with the whole prompt reuses all of it (store/reuse.py finds the short block as a partial
    piece). The scratch cache is dropped on return.
    """
    tokens = scratch.tokens[: scratch.processed]
    with ctx.store.writer(None, ctx.bundle.hash, tokens, pin=True, partial=True) as w:
        short = len(tokens) // ctx.block_tokens if len(tokens) % ctx.block_tokens else None
        batch, held = ctx.pool.batch(_sleep_budget(ctx, scratch)), []
        try:
            _write_blocks(ctx, w, lambda: scratch.cache, mlx, batch, held, skip=short)
            if short in w.needed:
                _write_short(ctx, w, scratch, short, mlx, batch, held)
        finally:
            batch.join()
            mlx(_dropping(held))
        batch.raise_first()
        info = w.commit()
    mlx(lambda: setattr(scratch, "cache", None))
    return info


# -- wake ----------------------------------------------------------------------


def fill_block(ctx: KvContext, buffers: restore_buffers.Buffers, ref: BlockRef, k: int, record: SnapshotRecord | None,
               keep_in_ram: bool) -> None:
    """Block k into place: from the RAM tier when it holds it (or once another restore reading it lands it),
    else decoded from its file, and landed in the RAM tier when `keep_in_ram` or another restore wants it."""
    # A block holds block_tokens tokens, except the short last block prefix.warm stores.
    start, count, what = k * ctx.block_tokens, len(ref.token_ids), f"block {k}"
    cached, flight = ctx.ram_tier.take(ref.key)
    if cached is not None and _put_cached(buffers, k, start, count, cached, what):
        _count(ctx, buffers, "blocks_ram")
        return
    landed, read_for = None, None
    try:
        # Shared: decoded into the host views, not staged, so that its copy is the block's arrays.
        share = keep_in_ram or (buffers.ring is None and ctx.ram_tier.shared(ref.key))
        arrays = ctx.store.read_block(ref, snapshot_id=record.id if record else None,
                                      session_id=record.session_id if record else None,
                                      place=buffers.place(start, count), stage=None if share else buffers.stage(k),
                                      procs=ctx.procs if buffers.mode == "direct" else None)
        buffers.check(arrays, start, count, what, staged=k in buffers.staged)
        _count(ctx, buffers, "blocks_disk")
        if share:
            landed = buffers.block(start, count)
        read_for = record.id if record is not None else None  # read and verified for this snapshot's wake
    finally:
        if flight is not None:  # None: read here after a staged image that did not fit (_put_cached)
            ctx.ram_tier.land(ref.key, flight, landed, read_for)


def _put_cached(buffers: restore_buffers.Buffers, k: int, start: int, count: int, cached: Any, what: str) -> bool:
    """Block k from memory: arrays copied into place, or a staged image (kv/hot_set.py) copied into the ring as
    its decode would have written it. False when the image does not fit this restore's staging."""
    if isinstance(cached, dict):
        buffers.put(start, count, cached, what)
        return True
    if not cached.stage_into(buffers.stage(k)):
        buffers.unstage(k)  # runs it staged before one did not fit were recorded: the read that follows is not
        return False
    buffers.check(dict(cached.rest), start, count, what, staged=k in buffers.staged)
    return True


def _count(ctx: KvContext, buffers: restore_buffers.Buffers, name: str, n: int = 1) -> None:
    ctx.counters.add(name, n)
    buffers.counts.add(name, n)


def block_specs(ctx: KvContext, ref: BlockRef) -> dict:
    """A block's tensor specs, from the RAM tier when it holds the block, else from its file's header."""
    cached = ctx.ram_tier.get(ref.key)
    return restore_buffers.specs_of(cached) if isinstance(cached, dict) else ctx.store.block_specs(ref)


class PrefixGone(Exception):
    """A wake's prefix still coming came short (or not at all): the wake reads every block instead."""


def _restore(ctx: KvContext, record: SnapshotRecord, mlx: Mlx, prefix: tuple[list, int] | None,
             counts: dict[str, int], phases: dict[str, float], pages: PagePool | None = None) -> list:
    """The snapshot's cache; `counts` gets where its blocks came from (blocks_ram, blocks_disk, blocks_shared),
    `phases` the milliseconds each step of it took, waits for the engine thread included (the wake's log and
    the turns' trace carry them: where a restart's wakes go)."""
    clock = _Clock(phases)
    n = len(record.token_ids)
    n_full, rest = divmod(n, ctx.block_tokens)
    sample, tokens = _sample(ctx, record, rest, mlx)
    if sample is None:
        tail = ctx.store.read_tail(record)
        return mlx(lambda: restore_buffers.finish_empty(ctx.model, n, tail, ctx.block_tokens))
    # blocks adopted, not read: from a cache given, or from one still coming (`coming`: the wake's docstring)
    coming = prefix[0] if prefix is not None and hasattr(prefix[0], "result") else None
    shared = prefix[1] // ctx.block_tokens if prefix is not None else 0
    # staging for the blocks it reads: a ring of a few slots; one for a wake waiting for a leader, so that the
    # leader, whom every waiter waits for, finds the kept slots idle (docs/decisions.md, "A waiting wake ...")
    # (with `pages`, straight into them, unless quantized after: kv/page_restore.py)
    pages = pages if ctx.kv_bits is None else None
    buffers = mlx(lambda: page_restore.make(pages, ctx.model, sample, tokens, n, ctx.block_tokens,
                                            list(record.token_ids), ctx.bundle.hash, tail_tokens=rest,
                                            mode=ctx.restore_mode, n_blocks=len(record.blocks) - shared,
                                            ring_slots=1 if coming is not None else None))
    clock.lap("buffers")
    with releasing(buffers, mlx):
        # a wake waiting for a leader reads its own blocks after the leader's reads (Pool.batch's `yields`)
        batch, tail_box, paged = ctx.pool.batch(yields=coming is not None), [], None
        try:
            if record.tail is not None:  # first: it decodes beside the first blocks, not after the last span
                batch.reserve(record.tail.raw_bytes)
                place = buffers.place(n_full * ctx.block_tokens, rest)
                batch.submit(record.tail.raw_bytes,
                             lambda: tail_box.append(ctx.store.read_tail(record, place, buffers.stage(None))))
            if coming is not None:
                buffers.expect_prefix(shared)
            elif prefix is not None:  # its first blocks from a cache holding them (wake's docstring)
                paged = _take_given(ctx, buffers, prefix, mlx)
                clock.lap("prefix")
            fill_spans(ctx, buffers, list(record.blocks), mlx, batch, record, first=shared)
        finally:
            batch.join()
        batch.raise_first()
        clock.lap("blocks")
        phases["joins"] = round(buffers.join_s * 1000, 2)  # of `blocks`, the device's joins (engine thread)
        phases["joins_eval"] = round(buffers.join_eval_s * 1000, 2)  # of those, waiting for the device
        if coming is not None:
            paged = _take_coming(ctx, buffers, coming, shared, mlx)
            clock.lap("prefix")
        tail = dict(tail_box[0]) if tail_box else {}
        if rest:
            buffers.check(buffers.take(tail), n_full * ctx.block_tokens, rest, "tail", staged=-1 in buffers.staged)
        while not mlx(lambda: buffers.upload(n, restore_buffers.UPLOAD_JOB_S)):  # a decoding neighbour waits a slice
            pass
        clock.lap("upload")
        counts.update(buffers.counts)
        # the rows left for the mapped pages (`paged`): the rest go after them, into pages
        cache = mlx(lambda: page_restore.finish(buffers, n, tail, paged, list(record.token_ids), ctx.bundle.hash))
        clock.lap("finish")
        return cache


def _sample(ctx: KvContext, record: SnapshotRecord, rest: int, mlx: Mlx) -> tuple[dict | None, int]:
    """(Specs of the tensors a restore's buffers are made for, the tokens they cover): a block's, or the tail's
    when the snapshot has no full block; (None, 0) when there is no cut KV to restore (the tail alone)."""
    if record.blocks:
        return block_specs(ctx, record.blocks[0]), ctx.block_tokens
    sample = ctx.store.tail_specs(record) if record.tail else {}
    if not (rest and restore_buffers.has_cut_kv(mlx(ctx.make_blank), sample)):
        return None, 0
    return sample, rest


def _take_given(ctx: KvContext, buffers: restore_buffers.Buffers, prefix: tuple[list, int],
                mlx: Mlx) -> list | None:
    """A wake's first blocks from a cache holding them (the wake's docstring), before its own are read;
    returns the prefix when it is paged (`_take`)."""
    paged = mlx(lambda: _take(buffers, *prefix))
    _count(ctx, buffers, "blocks_shared", prefix[1] // ctx.block_tokens)
    return paged


def _take(buffers: restore_buffers.Buffers, cache: list, tokens: int) -> list | None:
    """Engine thread: a prefix's first `tokens` into a restore. A paged cache's pages are not copied: the
    restore leaves their rows, and the cache, kept to those tokens, is returned (the restored tokens after
    them go into its pages: kv/paged_wake.py); a plain cache's are copied (None returned)."""
    if paged_cache.is_paged(cache):
        buffers.leave_prefix(tokens)
        return paged_wake.cut(cache, tokens)
    buffers.take_prefix(cache, tokens)
    return None


def _take_coming(ctx: KvContext, buffers: restore_buffers.Buffers, coming: Any, blocks: int,
                 mlx: Mlx) -> list | None:
    """A wake's first `blocks` from a prefix still coming (the wake's docstring), once its own blocks are in:
    its staging given back first (a waiting wake holds no ring slot another wake could use), then the
    leader's cache when it lands. Raises PrefixGone when it comes short or not at all."""
    mlx(buffers.drop_ring)
    tokens_wanted = blocks * ctx.block_tokens
    try:
        cache, tokens = coming.result(PREFIX_WAIT_S)
    except Exception as exc:  # noqa: BLE001 - the leader's copy failed, or it never landed
        raise PrefixGone(f"the wake in flight gave nothing: {exc!r}") from exc
    if cache is None or tokens < tokens_wanted:
        raise PrefixGone(f"the wake in flight gave {tokens} of the {tokens_wanted} tokens waited for")
    paged = mlx(lambda: _take(buffers, cache, tokens_wanted))
    _count(ctx, buffers, "blocks_shared", blocks)
    return paged


class _Clock:
    """Laps of a restore into `phases` (ms, summed by name)."""

    def __init__(self, phases: dict[str, float]) -> None:
        self.phases, self.last = phases, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(self.phases.get(name, 0.0) + (now - self.last) * 1000, 2)
        self.last = now


@contextlib.contextmanager
def releasing(buffers: restore_buffers.Buffers, mlx: Mlx) -> Iterator[restore_buffers.Buffers]:
    """A restore's buffers, released on the engine thread however the restore ends: by `finish`, or here when
    it is given up (a damaged block failing a wake, a prefix hit with nothing usable). Left to die on the
    caller's thread, their staging ring and joined spans would go back to MLX off the engine thread."""
    try:
        yield buffers
    finally:
        if not buffers.released:
            mlx(buffers.release)


def fill_spans(ctx: KvContext, buffers: restore_buffers.Buffers, refs: list[BlockRef], mlx: Mlx, batch: Batch,
               record: SnapshotRecord | None = None, shorten: bool = False, first: int = 0) -> int:
    """Blocks first .. len(refs)-1 of a restore into place (those before `first` were taken from another
    cache: Buffers.take_prefix): decoded a span at a time on the pool while the engine thread moves earlier
    spans to the device. Returns how many blocks are in place, unbroken from 0.

    Up to `buffers.slots` spans are decoding at once (the staging ring's slots; on unified memory
    all of them: the decoders write the final buffers, there is nothing to move). Span k is joined
    (`join_span`) as soon as its blocks are in place, and its slot then takes span k + slots:
    decoding and the host-to-device move overlap, and staging stays a few spans whatever the size.

    A wake (`shorten` False): the first failure stops the batch (its caller's `raise_first` raises it).
    A prefix hit (`shorten`): a block that cannot be read or does not verify is logged and ends the
    restore there (the hit shortens; its tokens are prefilled). Blocks not staged (direct mode, no ring)
    are kept in the RAM tier when `shorten`: shared prompts are what it is for.

    Reads are single-flight across restores that decode into host views (ram_tier.py; not staged ones):
    this restore says which blocks it needs for as long as it runs, a block another running restore needs
    too is read once and landed in the RAM tier for it, and one that restore is reading now is waited
    for, not read again.
    """
    # Staged (a GPU's ring): not shared. A shared block decoded into host views and uploaded from them took
    # longer than each restore staging its own copy on the device (docs/benchmarks.md, "fleet").
    with ctx.ram_tier.wanting([] if buffers.ring is not None else [ref.key for ref in refs[first:]]) as wants:
        return _fill_spans(ctx, buffers, refs, mlx, batch, record, shorten, wants, first)


def _fill_spans(ctx: KvContext, buffers: restore_buffers.Buffers, refs: list[BlockRef], mlx: Mlx, batch: Batch,
                record: SnapshotRecord | None, shorten: bool, wants: Wants, first: int) -> int:
    spans = buffers.spans(len(refs), first)
    pending: dict[int, list[cf.Future]] = {}
    keep_in_ram = shorten and buffers.ring is None

    def one(k: int, ref: BlockRef) -> bool:
        try:
            fill_block(ctx, buffers, ref, k, record, keep_in_ram)
        except CorruptBlockError as exc:
            if not shorten:
                raise
            ctx.log_unusable(exc)
            return False
        finally:
            wants.done(ref.key)
        return True

    def submit(s: int) -> None:
        start, count = spans[s]
        pending[s] = []
        for k in range(start, start + count):
            ref = refs[k]
            batch.reserve(ref.raw_bytes)
            if batch.failed:
                batch.release(ref.raw_bytes)
                return
            pending[s].append(batch.submit(ref.raw_bytes, one, k, ref))

    for s in range(min(buffers.slots, len(spans))):
        submit(s)
    for s, (start, count) in enumerate(spans):
        futures = pending.pop(s, [])
        cf.wait(futures)
        if batch.failed:
            return start
        good = next((i for i, f in enumerate(futures) if not f.result()), count)
        if good:
            mlx(lambda start=start, good=good: buffers.join_span(start, good))
        if good < count:
            return start + good
        if s + buffers.slots < len(spans):
            submit(s + buffers.slots)
    return len(refs)


def _wake_cache(ctx: KvContext, session_id: str, record: SnapshotRecord, mlx: Mlx,
                prefix: tuple[list, int] | None, counts: dict[str, int], phases: dict[str, float],
                pages: PagePool | None) -> list | None:
    """The snapshot's cache (None: it holds no tokens), for `wake`, under its store read."""
    ctx.store.touch([b.key for b in record.blocks])
    try:
        return _restore(ctx, record, mlx, prefix, counts, phases, pages) if record.token_ids else None
    except PrefixGone as gone:  # the leader failed or gave less: every block read here after all
        log.info("the wake in flight gave no prefix: reading every block", extra={"session": session_id,
                                                                                 "why": str(gone)})
        phases.clear()
        return _restore(ctx, record, mlx, None, counts, phases, pages)


def wake(ctx: KvContext, session_id: str, snapshot_id: str | None, mlx: Mlx,
         record: SnapshotRecord | None = None, prefix: tuple[list, int] | None = None,
         pages: PagePool | None = None) -> tuple[Session, dict[str, Any]]:
    """Restore a session from its latest (or a given) snapshot, exactly; the cache is evaluated on return.
    `record`: the snapshot's record as `ctx.record` verified it (its bundle checked), read by the caller.
    `prefix`: (a plain cache, tokens): another session's cache whose first `tokens` (whole blocks, at most the
    snapshot's) are this snapshot's first blocks, the same chain keys (a session woken beside it, or hot):
    those blocks are copied from it on the device, not read (Buffers.take_prefix). In place of the cache, a
    prefix still coming (a `result(timeout_s)` giving (cache, tokens): a wake in flight, sessions/
    shared_prefill.Pending): the wake reads its own blocks meanwhile and takes the first ones once it comes
    (a restart's waiting wakes no longer wait to start); given less than `tokens`, it reads them all.
    `pages`: a page pool (`--tune paged_kv`) the blocks read are restored into (kv/page_restore.py).

    Raises NotFoundError, BundleMismatchError (naming the differences), CorruptBlockError, and
    InvalidParamsError for a snapshot of another session.
    """
    started, counts = time.perf_counter(), {"blocks_ram": 0, "blocks_disk": 0, "blocks_shared": 0}
    phases: dict[str, float] = {}
    with ctx.store.reading():  # gc cannot evict this snapshot's files while they are read
        if record is None:
            wanted = snapshot_id or ctx.store.latest_snapshot(session_id)
            try:
                record = ctx.record(wanted)
            except KvwakeError:  # refused (another model's bundle, gone): nothing holds its blocks for it any more
                ctx.ram_tier.woken(wanted)
                raise
        if record.session_id != session_id:  # refused before its blocks read ahead are let go: not this wake's
            raise InvalidParamsError(f"snapshot {record.id} belongs to session {record.session_id}, not "
                                     f"{session_id}; use fork", session_id=session_id, snapshot_id=record.id)
        try:
            cache = _wake_cache(ctx, session_id, record, mlx, prefix, counts, phases, pages)
        finally:  # the blocks read ahead for this snapshot are not held for it any more (kv/hot_set.py)
            ctx.ram_tier.woken(record.id)
    session = Session.from_state(record.session_id, list(record.token_ids), record.metadata, record.id,
                                 ctx.vocab_size)
    if cache is not None and ctx.kv_bits is not None:
        cache = mlx(lambda: ctx.quantize(cache))
    session.cache = cache
    session.restored = len(record.blocks) * ctx.block_tokens if cache is not None and ctx.kv_bits is None else 0
    return session, {"snapshot_id": record.id, "tokens": len(session.tokens),
                     "blocks_from_memory": counts["blocks_ram"], "blocks_from_disk": counts["blocks_disk"],
                     "blocks_shared": counts["blocks_shared"],
                     "raw_bytes": record.raw_bytes, "ms": round((time.perf_counter() - started) * 1000, 3),
                     "phases_ms": phases}
