"""Calls joining the decoder's batch: rows built without a forward pass, in slots of a few sizes.

mlx-lm's `GenerationBatch` constructor runs its first step at once: a forward
pass of the new rows alone, evaluated (a blocking sync), before they can join
a running batch. kvwake joins every waiting call in one merge and lets the
running batch's next pass feed them, so `rows_batch` sets the state that
constructor sets before that step (mlx-lm 0.32's fields; pyproject pins the
minor version).

Rows live in slots: the batch has one of `SLOTS` rows, the ones no call holds
are dead (all padding, fed and sampled, never handed out). A call that leaves
leaves a dead slot, which the next call whose history fits the batch's length
takes (`place`: its KV copied in, right-aligned, no other row moved).

Rows that join a running batch (and the dead rows that round it up to its slot size) are laid into one new
buffer a plain KV layer (`joined`): mlx-lm's way merged them into a buffer of their own, appended that and
then the dead rows to the batch (a copy of every row each), and the next step grew the buffer that had no
room left (a copy again). Here each row's KV is copied once, beside room for the steps to come; the bytes
up to the batch's length are the ones mlx-lm's way makes, so the step computes the same.

Three kinds of cache layer batch (decode_calls.batch_mode): plain KV (`BatchKVCache`),
sliding windows (`BatchRotatingKVCache`) and recurrent state (`ArraysCache`),
alone or mixed in one model, and each kind takes a row into a dead slot: plain
KV right-aligned, a recurrent state as it is, a window's tokens as the newest
of the batch's ring, wherever its rotation has got to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences, TokenBuffer
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, CacheList, KVCache
from mlx_lm.sample_utils import greedy_sampler

from kvwake.daemon.kv import paged_batch
from kvwake.daemon.model.generation import make_processors

__all__ = ["SLOTS", "UNLIMITED", "Row", "dead_rows", "extract_row", "fits", "joined", "place", "retire", "rows_batch",
           "schedule", "slot_size"]

UNLIMITED = 1 << 62  # GenerationBatch's own max_tokens: TextOutput decides when a call ends
SLOTS = (1, 2, 4, 8, 16, 32)  # the batch sizes rows live in: MLX meets a few shapes, not one per row count


@dataclass
class Row:
    """A call joining the batch: the token its first pass feeds, its cache, the tokens it has generated
    that the cache holds, and its sampler."""

    call: Any  # decoder.Call
    token: int | mx.array
    cache: list
    generated: list[int]
    sampler: Any


def rows_batch(model: Any, uids: list[int], rows: list[Row], in_pages: bool = False) -> GenerationBatch:
    """A GenerationBatch of `rows` that has taken no step: their caches merged in one go (`in_pages`: each
    row's page table taken as it is, kv/paged_batch.py, nothing merged), each row's next token to feed its
    own. mlx-lm's constructor would run the first pass itself (a forward pass of these rows alone,
    evaluated); this sets the state that constructor sets before that pass (mlx-lm 0.32's fields, pinned
    in pyproject), so the running batch's next pass feeds them."""
    if in_pages:
        caches = paged_batch.merged([r.cache for r in rows])
    else:
        caches = [first.merge([r.cache[i] for r in rows]) for i, first in enumerate(rows[0].cache)]
    return _rows_unstepped(model, uids, rows, caches)


def joined(model: Any, batch: GenerationBatch | None, uids: list[int], rows: list[Row], dead: list[int],
           blanks: list) -> Callable[[], GenerationBatch]:
    """`batch` (None: none yet) with `rows` appended, then `dead` dead rows (their uids), as a merge and
    `dead_rows` extending it make it, each plain KV layer laid out once with room for the steps to come
    (module docstring), other kinds merged and extended as mlx-lm does. In two phases: this call makes the
    joining rows' layers and changes nothing of `batch` (what raises here concerns these rows alone); the
    function it returns puts them together, changing `batch` (what raises there is the batch's, as mlx-lm's
    extend is). Not for a batch over pages."""
    assert batch is None or not paged_batch.in_pages(batch.prompt_cache), "a batch over pages merges no KV"
    more = _rows_unstepped(model, uids, rows, [])  # the caches are put in below
    if dead:
        more.extend(_dead_unstepped(model, dead, []))
    old = batch.prompt_cache if batch is not None else [None] * len(blanks)
    made = [_made(o, [r.cache[i] for r in rows], len(dead), blanks[i]) for i, o in enumerate(old)]

    def put_together() -> GenerationBatch:
        more.prompt_cache = [_put(o, *part) for o, part in zip(old, made)]
        if batch is None:
            return more
        batch.prompt_cache = []  # mlx-lm's extend then takes the joined layers as they are
        batch.extend(more)
        return batch
    return put_together


