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
once (issue 24)"): a smaller chunk is a new (query, key) shape per offset on CUDA,
and runs the weights once per chunk; a slice of layers keeps the chunk's
shape and its weight reads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import mlx.core as mx

from kvwake.daemon.jobs import Packed
from kvwake.daemon.kv import paged_cache

__all__ = ["Chunk", "Slicer", "kind"]

# Queues a job behind the others from the engine thread (EngineThread.later; None elsewhere: run it here)
Later = Callable[[Callable[[], Any]], Future | None] | None


def kind(path: str, keys: int) -> str:
    """A chunk's kind for the Slicer's costs: its attention path ("fused", "plain", "bucket", "padded") and its key
    length to a power of two (attention's share of a layer grows with the keys: plain's most)."""
    return f"{path}@{keys.bit_length()}"


class Slicer:
    """How many layers a slice takes: from the measured seconds per layer and token of recent slices of the
    same kind of chunk (`kind`: the attention path it runs, "fused", "plain" or "bucket", and its key length
    to a power of two).

    Kinds apart: a long prompt's full chunks run fused, and its last, shorter one may run plain (a key
    length new to this process, beside decoding: scheduler/prefill.py), whose layer costs several times a
    fused one over a long cache: sized from the fused chunks' cost, its first slice would be several times
    its target, the one long gap in a neighbour's stream (docs/decisions.md, "Many agents at once
    (issue 24)"). A kind not seen yet starts at one layer, measured (a kind is also new at each doubling of
    the keys: one small slice more per doubling).
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
    differ several times from pack to pack (docs/decisions.md, "Many agents at once (issue 24)").

    A slice that raises leaves the cache's state unknown: the session's cache (every packed session's)
    is dropped (the engine rebuilds it from the tokens on next use), as after a failed generation, and
    later steps raise the same error. `later` queues what waited for the chunk's end as engine jobs (None:
    run at once, in process).
    """

    def __init__(self, session: Any, end: int, slicer: Slicer, target_s: float | None, kind: str = "fused",
                 more: list[tuple[Any, int]] | None = None, padded: int | None = None, later: Later = None) -> None:
        self.session, self.end, self.target_s, self.kind, self.later = session, end, target_s, kind, later
        self.slicer = Slicer() if more else slicer  # a pack's costs are its own
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
            s.settle(self.later)

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
            # a paged layer's pools, not its `state`: that is a gathered copy of every token the session holds, made
            # per layer and chunk for nothing (docs/benchmarks.md, "Paged KV in the fleet")
            mx.eval([paged_cache.state_arrays(layer) for layer in self.layers[self.computed : self.computed + n]])
        except BaseException as exc:
            self.failed = repr(exc)
            self._drop()
            raise
        # A slice of layers a..b evaluates their caches; a KV cache's input is the output of the layer before,
        # so the slice computes the attention of layers a-1..b-1 and the first layer's slice none: it says
        # nothing of what a layer costs (a recurrent layer 0 does its own work: one small slice more); sized
        # from it, the next slice would take several times its target.
        attentions = n - (self.computed == 0)
        if attentions:
            self.slicer.observe(time.perf_counter() - started, attentions, self.padded, self.kind)
        self.computed += n
        self.slices += 1
        if self.done:
            for s, end in self.rows:
                s.processed = end
                s.settle(self.later)
