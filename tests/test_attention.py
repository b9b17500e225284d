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


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_plain_prefill_gives_the_fused_kernels_logits(model, chunk):
    tokens = mx.random.randint(0, 256, (100 + chunk,), key=mx.random.key(chunk)).astype(mx.uint32)
    fused = logits_after(model, tokens[:100], tokens[100:], plain=False)
    plain = logits_after(model, tokens[:100], tokens[100:], plain=True)
    assert fused.shape == plain.shape
    if mx.default_device() == mx.cpu:  # MLX's own CPU attention is these plain ops: bit for bit
        assert mx.array_equal(fused, plain).item()
    assert mx.abs(fused - plain).max().item() < 2e-2 * max(1.0, mx.abs(fused).max().item())
    assert (mx.argmax(fused, -1) == mx.argmax(plain, -1)).all().item()


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