def _lays_out(old: Any, new: list) -> bool:
    """Whether a layer joins laid out (`_laid_out`): plain KV throughout, and some KV to lay out (an empty
    one merges as mlx-lm merges it: padding only)."""
    return ((old is None or type(old) is BatchKVCache) and all(type(c) is KVCache for c in new)
            and ((old is not None and old.keys is not None) or any(c.keys is not None and c.offset for c in new)))


def _made(old: Any, new: list, dead: int, blank: Any) -> tuple[Any, Any, Any]:
    """One layer's joining part, `old` unchanged: (the whole layer laid out, None, None), or (None, the rows'
    merge, the dead rows' merge or None) for `_put` to append to `old`."""
    if _lays_out(old, new):
        return _laid_out(old, new, dead), None, None
    return None, type(new[0]).merge(new), blank.merge([blank] * dead) if dead else None


def _put(old: Any, laid: Any, merged: Any, dead: Any) -> Any:
    """A layer of the joined batch from `_made`'s part: the laid-out layer as it is; else `old` (when there
    is one) extended by the rows' merge, then by the dead rows'."""
    if laid is not None:
        return laid
    layer = merged
    if old is not None:
        old.extend(merged)
        layer = old
    if dead is not None:
        layer.extend(dead)
    return layer


def _laid_out(old: BatchKVCache | None, new: list[KVCache], dead: int) -> BatchKVCache:
    """A plain layer's batch of `old`'s rows, `new`'s and `dead` dead ones, right-aligned to the longest, in one
    buffer (zeros, each row's KV copied once) with a step's room past it, so the next step does not grow it."""
    held = [old] if old is not None and old.keys is not None else []
    pieces = [c for c in new if c.keys is not None and c.offset]
    like = (held or pieces)[0].keys
    top = max([old._idx if old is not None else 0, *(c.offset for c in new)])
    b0 = old.offset.shape[0] if old is not None else 0
    rows = b0 + len(new) + dead
    _, heads, _, dk = like.shape
    dv = (held or pieces)[0].values.shape[3]
    size = top + BatchKVCache.step
    keys, values = mx.zeros((rows, heads, size, dk), like.dtype), mx.zeros((rows, heads, size, dv), like.dtype)
    if held:  # the batch's rows as they are up to its length (their padding too), shifted to the new length
        keys[:b0, :, top - old._idx : top, :] = old.keys[..., : old._idx, :]
        values[:b0, :, top - old._idx : top, :] = old.values[..., : old._idx, :]
    for j, c in enumerate(new):
        if c.keys is not None and c.offset:
            keys[b0 + j : b0 + j + 1, :, top - c.offset : top, :] = c.keys[..., : c.offset, :]
            values[b0 + j : b0 + j + 1, :, top - c.offset : top, :] = c.values[..., : c.offset, :]
    pads = [top - c.offset for c in new] + [top] * dead
    layer = BatchKVCache([0] * rows)
    layer.left_padding = mx.concatenate([*([old.left_padding + (top - old._idx)] if old is not None else []),
                                         mx.array(pads)])
    layer.offset = mx.concatenate([*([old.offset] if old is not None else []),
                                   mx.array([c.offset for c in new] + [0] * dead)])
    layer.keys, layer.values, layer._idx = keys, values, top
    return layer


def dead_rows(model: Any, uids: list[int], blanks: list, like: list | None = None) -> GenerationBatch:
    """Rows that hold nothing (all padding once they extend a batch): places for calls to come. They
    are fed and sample like any row (greedy, token 0 first); their tokens are never handed out.
    `blanks`: the model's fresh cache (one empty layer of each layer's kind): each layer's batched form
    is merged from n of them (an empty merge holds no KV, only each row's padding). `like`: the caches of
    the batch they extend; a paged batch's dead rows are rows with no page table."""
    n = len(uids)
    if like is not None and paged_batch.in_pages(like):
        caches = paged_batch.dead(like, n)
    else:
        caches = [blank.merge([blank] * n) for blank in blanks]
    return _dead_unstepped(model, uids, caches)


