"""Restore a prompt cache by filling preallocated per-layer buffers once.

`Buffers` is made on the engine thread from the model and the tensor specs of
one block (names, dtypes, shapes; see cache_blocks.py's naming). It allocates, once and
at its final size, one MLX array per cuttable tensor (`{unit}.keys`,
`{unit}.values`, or the three parts of quantized KV), with room for
`capacity` tokens, and exposes a writable host view of each. Worker threads
then decode block files straight into `place(start, count)` (the slice of
every view for tokens [start, start + count)), so each restored byte is
written once, where it stays. `finish` (engine thread again) hands the
buffers to the cache objects, restores the units that are not cut by token
from the tail, and evaluates everything: the first token pays nothing hidden.

Two ways to fill, by what computes:
- "direct" (the CPU): the views are the MLX buffers' own memory; decoders
  join byte planes straight into them. One write per restored byte: decoder
  -> buffer (the join is numpy's bit operations, on the pool's threads).
- "staged" (a GPU: CUDA, and Metal on Apple silicon): a plain KV cache's blocks are decompressed
  and verified into host staging of byte planes (`stage(k)`): a ring of a few
  spans of blocks (devplanes.Ring), not the session's size. As each span is
  in, `join_span` (engine thread) moves it to the GPU and joins and lays it
  out per tensor there, and its slot takes a later span; `finish` concatenates
  each tensor's spans (one tensor at a time). Blocks that cannot be staged
  (format-1 files, quantized KV, the RAM tier's) are joined on the CPU into
  host views and uploaded with their span. Writes per restored byte: decoder
  -> staging, host -> device, one pass on the device, one concatenation. On
  Apple silicon the ring is MLX's own shared memory, so nothing moves it to
  the GPU: the decoders write where the GPU joins (numpy's join on the CPU
  took four or five passes per byte there). Not timed on a Mac (none here);
  exact on the CPU backend (tests/test_pipeline.py runs both ways).
`restore_mode()` picks one by the backend (asked on the engine thread: no MLX
call at import); the tuning knob restore_mode overrides it (for benchmarks). Either
way, no per-block arrays are joined afterwards.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, QuantizedKVCache, make_prompt_cache

from kvwake.daemon.kv import capacity as kvcapacity
from kvwake.daemon.kv import devplanes, window_rows
from kvwake.daemon.kv.context import Counters
from kvwake.daemon.kv.cache_blocks import (
    CUTTABLE,
    QPARTS,
    StateMismatchError,
    NotCuttableError,
    check_meta,
    cuttable,
    kind_of,
    restore_whole,
    take_ints,
    units,
)
from kvwake.store.format.codec import DTYPES, Stage, Tensor

__all__ = ["MX_DTYPES", "STAGED_CODECS", "UPLOAD_JOB_S", "auto_codecs", "Buffers", "Specs", "finish_empty", "has_cut_kv", "restore_arrays", "restore_mode", "specs_of",
           "unified_memory"]

Specs = Mapping[str, tuple[str, tuple[int, ...]]]  # tensor name -> (safetensors dtype, shape of one block)
MX_DTYPES = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32, "U32": mx.uint32, "I32": mx.int32,
             "U8": mx.uint8, "I8": mx.int8, "U16": mx.uint16, "I16": mx.int16, "I64": mx.int64, "U64": mx.uint64}


def unified_memory() -> bool:
    """True when MLX arrays live in memory the CPU can write in place (CPU, Apple silicon)."""
    return mx.default_device() == mx.cpu or mx.metal.is_available()


# Seconds one engine-thread job lays out tensors on the device at a restore's end (Buffers.upload), then
# it returns and a decode step may run: under one decode step of a large model. A budget in time, not
# bytes: a tensor whose spans are already on the device concatenates at once, one uploaded from host views
# (a block from the RAM tier, a partial piece) takes far longer per byte, and a fixed byte budget per job
# left a decoding neighbour waiting several of its steps (docs/decisions.md, "Many agents at once (issue 24)").
UPLOAD_JOB_S = 0.004

# The codecs a store's codec "auto" may pick where restores stage (serve.py): the two whose staged
# wakes are measured on a GPU. "zstd" blocks once decoded on the CPU into the device's arrays, many times
# slower than staging; they now stage as raw runs (codec.decode_into), so stores holding them wake staged
# too, still slower than "planes-zstd" (docs/decisions.md, "Store"; docs/history/benchmarks-journal.md,
# "Overlapped restore and codec by machine (issue 23, points 2 and 3)").
STAGED_CODECS = ("planes-zstd", "raw")


def auto_codecs(configured: str | None = None) -> tuple[str, ...] | None:
    """The codecs a store's codec "auto" may pick for this process's restores (`configured` as for
    restore_mode): STAGED_CODECS where they stage, any elsewhere (None)."""
    return STAGED_CODECS if restore_mode(configured) == "staged" else None


def restore_mode(configured: str | None = None) -> str:
    """How restores fill buffers here: `configured` ("direct" or "staged": the tuning knob restore_mode) when
    given, else "staged" where a GPU computes (CUDA, Metal), "direct" on the CPU. (It also says whether
    sleeps split byte planes on the device.)"""
    return configured or ("direct" if mx.default_device() == mx.cpu else "staged")


def _slot_parts(name: str, slot: Any, specs: Specs) -> tuple[str, ...]:
    """The tensor names of one cuttable unit in these specs, checked against the model's slot."""
    quantized = f"{name}.keys.0" in specs
    allowed = {KVCache: (False, True), QuantizedKVCache: (True,), ConcatenateKVCache: (False,)}[type(slot)]
    if quantized not in allowed:
        raise StateMismatchError(f"{name}: {'quantized' if quantized else 'plain'} KV does not fit "
                                 f"a {type(slot).__name__}")
    parts = QPARTS if quantized else ("keys", "values")
    missing = [f"{name}.{p}" for p in parts if f"{name}.{p}" not in specs]
    if missing:
        raise StateMismatchError(f"{name}: missing {missing}")
    return tuple(f"{name}.{p}" for p in parts)


