"""Constrained decoding: each step's token mask, one (batch, ceil(vocab/32)) int32 bitmask, applied in one op.

A constrained call has a `Constraint`: its llguidance matcher, advanced with
every token the model is fed (the prompt's last token excepted: the first
feed). The decoder's forward passes go through `MaskedModel` when any row is
constrained: it queues the forward pass, waits only for the tokens being fed
(sampled the step before), advances the matchers and fills the constrained
rows of the bitmask on llguidance's thread pool while the device computes,
then returns the logits with disallowed tokens at -inf. Unconstrained rows are
all ones. The sampling that follows (mlx-lm's, or Solo's) is unchanged, and a
step with no constrained row never comes here: the unconstrained hot path is
untouched.

EOS is allowed only where the grammar accepts (llguidance's mask says so for
its one EOS id; the tokenizer's other EOS ids get the same bit, and any of
them is fed to the matcher as that one). A matcher that fails (a token it did
not allow: never, unless the mask was not applied) records its error, allows
only EOS so the call ends at once, and the call fails with that error.
"""

from __future__ import annotations

import time
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
    """The step's bitmask: a buffer of max_batch rows, filled in place; llguidance's pool fills rows.

    `fill_s` and `fills` count the time spent filling (the per-step cost on the hot path).
    """

    def __init__(self, vocab_size: int, max_batch: int, threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.buffer = llnp.allocate_token_bitmask(max(1, max_batch), vocab_size)
        self.executor = llg.LLExecutor(threads)
        self.fill_s, self.fills = 0.0, 0

    def fill(self, constraints: list[Constraint | None]) -> np.ndarray:
        """The mask for rows in this order (None: unconstrained, all ones); a view of the buffer."""
        started = time.perf_counter()
        n = len(constraints)
        if n > len(self.buffer):
            self.buffer = llnp.allocate_token_bitmask(n, self.vocab_size)
        mask = self.buffer[:n]
        mask.fill(-1)
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

    `fed`: the tokens this pass feeds, one per row, as the array the step before sampled. Called
    with the model's input: queues the forward pass, then waits for `fed` alone (a new op on the
    input would queue behind the forward pass and wait for all of it), advances each constrained
    row's matcher and fills the mask while the device computes, and returns the masked logits,
    still lazy.
    """

    def __init__(self, model: Any, constraints: list[Constraint | None], masks: Masks, fed: mx.array) -> None:
        self.model, self.constraints, self.masks, self.fed = model, constraints, masks, fed

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        logits = self.model(inputs, cache=cache)
        mx.async_eval(logits)
        for constraint, token in zip(self.constraints, self.fed.tolist()):
            if constraint is not None:
                constraint.feed(token)
        return apply_mask(logits, self.masks.fill(self.constraints))
