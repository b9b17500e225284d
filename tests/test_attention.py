"""Plain-ops prefill attention (daemon/model/attention.py): the same numbers as the fused kernel, swapped in and out."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from kvwake.daemon.kv import state as kvstate
from kvwake.daemon.model.attention import PLAIN_MAX_BYTES, plain_attention, plain_prefill


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


def float64_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal grouped-query attention in float64 numpy: the reference both attentions approximate."""
    rep, q_len, k_len = q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    scores[..., np.arange(k_len)[None] > np.arange(k_len - q_len, k_len)[:, None]] = -np.inf
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return (probs / probs.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("q_len", [2, 35, 200])
def test_plain_attention_is_as_exact_as_the_fused_kernel(q_len):
    shapes = {"q": (1, 8, q_len, 128), "k": (1, 2, 700, 128), "v": (1, 2, 700, 128)}
    q, k, v = (mx.random.normal(s, key=mx.random.key(i)).astype(mx.bfloat16) for i, s in enumerate(shapes.values()))
    scale = 128 ** -0.5
    exact = float64_attention(*(np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v)), scale)
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    plain = plain_attention(None)(q, k, v, None, scale, "causal")
    fused_error, plain_error = (np.abs(np.array(x.astype(mx.float32)) - exact).max() for x in (fused, plain))
    print(f"q_len {q_len}: max error against float64: fused {fused_error:.5f}, plain {plain_error:.5f}")
    assert plain.dtype == mx.bfloat16 and plain.shape == fused.shape
    assert plain_error <= fused_error * 1.1 + 1e-6


@pytest.mark.parametrize("chunk", [2, 7, 64])
def test_plain_prefill_gives_the_models_logits(model, chunk):
    tokens = mx.random.randint(0, 256, (100 + chunk,), key=mx.random.key(chunk)).astype(mx.uint32)
    fused = logits_after(model, tokens[:100], tokens[100:], plain=False)
    plain = logits_after(model, tokens[:100], tokens[100:], plain=True)
    # Within bf16's reach of each other (a wrong mask or head grouping moves logits by their whole range).
    assert plain.shape == fused.shape
    assert mx.abs(fused - plain).max().item() < 0.1 * mx.abs(fused).max().item()


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
    assert attention(q[:, :, :1], keys, keys, None, 1.0, None) == "fused"  # one query: the vector kernel
    assert len(calls) == 3 and attention(q, keys, keys, None, 1.0, "causal").shape == (1, 4, 8, 16)


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


def test_the_engine_takes_plain_attention_only_for_a_chunk_shorter_than_its_step(model_dir, tmp_path, monkeypatch):
    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.session import Session
    from kvwake.store import Store

    monkeypatch.setattr(attention, "wanted", lambda: True)  # as on CUDA
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, prefill_step=32)
    used, real = [], attention.plain_prefill
    monkeypatch.setattr(attention, "plain_prefill", lambda m: used.append(m) or real(m))
    got = engine.append(Session("s"), tokens=list(range(1, 80)))  # 78 to prefill: chunks of 32, 32, 14
    assert got["prefilled"] == 78 and len(used) == 1
    engine.close()
    store.close()


def test_the_daemon_lets_mlx_keep_many_attention_graphs():
    """MLX on CUDA raises once its fused-attention graph cache (256 by default) has missed twice its size over
    the process's life; importing the engine raises that size, unless the user set it (a fresh process each)."""
    import os
    import subprocess
    import sys

    from kvwake.daemon.model import attention

    show = "import os, kvwake.daemon.model.engine; print(os.environ['MLX_CUDA_SDPA_CACHE_SIZE'])"
    env = {k: v for k, v in os.environ.items() if k != "MLX_CUDA_SDPA_CACHE_SIZE"}
    unset = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True)
    given = subprocess.run([sys.executable, "-c", show], env={**env, "MLX_CUDA_SDPA_CACHE_SIZE": "77"},
                           capture_output=True, text=True, check=True)
    assert (unset.stdout.strip(), given.stdout.strip()) == (str(attention.SDPA_GRAPHS), "77")