# Staged restores not yet released (engine thread). MLX's cache of freed buffers is cleared when the last of
# them ends: restores running together (a restart's wakes) reuse each other's freed buffers of the same sizes
# instead of each clearing MLX's cache (cudaFree of gigabytes, a device sync) and allocating them afresh; what
# stays cached meanwhile is bounded by MLX's cache limit (model/memory.py).
_staged_open: weakref.WeakSet[Buffers] = weakref.WeakSet()


class Buffers:
    """Preallocated KV buffers for one restore, their host views, and the cache they become.

    sample: name -> (dtype, shape) of one block's or the tail's tensors (their
    headers are enough), covering `sample_tokens` tokens; names of units the
    model does not cut by token are ignored here.
    """

    def __init__(self, model: Any, sample: Specs, sample_tokens: int, capacity: int, block_tokens: int, *,
                 mode: str | None = None, n_blocks: int | None = None, tail_tokens: int = 0,
                 ring_slots: int | None = None) -> None:
        self.cache = make_prompt_cache(model)
        mode = mode or restore_mode()
        self.block_tokens, self.mode = block_tokens, mode
        self.units = [(name, i, j, c) for name, i, j, c in units(self.cache) if kind_of(c, name) in CUTTABLE]
        self.parts = {name: _slot_parts(name, c, sample) for name, _, _, c in self.units}
        self.quantized = {name: parts[0].endswith(".0") for name, parts in self.parts.items()}
        self.expected = {t for parts in self.parts.values() for t in parts}
        self.expected |= {f"{name}.quant" for name, q in self.quantized.items() if q}
        self.window = window_rows.window_names(self.cache)  # rows a block may carry for a point's rings: not ours
        self.held: window_rows.Held | None = None  # where a marker point's window rows decode (prefixhit.py)
        self._window_runs: dict[int, window_rows.WindowRun] = {}  # staged blocks carrying window rows, till checked
        self.quant: dict[str, list[int]] = {}
        self.dtypes: dict[str, str] = {}
        self.buffers: dict[str, mx.array] = {}
        self.views: dict[str, np.ndarray] = {}
        for unit, _, _, slot in self.units:
            # a KVCache's buffer as its own growth would make it (kv/capacity.py: off cuDNN's grid on CUDA)
            rows = capacity if isinstance(slot, ConcatenateKVCache) else kvcapacity.capacity(capacity) \
                if type(slot) is KVCache else -(-capacity // KVCache.step) * KVCache.step
            for name in self.parts[unit]:
                self._allocate(name, *sample[name], sample_tokens, rows)
        if mode == "direct":
            mx.eval(list(self.buffers.values()))
            for name, buf in self.buffers.items():
                self.views[name] = np.asarray(buf.view(mx.uint16) if buf.dtype == mx.bfloat16 else buf)
        self.order = tuple(t for unit, _, _, _ in self.units for t in self.parts[unit])
        # The views handed out by `place` (tensor, first token): a decode returns each one it filled,
        # checked by identity (np.shares_memory, an overlap solver, was 8% of a wake's decoding).
        self._placed: dict[tuple[str, int], np.ndarray] = {}
        self.staged: dict[int, bool] = {}  # block (-1: the tail) -> staged as planes (True) or raw (False)
        self.join_s = 0.0  # the engine thread's time in `join_span` (a wake's `joins` phase: within `blocks`)
        self.join_eval_s = 0.0  # of it, waiting for the device's joins (`joins_eval`)
        self.first = 0  # blocks taken from another cache (take_prefix): the ring stages from the one after
        self._expected: int | None = None  # blocks a prefix still coming will give (expect_prefix)
        self.ring: devplanes.Ring | None = None
        self._tail_view: np.ndarray | None = None
        self._tail_array: mx.array | None = None
        self._tail_release: Callable[[], Any] = lambda: None
        self.pieces: dict[str, list[mx.array]] = {name: [] for name in self.order}  # joined spans, in order
        self.joined = 0  # blocks the pieces cover (from 0); the rest are uploaded from the host views at finish
        self._out: dict[str, mx.array] = {}  # tensors laid out on the device (upload), in order
        self._layout: tuple[int, list[mx.array] | None] | None = None  # (tokens, the joined tail) once begun
        self.released = False  # `release` ran (by `finish`, or for a restore given up)
        # Where this restore's blocks came from (the context's counters add every restore's at once)
        self.counts = Counters("blocks_ram", "blocks_disk", "blocks_shared")
        if mode == "staged":
            _staged_open.add(self)
        specs = {t: sample[t] for t in self.order}
        blocks = n_blocks if n_blocks is not None else capacity // block_tokens
        self.span = max(1, blocks)  # blocks decoded before the engine thread takes them (join_span)
        if mode == "staged" and blocks and sample_tokens == block_tokens and specs and devplanes.planar(specs):
            # Staging in MLX's own host-visible memory: filled by the decoders, read by the GPU join,
            # never copied by an mx.array() of a numpy array (slow on a discrete GPU:
            # docs/history/benchmarks-journal.md, "GPU machine: before and after").
            # A ring of a few spans, reused span after span: not an allocation the size of the session.
            self.block_shape = next(iter(specs.values()))[1]
            size = DTYPES[self.dtypes[self.order[0]]][0].itemsize
            per_token = len(self.order) * math.prod(self.block_shape) // block_tokens
            self.ring = devplanes.Ring(blocks, size, per_token * block_tokens, size * per_token * block_tokens,
                                       most=ring_slots, owner=id(model))
            self.span = self.ring.span
            if tail_tokens:
                array, view, release = devplanes.staging((1, size * per_token * tail_tokens))
                self._tail_array, self._tail_view = array, view[0]
                self._tail_release = weakref.finalize(self, release)

    def spans(self, n_blocks: int, first: int = 0) -> list[tuple[int, int]]:
        """(first, count) of the spans blocks first .. n_blocks - 1 are restored in: each is decoded, then
        joined (join_span)."""
        return [(k, min(self.span, n_blocks - k)) for k in range(first, n_blocks, self.span)]

    def expect_prefix(self, blocks: int) -> None:
        """The first `blocks` will be taken from another cache once it comes (`take_prefix`, after this
        restore's own blocks are in): the ring stages from the one after them."""
        if self.joined or blocks <= 0:
            raise StateMismatchError(f"a prefix of {blocks} blocks expected after {self.joined} blocks were joined")
        self.first = self._expected = blocks

    def drop_ring(self) -> None:
        """Engine thread, once every staged span is joined: the ring's slots go back for other wakes."""
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    def take_prefix(self, prefix: list, tokens: int) -> None:
        """Engine thread: the first `tokens` (whole blocks) taken from another cache holding the same blocks
        (a session woken beside this one, or hot, whose prefix has their chain keys), in place of reading
        them: laid out on the device as the first joined span (staged), or copied into the host views
        (direct). Before the restore's own blocks, or after them where it was expected (`expect_prefix`:
        then the pieces go first). Plain KV only; raises StateMismatchError for a cache that is not this
        restore's shape."""
        self._check_prefix(tokens)
        given = {f"{name}.{part}": getattr(c, part) for name, _, _, c in units(prefix) if type(c) is KVCache
                 for part in ("keys", "values")}
        for name in self.order:
            arr = given.get(name)
            if (arr is None or arr.shape[-2] < tokens or MX_DTYPES[self.dtypes[name]] != arr.dtype
                    or arr.shape[:-2] != self.views[name].shape[:-2] or arr.shape[-1] != self.views[name].shape[-1]):
                raise StateMismatchError(f"{name}: the prefix given ({None if arr is None else arr.shape}) is not "
                                         f"{tokens} tokens of this restore's {self.dtypes[name]} KV")
            part = arr[..., :tokens, :]
            if self.mode == "direct":
                np.copyto(self.views[name][..., :tokens, :],
                          np.asarray(part.view(mx.uint16) if part.dtype == mx.bfloat16 else part))
            else:
                self.pieces[name].insert(0, part)  # the first tokens, whether own spans are in already or not
        self._prefix_taken(tokens)

    def leave_prefix(self, tokens: int) -> None:
        """Engine thread: the first `tokens` (whole blocks) are not this restore's: its caller maps them (a paged
        wake: pages already resident, kv/paged_cache.adopt's `prefix`). Their rows stay as allocated (zeros);
        the restore's own blocks go after them, as after `take_prefix`, with no copy of the prefix."""
        self._check_prefix(tokens)
        if self.mode != "direct":
            for name in self.order:
                view = self.views[name]
                self.pieces[name].insert(0, mx.zeros((*view.shape[:-2], tokens, view.shape[-1]),
                                                     MX_DTYPES[self.dtypes[name]]))
        self._prefix_taken(tokens)

    def _check_prefix(self, tokens: int) -> None:
        late = self._expected is not None
        if tokens <= 0 or tokens % self.block_tokens or (self.joined and not late) or \
                (late and tokens != self._expected * self.block_tokens):
            raise StateMismatchError(f"a prefix of {tokens} tokens is not whole blocks of {self.block_tokens} "
                                     f"ahead of this restore ({self.joined} blocks joined, "
                                     f"{self._expected} expected)")

    def _prefix_taken(self, tokens: int) -> None:
        self.first = tokens // self.block_tokens  # the ring's first slot and row take the next block
        self._expected = None
        if self.mode != "direct":
            self.joined = max(self.joined, self.first)  # own spans joined already cover from it on

    @property
    def slots(self) -> int:
        """Spans that may be decoding at once: the ring's slots (staged), all of them (direct)."""
        return self.ring.slots if self.ring is not None else 1 << 30

    def stage(self, k: int | None) -> Stage | None:
        """Staging for block k's run as stored (None: the tail's), format-2 plain KV on a GPU; else None
        (decoded into the host views)."""
        if (self.ring is None) if k is not None else self._tail_view is None:
            return None

        def where(names: tuple[str, ...], dtype: str, n: int, planes: bool) -> list[np.ndarray] | None:
            size = DTYPES[dtype][0].itemsize
            rows = self.ring.rows(k - self.first, planes) if k is not None else (
                devplanes.planes_of(self._tail_view, size) if planes else [self._tail_view])
            if names != self.order and k is not None and self.window and dtype == self.dtypes[self.order[0]]:
                return self._stage_window(k, names, dtype, n, rows, planes)  # its plain part staged like a block's
            if names != self.order or dtype != self.dtypes[names[0]] or n * size != self._row_bytes(k):
                return None
            self.staged[k if k is not None else -1] = planes
            return rows
        return where

    def unstage(self, k: int) -> None:
        """Block k is not staged after all: a staged image whose first runs fit and a later one did not
        (pipeline._put_cached) left its record here, and the block's read that follows is checked by it."""
        self.staged.pop(k, None)
        self._window_runs.pop(k, None)

    def _stage_window(self, k: int, names: tuple[str, ...], dtype: str, n: int, rows: list[np.ndarray],
                      planes: bool) -> list[np.ndarray] | None:
        """A block carrying window rows (kv/window_rows.py): its run decodes into scratch, and `check` stages
        its plain part into the ring's rows (`WindowRun`)."""
        run = window_rows.WindowRun.of(names, self.order, self.window, dtype, n, self.block_shape, rows, planes)
        if run is None:
            return None
        self.staged[k], self._window_runs[k] = planes, run
        return run.sections

    def _row_bytes(self, k: int | None) -> int:
        return self.ring.size * self.ring.plane_bytes if k is not None else self._tail_view.size

    def join_span(self, first: int, count: int) -> None:
        """Engine thread, once blocks [first, first + count) are in place: move them to the device.

        Staged blocks are joined from their ring slot, every tensor in one pass (a few device
        ops per span, not per tensor: a 32k 8B-shaped session has 64 tensors and ~64 spans), the
        others uploaded from the host views; everything is evaluated, so the slot is free for the
        next span on return. Direct mode: nothing to do (the decoders wrote MLX's own memory).
        """
        if self.mode == "direct" or not self.order:
            return
        started = time.perf_counter()
        b = self.block_tokens
        dtype, tensors = self.dtypes[self.order[0]], len(self.order)
        # Runs of blocks staged alike (planes, raw, or not staged: RAM tier, another layout), in order.
        runs: list[tuple[bool | None, int, int]] = []
        for k in range(first, first + count):
            kind = self.staged.get(k)
            if runs and runs[-1][0] == kind:
                runs[-1] = (kind, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((kind, k, 1))
        wholes = [None if kind is None else
                  devplanes.join(self.ring.planes(k - self.first, n), dtype, tensors, self.block_shape) if kind else
                  devplanes.join_raw(self.ring.raw(k - self.first, n), dtype, tensors, self.block_shape)
                  for kind, k, n in runs]
        out = [w for w in wholes if w is not None]
        for t, name in enumerate(self.order):
            parts = [whole[t] if whole is not None else
                     _device(self.views[name][..., k * b : (k + n) * b, :], self.dtypes[name])
                     for whole, (_, k, n) in zip(wholes, runs)]
            piece = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)
            self.pieces[name].append(piece)
            out.append(piece)
        evaluated = time.perf_counter()
        mx.eval(out)
        self.joined = first + count
        now = time.perf_counter()
        self.join_s += now - started
        self.join_eval_s += now - evaluated

    def _allocate(self, name: str, dtype: str, shape: tuple[int, ...], tokens: int, rows: int) -> None:
        if len(shape) < 2 or shape[-2] != tokens or dtype not in MX_DTYPES:
            raise StateMismatchError(f"{name}: {dtype}{list(shape)} is not KV of {tokens} tokens")
        full = (*shape[:-2], rows, shape[-1])
        self.dtypes[name] = dtype
        if self.mode == "direct":
            self.buffers[name] = mx.zeros(full, MX_DTYPES[dtype])
        else:
            self.views[name] = np.empty(full, DTYPES[dtype][0])

    def place(self, start: int, count: int) -> Callable[[str, str, tuple[int, ...]], np.ndarray | None]:
        """Where a block (or the tail's partial block) covering tokens [start, start+count) decodes to."""
        def where(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray | None:
            view = self.views.get(name)
            if view is None:
                return self.held.where(name, start) if self.held is not None and name in self.window else None
            self._placed[name, start] = placed = view[..., start : start + count, :]
            return placed
        return where

    def check(self, arrays: Mapping[str, Tensor], start: int, count: int, what: str, staged: bool = False) -> None:
        """After a decode: every tensor went where it belongs (or, staged, into the planes), and
        quantization agrees across blocks."""
        if self.window:
            run = self._window_runs.pop(start // self.block_tokens, None) if staged else None
            if run is not None:
                arrays = {**arrays, **run.finish(self.held, start)}
            if self.held is not None:
                self.held.took(arrays, start)
            arrays = {name: t for name, t in arrays.items() if name not in self.window}
        if staged:
            if set(arrays) != self.expected - set(self.order):
                raise StateMismatchError(f"{what} holds {sorted(arrays)} besides the staged KV")
            return
        if set(arrays) != self.expected:
            raise StateMismatchError(f"{what} holds {sorted(set(arrays) - self.expected)} this model's cache has "
                                     f"no place for, lacks {sorted(self.expected - set(arrays))}")
        for unit, parts in self.parts.items():
            for name in parts:
                t = arrays.get(name)
                if t is None or t.array is not self._placed.pop((name, start), None):
                    raise StateMismatchError(f"{what}: {name} missing or not of this model's KV")
            if self.quantized[unit]:
                quant = take_ints(dict(arrays), f"{unit}.quant", 2)
                if self.quant.setdefault(unit, quant) != quant:
                    raise StateMismatchError(f"{unit}: quantization {quant} after {self.quant[unit]}")

    def put(self, start: int, count: int, arrays: Mapping[str, Tensor], what: str) -> None:
        """Copy in-memory arrays (the RAM tier's, a test's) into place: the same checks as a decode."""
        placed: dict[str, Tensor] = {}
        target = self.place(start, count)
        for name, t in arrays.items():
            dest = target(name, t.dtype, t.array.shape)
            if dest is None:
                placed[name] = t  # quantization facts; anything else is refused by check()
                continue
            if dest.shape != t.array.shape or self.dtypes[name] != t.dtype:
                raise StateMismatchError(f"{name}: expected {self.dtypes[name]}{list(dest.shape)}, "
                                         f"found {t.dtype}{list(t.array.shape)}")
            np.copyto(dest, t.array)
            placed[name] = Tensor(t.dtype, dest)
        self.check(placed, start, count, what)

    def take(self, tail: dict[str, Tensor]) -> dict[str, Tensor]:
        """Pop the tail's partial block (this restore's KV names and quantization) out of `tail`."""
        return {name: tail.pop(name) for name in list(tail) if name in self.expected}

    def block(self, start: int, count: int) -> dict[str, Tensor]:
        """Copies of what is in place for tokens [start, start+count) (for the RAM tier)."""
        out = {name: Tensor(self.dtypes[name], view[..., start : start + count, :].copy())
               for name, view in self.views.items()}
        out.update({f"{unit}.quant": Tensor("I32", np.array(q, np.int32)) for unit, q in self.quant.items()})
        return out

    def upload(self, n_tokens: int, budget_s: float | None = None) -> bool:
        """Lay out the next tensors of n_tokens on the device until `budget_s` seconds have passed (at least
        one tensor; all of them when None); True once every tensor is. One call is one engine-thread job:
        in one job, a restore from host views held the engine thread for many decode steps while a decoding
        session waited; in slices it waits one slice. Nothing to do in direct mode."""
        if self.mode == "direct":
            return True
        if self._layout is None:
            self._layout = (n_tokens, self._tail_join(n_tokens))
        if self._layout[0] != n_tokens:
            raise StateMismatchError(f"restore laid out for {self._layout[0]} tokens, finished for {n_tokens}")
        tail, started = self._layout[1], time.perf_counter()
        n_full, rest = divmod(n_tokens, self.block_tokens)
        made: list[mx.array] = []
        for t, name in enumerate(self.order):
            if name in self._out:
                continue
            view, pieces = self.views[name], self.pieces[name]
            if self.joined < n_full:  # blocks no span took (a prefix hit fills host views only)
                pieces.append(_device(view[..., self.joined * self.block_tokens : n_full * self.block_tokens, :],
                                      self.dtypes[name]))
            if tail is not None:
                pieces.append(tail[t])
            elif rest:
                pieces.append(_device(view[..., n_full * self.block_tokens : n_tokens, :], self.dtypes[name]))
            # Always a new array of its own (the padding may be empty): a slice of a joined array
            # would share its buffer, and mlx-lm's first in-place update would copy the whole layer.
            pieces.append(mx.zeros((*view.shape[:-2], view.shape[-2] - n_tokens, view.shape[-1]),
                                   MX_DTYPES[self.dtypes[name]]))
            # One tensor at a time. The joined spans hold every tensor, so they go once the last
            # tensor is laid out: at that moment the device holds the KV twice, no more.
            # Queued, not waited for one by one: the job waits once for all it laid out. A wait per tensor
            # made a wake's upload a job per tensor, each a device sync and a thread hop, which a restart's
            # waking sessions, taking turns on the engine thread, paid one after another (docs/decisions.md).
            self._out[name] = out = mx.concatenate(pieces, axis=-2)
            mx.async_eval(out)
            made.append(out)
            self.pieces[name] = []
            if budget_s is not None and time.perf_counter() - started >= budget_s:
                break
        mx.eval(made)
        return len(self._out) == len(self.order)

    def _tail_join(self, n_tokens: int) -> list[mx.array] | None:
        """Every tensor's staged partial block, joined in one pass (None when the tail was not staged)."""
        rest = n_tokens % self.block_tokens
        if not rest or -1 not in self.staged:
            return None
        dtype, shape = self.dtypes[self.order[0]], (*self.block_shape[:-2], rest, self.block_shape[-1])
        size = DTYPES[dtype][0].itemsize
        return (devplanes.join(devplanes.planes_of(self._tail_array, size), dtype, len(self.order), shape)
                if self.staged[-1] else devplanes.join_raw(self._tail_array, dtype, len(self.order), shape))

    def _uploaded(self, n_tokens: int) -> dict[str, mx.array]:
        """The device arrays: MLX's own (direct), or the joined spans, the tail and the padding (staged)."""
        if self.mode == "direct":
            return self.buffers
        self.upload(n_tokens)
        return self._out

    def finish(self, n_tokens: int, tail: dict[str, Tensor] | None) -> list:
        """The cache holding n_tokens, evaluated.

        tail: the rest of the snapshot's tail once `take` popped the KV (meta
        state and units not cut by token), or None for a prefix restore.
        """
        buffers = self._uploaded(n_tokens)
        rest = None if tail is None else dict(tail)
        if rest is not None:
            check_meta(rest, n_tokens, self.block_tokens)
        for unit, i, j, slot in self.units:
            if rest is not None:
                (offset,) = take_ints(rest, f"{unit}.offset", 1)
                if offset != n_tokens:
                    raise StateMismatchError(f"{unit}: tail says {offset} tokens, restore asked for {n_tokens}")
            _place(self.cache, i, j, self._unit_cache(unit, slot, buffers, n_tokens))
        for name, _, _, c in units(self.cache):
            if kind_of(c, name) not in CUTTABLE:
                restore_whole(name, kind_of(c, name), c, rest if rest is not None else {}, n_tokens)
        if rest:
            raise StateMismatchError(f"tail holds arrays this model's cache has no place for: {sorted(rest)}")
        mx.eval([s for c in self.cache for s in _state_arrays(c)])
        self.release()
        return self.cache

    def release(self) -> None:
        """Engine thread: drop every reference to MLX memory but the cache's (the object itself may die
        elsewhere): the ring's slots go back (kept mapped for the next wake: devplanes.drop_idle frees
        them), staging leaves the host before MLX may reuse it for a kernel's output, joined spans and
        temporaries go back rather than stay cached once no other staged restore runs (`_staged_open`).
        `finish` ends with it; a restore given up calls it (`pipeline.releasing`). Once is enough: `released`
        says whether it ran."""
        self.released = True
        if self.ring is not None:
            self.ring.close()
        self._tail_release()
        self._placed.clear()
        self.buffers, self.views, self.ring, self._tail_array, self._tail_view = {}, {}, None, None, None
        self.pieces = {name: [] for name in self.order}
        self._out, self._layout = {}, None
        _staged_open.discard(self)
        if self.mode == "staged" and not _staged_open:
            mx.clear_cache()

    def _unit_cache(self, unit: str, slot: Any, buffers: dict[str, mx.array], n_tokens: int) -> Any:
        if self.quantized[unit]:
            if unit not in self.quant:
                raise StateMismatchError(f"{unit}: quantized KV without its quantization")
            group_size, bits = self.quant[unit]
            c = QuantizedKVCache(group_size=group_size, bits=bits)
            c.keys = tuple(buffers[f"{unit}.keys.{k}"] for k in range(3))
            c.values = tuple(buffers[f"{unit}.values.{k}"] for k in range(3))
        else:
            c = type(slot)()
            c.keys, c.values = buffers[f"{unit}.keys"], buffers[f"{unit}.values"]
        c.offset = n_tokens
        return c


def _device(host: np.ndarray, dtype: str) -> mx.array:
    a = mx.array(host)
    return a.view(mx.bfloat16) if dtype == "BF16" else a


def _place(cache: list, i: int, j: int | None, c: Any) -> None:
    if j is None:
        cache[i] = c
    else:
        members = list(cache[i].caches)
        members[j] = c
        cache[i].caches = tuple(members)


def _state_arrays(c: Any) -> list[mx.array]:
    state = c.state
    flat: list = []
    stack = [state]
    while stack:
        x = stack.pop()
        if isinstance(x, mx.array):
            flat.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return flat


def specs_of(arrays: Mapping[str, Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor specs (dtype, shape) of in-memory arrays, for `Buffers`."""
    return {name: (t.dtype, tuple(t.array.shape)) for name, t in arrays.items()}


def has_cut_kv(model_cache: list, sample: Mapping[str, Any]) -> bool:
    """Whether `sample` (a tail's names) holds KV of any cuttable unit (False when the tail has no partial block)."""
    return any(f"{name}.keys" in sample or f"{name}.keys.0" in sample
               for name, _, _, c in units(model_cache) if kind_of(c, name) in CUTTABLE)


def restore_arrays(model: Any, blocks: list[Mapping[str, Tensor]], tail: dict[str, Tensor] | None, n_tokens: int,
                   block_tokens: int, *, capacity: int | None = None) -> list:
    """A cache from in-memory block arrays (+ tail; None for a prefix): tests and the RAM tier use it.

    The same buffers and checks as a restore from the store; one thread.
    """
    n_full, rest = divmod(n_tokens, block_tokens)
    if tail is None and not cuttable(make_prompt_cache(model)):
        kinds = sorted({kind_of(c, name) for name, _, _, c in units(make_prompt_cache(model))} - CUTTABLE)
        raise NotCuttableError(f"this model's cache has {', '.join(kinds)} layers; a prefix cannot be restored")
    if tail is not None:
        check_meta(dict(tail), n_tokens, block_tokens)
    if len(blocks) != n_full:
        raise StateMismatchError(f"{len(blocks)} blocks given, {n_full} expected for {n_tokens} tokens")
    tail = dict(tail) if tail is not None else None
    if blocks:
        sample, tokens = specs_of(blocks[0]), block_tokens
    elif tail and rest and has_cut_kv(make_prompt_cache(model), tail):
        sample, tokens = specs_of(tail), rest
    else:
        return finish_empty(model, n_tokens, tail, block_tokens)
    buffers = Buffers(model, sample, tokens, capacity or n_tokens, block_tokens)
    for k, block in enumerate(blocks):
        buffers.put(k * block_tokens, block_tokens, block, f"block {k}")
    for first, count in buffers.spans(len(blocks)):
        buffers.join_span(first, count)
    if tail is not None and rest:
        buffers.put(n_full * block_tokens, rest, buffers.take(tail), "tail")
    return buffers.finish(n_tokens, tail)


def finish_empty(model: Any, n_tokens: int, tail: dict[str, Tensor] | None, block_tokens: int) -> list:
    """A cache with no cut KV at all: only whole-state units, or no tokens yet."""
    cache = make_prompt_cache(model)
    given, tail = tail is not None, dict(tail or {})
    if given:
        check_meta(tail, n_tokens, block_tokens)
    for name, _, _, c in units(cache):
        kind = kind_of(c, name)
        if kind in CUTTABLE:
            if given and take_ints(tail, f"{name}.offset", 1) != [n_tokens]:
                raise StateMismatchError(f"{name}: tail's offset is not {n_tokens}")
            if n_tokens:
                raise StateMismatchError(f"{name}: {n_tokens} tokens but no KV for them")
        else:
            restore_whole(name, kind, c, tail, n_tokens)
    if tail:
        raise StateMismatchError(f"tail holds arrays this model's cache has no place for: {sorted(tail)}")
    return cache
