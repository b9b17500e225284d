"""A prefill chunk computed a slice of layers at a time, so decoding calls wait one slice, not one chunk.

A chunk's forward pass is queued whole (MLX builds the graph lazily), then
computed by evaluating its cache layers: all at once when no call decodes,
else a few layers per engine job, each slice sized from the measured cost of
a layer so it takes about one decode step. The engine thread runs a decode
step between two jobs, so a decoding neighbour's gap during a long prefill is
about two steps, whatever the chunk size. The graph and its kernels are the
ones a whole chunk runs (same shapes, same ops, evaluated in order): the
cache is bit-identical to a chunk computed at once, and on CUDA a full chunk
still meets the cuDNN graph its shape already built.

Why layers and not smaller chunks (docs/decisions.md, "Many agents at
once"): a smaller chunk is a new (query, key) shape per offset on CUDA,
and runs the weights once per chunk; a slice of layers keeps the chunk's
shape and its weight reads.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import mlx.core as mx

from kvwake.daemon.kv.context import Packed, later

__all__ = ["Chunk", "Slicer", "SLICE_OF_STEP", "kind"]

# A slice's target time, in decode steps: a neighbour's gap during a prefill is about one step plus one slice.
# KVWAKE_SLICE_OF_STEP sets it for a measurement (bench/batching.py's prefill row compares).
SLICE_OF_STEP = float(os.environ.get("KVWAKE_SLICE_OF_STEP", "1.0"))
# KVWAKE_PACK_OWN_COSTS=0: packed chunks size their slices from the shared costs of their kind, as before
# session 25 (bench/turns_at_once.py's "shared" runs compare)
PACK_OWN_COSTS = os.environ.get("KVWAKE_PACK_OWN_COSTS", "1") != "0"


def kind(path: str, keys: int) -> str:
    """A chunk's kind for the Slicer's costs: its attention path ("fused", "plain", "bucket") and its key
    length to a power of two (attention's share of a layer grows with the keys: plain's most)."""
    return f"{path}@{keys.bit_length()}"


class Slicer:
    """How many layers a slice takes: from the measured seconds per layer and token of recent slices of the
    same kind of chunk (`kind`: the attention path it runs, "fused", "plain" or "bucket", and its key length
    to a power of two).

    Kinds apart: a long prompt's full chunks run fused, and its last, shorter one may run plain (a key
    length new to this process, beside decoding: engine.py), whose layer costs several times a fused one
    over a long cache. Sized from the fused chunks' cost, that chunk's first slice took 28-30 ms on the
    H100 against a 4 ms target: the one gap of 6x in a neighbour's stream. A kind not seen yet starts at
    one layer, measured (a kind is also new at each doubling of the keys: one small slice more per doubling).
    """

    def __init__(self) -> None:
        self.layer_token_s: dict[str, float] = {}  # by kind: a moving average over its slices

    def layers_for(self, target_s: float, tokens: int, left: int, kind: str = "fused") -> int:
        """Layers (1..left) whose computation of `tokens` tokens takes about `target_s`."""
        cost = self.layer_token_s.get(kind)
        if cost is None:
            return 1  # no measurement yet: the smallest slice, measured
        return max(1, min(left, math.floor(target_s / (cost * tokens))))

    def observe(self, seconds: float, layers: int, tokens: int, kind: str = "fused") -> None:
        cost = seconds / (layers * tokens)
        was = self.layer_token_s.get(kind)
        self.layer_token_s[kind] = cost if was is None else 0.5 * was + 0.5 * cost


class Chunk:
    """A queued prefill chunk of `session`, computed by `step()` until `done`; then the session's
    `processed` is `end`. `target_s`: a slice's time (a decode step's), or None for all layers in one step;
    `kind`: the attention path its graph takes (the Slicer's costs are kept per kind).

    `more`: the other sessions (session, end) of a packed chunk (model/packing.py: one forward pass for
    several sessions' short chunks), computed slice by slice together; `padded`: the tokens the pass
    computes (rows x the longest), what a slice's cost grows with. Its callers step it each through
    `step_job`: the ones queued at a turn make one job. A packed chunk sizes its slices from its own
    slices only, starting at one layer: every pack is its own set of shapes, and their costs per token
    differ several times (H200, 8B shape: 1.3-2.9 us per token and layer for 14 rows of ~230 tokens, 4-22 us
    for 16 rows of ~115; sized from the first, the second's first slice took 217 ms against a 40 ms target).

    A slice that raises leaves the cache's state unknown: the session's cache (every packed session's)
    is dropped (the engine rebuilds it from the tokens on next use), as after a failed generation, and
    later steps raise the same error.
    """

    def __init__(self, session: Any, end: int, slicer: Slicer, target_s: float | None, kind: str = "fused",
                 more: list[tuple[Any, int]] | None = None, padded: int | None = None) -> None:
        self.session, self.end, self.target_s, self.kind = session, end, target_s, kind
        self.slicer = Slicer() if more and PACK_OWN_COSTS else slicer  # a pack's costs are its own
        self.rows = [(session, end), *(more or ())]
        self.starts = {id(s): s.processed for s, _ in self.rows}
        self.layers = list(zip(*(s.cache for s, _ in self.rows)))  # by layer, every row's
        self.tokens = end - session.processed
        self.padded = padded or sum(e - s.processed for s, e in self.rows)
        self.computed = 0  # layers evaluated so far
        self.slices = 0
        self.last = (0, 0)  # the last slice's first layer and its number of layers
        self.failed: str | None = None  # what a failed slice raised (later steps raise it again)
        for s, _ in self.rows:
            s.computing = True  # until the last slice: what reads the cache waits (Session.when_settled)

    @property
    def step_job(self) -> Packed:
        """`step` as a job the steps queued with it join (made per use: kept, it would tie the chunk and its
        layers in a cycle, freed by the collector, not when the chunk goes)."""
        return Packed(self.step, self._step_once)

    def start_of(self, session: Any) -> int:
        """Where `session`'s part of the chunk starts (its `processed` when the chunk was queued)."""
        return self.starts[id(session)]

    def trace(self) -> str:
        """What the last slice computed, for the engine thread's record of slow work (`status.engine_thread`)."""
        first, n = self.last
        rows = f" in {len(self.rows)} sessions" if len(self.rows) > 1 else ""
        return f"{self.kind} {self.padded} tokens{rows}, layers {first}-{first + n - 1} of {len(self.layers)}"

    @property
    def done(self) -> bool:
        return self.computed >= len(self.layers)

    def abandon(self) -> None:
        """The chunk will not be finished (its caller stopped between slices): the cache, half computed, is
        dropped as after a failed slice, and what waited for the chunk's end runs."""
        if not self.done and self.failed is None:
            self.failed = "abandoned by a caller"  # a packed chunk's other callers stop stepping it too
            self._drop()

    def _drop(self) -> None:
        for s, _ in self.rows:
            s.cache, s.processed = None, 0
            s.settle(later)

    def _step_once(self, jobs: list[Packed]) -> list[None]:
        """The pack of step jobs queued together: one slice for them all."""
        self.step()
        return [None] * len(jobs)

    def step(self) -> None:
        """Compute the next slice of layers (the chunk's whole pass when not sliced); nothing once done."""
        if self.failed is not None:
            raise RuntimeError(f"the chunk's slice failed before: {self.failed}")
        if self.done:
            return
        left = len(self.layers) - self.computed
        n = left if self.target_s is None else self.slicer.layers_for(self.target_s, self.padded, left, self.kind)
        started = time.perf_counter()
        self.last = (self.computed, n)
        try:
            mx.eval([c.state for layer in self.layers[self.computed : self.computed + n] for c in layer])
        except BaseException as exc:
            self.failed = repr(exc)
            self._drop()
            raise
        # A slice of layers a..b evaluates their caches; a KV cache's input is the output of the layer before,
        # so the slice computes the attention of layers a-1..b-1 and the first layer's slice none: it says
        # nothing of what a layer costs (a recurrent layer 0 does its own work: one small slice more). On the
        # H100 the plain path's layer 0 took ~1 ms against ~5 for each later one: sized from it, the next
        # slice took 4-5 layers, 22-25 ms against a 6 ms target.
        attentions = n - (self.computed == 0)
        if attentions:
            self.slicer.observe(time.perf_counter() - started, attentions, self.padded, self.kind)
        self.computed += n
        self.slices += 1
        if self.done:
            for s, end in self.rows:
                s.processed = end
                s.settle(later)
