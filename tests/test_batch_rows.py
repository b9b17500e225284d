"""Rows joining a running batch laid out in one buffer a plain layer (model/batch_rows.py `joined`): the bytes,
padding and lengths mlx-lm's merge and extends make, with room for the next step (tiny llama, CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.utils import load_model

from kvwake.daemon.model.batch_rows import Row, dead_rows, joined, rows_batch
from kvwake.daemon.model.generation import GenerateParams


def row(model, length: int, seed: int) -> Row:
    """A call's row over a session of `length` tokens of random KV (none for a one-token session)."""
    mx.random.seed(seed)
    cache = make_prompt_cache(model)
    for layer in cache:
        if length:
            heads, dim = model.layers[0].self_attn.n_kv_heads, model.args.head_dim or 16
            k = mx.random.normal((1, heads, length, dim)).astype(mx.bfloat16)
            layer.update_and_fetch(k, k * 2)
    session = SimpleNamespace(tokens=list(range(length + 1)), processed=length)
    call = SimpleNamespace(session=session, output=SimpleNamespace(params=GenerateParams()))
    return Row(call, length % 7, cache, [], greedy_sampler)


def kv(batch) -> list:
    return [(np.asarray(c.keys[..., : c._idx, :].view(mx.uint16)).tobytes(),
             np.asarray(c.values[..., : c._idx, :].view(mx.uint16)).tobytes(),
             c.left_padding.tolist(), c.offset.tolist(), c._idx) for c in batch.prompt_cache]


def test_rows_joined_in_one_buffer_hold_what_mlx_lms_merge_and_extends_make_with_room_for_a_step(model_dir):
    model, _ = load_model(model_dir)
    blanks = make_prompt_cache(model)
    running = [row(model, n, i) for i, n in enumerate((40, 25, 0))]
    coming = [row(model, n, 10 + i) for i, n in enumerate((60, 0, 33))]
    old_way, new_way = rows_batch(model, [0, 1, 2], running), rows_batch(model, [0, 1, 2], running)
    old_way.extend(rows_batch(model, [3, 4, 5], coming))  # mlx-lm's way: merged, appended, dead rows appended
    old_way.extend(dead_rows(model, [6, 7], blanks, like=old_way.prompt_cache))
    new_way = joined(model, new_way, [3, 4, 5], coming, [6, 7], blanks)
    assert kv(new_way) == kv(old_way) and new_way.uids == old_way.uids == list(range(8))
    assert new_way.tokens == old_way.tokens and new_way._next_tokens.tolist() == old_way._next_tokens.tolist()
    layer = new_way.prompt_cache[0]
    held = layer.keys
    step = mx.ones((8, held.shape[1], 1, held.shape[3]), mx.bfloat16)
    layer.update_and_fetch(step, step)
    old_way.prompt_cache[0].update_and_fetch(step, step)
    assert layer.keys.shape == held.shape  # the step wrote into the room it had: nothing grown, nothing copied
    assert kv(new_way)[0] == kv(old_way)[0]


def test_a_first_batch_is_laid_out_with_its_dead_rows(model_dir):
    model, _ = load_model(model_dir)
    blanks = make_prompt_cache(model)
    rows = [row(model, n, 20 + i) for i, n in enumerate((9, 30, 17))]
    old_way = rows_batch(model, [0, 1, 2], rows)
    old_way.extend(dead_rows(model, [3], blanks, like=old_way.prompt_cache))
    assert kv(joined(model, None, [0, 1, 2], rows, [3], blanks)) == kv(old_way)
