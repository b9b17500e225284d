"""Restoring a prefix-cache hit: whole blocks, then the first k tokens of a partial piece.

The store finds the hit (store/reuse.py); this fills a fresh cache from it, the
MLX work through `mlx` (context.py says how), the reading and decoding on the
pool. Nothing here fails an append: a block or tail that cannot be read or does
not verify shortens the hit, and those tokens are prefilled instead.

A model whose cache does not cut by token is served through restore points
(kv/points.py takes them): the longest run of the request's blocks whose last
block has a point, the blocks restored and the point in place of a tail; a
point that does not verify, or verifies but does not fit the model's cache,
gives way to a shallower one; a block of the run that does not verify ends
the hit (all of it is prefilled).
"""

from __future__ import annotations

from kvwake.daemon.kv import restore_buffers, window_rows, window_stage
from kvwake.daemon.kv.cache_blocks import StateMismatchError
from kvwake.daemon.kv.context import KvContext, Mlx, log
from kvwake.daemon.kv.pipeline import block_specs, fill_block, fill_spans, releasing
from kvwake.daemon.kv.points import check_fits
from kvwake.errors import CorruptBlockError, KvwakeError
from kvwake.store import ROOT_KEY, BlockRef, SnapshotRecord
from kvwake.store.points import PointRef
from kvwake.store.reuse import PrefixHit

__all__ = ["POINT_KEY", "point_prefix", "restore_prefix", "stored_prefix"]

POINT_KEY = "point:"  # a restore point's name in the RAM tier: this, then its chain key (a block's is the key)
POINT_TRIES = 3  # points a hit tries, deepest first, when one does not verify


def stored_prefix(ctx: KvContext, target: list[int], mlx: Mlx) -> tuple[list | None, int]:
    """A fresh cache restored from the stored blocks (and partial piece) that start `target`; for a model
    whose cache cannot be cut by token, from the blocks up to a restore point (`point_prefix`).

    At most len(target) - 1 tokens: the last one stays pending. Store and codec work on the
    caller's thread and the pool, MLX work through `mlx`. Returns (cache or None, tokens it holds).
    """
    if len(target) < 2:
        return None, 0
    if not ctx.cuttable:
        return point_prefix(ctx, target, mlx)
    hit = ctx.store.prefix_hit(ctx.bundle.hash, target[: len(target) - 1], min_partial=ctx.min_partial)
    return restore_prefix(ctx, hit, target, mlx)


def restore_prefix(ctx: KvContext, hit: PrefixHit, target: list[int], mlx: Mlx) -> tuple[list | None, int]:
    """A cache holding the longest usable part of `hit` (a prefix-cache hit), room for len(target) tokens.

    The hit's whole blocks, then the first k tokens of its partial piece (a block or a
    snapshot's tail whose first k token ids continue target). Returns (cache or None, tokens
    it holds). A bad block or tail shortens the hit (logged by the caller); it never fails the
    append. Blocks decoded into host views (on the CPU; the partial piece anywhere) are kept in
    the RAM tier: shared prompts are what it is for. Staged blocks are not (their copy would be
    the numpy join a GPU restore avoids; from the page cache they stage at the wake's speed).
    """
    piece = _partial_piece(ctx, hit, target)
    pieces: list[BlockRef | SnapshotRecord] = [*hit.blocks, *([piece] if piece is not None else [])]
    if not pieces:
        return None, 0
    try:
        sample = _piece_specs(ctx, pieces[0])
    except CorruptBlockError as exc:
        ctx.log_unusable(exc)
        return None, 0
    start = len(hit.blocks) * ctx.block_tokens
    # The partial piece is decoded whole (a block's B tokens), then cut to k by the cache's offset.
    room = max(len(target), start + (_piece_tokens(ctx, piece) if piece is not None else 0))
    # Where a GPU computes, the whole blocks stage and join on the device a span at a time, as a wake's do
    # (decoding every block and joining its planes with numpy into host views, then uploading them, took
    # longer than prefilling them: docs/decisions.md, "Engine"). The partial piece decodes into host views and goes up with the layout.
    buffers = mlx(lambda: restore_buffers.Buffers(ctx.model, sample[0], sample[1], room, ctx.block_tokens,
                                       n_blocks=len(hit.blocks), mode=ctx.restore_mode))
    with releasing(buffers, mlx):
        usable = _fill_all(ctx, buffers, hit.blocks, piece, start, mlx)
        tokens = usable * ctx.block_tokens
        if usable > len(hit.blocks) and hit.partial is not None:
            tokens = start + hit.partial.tokens
        if not tokens:
            return None, 0
        cache = _finish(ctx, buffers, tokens, None, mlx)
    return cache, tokens


