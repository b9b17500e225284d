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
        mx.eval(model(mx.array([[1]]), cache=cache))  # and a decode step: its kernels differ (mlx-cuda: 1x1 shapes)
    except RuntimeError as exc:  # e.g. mlx-cuda: "[quantized_matmul] No implementation for problem shape"
        return str(exc)
    return None


def require_quantized_kv(model: Any, bits: int, group_size: int = 32, tokens: int = 48) -> None:
    """Skip unless this model's attention runs over `bits`-bit quantized KV here (probed with a real
    prefill of `tokens` tokens and one decode step, once per model object and setting)."""
    failure = _quantized_kv_failure(model, bits, group_size, tokens)
    if failure is not None:
        pytest.skip(f"quantized KV ({bits}-bit, group {group_size}) does not run on {mx.default_device()} "
                    f"(probed: {failure})")


_chunking: dict[int, bool] = {}


def chunked_prefill_is_exact(engine: Any, tokens: int = 40, splits: tuple[int, ...] = (32, 37, 39)) -> bool:
    """Whether the engine's prefill of `tokens` tokens in two chunks (each of `splits`, then the rest) leaves
    next-token logits bit-identical to one chunk of them all, as a prefix hit and a cold prefill do: true on
    the CPU; MLX on CUDA picks kernels (and kvwake its attention path) by shape, so it may not be: a long
    rest and a rest of a few tokens both. Probed once per engine, on its own prefill path."""
    from kvwake.daemon.session_state import Session

    if getattr(getattr(engine, "planner", None), "plain_prefill", False):
        # CUDA: a chunk's attention path is chosen by costs each engine's planner measures (and by what the
        # process built before), so two engines may prefill the same chunk two ways: a warmed prompt's hit
        # can be bit-exact in one run of the suite and not in the next
        return False
    if id(engine) not in _chunking:
        # and a hit of a whole warmed prompt of `tokens` (warm prefills all but its last token, then that
        # one) with a few more after it: the tests' own shapes (on CUDA the first probe alone can say
        # exact while such a hit is not)
        exact = True
        for total, cuts in ((tokens, [(split,) for split in splits]), (tokens + 3, [(tokens,), (tokens - 1, tokens)])):
            ids = [(i * 31 + 11) % 200 + 20 for i in range(total)]
            logits = []
            for stops in ((total - 1,), *((*cut, total - 1) for cut in cuts)):
                session = Session("probe", tokens=list(ids), cache=make_prompt_cache(engine.model))
                for upto in stops:
                    engine.prefill(session, upto)
                logits.append(engine.model(mx.array(ids[-1:], dtype=mx.uint32)[None], cache=session.cache)[0, -1])
            exact = exact and all(bool(mx.array_equal(logits[0], other).item()) for other in logits[1:])
        _chunking[id(engine)] = exact
    return _chunking[id(engine)]


_decoding: dict[str, bool] = {}


def decode_matches_prefill(model_dir: Any, tokens: int = 40) -> bool:
    """Whether a token's logits are bit-identical decoded alone after `tokens` - 1 prefilled and prefilled as the
    last of a chunk of `tokens` (mlx-lm's own forward of the model in `model_dir`): true on the CPU; on CUDA MLX
    takes other kernels for one query than for many, so a conversation that comes back from a crash with its
    last reply's tokens prefilled (they were decoded) is held to a bound there, not to bits (DESIGN, invariant 1).
    Probed once per model folder; never exact where kvwake's own prefill attention runs (CUDA's plain and
    bucketed paths, `attention.wanted`), whose bits mlx-lm's forward does not show."""
    from mlx_lm import load

    from kvwake.daemon.model import attention

    if attention.wanted():
        return False
    key = str(model_dir)
    if key not in _decoding:
        model, _ = load(key)
        ids = mx.array([[(i * 37 + 5) % 200 + 20 for i in range(tokens)]], dtype=mx.uint32)
        whole, part = make_prompt_cache(model), make_prompt_cache(model)
        chunk = model(ids, cache=whole)[:, -1]
        model(ids[:, :-1], cache=part)
        step = model(ids[:, -1:], cache=part)[:, -1]
        _decoding[key] = bool(mx.array_equal(chunk, step).item())
    return _decoding[key]
