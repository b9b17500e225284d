"""Constrained decoding: each step's token mask, one (batch, ceil(vocab/32)) int32 bitmask, applied in one op.

A constrained call has a `Constraint`: its llguidance matcher, advanced with
every token the model is fed (the prompt's last token excepted: the first
feed). The decoder's forward passes go through `MaskedModel` when any row is
constrained: it queues the forward pass and returns its logits with the
tokens the grammar disallows at -inf. Unconstrained rows are all ones. The
sampling that follows (mlx-lm's, or Solo's) is unchanged, and a step with no
constrained row never comes here: the unconstrained hot path is untouched.

Ahead of the pass: a constrained step cannot be queued on the device ahead
of the host the way a free one is, since its mask needs the token sampled
the step before. So as soon as a step has scheduled its sampled tokens, the
decoder hands them to `Masks.prefetch`: one worker thread waits for a copy of
them that only it holds (a wait on an array already scheduled: it releases
the GIL and builds no MLX op), advances the matchers and fills the next pass's mask on llguidance's
pool, while the engine thread hands the step's tokens out and builds the next
forward pass. The pass then takes the mask ready (`take`). Where the rows
changed in between (a call joined), the pass waits for what was started,
feeds the rows nothing fed yet, and fills the mask itself, as every pass did
before. Every token is fed to its matcher exactly once, in order.

EOS is allowed only where the grammar accepts (llguidance's mask says so for
its one EOS id; the tokenizer's other EOS ids get the same bit, and any of
them is fed to the matcher as that one). A matcher that fails (a token it did
not allow: never, unless the mask was not applied) records its error, allows
only EOS so the call ends at once, and the call fails with that error.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance as llg
import llguidance.numpy as llnp
import mlx.core as mx
import numpy as np

__all__ = ["Constraint", "MaskedModel", "Masks", "apply_mask"]


class Constraint:
    """One call's grammar state. `feed` every token the model is fed, in order (the first, the
    prompt's last token, is skipped); `error` is set once the matcher failed."""

    def __init__(self, matcher: llg.LLMatcher, eos: set[int], eos_id: int) -> None:
        self.matcher, self.eos, self.eos_id = matcher, eos, eos_id
        self.prompt_token = True
        self.error: str | None = None

    def feed(self, token: int) -> None:
        if self.prompt_token:
            self.prompt_token = False
            return
        if self.error is None and not self.matcher.consume_token(self.eos_id if token in self.eos else token):
            self.error = self.matcher.get_error() or f"token {token} was not allowed"

    @property
    def accepting(self) -> bool:
        """The text so far is a whole answer (EOS would be allowed)."""
        return self.error is None and self.matcher.is_accepting()