def point_prefix(ctx: KvContext, target: list[int], mlx: Mlx, counted: bool = True) -> tuple[list | None, int]:
    """A fresh cache restored through the deepest restore point that verifies on target's chain of stored
    blocks (all but its last token) and fits the cache: (cache, tokens it holds), or (None, 0) when there is
    none or a block of the run does not verify (logged; the request prefills instead). `counted`: in
    `tokens_from_points` (a request's reuse; not the engine's own re-prefill: model/reply_points.py)."""
    run = ctx.store.longest_prefix(ctx.bundle.hash, target[: len(target) - 1])
    points = ctx.store.point_refs([b.key for b in run], ctx.bundle.hash)
    for depth in [k for k in range(len(run), 0, -1) if run[k - 1].key in points][:POINT_TRIES]:
        ref = points[run[depth - 1].key]
        try:
            return _restore_through(ctx, run[:depth], ref, len(target), mlx, counted)
        except CorruptBlockError as exc:  # a shallower one may serve
            ctx.log_unusable(exc)
        except StateMismatchError as exc:  # it verified, yet is not this model's cache: a shallower one may be
            log.warning("restore point %s (%d tokens) does not fit the cache, trying a shallower one: %s",
                        ref.key[:16], ref.n_tokens, exc)
    return None, 0


def _restore_through(ctx: KvContext, blocks: list[BlockRef], ref: PointRef, room: int,
                     mlx: Mlx, counted: bool) -> tuple[list | None, int]:
    """A cache of `blocks` and the restore point `ref` that closes them, with room for `room` tokens; (None, 0)
    when a block does not verify (the point closes the last one: a shorter run has none)."""
    point = _point(ctx, ref)
    tokens = len(blocks) * ctx.block_tokens
    try:
        sample = block_specs(ctx, blocks[0])
    except CorruptBlockError as exc:
        ctx.log_unusable(exc)
        return None, 0
    buffers = mlx(lambda: restore_buffers.Buffers(ctx.model, sample, ctx.block_tokens, room, ctx.block_tokens,
                                                  n_blocks=len(blocks), mode=ctx.restore_mode))
    marked = window_rows.marked_blocks(point, ctx.block_tokens)
    if marked:  # the window blocks' rows decode into one array a name (the last block is in every window)
        lo, hi = min(marked), max(marked) + 1
        specs = block_specs(ctx, blocks[hi - 1])
        staged = mlx(lambda: window_stage.StagedRows.of(lo, hi - lo, ctx.block_tokens, window_stage.window_order(
            buffers.cache, buffers.window), specs)) if buffers.ring is not None else None
        buffers.held = staged or window_rows.Held(lo, hi - lo, ctx.block_tokens, buffers.window, specs)
    with releasing(buffers, mlx):
        batch = ctx.pool.batch()
        try:
            usable = fill_spans(ctx, buffers, list(blocks), mlx, batch, shorten=True)
        finally:
            batch.join()
        batch.raise_first()
        if usable < len(blocks):
            return None, 0
        if buffers.held is not None:
            point = _joined(ctx, ref, point, blocks, buffers.held, mlx)
        cache = _finish(ctx, buffers, tokens, point, mlx)
    if counted:
        ctx.counters.add("tokens_from_points", tokens)
    return cache, tokens


def _point(ctx: KvContext, ref: PointRef) -> dict:
    """A restore point's arrays: from the RAM tier, or read, verified and checked against the model's cache
    shapes (StateMismatchError), then kept there (the prompt it closes is a shared one; a restore copies
    them, never changes them). A marker point (kv/window_rows.py) is kept once its rings are joined
    (`_joined`)."""
    name = POINT_KEY + ref.key
    arrays = ctx.ram_tier.get(name)
    if arrays is None:
        arrays = ctx.store.read_point(ref)
        if not window_rows.marked_blocks(arrays, ctx.block_tokens):
            check_fits(arrays, ctx.bundle.description["kv_layout"])
            ctx.ram_tier.put(name, arrays)
    return arrays


def _joined(ctx: KvContext, ref: PointRef, point: dict, blocks: list[BlockRef], held: window_rows.Held,
            mlx: Mlx) -> dict:
    """A marker point made whole from the window rows its blocks carry: joined on the device where the
    restore staged them (kv/window_stage.py: not kept in the RAM tier, which holds host arrays), else as
    the restore decoded them (`held`) or read again (a block the RAM tier gave holds none), checked and kept
    in the RAM tier as `_point` does. StateMismatchError when a block lacks them (stored before, or by
    another writer)."""
    if held.staged:
        rings = mlx(lambda: held.rings(point))  # type: ignore[attr-defined]
        if rings is not None:
            check_fits(rings, ctx.bundle.description["kv_layout"])
            return rings
    whole = window_rows.assemble(point, ctx.block_tokens,
                                 lambda k: held.rows_of(k) or ctx.store.read_block(blocks[k]), held.span)
    check_fits(whole, ctx.bundle.description["kv_layout"])
    ctx.ram_tier.put(POINT_KEY + ref.key, whole)
    return whole


