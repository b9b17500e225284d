"""Rows joining a running batch laid out in one buffer a plain layer (model/batch_rows.py `joined`): the bytes,
padding and lengths mlx-lm's merge and extends make, with room for the next step (tiny llama, CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
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
    new_way = joined(model, new_way, [3, 4, 5], coming, [6, 7], blanks)()
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
    assert kv(joined(model, None, [0, 1, 2], rows, [3], blanks)()) == kv(old_way)


H, D = 2, 8


def layer(kind: str, n: int, seed: int):
    """One session layer of `kind` holding `n` tokens (plain, sliding window, recurrent, a list of two)."""
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    mx.random.seed(seed)
    if kind == "list":
        return CacheList(layer("kv", n, seed + 1), layer("kv", n, seed + 2))
    if kind == "arr":
        c = ArraysCache(2)
        if n:
            c[0], c[1] = mx.random.normal((1, 3, 4)), mx.random.normal((1, 5))
        return c
    c = KVCache() if kind == "kv" else RotatingKVCache(max_size=16)
    if n:
        k = mx.random.normal((1, H, n, D)).astype(mx.bfloat16)
        c.update_and_fetch(k, k * 2)
    return c


def synthetic(kinds: list[str], n: int, seed: int) -> Row:
    session = SimpleNamespace(tokens=list(range(n + 1)), processed=n)
    call = SimpleNamespace(session=session, output=SimpleNamespace(params=GenerateParams()))
    return Row(call, n % 7, [layer(k, n, seed * 10 + i) for i, k in enumerate(kinds)], [], greedy_sampler)


def state(batch) -> list:
    """Every leaf layer's rows up to the batch's length (bytes), padding and lengths; the batch's own fields."""
    from kvwake.daemon.model.batch_rows import _leaves

    out = []
    for c in _leaves(batch.prompt_cache):
        if c.__class__.__name__ == "ArraysCache":
            out.append([None if a is None else np.asarray(a).tobytes() for a in c.cache])
            continue
        kv_bytes = None if c.keys is None else [np.asarray(a[..., : c._idx, :].astype(mx.float32)).tobytes()
                                                for a in (c.keys, c.values)]
        out.append((type(c).__name__, kv_bytes, c.left_padding.tolist(), c.offset.tolist(), c._idx))
    return [out, batch.uids, batch.tokens, batch._next_tokens.tolist(), batch._num_tokens]


@pytest.mark.parametrize("kinds, running, coming, dead", [
    (["kv"], [40, 25, 0], [10, 0, 3], 2),  # the batch longer than the rows joining
    (["kv"], [0, 0], [10, 0, 3], 3),  # a batch that holds no KV yet
    (["kv"], [0, 0], [0, 0], 4),  # nothing to lay out: mlx-lm's merge
    (["kv"], None, [0, 3, 20], 1),  # a first batch
    (["kv", "rot", "arr", "list"], [40, 25, 0], [60, 0, 33], 2),  # other kinds beside plain KV: mlx-lm's way
    (["rot", "arr"], [20, 0], [3, 30], 3),
])
def test_every_kind_of_layer_joins_as_mlx_lms_merge_and_extends_make_it(kinds, running, coming, dead):
    blanks = [layer(k, 0, 0) for k in kinds]
    first = len(running or [])
    uids, dead_uids = list(range(first, first + len(coming))), list(range(first + len(coming), first + len(coming) + dead))
    arriving = lambda: [synthetic(kinds, n, 100 + i) for i, n in enumerate(coming)]  # noqa: E731
    batch = (lambda: rows_batch(None, list(range(first)), [synthetic(kinds, n, i) for i, n in enumerate(running)])) \
        if running else (lambda: None)
    old_way = batch()
    if old_way is None:
        old_way = rows_batch(None, uids, arriving())
    else:
        old_way.extend(rows_batch(None, uids, arriving()))
    old_way.extend(dead_rows(None, dead_uids, blanks, like=old_way.prompt_cache))
    assert state(joined(None, batch(), uids, arriving(), dead_uids, blanks)()) == state(old_way)


def test_a_join_that_cannot_be_made_leaves_the_batch_as_it_was():
    # a row whose layer cannot merge (quantized KV): `joined` raises while making the rows' part, before anything
    # of the running batch changed, so the decoder fails these calls alone and the batch goes on
    from mlx_lm.models.cache import QuantizedKVCache

    batch = rows_batch(None, [0, 1], [synthetic(["kv", "kv"], n, i) for i, n in enumerate([5, 7])])
    before = state(batch)
    bad = synthetic(["kv", "kv"], 4, 9)
    bad.cache[1] = QuantizedKVCache()
    bad.cache[1].update_and_fetch(*(2 * [mx.random.normal((1, H, 4, 64)).astype(mx.bfloat16)]))
    with pytest.raises(Exception):
        joined(None, batch, [2], [bad], [3], [layer("kv", 0, 0)] * 2)
    assert state(batch) == before


def test_a_join_that_fails_putting_the_batch_together_fails_its_calls_not_hangs_them(model_dir, tmp_path,
                                                                                      monkeypatch):
    # What raises once the batch is being changed is the batch's failure (the engine thread fails every call in
    # flight); the joining calls, in neither the waiting queue nor the batch then, were left unanswered
    from kvwake.daemon.model import decoder as decoder_module
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    from kvwake.daemon.config import Tuning

    store = Store(tmp_path / "store", block_tokens=16)
    # a merged batch's assembly, whatever the default (a batch over pages merges nothing)
    engine = Engine(store, tmp_path, model_dir, max_batch=8, warm=False, tuning=Tuning(paged_kv=False))
    try:
        sessions = [Session(f"s{i}") for i in range(3)]
        for i, s in enumerate(sessions):
            engine.append(s, tokens=[5 + i, 6, 7, 8])
        first = [engine.start_call(s, GenerateParams(max_tokens=50)) for s in sessions[:2]]
        for call in first:
            engine.decoder.join(call)
        engine.decoder.step()  # a batch of two decoding

        def broken(*args):
            def put_together():
                raise RuntimeError("the batch could not be put together")
            return put_together
        monkeypatch.setattr(decoder_module, "joined", broken)
        late = engine.start_call(sessions[2], GenerateParams(max_tokens=50))
        engine.decoder.join(late)
        with pytest.raises(RuntimeError):
            engine.decoder.step()
        assert late.future.done() and isinstance(late.future.exception(), RuntimeError)
    finally:
        engine.decoder.abort(RuntimeError("the test is done"))
        engine.close()
        store.close()
