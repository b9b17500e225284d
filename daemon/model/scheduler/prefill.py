"""Prefill scheduling: where each session's next chunk ends, which attention path it takes, which chunks
pack into one forward pass, and how a chunk is sliced beside decoding calls.

The engine's append protocol asks this for a session's next chunk (`chunk`), or for several sessions' at
once (`queue_chunks`, the `Packed` job of turns that came together); what a chunk computes is
`slices.Chunk`, stepped one slice of layers per engine job while calls decode. The choices and why:

- Chunks end on multiples of the prefill step (`chunk_end`), so a full chunk's key length recurs and MLX on
  CUDA builds one attention graph per (step, multiple). The step is 2048 tokens on CUDA, 512 elsewhere
  (`default_step`).
- A short chunk (a turn's input, a hit's remainder) takes the plain attention ops when those cost less than
  a new fused graph at its key length (`attention.PathCosts`, measured at warm-up; until then plain below
  kv/capacity.py's CUDNN_MIN keys, and past it where no shape is shared), or runs fused at a shared
  query bucket over the whole buffer (`attention.bucketed_attention`) so turns within one capacity share one
  graph. A full chunk whose fused graph is new runs plain beside decoding `PLAIN_BEFORE_BUILD` times, then is
  built: a build inside a slice is a gap in every decoding neighbour's stream.
- Short chunks of several sessions that come at once pack into one forward pass (`pack_groups`, padding
  bounded) where calls batch: one pass instead of one per turn.
- While calls decode, a chunk is computed a slice of layers per job, each about `slice_of_step` decode steps
  (slices.py); a pack's slice is shared by the sessions on each side (N turns beside D calls: N / D steps).

docs/decisions.md ("Engine", "Many agents at once (issue 24)") holds the measurements behind these.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from kvwake.daemon.jobs import Mlx, Packed, outcome
from kvwake.daemon.kv import capacity as kvcapacity
from kvwake.daemon.kv.context import Counters
from kvwake.daemon.kv.paged_cache import PagedKVCache
from kvwake.daemon.model import attention, packing
from kvwake.daemon.model.decoder import Decoder
from kvwake.daemon.model.parallel_rows import ParallelRows
from kvwake.daemon.model.scheduler import slices
from kvwake.daemon.session_state import Session

__all__ = ["CUDA_STEP", "STEP", "PrefillPlanner", "default_step", "pack_groups"]

log = logging.getLogger("kvwake.engine")
T = TypeVar("T")

BUCKET_AHEAD_AFTER = 4096  # a prefill this long ends by building the next turn's likeliest buckets (build_ahead)
BUCKETS_AHEAD = 2  # this many of them (the 128 and 192 query buckets: turns of 65-192 tokens)
PACK_MIN = 2  # turns whose short chunks come at once prefill in one forward pass from this many
PACK_PADDING = 2.0  # a pack computes at most this many times its rows' tokens (right-padded to the longest)
PLAIN_BEFORE_BUILD = 2  # a full chunk's new fused shape runs plain beside decoding this often, then is built


STEP = 512  # tokens per full chunk on the CPU and Metal
CUDA_STEP = 2048  # on CUDA: a long prompt builds a quarter of the attention graphs, each pass over more tokens


def _unmeasured_plain(keys: int, shared: bool) -> bool:
    """Whether a short chunk over `keys` keys runs plain ops while the attention paths' costs are not measured:
    below kv/capacity.py's CUDNN_MIN, where a fused shape rarely recurs (each build a stall) and plain ops over
    few keys cost little; from there on unless the chunk has a shape its next turns share (`shared`: a bucket
    over the buffer, a paged turn's padding), built once, where plain ops grow with the keys every turn
    (docs/decisions.md, "Before the costs are measured, plain attention below CUDNN_MIN keys only"). A chunk
    with no shared shape (a sliding-window model's, a paged turn whose mask would be too large) would build its
    own graph every turn: plain, as before."""
    return keys < kvcapacity.CUDNN_MIN or not shared


def default_step() -> int:
    """Tokens per full prefill chunk where the settings name none. On CUDA a fresh process builds a cuDNN graph
    for each new (chunk, key length) pair, and over a long prompt a 512-token chunk costs little more than its
    graph: longer chunks build fewer graphs and make fewer passes (docs/benchmarks.md, "fleet"). Beside
    decoding calls a chunk is sliced by layers all the same. Fixed per process, so a prompt's KV never depends
    on what else ran at the time."""
    return CUDA_STEP if attention.on_cuda() else STEP


class PrefillPlanner:
    """The prefill policy of one loaded model: chunk ends, attention paths, packs and slices.

    model: the MLX model the chunks run through. decoder: whose calls a sliced chunk makes room for.
    prefill_step: tokens per full chunk. plain_prefill, bucket_prefill: the CUDA attention paths
    (model/attention.py). pack_prefill: several sessions' chunks in one pass. slice_of_step: a slice's
    target, in decode steps. gather_s: how long the first chunks of turns that come at once wait, while
    nothing decodes, for the turns still on their way (the engine thread's scheduler holds them). first_s:
    where turns go one at a time, how long at most their prefill goes before other calls' decode steps.
    one_at_a_time: turns go one at a time, each to its first token (the scheduler's TurnOrder): where a pass
    costs its tokens (packing.wanted false), not merely where a model cannot pack. `paths` is
    set by the warm-up once the attention paths' costs are measured; `idle` and `later` by the engine thread
    (None in process: shapes are built when first met).
    """

    def __init__(self, model: Any, decoder: Decoder, counters: Counters, *, prefill_step: int,
                 plain_prefill: bool, bucket_prefill: bool, pack_prefill: bool, slice_of_step: float = 1.0,
                 gather_s: float = 0.0, first_s: float = 0.0, one_at_a_time: bool = False,
                 parallel: ParallelRows | None = None, padded_prefill: bool = True) -> None:
        self.model, self.decoder, self.counters, self.prefill_step = model, decoder, counters, prefill_step
        self.plain_prefill, self.bucket_prefill, self.pack_prefill = plain_prefill, bucket_prefill, pack_prefill
        self.slice_of_step, self.gather_s, self.first_s = slice_of_step, gather_s, first_s
        self.one_at_a_time = one_at_a_time and not pack_prefill
        # where a pass costs its tokens (the CPU), a pack's rows each on a thread of its own, not one pass
        # (model/parallel_rows.py); None: one pass (model/packing.py)
        self.parallel = parallel
        self.padded_prefill = padded_prefill  # a turn's longer chunk at a shared padded shape (`_padded`)
        self.slice_prefill = True  # off: whole chunks beside decoding too (the prefill_slices bench compares)
        # (session, upto) -> where a chunk must end before upto, or None: a restore point's block boundary
        # (kv/points.py; set by the engine for a model that takes them)
        self.stop_at: Callable[[Session, int], int | None] | None = None
        self.slicer = slices.Slicer()
        self.paths: attention.PathCosts | None = None
        # Runs a job on the engine thread when nothing else waits: the next turns' shared shapes built ahead.
        self.idle: Callable[[Callable[[], Any]], None] | None = None
        # Queues a job from a job on the engine thread (a chunk's end lets what waited on it run).
        self.later: Callable[[Callable[[], Any]], Future] | None = None
        self._bucket_warming: set[tuple[Any, ...]] = set()
        # chunks' shapes run fused: attention.fused_shape, ("bucket", *attention.bucket_shape) or
        # ("padded", *attention.padded_shape)
        self._fused_shapes: set[tuple[Any, ...]] = set()
        self._plain_shapes: dict[tuple[Any, ...], int] = {}  # new ones run plain beside decoding, how often

    def next_chunks(self, jobs: list[Packed]) -> list[Any]:
        """The next `chunk` of every prefill queued at once (a Packed job each), in one job."""
        if len(jobs) == 1 or not self.pack_prefill:
            return [outcome(lambda job=job: self.chunk(*job.args)) for job in jobs]
        return self.queue_chunks([job.args for job in jobs])

    def queue_chunks(self, rows: list[tuple[Session, int]]) -> list[Any]:
        """Each session's next chunk towards its `upto`: those of plain KV layers in packs (`pack_groups`:
        PACK_MIN or more, padding bounded), one forward pass each (model/packing.py), the others alone. An
        item is the chunk (shared by a pack's sessions) or the exception queuing it raised."""
        out: list[Any] = [None] * len(rows)
        # a paged session's turn packs too (each row's layer writes its own pages), and a ring's (packing.row_mask)
        packable = (KVCache, PagedKVCache, RotatingKVCache)
        packs = pack_groups([(i, self.end_of(session, upto) - session.processed)
                             for i, (session, upto) in enumerate(rows)
                             if session.cache is not None and all(type(c) in packable for c in session.cache)])
        packed = {i for pack in packs for i in pack}
        for i, (session, upto) in enumerate(rows):
            if i not in packed:
                out[i] = outcome(lambda: self.chunk(session, upto))
        for pack in packs:
            chunk = outcome(lambda: self._pack_chunk([rows[i] for i in pack]))
            for i in pack:
                out[i] = chunk
        return out

    def _pack_chunk(self, rows: list[tuple[Session, int]]) -> slices.Chunk:
        """Queue one forward pass feeding each session of `rows` (session, upto) its next chunk (`end_of`),
        each row's attention on the path its chunk alone would take; computed all at once when nobody
        decodes, else a slice of layers per step (a Chunk of several sessions)."""
        sliced = self.slice_prefill and self.decoder.active
        ends = [(session, self.end_of(session, upto), upto) for session, upto in rows]
        # Rows at two or more shapes no graph was built for: each would build its own (docs/benchmarks.md,
        # "fleet": the 4-bit restart's pack), so those rows run at padded shapes they share. A pack of one
        # shape (agents alike) builds one graph as it is, and a lone turn keeps its own shape: neither was
        # measured to gain from the padding's copy and its masked kernel.
        exact = [attention.fused_shape(session.cache, end - session.processed) for session, end, _ in ends]
        new = [shape is not None and shape not in self._fused_shapes for shape in exact]
        pad = len({shape for shape, fresh in zip(exact, new) if fresh}) > 1
        paths = [self._path(session, end - session.processed, end, sliced, pad=pad and fresh)[1] or _fused
                 for (session, end, _), fresh in zip(ends, new)]
        # Apart on threads when nothing decodes (beside decoding calls the pack goes in slices of layers) and every
        # row runs MLX's own attention (the CUDA paths swap the model module's: one model, one swap at a time)
        # and no row's layers share a pool (paged KV: its pages' allocation is one thread's)
        apart = self.parallel is not None and not sliced and all(path is _fused for path in paths) and \
            not any(isinstance(c, PagedKVCache) for session, _, _ in ends for c in session.cache)
        try:
            if apart:
                self.parallel.run(self.model, [(session.tokens[session.processed : end], session.cache)
                                               for session, end, _ in ends])
            else:
                packing.forward(self.model, [(session.tokens[session.processed : end], session.cache)
                                             for session, end, _ in ends], paths)
        except BaseException:  # caches part-fed (their offsets moved layer by layer): rebuilt from tokens on next use
            for session, _, _ in ends:
                session.cache, session.processed = None, 0
            raise
        for session, end, upto in ends:
            if end == upto:  # its prefill's last chunk: the next turn's shapes, once the engine is idle
                self._warm_buckets(session, end - session.processed)
        longest = max(end - session.processed for session, end, _ in ends)
        (first, end, _), more = ends[0], [(session, end) for session, end, _ in ends[1:]]
        # A slice's time is shared by the sessions on each side: N turns waiting beside D decoding calls take
        # slices of N / D steps (at least one). One step each, many turns packed beside one talker waited a
        # step between every slice, so their first tokens came late (docs/decisions.md, "Many agents at
        # once (issue 24)").
        share = max(1.0, len(rows) / max(1, self.decoder.running))
        chunk = slices.Chunk(first, end, self.slicer,
                                    self.decoder.step_s * self.slice_of_step * share if sliced else None,
                                    kind=slices.kind("apart" if apart else "packed",
                                                     max(end for _, end, _ in ends)),
                                    more=more, padded=len(rows) * longest, later=self.later)
        self.counters.add("prefill_packs", 1)
        self.counters.add("prefill_packed_chunks", len(rows))
        if not sliced:
            chunk.step()
        return chunk


    def chunk_end(self, processed: int, upto: int) -> int:
        """Where the prefill chunk from `processed` ends: at the next multiple of the prefill step (or `upto`).

        Aligned, every full chunk's key length is a multiple of the step whatever the turn or prefix hit
        before it, so MLX on CUDA builds one cuDNN graph per (step, multiple), not one per chunk (each build
        a stall of its own); the short chunk that reaches the boundary is a turn's input or a hit's remainder.
        """
        step = self.prefill_step
        return min(upto, (processed // step + 1) * step)

    def end_of(self, session: Session, upto: int) -> int:
        """Where the session's next prefill chunk ends: `chunk_end`, or `upto` for a turn's input that runs at
        one query bucket (no boundary to keep: its graph is the bucket's); before either, a restore point's
        boundary (`stop_at`)."""
        end = self.chunk_end(session.processed, upto)
        if end < upto and (self._bucketed(session.cache, upto - session.processed)
                           or self._paged_turn(session.cache, upto - session.processed)):
            end = upto
        stop = self.stop_at(session, upto) if self.stop_at is not None else None
        return end if stop is None else min(end, stop)

    def chunk(self, session: Session, upto: int) -> slices.Chunk:
        """Queue the next chunk's forward pass and compute all of it, or, while other calls decode, nothing
        yet (the `Chunk` computes it a slice of layers per `step`, one per engine job)."""
        if session.cache is None:  # dropped under it (a failed pass of a pack it was in): nothing to feed
            raise RuntimeError(f"session {session.id}: its cache was dropped before its chunk to {upto}")
        end = self.end_of(session, upto)
        sliced = self.slice_prefill and self.decoder.active  # a decoding neighbour waits one slice, not the chunk
        n = end - session.processed
        path, make = self._path(session, n, end, sliced)
        with attention.swapped(self.model, make) if make else contextlib.nullcontext():
            self.model(mx.array(session.tokens[session.processed : end], dtype=mx.uint32)[None], cache=session.cache)
        if end == upto:  # the prefill's last chunk: the next turn's shapes, once the engine is idle
            self._warm_buckets(session, n)
        chunk = slices.Chunk(session, end, self.slicer,
                                    self.decoder.step_s * self.slice_of_step if sliced else None,
                                    kind=slices.kind(path, end), later=self.later)
        if not sliced:  # all of it in this job; sliced, the graph's building (host-side Python) is a job of
            chunk.step()  # its own, and its slices the next ones
        return chunk

    def _path(self, session: Session, n: int, end: int, sliced: bool,
              pad: bool = False) -> tuple[str, Callable[[Any], Any] | None]:
        """The attention path of a chunk of n tokens of the session's (to `end`): ("plain" | "bucket" |
        "padded" | "fused", what makes its attention from the model's fused one; None: the fused one itself).
        Records the shapes run fused, and those run plain beside decoding. `pad`: a turn's longer chunk may run
        at a padded shape (`_pack_chunk` says which)."""
        # A chunk shorter than the step (a turn's input, a prompt's last piece) has a key length nothing
        # computed before: plain attention spares it a cuDNN graph build, where plain ops cost less than
        # the build at this key length (measured: attention.PathCosts). Full chunks stay fused: their
        # shapes recur (aligned), and over a long context plain ops cost more than a cached graph
        # (docs/decisions.md, "Engine") -- unless a neighbour decodes and the graph would be new to
        # this process: its build (in the chunk's first slice) is a gap of many decode steps
        # (docs/decisions.md, "Many agents at once (issue 24)"); plain, the neighbour waits one slice
        # (the prefill itself takes longer). A shape that comes back (PLAIN_BEFORE_BUILD times plain) is
        # built then: its build pays for itself.
        # Past CUDNN_MIN such a chunk runs fused at its query bucket over the whole buffer: turns within
        # one capacity share its graph (attention.bucketed_attention), built once, not once per turn.
        # In a pack whose rows would each build a graph of their own, a turn's chunk of more queries than plain
        # ops take runs fused at a padded shape the rows share (attention.padded_attention, `_pack_chunk`).
        is_short = n < self.prefill_step and n <= attention.PLAIN_MAX_QUERIES
        bucket = self._bucketed(session.cache, n)
        padded = None if bucket else (self._padded(session.cache, n) if pad else None)
        # a paged turn past CUDNN_MIN pads alone as in a pack (where `_padded` takes only the longer turns)
        paged_turn = None if bucket or padded else self._paged_turn(session.cache, n)
        padded = padded or paged_turn
        shape = ("bucket", *bucket) if bucket else ("padded", *padded) if padded else \
            attention.fused_shape(session.cache, n) if self.plain_prefill else None
        new = shape is None or shape not in self._fused_shapes  # unknown (not a plain KVCache): counted new
        # costed at the shape the fused kernel runs it at: a bucket's, a paged turn's padded one; before the costs
        # are measured (the daemon's warm-up measures them in idle moments, which turns coming one after another
        # may not leave) by key length and shape (`_unmeasured_plain`)
        short = is_short and (self.paths.plain(n, end, new, bucket or paged_turn) if self.paths is not None
                              else _unmeasured_plain(end, bool(bucket or paged_turn)))
        new_beside = sliced and shape is not None and new and self._plain_shapes.get(shape, 0) < PLAIN_BEFORE_BUILD
        if new_beside:
            self._plain_shapes[shape] = self._plain_shapes.get(shape, 0) + 1
        plain = self.plain_prefill and (short or new_beside)
        if self.plain_prefill and not plain and shape is not None:
            self._fused_shapes.add(shape)  # the one record of shapes run fused (their graphs built)
        if plain:
            queries = max(n, attention.PLAIN_MAX_QUERIES)
            return "plain", lambda fused: attention.plain_attention(fused, queries)
        if bucket:
            return "bucket", attention.bucketed_attention
        return ("padded", attention.padded_attention) if padded else ("fused", None)

    def _padded(self, cache: list, n: int) -> tuple[int, int] | None:
        """The shared shape a turn's chunk of n tokens fed to `cache` would run on (attention.padded_shape): a
        chunk of more than PLAIN_MAX_QUERIES tokens and below the prefill step while bucketed and padded
        prefill are on; else None."""
        if not (self.padded_prefill and self.bucket_prefill and attention.PLAIN_MAX_QUERIES < n < self.prefill_step):
            return None
        return attention.padded_shape(cache, n)

    def _paged_turn(self, cache: list, n: int) -> tuple[int, int] | None:
        """The shared shape a lone turn's chunk of n tokens over a paged cache past CUDNN_MIN keys runs on
        (attention.padded_shape: its query bucket, its key bucket), what a KVCache's short chunk there gets from
        its buffer (`_bucketed`). A paged cache has no buffer: at its own shape, new every turn, each turn ran
        plain ops or built a graph (docs/decisions.md, "Paged KV in the fleet, again"). None otherwise."""
        c = cache[0] if cache else None
        if not (self.bucket_prefill and type(c) is PagedKVCache and 2 <= n < self.prefill_step
                and (n <= attention.PLAIN_MAX_QUERIES or self.padded_prefill) and c.offset + n >= kvcapacity.CUDNN_MIN):
            return None  # a longer turn pads as a KVCache's does: while padded prefill is on
        return attention.padded_shape(cache, n)

    def _bucketed(self, cache: list, n: int) -> tuple[int, int] | None:
        """The shared shape a chunk of n tokens fed to `cache` would run on (attention.bucket_shape), for a
        short chunk (2 tokens to below the prefill step and PLAIN_MAX_QUERIES: one query takes the decode
        kernel) while bucketed prefill is on; else None."""
        if not (self.bucket_prefill and 2 <= n < self.prefill_step and n <= attention.PLAIN_MAX_QUERIES):
            return None
        return attention.bucket_shape(cache, n)

    def _turn_shapes(self, cache: list, n: int) -> list[tuple[Any, ...]]:
        """The shapes a next turn's chunk over `cache` once fed n more tokens runs on, likeliest first: over a
        KVCache ("bucket", every query bucket, the capacity it then has), over a paged cache ("padded", the
        query bucket, the key bucket of its keys with that many queries: `_paged_turn`); none where no later
        turn would share those graphs: bucketed prefill off, neither cache past CUDNN_MIN, or a buffer off the
        capacity grid (a batch's or a copy's, trimmed; its next growth puts it back on the grid)."""
        buckets = attention.query_buckets(min(attention.PLAIN_MAX_QUERIES, self.prefill_step - 1))
        c = cache[0] if cache else None
        if type(c) is PagedKVCache:
            if not (self.bucket_prefill and c.offset + n >= kvcapacity.CUDNN_MIN):
                return []
            size = c.session.pool.layout.dtype.size
            return [("padded", b, attention.key_bucket(c.offset + n + b)) for b in buckets
                    if b * attention.key_bucket(c.offset + n + b) * size <= attention.PADDED_MASK_BYTES]
        if not self.bucket_prefill or not cache or attention.bucket_shape(cache, max(n, 1)) is None:
            return []
        capacity = kvcapacity.grown(c, n)
        if kvcapacity.capacity(capacity) != capacity:
            return []
        return [("bucket", bucket, capacity) for bucket in buckets]

    def _warm_buckets(self, session: Session, n: int) -> None:
        """The shared shapes of the next turns over the session's cache once fed n more tokens, built as
        idle jobs: when nothing else waits. Built ones and queued ones are skipped; so is one whose
        session holds another capacity by its turn (grown, or gone)."""
        for shape in self._turn_shapes(session.cache, n) if self.idle is not None else ():
            if shape not in self._fused_shapes and shape not in self._bucket_warming:
                self._bucket_warming.add(shape)
                self.idle(lambda shape=shape, ref=weakref.ref(session): self._warm_bucket(shape, ref))

    def build_ahead(self, session: Session, prefilled: int, mlx: Mlx) -> None:
        """After a prefill of `prefilled` tokens: when it was long (BUCKET_AHEAD_AFTER) and nobody decodes, the
        likeliest turns' shared shapes at the cache's capacity (BUCKETS_AHEAD of them) built now, one job each
        (a graph build is small beside a prefill of seconds), not by the next turn: a client that sends it at
        once leaves no idle time to build it in, and that turn's first token would pay for the build
        (docs/decisions.md, "Many agents at once (issue 24)"). Beside a decoding call (a gap) the idle jobs build
        them."""
        if prefilled < BUCKET_AHEAD_AFTER:
            return
        for shape in self._turn_shapes(session.cache, 0)[:BUCKETS_AHEAD]:
            if shape not in self._fused_shapes:
                mlx(lambda shape=shape: self.decoder.active or self._warm_bucket(shape, weakref.ref(session)))

    def _warm_bucket(self, shape: tuple[Any, ...], session: weakref.ref) -> None:
        """Build `shape`'s graph (attention.warm_bucket) for the session's buffer if it still has that
        capacity. Only speed is at stake: a failure is logged, never raised."""
        self._bucket_warming.discard(shape)
        s = session()
        layer = s.cache[0] if s is not None and s.cache else None
        if shape[0] == "padded":  # a paged cache's: the graph its padded turn runs (`_bucketed` at those lengths)
            if shape in self._fused_shapes or type(layer) is not PagedKVCache:
                return  # built meanwhile, or its session's cache is gone
            layout = layer.session.pool.layout
            like = mx.zeros((1, layout.kv_heads, 1, layout.head_dim), layout.dtype)
        elif shape in self._fused_shapes or type(layer) is not KVCache or layer.keys is None or \
                layer.keys.shape[2] != shape[2]:
            return  # built meanwhile, or its session's cache is gone or holds another capacity now
        else:
            like = layer.keys
        try:
            if attention.warm_bucket(self.model, shape[1], shape[2], like=like):
                self._fused_shapes.add(shape)
        except Exception as exc:  # noqa: BLE001
            log.warning("building a turn's attention graph ahead failed",
                        extra={"session": s.id, "shape": list(shape[1:]), "error": repr(exc)})

    # -- generation -----------------------------------------------------------


def pack_groups(rows: list[tuple[T, int]]) -> list[list[T]]:
    """Rows (each with its number of new tokens) in packs of PACK_MIN or more whose padding (every row as
    long as the pack's longest) at most doubles the tokens computed; a row that fits no pack is left out
    (it prefills alone). Shortest first, each pack takes the next (longer) rows while they fit."""
    packs: list[list[tuple[T, int]]] = []
    for row in sorted(rows, key=lambda r: r[1]):
        pack = packs[-1] if packs else None
        if pack is not None and (len(pack) + 1) * row[1] <= PACK_PADDING * (sum(n for _, n in pack) + row[1]):
            pack.append(row)
        else:
            packs.append([row])
    return [[r for r, _ in pack] for pack in packs if len(pack) >= PACK_MIN]


def _fused(fused: Any) -> Any:
    """A packed row's attention on the fused path: the model's own."""
    return fused