def _finish(ctx: KvContext, buffers: restore_buffers.Buffers, tokens: int, rest: dict | None, mlx: Mlx) -> list:
    """The restored blocks uploaded (a slice per job: a decoding neighbour waits one) and made the cache, with
    `rest` (a restore point's state) in the layers that do not cut; quantized when the KV is."""
    while not mlx(lambda: buffers.upload(tokens, restore_buffers.UPLOAD_JOB_S)):
        pass
    cache = mlx(lambda: buffers.finish(tokens, rest))
    return mlx(lambda: ctx.quantize(cache)) if ctx.kv_bits is not None else cache


def _fill_all(ctx: KvContext, buffers: restore_buffers.Buffers, blocks: list[BlockRef], piece: BlockRef | SnapshotRecord | None,
              start: int, mlx: Mlx) -> int:
    """The hit's blocks (spans, joined on the device as they come in) and its partial piece into place;
    returns how many of blocks + [piece] lead the list unbroken."""
    batch, piece_ok = ctx.pool.batch(), [False]

    def partial() -> None:
        try:
            if isinstance(piece, BlockRef):
                fill_block(ctx, buffers, piece, len(blocks), None, True)
            else:
                _fill_tail(ctx, buffers, piece, start)
            piece_ok[0] = True
        except CorruptBlockError as exc:
            ctx.log_unusable(exc)

    try:
        if piece is not None:  # first: it decodes beside the first blocks, not after the last span
            nbytes = piece.raw_bytes if isinstance(piece, BlockRef) else piece.tail.raw_bytes  # type: ignore[union-attr]
            batch.reserve(nbytes)
            batch.submit(nbytes, partial)
        usable = fill_spans(ctx, buffers, list(blocks), mlx, batch, shorten=True)
    finally:
        batch.join()
    batch.raise_first()
    return usable + (usable == len(blocks) and piece_ok[0])


def _partial_piece(ctx: KvContext, hit: PrefixHit, target: list[int]) -> BlockRef | SnapshotRecord | None:
    """The hit's partial piece, checked: a block (verified when read), or a tail's verified snapshot record
    whose tokens start target; None when there is none or it cannot be used."""
    partial = hit.partial
    if partial is None:
        return None
    start = len(hit.blocks) * ctx.block_tokens
    wanted = list(target[start : start + partial.tokens])
    if partial.block is not None:  # read_block checks that its key hashes its parent, bundle and tokens
        ref, parent = partial.block, hit.blocks[-1].key if hit.blocks else ROOT_KEY
        return ref if ref.parent == parent and list(ref.token_ids[: partial.tokens]) == wanted else None
    try:
        record = ctx.store.snapshot(partial.snapshot_id or "", bundle=ctx.bundle.hash)
    except KvwakeError as exc:  # pruned since the lookup, or damaged: prefill those tokens instead
        ctx.log_unusable(exc)
        return None
    keep = start + partial.tokens
    if record.tail is None or len(record.blocks) * ctx.block_tokens != start or \
            list(record.token_ids[:keep]) != list(target[:keep]):
        return None
    return record


def _piece_tokens(ctx: KvContext, piece: BlockRef | SnapshotRecord) -> int:
    if isinstance(piece, BlockRef):
        return len(piece.token_ids)
    return len(piece.token_ids) - len(piece.blocks) * ctx.block_tokens


def _piece_specs(ctx: KvContext, piece: BlockRef | SnapshotRecord) -> tuple[dict, int]:
    """Tensor specs of a block or tail (to allocate the buffers), and the tokens they cover."""
    specs = block_specs(ctx, piece) if isinstance(piece, BlockRef) else ctx.store.tail_specs(piece)
    return specs, _piece_tokens(ctx, piece)


def _fill_tail(ctx: KvContext, buffers: restore_buffers.Buffers, record: SnapshotRecord, start: int) -> None:
    """A snapshot's tail KV into place at `start` (verified; its other state is not needed for a prefix)."""
    count = _piece_tokens(ctx, record)
    tail = ctx.store.read_tail(record, buffers.place(start, count), None)
    buffers.check(buffers.take(dict(tail)), start, count, f"tail of snapshot {record.id}")
