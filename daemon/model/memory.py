"""MLX's memory limits, set from the machine and the daemon's settings, and the tokens one session may hold.

What grew a process to many times its KV resident on a GPU (docs/decisions.md,
"Memory limits (issue 25, point 7)"): MLX's
buffer cache. A long prefill left more freed buffers cached than it had in use
(the KV grows in steps and every step is a new, larger buffer; attention's
scratch comes in ever new sizes). MLX lets its cache grow to its memory limit
(95% of the GPU's memory on CUDA), and on CUDA its buffers are managed memory,
which the driver spills to host memory past the GPU's size: two such sessions
and the kernel's OOM killer ends the daemon. A cache limit of a few GiB keeps
it bounded with no slower prefill, sleep, wake or first token (the same section).

So the daemon sets both limits at start (`apply_limits`): the cache limit
(`mlx_cache_bytes`, default 4 GiB) and the memory limit (`mlx_memory_bytes`,
default 90% of the memory MLX computes in: the GPU's own on CUDA, else the
machine's RAM). And since MLX on CUDA does not refuse an allocation past its
limit (it spills), the daemon refuses work before it starts: a session may hold
at most `session_tokens` tokens, the KV that fits the memory limit after the
weights and a prefill's working memory (`Engine.check_fits`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvwake.daemon.kv import capacity as kvcapacity
from kvwake.daemon.kv import cache_blocks

__all__ = ["DEFAULT_CACHE_BYTES", "DEFAULT_HOT_BUDGET", "HOT_SHARE", "MEMORY_SHARE", "Limits", "apply_limits",
           "device_memory", "hot_budget", "hot_budget_in", "kv_room", "kv_token_bytes", "session_tokens", "tokens_in"]

DEFAULT_CACHE_BYTES = 4 << 30
MEMORY_SHARE = 0.9  # of the device's memory, when no limit is configured
WORKSPACE_SHARE = 0.1  # of the limit, kept for a prefill's scratch (docs/decisions.md, "Memory limits (issue 25, point 7)")
HOT_SHARE = 0.5  # of the memory left for KV, the hot sessions' budget when none is configured
DEFAULT_HOT_BUDGET = 2 << 30  # the budget of an engine that sets no limits (tests, tools)


@dataclass(frozen=True)
class Limits:
    """The limits in force: bytes MLX may use, bytes of freed buffers it may keep."""

    memory_bytes: int
    cache_bytes: int


def device_memory() -> int:
    """Bytes of the memory MLX computes in: a GPU's own (CUDA reports it), else the machine's RAM (CPU,
    and Apple silicon's unified memory)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    info = mx.device_info() if mx.default_device() == mx.gpu else {}
    gpu = int(info.get("total_memory", 0) or info.get("memory_size", 0) or 0)  # CUDA's name, Metal's
    return min(gpu, ram) if gpu else ram


def apply_limits(memory_bytes: int | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES) -> Limits:
    """Set MLX's memory limit (`memory_bytes`, None: MEMORY_SHARE of device_memory()) and cache limit."""
    limits = Limits(memory_bytes or int(device_memory() * MEMORY_SHARE), cache_bytes)
    mx.set_memory_limit(limits.memory_bytes)
    mx.set_cache_limit(limits.cache_bytes)
    return limits


def kv_token_bytes(model: Any, kv_bits: int | None = None, kv_group_size: int = 64) -> int:
    """Bytes one more token adds to a session's KV (the cuttable layers'; windows and recurrent state do not
    grow), from the shapes a one-token forward pass gives a fresh cache: the pass is built, never run (MLX
    knows an array's shape before computing it), so no kernel is compiled or run for it at a start.
    Quantized KV (`kv_bits`) is counted from the plain cache's: `kv_bits` per value plus a scale and a bias
    (16 bits each) per group, not measured by a quantized pass (mlx-cuda has no quantized kernels for some
    shapes, and the engine must still start)."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]], dtype=mx.uint32), cache=cache)
    plain = cache_blocks.bytes_per_token(cache)
    if kv_bits is None:
        return plain
    itemsize = next((c.keys.dtype.size for c in cache if getattr(c, "keys", None) is not None), 2)
    return int(plain / itemsize * (kv_bits / 8 + 4 / kv_group_size))


def kv_room(limits: Limits, weights_bytes: int) -> int:
    """Bytes the memory limit leaves for KV: beside the weights and a prefill's scratch (WORKSPACE_SHARE)."""
    return int(max(0.0, limits.memory_bytes * (1 - WORKSPACE_SHARE) - weights_bytes))


def hot_budget(limits: Limits, weights_bytes: int) -> int:
    """Bytes of KV hot sessions may hold before the least recently used sleep, when none is configured:
    HOT_SHARE of what the memory limit leaves beside the weights and a prefill's scratch. The other half is
    room for a session to wake or prefill while others stay hot. A fixed budget smaller than one long session
    put it to sleep between an agent's turns, so its next turn restored it instead of continuing it
    (docs/decisions.md, "Memory limits (issue 25, point 7)")."""
    return hot_budget_in(kv_room(limits, weights_bytes))


def hot_budget_in(room: int) -> int:
    """The hot sessions' budget when none is configured, of `room` bytes all KV may hold (`hot_budget`)."""
    return int(HOT_SHARE * room)


def session_tokens(limits: Limits, weights_bytes: int, token_bytes: int) -> int | None:
    """The most tokens one session's KV may hold under `limits`, beside the weights and a prefill's scratch;
    None when a token costs nothing that grows."""
    return tokens_in(kv_room(limits, weights_bytes), token_bytes)


def tokens_in(room: int, token_bytes: int) -> int | None:
    """The most tokens one session's KV may hold in `room` bytes; None when a token costs nothing that grows."""
    if token_bytes <= 0:
        return None
    tokens = room // token_bytes
    if kvcapacity.installed() and tokens > kvcapacity.CUDNN_MIN:
        # Past CUDNN_MIN a buffer holds up to a sixteenth more than its tokens (kv/capacity.py): the most
        # tokens whose buffer fits, not the most tokens (it would eat the prefill's scratch share).
        lo, hi = kvcapacity.CUDNN_MIN, tokens  # capacity(CUDNN_MIN) is CUDNN_MIN: it fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if kvcapacity.capacity(mid) <= tokens else (lo, mid - 1)
        tokens = lo
    return tokens
