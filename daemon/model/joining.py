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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences, TokenBuffer
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.sample_utils import greedy_sampler

from kvwake.daemon.model.generation import make_processors

__all__ = ["SLOTS", "UNLIMITED", "Row", "dead_rows", "fits", "place", "retire", "rows_batch", "slot_size"]

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


def rows_batch(model: Any, uids: list[int], rows: list[Row]) -> GenerationBatch:
    """A GenerationBatch of `rows` that has taken no step: their caches merged in one go, each row's
    next token to feed its own. mlx-lm's constructor would run the first pass itself (a forward pass
    of these rows alone, evaluated); this sets the state that constructor sets before that pass
    (mlx-lm 0.32's fields, pinned in pyproject), so the running batch's next pass feeds them."""
    caches = [first.merge([r.cache[i] for r in rows]) for i, first in enumerate(rows[0].cache)]
    tokens = [_history(r) for r in rows]
    return _unstepped(model, uids, caches, tokens, [r.sampler for r in rows],
                      [make_processors(r.call.output.params) for r in rows],
                      mx.concatenate([_token(r) for r in rows]))


def dead_rows(model: Any, uids: list[int], layers: int) -> GenerationBatch:
    """Rows that hold nothing (all padding once they extend a batch): places for calls to come. They
    are fed and sample like any row (greedy, token 0 first); their tokens are never handed out."""
    n = len(uids)
    caches = [BatchKVCache([0] * n) for _ in range(layers)]
    return _unstepped(model, uids, caches, [[] for _ in uids], [greedy_sampler] * n, [() for _ in uids],
                      mx.zeros((n,), dtype=mx.uint32))


def place(batch: GenerationBatch, i: int, uid: int, row: Row) -> None:
    """Put `row` in the batch's slot i (a dead row's): its KV right-aligned to the batch's length, the
    rest of the slot masked as padding, its state in the slot's. Its history must fit (`fits`)."""
    for layer, own in zip(batch.prompt_cache, row.cache):
        n, end = own.offset, layer._idx
        if n:  # (a one-token session's cache is empty: its whole slot is padding)
            layer.keys[i : i + 1, :, end - n : end, :] = own.keys[..., :n, :]
            layer.values[i : i + 1, :, end - n : end, :] = own.values[..., :n, :]
        layer.left_padding[i : i + 1] = mx.array([end - n])
        layer.offset[i : i + 1] = mx.array([n])
    history = _history(row)
    batch.uids[i], batch.tokens[i], batch.samplers[i] = uid, history, row.sampler
    batch.logits_processors[i] = make_processors(row.call.output.params)
    batch.stop_sequences[i], batch.max_tokens[i] = StopSequences(), UNLIMITED
    batch._next_tokens[i : i + 1] = _token(row)
    batch._next_logprobs[i] = mx.zeros((0,))
    batch._token_context[i], batch._num_tokens[i] = TokenBuffer(history), 0
    batch._matchers[i] = batch.stop_sequences[i].matcher()


def fits(batch: GenerationBatch, row: Row) -> bool:
    """Whether the row's history fits the batch's length (a longer one would need every row re-padded)."""
    return row.cache[0].offset <= batch.prompt_cache[0]._idx


def retire(batch: GenerationBatch, i: int) -> None:
    """Slot i's row has left: it samples greedily, without processors, until a call takes the slot."""
    batch.samplers[i], batch.logits_processors[i] = greedy_sampler, ()


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
