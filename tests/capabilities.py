"""Skips found by probing what this machine's MLX can do, never by platform name."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache


_probed: dict[tuple, str | None] = {}


def _quantized_kv_failure(model: Any, bits: int, group_size: int, tokens: int) -> str | None:
    key = (id(model), bits, group_size, tokens)
    if key not in _probed:
        _probed[key] = _probe(model, bits, group_size, tokens)
    return _probed[key]


def _probe(model: Any, bits: int, group_size: int, tokens: int) -> str | None:
    cache = [c.to_quantized(group_size=group_size, bits=bits) for c in make_prompt_cache(model)]
    try:
        mx.eval(model(mx.array([list(range(1, tokens + 1))]), cache=cache))
    except RuntimeError as exc:  # e.g. mlx-cuda: "[quantized_matmul] No implementation for problem shape"
        return str(exc)
    return None


def require_quantized_kv(model: Any, bits: int, group_size: int = 32, tokens: int = 48) -> None:
    """Skip unless this model's attention runs over `bits`-bit quantized KV here (probed with a real
    prefill of `tokens` tokens, once per model object and setting)."""
    failure = _quantized_kv_failure(model, bits, group_size, tokens)
    if failure is not None:
        pytest.skip(f"quantized KV ({bits}-bit, group {group_size}) does not run on {mx.default_device()} "
                    f"(probed: {failure})")


_chunking: dict[int, bool] = {}


def chunked_prefill_is_exact(model: Any, tokens: int = 40, split: int = 32) -> bool:
    """Whether prefilling `tokens` tokens as two chunks (`split`, then the rest) gives logits bit-identical
    to one chunk of them all here: true on the CPU; MLX on CUDA picks kernels by shape, so it may not be.
    Probed once per model object, with the model's own cache."""
    key = id(model)
    if key not in _chunking:
        ids = mx.array([[(i * 31 + 11) % 200 + 20 for i in range(tokens)]], dtype=mx.uint32)
        whole = model(ids, cache=make_prompt_cache(model))[0, -1]
        cache = make_prompt_cache(model)
        model(ids[:, :split], cache=cache)
        parts = model(ids[:, split:], cache=cache)[0, -1]
        _chunking[key] = bool(mx.array_equal(whole, parts).item())
    return _chunking[key]