class Masks:
    """Each pass's bitmask, filled on llguidance's pool; and the masks being filled ahead (`prefetch`).

    `fill_s` and `fills` count the time spent filling; `timing` the engine thread's own time in a
    constrained pass (waiting for a mask filled ahead, or feeding and filling itself).
    """

    def __init__(self, vocab_size: int, max_batch: int, threads: int | None = None, ahead: bool = True) -> None:
        self.vocab_size = vocab_size
        self.executor = llg.LLExecutor(threads)
        self.fill_s, self.fills = 0.0, 0
        self.ahead_enabled = ahead
        # The rows' constraints (ids, in row order) -> the work filling their next mask, and those rows.
        self._ahead: dict[tuple[int, ...], tuple[Future[np.ndarray], list[Constraint | None]]] = {}
        self._fed: set[Constraint] = set()  # fed ahead by work settled outside their pass: the pass skips the feed
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvwake-masks")
        self.timing = {"passes": 0, "ready": 0, "take_s": 0.0}

    def fill(self, constraints: list[Constraint | None]) -> np.ndarray:
        """The mask for rows in this order (None: unconstrained, all ones)."""
        started = time.perf_counter()
        mask = llnp.allocate_token_bitmask(len(constraints), self.vocab_size)  # its own: fills may overlap
        live = [(c.matcher, i) for i, c in enumerate(constraints) if c is not None and c.error is None]
        if live:
            llnp.fill_next_token_bitmask_par(self.executor, live, mask)
        for i, c in enumerate(constraints):
            if c is None:
                continue
            if c.error is not None or c.matcher.is_error():
                c.error = c.error or c.matcher.get_error()
                mask[i] = 0  # only EOS: the call ends now and fails with the matcher's error
                _allow(mask[i], c.eos_id)
            if len(c.eos) > 1 and mask[i, c.eos_id // 32] >> (c.eos_id % 32) & 1:
                for token in c.eos:
                    _allow(mask[i], token)
        self.fill_s += time.perf_counter() - started
        self.fills += 1
        return mask

    def prefetch(self, constraints: list[Constraint | None], sampled: mx.array) -> None:
        """`sampled` (already scheduled) holds the token each row feeds next: feed them and fill the
        next pass's mask on the worker thread. Call only for rows that will be fed these tokens."""
        if self.ahead_enabled and any(constraints):
            # The worker waits on a copy of its own: waiting changes an array (MLX drops its event),
            # and the engine thread reads `sampled`'s as it queues the next pass (a crash on CUDA).
            copy = sampled.astype(mx.int32)
            mx.async_eval(copy)
            self._ahead[_key(constraints)] = (self._worker.submit(self._advance, constraints, copy), constraints)

    def _advance(self, constraints: list[Constraint | None], sampled: mx.array) -> np.ndarray:
        mx.eval(sampled)  # scheduled by the engine thread, and only this thread holds it: only waits
        for constraint, token in zip(constraints, sampled.tolist()):
            if constraint is not None:
                constraint.feed(token)
        return self.fill(constraints)

    def take(self, constraints: list[Constraint | None], fed: mx.array) -> np.ndarray:
        """The mask for the pass that feeds `fed` (one token per row, scheduled) to these rows."""
        started = time.perf_counter()
        ready = self._ahead.pop(_key(constraints), None)
        self.timing["passes"] += 1
        if ready is not None:
            mask = ready[0].result()
            self.timing["ready"] += 1
        else:
            self.settle(constraints, strict=True)
            for constraint, token in zip(constraints, fed.tolist()):
                if constraint is None:
                    continue
                if constraint in self._fed:
                    self._fed.discard(constraint)
                else:
                    constraint.feed(token)
            mask = self.fill(constraints)
        self.timing["take_s"] += time.perf_counter() - started
        return mask

    def settle(self, constraints: list[Constraint | None], strict: bool = False) -> None:
        """Wait for the work ahead that touches these rows. Every row that work fed (these and any
        other in it) is remembered, so its own pass, whenever it comes, does not feed it again.
        `strict`: a failure there is raised (for a pass); else ignored (the rows are failing)."""
        ids = {id(c) for c in constraints if c is not None}
        for key in [k for k in self._ahead if ids.intersection(k)]:
            future, rows = self._ahead.pop(key)
            if strict:
                future.result()
            else:
                future.exception()
            self._fed.update(c for c in rows if c is not None)

    def forget(self, constraints: list[Constraint | None]) -> None:
        """Rows that will have no pass again (their calls failed or were dropped): settle and forget them."""
        self.settle(constraints)
        self._fed.difference_update(constraints)


def _key(constraints: list[Constraint | None]) -> tuple[int, ...]:
    return tuple(id(c) if c is not None else 0 for c in constraints)


def _allow(row: np.ndarray, token: int) -> None:
    row[token // 32] |= np.uint32(1 << (token % 32)).view(np.int32)


@mx.compile
def _masked(logits: mx.array, mask: mx.array) -> mx.array:
    bits = ((mask[..., None] >> mx.arange(32, dtype=mx.int32)) & 1).reshape(mask.shape[0], -1)[:, : logits.shape[-1]]
    return mx.where(bits.astype(mx.bool_), logits, mx.array(-mx.inf, dtype=logits.dtype))


def apply_mask(logits: mx.array, mask: np.ndarray) -> mx.array:
    """`logits` (batch, vocab) or (batch, 1, vocab) with the tokens the mask's bits do not allow at -inf."""
    flat = logits.reshape(logits.shape[0], logits.shape[-1])
    return _masked(flat, mx.array(mask)).reshape(logits.shape)


class MaskedModel:
    """The model for one forward pass over rows some of which are constrained (same call signature).

    `fed`: the tokens this pass feeds, one per row, as the array the step before sampled (scheduled).
    Called with the model's input: queues the forward pass, then takes the pass's mask (filled
    ahead, or filled now while the device computes) and returns the masked logits, still lazy.
    """

    def __init__(self, model: Any, constraints: list[Constraint | None], masks: Masks, fed: mx.array) -> None:
        self.model, self.constraints, self.masks, self.fed = model, constraints, masks, fed

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        logits = self.model(inputs, cache=cache)
        mx.async_eval(logits)
        return apply_mask(logits, self.masks.take(self.constraints, self.fed))
