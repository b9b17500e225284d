"""A batched decode step's attention by the row kernel (model/ragged_decode.py): where it applies, what it
computes against mlx-lm's masked attention over the padded batch (CUDA), and what it leaves alone."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

from kvwake.daemon.model import ragged_decode
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.session_state import Session
from kvwake.store import Store
from kvwake.daemon.config import Tuning
from testkit.tinymodel import make_model_dir

KV_HEADS, Q_HEADS, HEAD_DIM = 2, 8, 64


def _cuda() -> bool:
    return mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


def fused(queries, keys, values, cache, scale, mask, sinks=None):
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def padded_batch(lengths: list[int], dtype: mx.Dtype, cache_type=BatchKVCache) -> tuple[Any, ...]:
    """A batch cache whose rows hold `lengths` tokens (left-padded to the longest), its keys and values as
    mlx-lm's attention gets them after a decode step's update, that step's queries and its mask."""
    mx.random.seed(3)
    longest = max(lengths)
    cache = cache_type([longest - n for n in lengths]) if cache_type is BatchKVCache else \
        cache_type(max_size=4096, left_padding=[longest - n for n in lengths])
    k, v = (mx.random.normal((len(lengths), KV_HEADS, longest - 1, HEAD_DIM)).astype(dtype) for _ in range(2))
    cache.update_and_fetch(k, v)
    mask = cache.make_mask(1, return_array=True)  # as the model makes it: before the step's update
    k1, v1 = (mx.random.normal((len(lengths), KV_HEADS, 1, HEAD_DIM)).astype(dtype) for _ in range(2))
    keys, values = cache.update_and_fetch(k1, v1)
    queries = mx.random.normal((len(lengths), Q_HEADS, 1, HEAD_DIM)).astype(dtype)
    return cache, keys, values, queries, mask


def test_it_is_wanted_on_cuda_alone_and_when_asked():
    assert ragged_decode.wanted(True) == _cuda()
    assert ragged_decode.wanted(False) is False


@pytest.mark.parametrize("case", ["prefill chunk", "sliding window", "sinks"])
def test_what_the_mask_alone_can_say_takes_the_fused_path(case):
    called = []

    def marked(*args, **kwargs):
        called.append(case)
        return mx.zeros((1,))

    cache_type = BatchRotatingKVCache if case == "sliding window" else BatchKVCache
    cache, keys, values, queries, _ = padded_batch([5, 9], mx.float32, cache_type)
    if case == "prefill chunk":
        queries = mx.concatenate([queries, queries], axis=2)
    sinks = mx.zeros((Q_HEADS,)) if case == "sinks" else None
    ragged_decode.ragged(marked)(queries, keys, values, cache, 0.125, None, sinks=sinks)
    assert called == [case]


@pytest.mark.skipif(not _cuda(), reason="the row kernel is a CUDA kernel: MLX does not run on CUDA here")
@pytest.mark.parametrize("dtype,bound", [(mx.float32, 1e-5), (mx.bfloat16, 2e-2)])
@pytest.mark.parametrize("lengths", [[1, 7, 300], [4000, 12, 2500, 1]])
def test_the_row_kernel_agrees_with_masked_attention_over_the_padded_batch(dtype, bound, lengths):
    cache, keys, values, queries, mask = padded_batch(lengths, dtype)
    want = fused(queries, keys, values, cache, 0.125, mask)
    got = ragged_decode.ragged(lambda *a, **k: pytest.fail("took the fused path"))(queries, keys, values, cache,
                                                                                   0.125, mask)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < bound


@pytest.mark.skipif(not _cuda(), reason="the row kernel is a CUDA kernel: MLX does not run on CUDA here")
def test_with_the_row_kernel_a_call_decodes_the_same_tokens_batched_or_alone(tmp_path):
    # A row's spans are cut at fixed token counts of its own (ROW_SPLIT): its sums do not depend on its company.
    model_dir = make_model_dir(tmp_path / "tiny")
    prompts = ["short", "a somewhat longer prompt about tools " * 6, "x" * 300]
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, max_batch=8, tuning=Tuning(row_kernel=True))
    assert engine.decoder.row_kernel
    params = GenerateParams(max_tokens=24)

    def started(name: str, text: str):
        s = Session(name)
        engine.append(s, text=text)
        return engine.start_call(s, params)

    alone = []
    for i, text in enumerate(prompts):
        call = started(f"alone{i}", text)
        engine.decoder.join(call)
        while engine.decoder.active:
            engine.decoder.step()
        alone.append(call.future.result().tokens)
    calls = [started(f"b{i}", text) for i, text in enumerate(prompts)]
    for call in calls:
        engine.decoder.join(call)
    while engine.decoder.active:
        engine.decoder.step()
    assert [c.future.result().tokens for c in calls] == alone
    assert engine.decoder.counters["max_batch_seen"] == 3
    engine.close()
    store.close()


@pytest.mark.parametrize("builds", [True, False])
def test_the_engine_builds_the_row_kernel_before_it_answers(tmp_path, monkeypatch, builds):
    # Was the warm-up's first idle job: a restart's first requests, sent as the daemon answered, waited
    # behind it (the compile runs in every process). Now a step of the engine's start; a model
    # whose heads the kernel does not take decodes without it.
    built = []
    monkeypatch.setattr(ragged_decode, "wanted", lambda asked: asked)
    monkeypatch.setattr(ragged_decode, "warm", lambda model, **kw: built.append(model) or builds)
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, make_model_dir(tmp_path / "tiny"), max_batch=8, warm=False)
    try:
        assert built == [engine.model] and engine.decoder.row_kernel is builds
        assert "row_kernel" in engine.started.ms
        engine.warm_jobs()
        assert len(built) == 1  # no warm-up job builds it again
    finally:
        engine.close()
        store.close()


def test_a_call_alones_lengths_and_the_kernels_constants_are_made_once_not_per_layer(monkeypatch):
    # Each layer of each step made its own small arrays from host memory (the kernel's scale and span length,
    # a call alone's starts and lengths): on CUDA each a move the kernel waited for. Made once now: the
    # layers of a step share them (here on the CPU the kernel's inputs are recorded, not run).
    from mlx_lm.models.cache import KVCache

    from kvwake.daemon.model import paged_attention

    seen = []
    monkeypatch.setattr(ragged_decode, "row_attention", lambda q, k, v, starts, lengths, scale, max_tokens:
                        seen.append((starts, lengths, max_tokens)) or mx.zeros(q.shape, q.dtype))
    attention = ragged_decode.ragged(fused)
    queries = mx.zeros((1, Q_HEADS, 1, HEAD_DIM), mx.bfloat16)
    layers = [KVCache() for _ in range(3)]
    for step, n in enumerate((40, 41)):
        for cache in layers:
            kv = mx.ones((1, KV_HEADS, n - cache.offset, HEAD_DIM), mx.bfloat16)
            cache.update_and_fetch(kv, kv)
            attention(queries, cache.keys, cache.values, cache, 0.125, None)
    first, second = seen[:3], seen[3:]
    assert all(s[0] is first[0][0] and s[1] is first[0][1] for s in first)  # one pair for a step's layers
    assert second[0][1] is not first[0][1] and all(s[1] is second[0][1] for s in second)
    assert [s[1].tolist() for s in (first[0], second[0])] == [[40], [41]] and first[0][0].tolist() == [0]
    assert paged_attention.constant(0.125, mx.float32) is paged_attention.constant(0.125, mx.float32)
    assert paged_attention.constant(256, mx.int32).tolist() == [256]
    assert paged_attention.constant(0.5, mx.float32) is not paged_attention.constant(0.125, mx.float32)
