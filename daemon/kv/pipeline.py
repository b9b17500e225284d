"""Sleep and wake: the one pipeline the in-process engine and the daemon both run.

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
one read from the page cache into a per-thread buffer, then one write per
byte into the final KV buffer (planes are joined there); on CUDA the planes
are staged in MLX host-visible memory and joined on the GPU (kvfill.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx

from kvwake.daemon.kv import fill as kvfill, state as kvstate
from kvwake.daemon.session import Session
from kvwake.errors import InvalidParamsError
from kvwake.store import BlockRef, SnapshotRecord, SnapshotWriter

if TYPE_CHECKING:
    from kvwake.daemon.model.engine import Engine

__all__ = ["Batch", "Pool", "block_specs", "direct", "fill_block", "sleep", "wake", "write_prefix"]

T = TypeVar("T")
Mlx = Callable[[Callable[[], Any]], Any]
SPAN_SHARE = 4  # a sleep stages at most 1/SPAN_SHARE of the byte budget per engine-thread call
# A sleep keeps at most 1/SLEEP_SHARE of the session's KV in flight: a block in flight holds its
# host copy (GPU) and its encoded bytes, about 1.7x its raw size, so RSS grows by about a fifth of
# the KV at most (the bound is a quarter).
SLEEP_SHARE = 8


def direct(fn: Callable[[], T]) -> T:
    """The `mlx` runner for a caller that is itself the engine thread."""
    return fn()


class Pool:
    """Worker threads for codec and disk work, and the byte budget each batch gets.

    workers: threads (default: every core). inflight_bytes: raw bytes a batch
    may have read, decoded or staged but not yet finished.
    """

    def __init__(self, workers: int | None = None, inflight_bytes: int = 512 << 20) -> None:
        self.workers = workers or os.cpu_count() or 1
        self.inflight_bytes = inflight_bytes
        self._executor = cf.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="kvwake-io")

    def batch(self, budget: int | None = None) -> Batch:
        """A batch bounded by `budget` bytes in flight (at most the pool's inflight_bytes)."""
        return Batch(self._executor, min(budget or self.inflight_bytes, self.inflight_bytes))

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class Batch:
    """Tasks on the pool, admitted while their bytes fit the budget; the first failure stops the rest.

    `reserve(n)` waits until n more bytes fit (or nothing is in flight); each
    task submitted with `submit(n, ...)` gives its n reserved bytes back when
    it ends. `join()` waits for every task; `raise_first()` re-raises the first
    failure as itself.
    """

    def __init__(self, executor: cf.Executor, budget: int) -> None:
        self._executor, self.budget = executor, budget
        self._cond = threading.Condition()
        self._used = 0
        self._futures: list[cf.Future] = []
        self.error: BaseException | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def reserve(self, nbytes: int) -> None:
        with self._cond:
            while self._used and self._used + nbytes > self.budget and self.error is None:
                self._cond.wait()
            self._used += nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()

    def submit(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> cf.Future:
        """Run fn(*args) on the pool with `nbytes` already reserved (they are released when it ends)."""
        future = self._executor.submit(self._run, nbytes, fn, args)
        self._futures.append(future)
        return future

    def _run(self, nbytes: int, fn: Callable[..., Any], args: tuple) -> Any:
        try:
            if self.error is None:  # after a failure, tasks not yet started do nothing
                return fn(*args)
        except BaseException as exc:
            with self._cond:
                if self.error is None:
                    self.error = exc
            raise
        finally:
            self.release(nbytes)
        return None

    def join(self) -> None:
        cf.wait(self._futures)

    def raise_first(self) -> None:
        if self.error is not None:
            raise self.error


# -- sleep ---------------------------------------------------------------------


def _spans(needed: list[int], per_span: int) -> list[tuple[int, int]]:
    """(first, count) runs of consecutive block indices, at most per_span long."""
    spans: list[tuple[int, int]] = []
    for i in needed:
        if spans and spans[-1][0] + spans[-1][1] == i and spans[-1][1] < per_span:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        else:
            spans.append((i, 1))
    return spans


def _write_blocks(engine: Engine, w: SnapshotWriter, cache: list, mlx: Mlx, batch: Batch, held: list,
                  skip: int | None = None) -> None:
    """Capture the writer's needed blocks a span at a time (engine thread) and encode and write them (pool).

    On unified memory a span is all of it (views of the cache cost nothing); on a GPU a span's
    host copy is a quarter of the batch budget. Each block is admitted by the budget (its
    encoded bytes live until written). `held` keeps each span with its tasks; finished spans
    are dropped inside the next engine-thread call, the rest by the caller there too: MLX
    memory is freed on the thread that runs MLX.
    """
    block_bytes = max(1, engine.kv_bytes_per_token(cache) * engine.block_tokens)
    per_span = len(w.needed) if not engine.device_planes else max(1, batch.budget // SPAN_SHARE // block_bytes)

    def capture(first: int, count: int) -> list:
        held[:] = [(blocks, futures) for blocks, futures in held if not all(f.done() for f in futures)]
        return engine.capture_blocks(cache, first, count)

    for first, count in _spans([i for i in w.needed if i != skip], per_span):
        if batch.failed:
            return
        blocks = mlx(lambda first=first, count=count: capture(first, count))
        futures: list[cf.Future] = []
        held.append((blocks, futures))
        for k, arrays in enumerate(blocks):
            batch.reserve(block_bytes)
            if batch.failed:
                batch.release(block_bytes)
                return
            futures.append(batch.submit(block_bytes, w.add_block, first + k, arrays))


def _sleep_budget(engine: Engine, session: Session) -> int:
    """Bytes a sleep may have in flight: an eighth of the session's KV, at least one block."""
    per_token = engine.kv_bytes_per_token(session.cache) if session.cache is not None else 0
    return max(per_token * engine.block_tokens, per_token * session.processed // SLEEP_SHARE, 1)


def sleep(engine: Engine, session: Session, mlx: Mlx, *, label: str | None = None, free: bool = True) -> dict[str, Any]:
    """Write the session's KV as a snapshot (and free it unless `free` is False: a checkpoint).

    Until the commit succeeds the session stays hot; on failure every file
    this sleep wrote is removed and the error is raised as itself.
    """
    started = time.perf_counter()
    with engine.begin_sleep(session, label=label) as w:
        batch, held = engine.pool.batch(_sleep_budget(engine, session)), []
        try:
            if session.cache is not None:
                _write_blocks(engine, w, session.cache, mlx, batch, held)
                tail = mlx(lambda: engine.capture_tail(session))
                held.append(tail)
                if tail and not batch.failed:
                    batch.submit(0, w.set_tail, tail)
        finally:  # never leave a write running behind an aborting writer
            batch.join()
            mlx(held.clear)
        batch.raise_first()
        info = engine.finish_sleep(session, w, started)
    if free:
        mlx(lambda: _free(session))
    return info


def _free(session: Session) -> None:
    """Drop a slept session's KV and give MLX's cached buffers back: sleeping is for freeing memory.

    Without the clear, freed buffers stay in MLX's cache (up to 80% of the device's memory), and
    on a discrete GPU the host-side copies a sleep made stay pinned: a 32k-token 8B-shaped session
    slept and woken twice was killed for host memory on the 128 GiB H100 machine.
    """
    session.cache = None
    mx.clear_cache()


def write_prefix(engine: Engine, scratch: Session, mlx: Mlx) -> Any:
    """Store (and pin) every token of a prefilled scratch session's prompt; returns the commit's SnapshotInfo.

    The pending last token is prefilled too, and the last partial block is stored as a short
    block (a child of the last full one): a later request that starts with the whole prompt
    reuses all of it (store/prefix.py finds the short block as a partial piece).
    """
    engine.prefill(scratch, len(scratch.tokens), mlx)
    tokens = scratch.tokens[: scratch.processed]
    with engine.store.writer(None, engine.bundle.hash, tokens, pin=True, partial=True) as w:
        short = len(tokens) // engine.block_tokens if len(tokens) % engine.block_tokens else None
        batch, held = engine.pool.batch(_sleep_budget(engine, scratch)), []
        try:
            _write_blocks(engine, w, scratch.cache, mlx, batch, held, skip=short)
            if short in w.needed:
                arrays = mlx(lambda: kvstate.capture_span(scratch.cache, short * engine.block_tokens, len(tokens)))
                held.append(arrays)
                batch.reserve(0)
                batch.submit(0, w.add_block, short, arrays)
        finally:
            batch.join()
            mlx(held.clear)
        batch.raise_first()
        info = w.commit()
    mlx(lambda: setattr(scratch, "cache", None))
    return info


# -- wake ----------------------------------------------------------------------


def fill_block(engine: Engine, buffers: kvfill.Buffers, ref: BlockRef, k: int, record: SnapshotRecord | None,
          keep_hot: bool) -> None:
    """Block k into place: from the RAM tier when it holds it, else decoded from its file."""
    # A block holds block_tokens tokens, except the short last block prefix.warm stores.
    start, count, what = k * engine.block_tokens, len(ref.token_ids), f"block {k}"
    hot = engine.hot.get(ref.key)
    if hot is not None:
        buffers.put(start, count, hot, what)
        engine.count("blocks_ram", 1)
        return
    stage = None if keep_hot else buffers.stage(k)
    arrays = engine.store.read_block(ref, snapshot_id=record.id if record else None,
                                     session_id=record.session_id if record else None,
                                     place=buffers.place(start, count), stage=stage)
    buffers.check(arrays, start, count, what, staged=k in buffers.staged)
    engine.count("blocks_disk", 1)
    if keep_hot:
        engine.hot.put(ref.key, buffers.block(start, count))


def block_specs(engine: Engine, ref: BlockRef) -> dict:
    hot = engine.hot.get(ref.key)
    return kvfill.specs_of(hot) if hot is not None else engine.store.block_specs(ref)


def _restore(engine: Engine, record: SnapshotRecord, mlx: Mlx) -> list:
    n = len(record.token_ids)
    n_full, rest = divmod(n, engine.block_tokens)
    if record.blocks:
        sample, tokens = block_specs(engine, record.blocks[0]), engine.block_tokens
    else:
        sample, tokens = (engine.store.tail_specs(record) if record.tail else {}), rest
        if not (rest and kvfill.has_cut_kv(mlx(engine.make_blank), sample)):
            tail = engine.store.read_tail(record)
            return mlx(lambda: kvfill.finish_empty(engine.model, n, tail, engine.block_tokens))
    buffers = mlx(lambda: kvfill.Buffers(engine.model, sample, tokens, n, engine.block_tokens, tail_tokens=rest))
    batch, tail_box = engine.pool.batch(), []
    try:
        for k, ref in enumerate(record.blocks):
            batch.reserve(ref.raw_bytes)
            if batch.failed:
                batch.release(ref.raw_bytes)
                break
            batch.submit(ref.raw_bytes, fill_block, engine, buffers, ref, k, record, False)
        if record.tail is not None and not batch.failed:
            batch.reserve(record.tail.raw_bytes)
            place = buffers.place(n_full * engine.block_tokens, rest)
            batch.submit(record.tail.raw_bytes,
                         lambda: tail_box.append(engine.store.read_tail(record, place, buffers.stage(None))))
    finally:
        batch.join()
    batch.raise_first()
    tail = dict(tail_box[0]) if tail_box else {}
    if rest:
        buffers.check(buffers.take(tail), n_full * engine.block_tokens, rest, "tail", staged=-1 in buffers.staged)
    return mlx(lambda: buffers.finish(n, tail))


def wake(engine: Engine, session_id: str, snapshot_id: str | None, mlx: Mlx) -> tuple[Session, dict[str, Any]]:
    """Restore a session from its latest (or a given) snapshot, exactly; the cache is evaluated on return."""
    started = time.perf_counter()
    before = dict(engine.counters)
    with engine.store.reading():  # gc cannot evict this snapshot's files while they are read
        sid = snapshot_id or engine.store.latest_snapshot(session_id)
        record = engine.record(sid)
        if record.session_id != session_id:
            raise InvalidParamsError(f"snapshot {sid} belongs to session {record.session_id}, not {session_id}; "
                                     "use fork", session_id=session_id, snapshot_id=sid)
        engine.store.touch([b.key for b in record.blocks])
        cache = _restore(engine, record, mlx) if record.token_ids else None
    session = Session.from_state(record.session_id, list(record.token_ids), record.metadata, record.id,
                                 engine.vocab_size)
    if cache is not None and engine.kv_bits is not None:
        cache = mlx(lambda: engine.quantize(cache))
    session.cache = cache
    return session, {"snapshot_id": record.id, "tokens": len(session.tokens),
                     "blocks_from_memory": engine.counters["blocks_ram"] - before["blocks_ram"],
                     "blocks_from_disk": engine.counters["blocks_disk"] - before["blocks_disk"],
                     "raw_bytes": record.raw_bytes, "ms": round((time.perf_counter() - started) * 1000, 3)}
