"""Plain-ops prefill attention (daemon/attention.py): the same numbers as the fused kernel, swapped in and out."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from kvwake.daemon import kvstate
from kvwake.daemon.attention import PLAIN_MAX_BYTES, plain_attention, plain_prefill


@pytest.fixture(scope="module")
def model(model_dir):
    return mlx_lm.load(str(model_dir))[0]


def logits_after(model, prefix: mx.array, chunk: mx.array, plain: bool) -> mx.array:
    cache = make_prompt_cache(model)
    model(prefix[None], cache=cache)
    mx.eval([c.state for c in cache])
    if plain:
        with plain_prefill(model):
            out = model(chunk[None], cache=cache)
    else:
        out = model(chunk[None], cache=cache)
    return out.astype(mx.float32)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same weights in float32: the numbers both attentions approximate."""
    model = mlx_lm.load(str(model_dir))[0]
    model.set_dtype(mx.float32)
    return model


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_plain_prefill_is_as_close_to_float32_as_the_fused_kernel(model, reference, chunk):
    tokens = mx.random.randint(0, 256, (100 + chunk,), key=mx.random.key(chunk)).astype(mx.uint32)
    exact = logits_after(reference, tokens[:100], tokens[100:], plain=False)
    fused = logits_after(model, tokens[:100], tokens[100:], plain=False)
    plain = logits_after(model, tokens[:100], tokens[100:], plain=True)
    fused_error, plain_error = (mx.abs(x - exact).max().item() for x in (fused, plain))
    print(f"chunk {chunk}: max error against float32: fused {fused_error:.4f}, plain {plain_error:.4f}")
    assert plain.shape == fused.shape
    assert plain_error <= fused_error * 1.25 + 1e-3  # bf16 weights and KV bound both; plain adds no error of its own


def test_the_fused_kernel_is_back_after_the_chunk_and_big_chunks_keep_it(model):
    fused = llama.scaled_dot_product_attention
    with plain_prefill(model):
        assert llama.scaled_dot_product_attention is not fused
    assert llama.scaled_dot_product_attention is fused
    calls = []
    attention = plain_attention(lambda *a, **k: calls.append(k["mask"]) or "fused")
    q = mx.zeros((1, 4, 8, 16))
    keys = mx.zeros((1, 2, 8, 16))
    assert attention(q, keys, keys, None, 1.0, mx.zeros((8, 8))) == "fused"  # an array mask: the kernel's
    big = PLAIN_MAX_BYTES // (4 * 4 * 8) + 1  # scores over this many keys would pass the byte bound
    assert attention(q, mx.zeros((1, 2, big, 16)), mx.zeros((1, 2, big, 16)), None, 1.0, "causal") == "fused"
    assert len(calls) == 2 and attention(q, keys, keys, None, 1.0, "causal").shape == (1, 4, 8, 16)


def test_a_copied_prefix_then_plain_prefill_continues_like_one_cache(model):
    tokens = mx.random.randint(0, 256, (90,), key=mx.random.key(5)).astype(mx.uint32)
    cache = make_prompt_cache(model)
    model(tokens[:60][None], cache=cache)
    mx.eval([c.state for c in cache])
    twin = kvstate.copy_prefix(cache, 60)
    with plain_prefill(model):
        a = model(tokens[60:][None], cache=cache)
        b = model(tokens[60:][None], cache=twin)
    assert mx.array_equal(a, b).item()