def place(batch: GenerationBatch, i: int, uid: int, row: Row) -> None:
    """Put `row` in the batch's slot i (a dead row's): its KV right-aligned to the batch's length, the
    rest of the slot masked as padding, its recurrent state in the slot's, its sampling state in the
    slot's (a paged batch: its page table in the slot, kv/paged_batch.py). It must fit (`fits`)."""
    if paged_batch.in_pages(batch.prompt_cache):
        batch.prompt_cache[0].rows.place(i, paged_batch.takes(row.cache))
    for layer, own in zip(_leaves(batch.prompt_cache), _leaves(row.cache)):
        if isinstance(layer, paged_batch.PagedBatchKVCache):
            continue
        if isinstance(layer, ArraysCache):
            _place_arrays(layer, i, own)
        elif isinstance(layer, BatchRotatingKVCache):
            _place_ring(layer, i, own)
        else:
            _place_kv(layer, i, own)
    history = _history(row)
    batch.uids[i], batch.tokens[i], batch.samplers[i] = uid, history, row.sampler
    batch.logits_processors[i] = make_processors(row.call.output.params)
    batch.stop_sequences[i], batch.max_tokens[i] = StopSequences(), UNLIMITED
    batch._next_tokens[i : i + 1] = _token(row)
    batch._next_logprobs[i] = mx.zeros((0,))
    batch._token_context[i], batch._num_tokens[i] = TokenBuffer(history), 0
    batch._matchers[i] = batch.stop_sequences[i].matcher()


def fits(batch: GenerationBatch, row: Row) -> bool:
    """Whether the row's history fits the batch's length in every layer (a longer one would need every
    row re-padded); a wrapped window's ring holds any row's window, a recurrent state has no length; a
    paged batch takes any row paged whole (it pads none)."""
    if paged_batch.in_pages(batch.prompt_cache):
        return paged_batch.takes(row.cache) is not None
    for layer, own in zip(_leaves(batch.prompt_cache), _leaves(row.cache)):
        if isinstance(layer, BatchKVCache) and own.offset > layer._idx:
            return False
        if isinstance(layer, BatchRotatingKVCache) and not _wrapped(layer) and own.size() > layer._idx:
            return False
    return True


def _wrapped(ring: BatchRotatingKVCache) -> bool:
    """The batch's ring is full (it has rotated, or rotates at its next token)."""
    return ring.rotated or ring._idx >= ring.max_size


def _place_kv(layer: BatchKVCache, i: int, own: Any) -> None:
    n, end = own.offset, layer._idx
    if n:  # (a one-token session's cache is empty: its whole slot is padding)
        layer.keys[i : i + 1, :, end - n : end, :] = own.keys[..., :n, :]
        layer.values[i : i + 1, :, end - n : end, :] = own.values[..., :n, :]
    layer.left_padding[i : i + 1] = mx.array([end - n])
    layer.offset[i : i + 1] = mx.array([n])


def _place_ring(layer: BatchRotatingKVCache, i: int, own: Any) -> None:
    """A sliding window's tokens into slot i: the s it holds (s = own.size(), in temporal order) become
    the newest s of the batch's ring, the rest of the slot masked. Before the ring wraps, its newest
    token sits at `_idx - 1` (as plain KV); once wrapped, temporal position p (0 the oldest) sits at
    (_idx + p) mod max_size, and `left_padding` counts the slot's masked positions from the oldest."""
    size, s = layer.max_size, own.size()
    if _wrapped(layer):
        first, padding = (layer._idx + size - s) % size, size - s
    else:
        first, padding = layer._idx - s, layer._idx - s
    if s:
        head = min(s, size - first)  # the run up to the ring's end; the rest wraps to its start
        for mine, theirs in ((own.keys, layer.keys), (own.values, layer.values)):
            tokens = own._temporal_order(mine)[..., -s:, :]
            theirs[i : i + 1, :, first : first + head, :] = tokens[..., :head, :]
            if head < s:
                theirs[i : i + 1, :, : s - head, :] = tokens[..., head:, :]
    layer.left_padding[i : i + 1] = mx.array([padding])
    layer.offset[i : i + 1] = mx.array([own.offset])


def _place_arrays(layer: ArraysCache, i: int, own: ArraysCache) -> None:
    """A recurrent layer's state into slot i: the row's own, or zeros (a fresh state) where it has none."""
    for e, mine in enumerate(own.cache):
        if layer.cache[e] is None and mine is None:
            continue
        if layer.cache[e] is None:  # no row has this state yet: fresh (zero) states for the others
            layer.cache[e] = mx.zeros((layer.batch_size, *mine.shape[1:]), mine.dtype)
        layer.cache[e][i : i + 1] = mine if mine is not None else mx.zeros_like(layer.cache[e][i : i + 1])
    if layer.left_padding is not None:  # decoding: nothing of the slot is padding
        layer.left_padding[i : i + 1] = mx.array([0])


