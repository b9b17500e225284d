"""A generate call, and a call decoding alone.

`Call` is one generate call in flight: its session (whose cache it takes while
it runs), the token it feeds first, its output, and how it ends (`finish`: the
session takes its tokens; `fail`: the session's cache is dropped, rebuilt from
its tokens on next use).

`Solo` decodes one call alone on its session's own cache (mlx-lm's
`generate_step`, one step at a time). A call that starts while no other call
decodes or waits goes this way: a batch of one costs more per token than a
plain forward pass (docs/history/benchmarks-journal.md, "Many agents at once:
batched generation (issue 11)"). The decoder (decoder.py) moves it into the
batch when company comes.

`batch_mode` says whether a model's calls can decode together at all: quantized
KV, cache kinds kvwake does not batch, rotary embeddings that take one offset
for every row and models whose batched pass cannot be built decode alone, as
does every call when `max_batch` is 1 (for users who need output bit-identical
to decoding alone).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from kvwake.daemon.kv import capacity as kvcapacity
from kvwake.daemon.jobs import unframed
from kvwake.daemon.model.generation import GenerateResult, TextOutput
from kvwake.daemon.model.masks import Constraint
from kvwake.daemon.model.packing import packable_model
from kvwake.daemon.session_state import Session
from kvwake.errors import InternalError

__all__ = ["Call", "Solo", "batch_mode"]


@dataclass
class Call:
    """One generate call: its session (whose cache it takes while it runs), last prompt token and output."""

    session: Session
    token: int  # the pending token fed at the first step (earlier pending tokens are prefilled)
    output: TextOutput
    prompt_tokens: int
    future: Future[GenerateResult] = field(default_factory=Future)
    solo: Solo | None = None  # while it decodes alone
    constraint: Constraint | None = None  # structured output: its grammar masks each token (masks.py)

    def finish(self, reason: str) -> None:
        if self.constraint is not None and self.constraint.error is not None:
            self.fail(InternalError(f"constrained decoding failed in session {self.session.id}: "
                                    f"{self.constraint.error}", session_id=self.session.id))
            return
        result = self.output.result(reason, self.prompt_tokens)
        s = self.session
        if s.cache is not None:  # a lone call's growth ahead left half done: every layer one size again
            kvcapacity.even_out(s.cache)
        s.tokens = s.tokens + result.tokens
        s.processed = len(s.tokens)
        if s.mode == "chat":  # the raw text (tool-call markup and all): it re-renders to these same tokens
            s.messages.append({"role": "assistant", "content": result.text})
        self.future.set_result(result)

    def fail(self, exc: BaseException) -> None:
        self.session.cache, self.session.processed = None, 0  # state unknown: rebuilt from tokens on next use
        self.future.set_exception(unframed(exc))  # its frames' MLX arrays freed here, on the engine thread


class Solo:
    """One call decoding alone on its own cache: `generate_step`'s steps, with the state in the open.

    `next` is the token sampled but not yet fed; each step feeds it, samples the one after, and
    returns it, so every token returned is in the cache (as generate_step's yields are).
    `model_for(tokens)`: the model for the pass that feeds `tokens` (masked for a constrained call).
    """

    def __init__(self, model_for: Any, cache: list, first: mx.array, sampler: Any, processors: list,
                 context: list[int]) -> None:
        self.model_for, self.cache, self.sampler, self.processors = model_for, cache, sampler, processors
        self.context = mx.array(context, dtype=mx.uint32) if processors else None
        self.next = self._feed(first)
        mx.async_eval(self.next)

    def _feed(self, tokens: mx.array) -> mx.array:
        logits = self.model_for(tokens)(tokens[None], cache=self.cache)[:, -1, :]
        if self.processors:
            self.context = mx.concatenate([self.context, tokens]) if self.context is not None else tokens
            for processor in self.processors:
                logits = processor(self.context, logits)
        return self.sampler(logits - mx.logsumexp(logits, keepdims=True))

    def step(self) -> int:
        current = self.next
        kvcapacity.grow_ahead(self.cache)  # a full buffer's growth, a layer a step before it fills
        self.next = self._feed(current)
        mx.async_eval(self.next)
        return int(current.item())


# RoPE modules that rotate by a Python int offset: mlx-lm's DynamicNTKScalingRoPE takes its base from the offset
# and raises on the array of row offsets a batch's cache gives it (model/packing.py's ROW_ROPES take one)
ONE_OFFSET_ROPES = frozenset({"DynamicNTKScalingRoPE"})


def batch_mode(cache: list, kv_bits: int | None, max_batch: int, model: Any = None) -> tuple[str, str]:
    """("batched" | "solo", why) for a model whose fresh cache is `cache` (and, when `model` is given, whose
    modules are asked for a RoPE that takes one offset for every row and whose batched pass is built once)."""
    if max_batch <= 1:
        return "solo", "max_batch is 1: every call decodes alone"
    if kv_bits is not None or any(isinstance(c, QuantizedKVCache) for c in cache):
        return "solo", "quantized KV cannot be batched by mlx-lm"
    kinds = sorted({type(c).__name__ for c in cache if not _batchable(c)})
    if kinds:
        return "solo", f"cache layers mlx-lm cannot batch: {', '.join(kinds)}"
    ropes = sorted({type(m).__name__ for _, m in model.named_modules()} & ONE_OFFSET_ROPES) if model is not None else []
    if ropes:
        return "solo", f"rotary embeddings that take one offset for every row: {', '.join(ropes)}"
    # built only for models outside packing's list: those take each row's offset by design, and the build is
    # Python at a load's end, where another model's decode steps wait for the GIL (docs/decisions.md)
    refused = _batched_pass_refused(model, cache) if model is not None and not packable_model(model) else None
    if refused:
        return "solo", f"a batched pass cannot be built: {refused}"
    return "batched", f"up to {max_batch} calls per forward pass"


def _batched_pass_refused(model: Any, cache: list) -> str | None:
    """What building (never running) a one-token pass of two rows raises, if anything. Some models use the
    cache's offset as a Python int outside their RoPE (mlx-lm's gpt_bigcode numbers its positions with numpy's
    arange) and raise on a batch's array of row offsets as the pass is built, before any kernel runs."""
    try:
        model(mx.zeros((2, 1), dtype=mx.uint32), cache=[layer.merge([layer] * 2) for layer in cache])
    except Exception as exc:  # noqa: BLE001 - any of them: the batched step would raise it for every call
        return repr(exc)
    return None


def _batchable(layer: Any) -> bool:
    # The kinds mlx-lm merges and extracts whole: plain KV, a sliding window's ring (without kept
    # tokens: BatchRotatingKVCache has no `keep`) and recurrent state. What leaves the batch is the
    # same kind of cache, holding the same tokens (a window's ring in temporal order), and sleeps and
    # wakes as one decoded alone does (tests/test_batching_archs.py).
    kind = type(layer).__name__
    if kind == "CacheList":  # a layer of several caches (falcon_h1: recurrent state and KV): each member's kind
        return all(_batchable(member) for member in layer.caches)
    return kind in ("KVCache", "ArraysCache") or (kind == "RotatingKVCache" and layer.keep == 0)
