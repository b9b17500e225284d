"""The decoder: every generate call in flight, advanced one token per step on the engine thread.

Batched mode (models whose cache layers mlx-lm can merge): calls decode
together, one forward pass per step, through mlx-lm's `GenerationBatch` over a
`BatchKVCache` (shorter histories are left-padded and the padding masked). A
call joins between steps: its session's plain cache is merged into a one-row
batch, which takes its first step alone and then joins the running batch. A
call leaves when it finishes: its row is extracted as a plain per-layer cache
into its session and the batch is filtered. So whenever no call runs on a
session, the session holds a plain cache, and sleep, fork and prefix reuse see
what they always saw.

A call that starts while no other call decodes or waits decodes alone, on
its session's own cache (`Solo`: mlx-lm's `generate_step`, one step at a
time): a batch of one costs more per token than a plain forward pass (on the
H100 machine, 10.5-13.8 ms against 8.1-9.6 ms per token). When a second call
arrives, the lone call moves into the batch between two steps, with the token
it has sampled but not yet fed.

Structured output: a call with a `Constraint` has its logits masked by its
grammar each step (masks.py); while any running call has one, the forward pass
goes through `MaskedModel`, so constrained and unconstrained calls still share
one forward pass and one mask op per step. After each step the decoder hands
the constrained rows' sampled tokens to `Masks.prefetch`, so the next mask is
filled on a worker thread while this thread hands tokens out and builds the
next pass.

Solo mode (quantized KV and cache kinds kvwake does not batch; or
`max_batch` = 1 for users who need output bit-identical to decoding alone):
every call decodes alone; calls take one step each in turn, so they
interleave but never share a forward pass.

At most `max_batch` calls decode at once; more wait, in order, for a place.
Every token handed to a call's `TextOutput` has been fed to the model, so a
finished call's cache covers all of its tokens. A step that raises fails the
calls it was running (their caches are dropped; the engine rebuilds them from
the tokens on next use); the decoder itself goes on.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences, generation_stream
from mlx_lm.models.cache import QuantizedKVCache
from mlx_lm.sample_utils import greedy_sampler

from kvwake.daemon.model.generation import GenerateResult, TextOutput, make_processors, make_sampler
from kvwake.daemon.model.masks import Constraint, MaskedModel, Masks
from kvwake.daemon.session import Session
from kvwake.errors import InternalError

__all__ = ["Call", "Decoder", "batch_mode", "run_alone"]

log = logging.getLogger("kvwake.decoder")
UNLIMITED = 1 << 62  # GenerationBatch's own max_tokens: TextOutput decides when a call ends


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
        s.tokens = s.tokens + result.tokens
        s.processed = len(s.tokens)
        if s.mode == "chat":  # the raw text (tool-call markup and all): it re-renders to these same tokens
            s.messages.append({"role": "assistant", "content": result.text})
        self.future.set_result(result)

    def fail(self, exc: BaseException) -> None:
        self.session.cache, self.session.processed = None, 0  # state unknown: rebuilt from tokens on next use
        self.future.set_exception(exc)


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
        self.next = self._feed(current)
        mx.async_eval(self.next)
        return int(current.item())


def batch_mode(cache: list, kv_bits: int | None, max_batch: int) -> tuple[str, str]:
    """("batched" | "solo", why) for a model whose fresh cache is `cache`."""
    if max_batch <= 1:
        return "solo", "max_batch is 1: every call decodes alone"
    if kv_bits is not None or any(isinstance(c, QuantizedKVCache) for c in cache):
        return "solo", "quantized KV cannot be batched by mlx-lm"
    kinds = sorted({type(c).__name__ for c in cache if not _batchable(c)})
    if kinds:
        return "solo", f"cache layers mlx-lm cannot batch: {', '.join(kinds)}"
    return "batched", f"up to {max_batch} calls per forward pass"


def _batchable(layer: Any) -> bool:
    # Plain KV only: mlx-lm can also merge sliding-window and recurrent layers, but its batched
    # forms of those give back caches laid out differently from the ones kvwake captures.
    return type(layer).__name__ == "KVCache"


class Decoder:
    """Calls in flight and waiting; `step()` (engine thread) advances each running call by one token."""

    def __init__(self, model: Any, mode: str, max_batch: int, vocab_size: int) -> None:
        self.model, self.mode, self.max_batch = model, mode, max(1, max_batch)
        self.masks = Masks(vocab_size, self.max_batch)
        self.waiting: deque[Call] = deque()
        self.solo: list[Call] = []
        self.batch: GenerationBatch | None = None
        self.rows: dict[int, Call] = {}  # batch uid -> call
        self._uids = itertools.count()
        self.counters = {"decode_steps": 0, "decode_tokens": 0, "max_batch_seen": 0}
        self.step_s = 0.0  # moving average of one step's wall time

    @property
    def running(self) -> int:
        return len(self.rows) + len(self.solo)

    @property
    def active(self) -> bool:
        return bool(self.waiting or self.rows or self.solo)

    def join(self, call: Call) -> None:
        """Queue a call; it starts at the next step with a free place."""
        self.waiting.append(call)

    def step(self) -> None:
        """Admit waiting calls, then one token for every running call."""
        started = time.perf_counter()
        with mx.stream(generation_stream):
            while self.waiting and self.running < self.max_batch:
                self._admit(self.waiting.popleft())
            self._step_batch()
            for call in list(self.solo):
                self._step_solo(call)
        n = self.running
        self.counters["max_batch_seen"] = max(self.counters["max_batch_seen"], n)
        self.step_s = 0.9 * self.step_s + 0.1 * (time.perf_counter() - started) if self.step_s else \
            time.perf_counter() - started

    def abort(self, exc: BaseException) -> None:
        """Fail every call (the engine thread is stopping)."""
        calls = [*self.waiting, *self.rows.values(), *self.solo]
        self.masks.settle([call.constraint for call in calls])
        for call in calls:
            call.fail(exc)
        self.waiting.clear()
        self.rows.clear()
        self.solo.clear()
        self.batch = None

    # -- joining ----------------------------------------------------------------

    def _admit(self, call: Call) -> None:
        s, p = call.session, call.output.params
        try:
            if self.mode == "batched" and (self.rows or self.solo or self.waiting):
                for lone in list(self.solo):  # company: the lone call joins the batch first
                    self._move_to_batch(lone)
                self._join_batch(call, mx.array([call.token], dtype=mx.uint32), s.cache, [])
            else:
                call.solo = Solo(lambda fed, call=call: self._model([call], fed), s.cache, mx.array([call.token], dtype=mx.uint32), make_sampler(p),
                                 make_processors(p), s.tokens[: s.processed])
                self.solo.append(call)
                self.masks.prefetch([call.constraint], call.solo.next)
        except Exception as exc:  # bad input for this call only (the model raised on it)
            call.fail(exc)

    def _move_to_batch(self, call: Call) -> None:
        """A lone call joins the batch with the token it has sampled: the batch's first step feeds it
        without returning it, so it is handed to the call's output here."""
        self.solo.remove(call)
        assert call.solo is not None
        token = call.solo.next
        self.counters["decode_tokens"] += 1  # a token handed out, not a step of its own
        reason = call.output.add(int(token.item()))
        if reason is not None:  # that token ends the call: feed it alone, as every token handed out is
            call.solo.step()
            call.solo = None
            call.finish(reason)
            return
        self._join_batch(call, token, call.solo.cache, call.output.tokens[:-1])

    def _join_batch(self, call: Call, inputs: mx.array, cache: list, generated: list[int]) -> None:
        """Add a call whose cache holds its history and `generated`; `inputs` is its next token to feed."""
        s, p = call.session, call.output.params
        sampler = call.solo.sampler if call.solo is not None else make_sampler(p)  # the same random state
        call.solo = None
        uid = next(self._uids)
        merged = [layer.merge([layer]) for layer in cache]
        one = GenerationBatch(self._model([call], inputs), [uid], inputs, merged, [s.tokens[: s.processed] + generated],
                              [sampler], greedy_sampler, [make_processors(p)], [StopSequences()],
                              [UNLIMITED])  # takes the call's next step, alone
        s.cache = None  # the batch holds the only copy until the call leaves
        if self.batch is None:
            self.batch = one
        else:
            self.batch.extend(one)
            mx.async_eval(self.batch._next_tokens)  # joined: scheduled before the next pass (MaskedModel waits on it)
        self.rows[uid] = call

    # -- stepping ---------------------------------------------------------------

    def _model(self, calls: list[Call], fed: mx.array) -> Any:
        """The model for a forward pass over `calls` (in row order) feeding `fed`: masked when any is
        constrained. `fed` must be the array the step before scheduled (or a constant), so waiting
        for its values never waits for this pass."""
        constraints = [call.constraint for call in calls]
        return MaskedModel(self.model, constraints, self.masks, fed) if any(constraints) else self.model

    def _step_batch(self) -> None:
        if self.batch is None:
            return
        # mlx-lm's GenerationBatch feeds `_next_tokens`, sampled (and scheduled) by its step before.
        self.batch.model = self._model([self.rows[uid] for uid in self.batch.uids], self.batch._next_tokens)
        try:
            responses = self.batch.next()
        except Exception as exc:
            log.exception("batched decode step failed; failing its %d calls", len(self.rows))
            self.masks.settle([call.constraint for call in self.rows.values()])
            for call in self.rows.values():
                call.fail(exc)
            self.rows.clear()
            self.batch = None
            return
        self._count(len(responses))
        done = [(i, r.uid, reason) for i, r in enumerate(responses)
                if (reason := self.rows[r.uid].output.add(r.token)) is not None]
        if done:
            self._leave(done)
        if self.batch is not None:  # the rows that go on: their next mask, filled while this thread goes on
            self.masks.prefetch([self.rows[uid].constraint for uid in self.batch.uids], self.batch._next_tokens)

    def _leave(self, done: list[tuple[int, int, str]]) -> None:
        """Give finished rows back to their sessions as plain caches; keep the others batched."""
        batch = self.batch
        assert batch is not None
        for i, uid, reason in done:
            call = self.rows.pop(uid)
            call.session.cache = batch.extract_cache(i)
            mx.eval([c.state for c in call.session.cache])
            call.finish(reason)
        leaving = {i for i, _, _ in done}
        keep = [i for i in range(len(batch.uids)) if i not in leaving]
        if keep:
            batch.filter(keep)
            mx.async_eval(batch._next_tokens)  # the rows kept: scheduled before the next pass
        else:
            self.batch = None

    def _step_solo(self, call: Call) -> None:
        assert call.solo is not None
        try:
            token = call.solo.step()
        except Exception as exc:
            self.solo.remove(call)
            self.masks.settle([call.constraint])
            call.fail(exc)
            return
        self._count(1)
        reason = call.output.add(token)
        if reason is not None:
            self.solo.remove(call)
            call.solo = None
            call.finish(reason)
        else:
            self.masks.prefetch([call.constraint], call.solo.next)

    def _count(self, tokens: int) -> None:
        self.counters["decode_steps"] += 1
        self.counters["decode_tokens"] += tokens

    def status(self) -> dict[str, Any]:
        masks = self.masks
        return {"running": self.running, "waiting": len(self.waiting), **self.counters,
                "step_ms": round(self.step_s * 1000, 3), "mask_fills": masks.fills,
                "mask_fill_ms": round(masks.fill_s / masks.fills * 1000, 4) if masks.fills else None,
                "mask_passes": masks.timing["passes"], "masks_ready_ahead": masks.timing["ready"],
                "mask_take_ms": round(masks.timing["take_s"] / masks.timing["passes"] * 1000, 4)
                if masks.timing["passes"] else None}


def run_alone(decoder: Decoder, call: Call) -> GenerateResult:
    """Drive `call` to its end on the calling (engine) thread: the in-process engine's generate."""
    decoder.join(call)
    while not call.future.done():
        decoder.step()
    return call.future.result()