def extract_row(caches: list, i: int) -> list:
    """Row i of a batch's caches as the plain caches a session holds, owning their memory: mlx-lm extracts a
    recurrent state as a view of the batch's (B, ...) array (plain KV and windows as copies), which would
    keep the whole batch's state alive in every session that left it, counted as one row's."""
    row = [c.extract(i) for c in caches]
    for c in _leaves(row):
        if isinstance(c, ArraysCache):
            c.cache = [mx.contiguous(a) if a is not None else None for a in c.cache]
    return row


def _leaves(cache: list) -> Iterator[Any]:
    """Every layer's caches, a `CacheList`'s members one by one."""
    for c in cache:
        if isinstance(c, CacheList):
            yield from _leaves(list(c.caches))
        else:
            yield c


def retire(batch: GenerationBatch, i: int) -> None:
    """Slot i's row has left: it samples greedily, without processors, until a call takes the slot (in a
    paged batch the slot's page table goes: nothing is written for it)."""
    batch.samplers[i], batch.logits_processors[i] = greedy_sampler, ()
    if paged_batch.in_pages(batch.prompt_cache):
        batch.prompt_cache[0].rows.vacate(i)


def schedule(batch: GenerationBatch) -> None:
    """Schedule what a batch's next pass needs, once rows joined (merged, placed) or left (compacted): its
    next tokens, then its caches, as work of their own ahead of the pass (the tokens first: a constrained
    row's mask waits for them, not for the copies). Left to the pass, the merge's copies are computed inside
    it, and there they cost about twice their time apart (docs/decisions.md, "Many agents at once
    (issue 24)")."""
    mx.async_eval(batch._next_tokens)
    mx.async_eval([c.state for c in batch.prompt_cache])


def slot_size(n: int, most: int) -> int:
    """The batch size for n rows: the next of SLOTS (then `most`, the largest batch) at or above n."""
    return next((size for size in (*(s for s in SLOTS if s < most), most) if size >= n), n)


def _history(row: Row) -> list[int]:
    s = row.call.session
    return s.tokens[: s.processed] + row.generated


def _token(row: Row) -> mx.array:
    if isinstance(row.token, mx.array):
        return row.token.astype(mx.uint32).reshape(1)
    return mx.array([row.token], dtype=mx.uint32)


def _rows_unstepped(model: Any, uids: list[int], rows: list[Row], caches: list) -> GenerationBatch:
    """`rows` as an unstepped batch over `caches`: each row's history, sampler, processors and next token."""
    return _unstepped(model, uids, caches, [_history(r) for r in rows], [r.sampler for r in rows],
                      [make_processors(r.call.output.params) for r in rows], mx.concatenate([_token(r) for r in rows]))


def _dead_unstepped(model: Any, uids: list[int], caches: list) -> GenerationBatch:
    """Dead rows as an unstepped batch over `caches`: no history, greedy, token 0 first."""
    n = len(uids)
    return _unstepped(model, uids, caches, [[] for _ in uids], [greedy_sampler] * n, [() for _ in uids],
                      mx.zeros((n,), dtype=mx.uint32))


def _unstepped(model: Any, uids: list[int], caches: list, tokens: list[list[int]], samplers: list,
               processors: list, next_tokens: mx.array) -> GenerationBatch:
    stops = [StopSequences() for _ in uids]
    batch = GenerationBatch(model, [], mx.array([], dtype=mx.uint32), [], [], [], greedy_sampler, [], [], [])
    batch.uids, batch.prompt_cache, batch.tokens = list(uids), caches, tokens
    batch.samplers, batch.logits_processors = list(samplers), list(processors)
    batch.stop_sequences, batch.max_tokens = stops, [UNLIMITED] * len(uids)
    batch._next_tokens = next_tokens
    # Before its first pass (kvwake reads no logprobs). Made here, on the engine thread: MLX evaluates
    # an array only on a thread that has its stream.
    batch._next_logprobs = [mx.zeros((0,)) for _ in uids]
    batch._token_context = [TokenBuffer(t) for t in tokens]
    batch._num_tokens = [0] * len(uids)
    batch._matchers = [stop.matcher() for stop in stops]
    return batch
