"""The byte-plane filter on the device that holds the KV (CUDA), both ways.

On a discrete GPU the CPU cannot afford numpy's bit operations per byte (they
do not scale across threads: docs/decisions.md, "Engine"), and the GPU does
them at memory speed. So for a
plain KV cache (every cut tensor of one float dtype and one shape):

- sleep: the GPU splits a span of blocks into byte planes laid out
  exactly as a format-4 "planes-zstd" run stores them (block-major, then
  tensor, then the tensor's C order), and the host receives one array per
  plane; the pool only compresses, digests and writes (`codec.Planed`).
- wake: the pool decompresses and verifies each block's planes into a slot of
  a staging ring (`Ring`, `codec.decode_into(stage=...)`; an older block's
  planes are made format 4's by the codec); as soon as a span of blocks is in,
  the GPU joins it and lays it out per tensor in one pass, and the slot takes
  a later span.

`planar(...)` says whether a cache (or a block's tensor specs) qualifies; the
others (quantized KV, mixed shapes) take the CPU path in cache_blocks.py/restore_buffers.py.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from kvwake.daemon.kv import cudart
from kvwake.store.format.codec import Planed

__all__ = ["PLANAR_DTYPES", "RING_SLOTS", "SPAN_BYTES", "STAGING", "Ring", "drop_idle", "join", "join_raw", "planar",
           "drop_owned", "note_owner", "planes_of", "release_all", "slot_shape", "split_span", "staging", "warm"]

PLANAR_DTYPES = {"BF16": (mx.bfloat16, mx.uint16), "F16": (mx.float16, mx.uint16), "F32": (mx.float32, mx.uint32)}
_MX_NAME = {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32"}
# A wake stages at most RING_SLOTS spans of about SPAN_BYTES of raw KV each: while the GPU joins
# one span, the pool decodes the next ones into the other slots. Enough slots that the decoders
# never wait for the join (it runs at device speed), few enough that staging stays a few hundred
# MB whatever the session's size (it was the whole session: docs/history/benchmarks-journal.md, "Copies per
# restored byte").
# Spans large enough that per-span device work (a join, and one piece per tensor to concatenate
# at the end) stays a few hundred ops at 32k; small enough that the last span's join, which
# nothing overlaps, is a small part of a wake.
SPAN_BYTES = 128 << 20
RING_SLOTS = 3
# How staging memory is made (bench/ring_upload.py measures each): "device" (an array the GPU
# made, which numpy's view moves into managed memory), "host" (managed memory the CPU touched
# first), "mapped" (host, and on CUDA kept there and mapped for the GPU to read in place: cudart.py).
STAGING = "mapped"


def staging(shape: tuple[int, ...]) -> tuple[mx.array, np.ndarray, Callable[[], None]]:
    """A uint8 array in host-visible MLX memory, the numpy view the decoders write, and what releases
    its mapping (call it before MLX may reuse the memory: a kernel must not write host-preferred
    pages; harmless twice)."""
    if STAGING == "device":
        a = mx.zeros(shape, mx.uint8)
    else:  # written by the CPU, in place: no numpy array copied in (a copy of the slot's size, at a few GB/s)
        a = mx.zeros(shape, mx.uint8, stream=mx.cpu)
    mx.eval(a)
    view = np.asarray(a)
    ptr, n = view.ctypes.data, view.nbytes
    if STAGING == "mapped" and n and cudart.map_to_device(ptr, n):
        done: list[bool] = []

        def release() -> None:
            if not done:
                done.append(True)
                cudart.unmap(ptr, n)
        return a, view, release
    return a, view, lambda: None


def planar(specs: dict[str, tuple[str, tuple[int, ...]]]) -> bool:
    """True when every tensor has one planar dtype and one shape (the run is one GPU array)."""
    kinds = {(dtype, tuple(shape)) for dtype, shape in specs.values()}
    return len(kinds) == 1 and next(iter(kinds))[0] in PLANAR_DTYPES


def _bits(dtype: str) -> tuple[Any, int]:
    _, unsigned = PLANAR_DTYPES[dtype]
    return unsigned, 2 if unsigned == mx.uint16 else 4


def split_span(names: list[str], arrays: list[mx.array], block_tokens: int,
               count: int) -> tuple[list[mx.array], Callable[[list[np.ndarray]], list[Planed]]] | None:
    """`count` blocks of these [.., tokens, dim] arrays (already sliced to the span) as planed runs:
    the planes, lazy (one array per plane, evaluated on the device), and what makes the runs of their
    host copies (kv/cache_blocks.py's `Deferred`).

    Returns None when they do not share one planar dtype and shape.
    """
    dtype = _MX_NAME.get(arrays[0].dtype)
    shape = tuple(arrays[0].shape)
    if dtype is None or any(a.dtype != arrays[0].dtype or tuple(a.shape) != shape for a in arrays):
        return None
    unsigned, size = _bits(dtype)
    lead, dim = shape[:-2], shape[-1]
    x = mx.stack(arrays).view(unsigned)  # [tensors, *lead, count*B, dim]
    x = x.reshape(len(arrays), *lead, count, block_tokens, dim)
    x = mx.moveaxis(x, len(lead) + 1, 0)  # [count, tensors, *lead, B, dim]: each block's run in payload order
    planes = [((x >> (8 * (size - 1 - k))) & 0xFF).astype(mx.uint8).reshape(count, -1) for k in range(size)]
    block_shape = (*lead, block_tokens, dim)

    def runs(host: list[np.ndarray]) -> list[Planed]:
        return [Planed(tuple(names), dtype, (block_shape,) * len(names), tuple(h[k] for h in host))
                for k in range(count)]

    return planes, runs


class Ring:
    """Staging for a wake's blocks: `slots` slots of `span` blocks each, in MLX host-visible memory.

    Block k of a restore stages into slot (k // span) % slots, row k % span: its run as stored,
    byte planes (`rows(k, True)`, planes-zstd) or the values whole (`rows(k, False)`, raw). The
    caller decodes a span only once the span `slots` before it was joined (its slot is then free).
    Filled by the decoders through numpy views of MLX's own memory (so no copy moves them into
    MLX), read by the GPU join through `planes` and `raw`. Made and dropped on the engine thread.
    """

    def __init__(self, blocks: int, size: int, plane_bytes: int, block_bytes: int, most: int | None = None,
                 owner: int | None = None) -> None:
        """`most`: slots at most (default RING_SLOTS); `owner`: whose wakes kept slots are (`drop_owned`)."""
        rows = max(1, SPAN_BYTES // max(1, block_bytes))
        self.span = min(blocks, rows) if blocks else 1
        self.slots = max(1, min(most or RING_SLOTS, -(-blocks // self.span)))
        self.size, self.plane_bytes = size, plane_bytes
        # Mapped for a discrete GPU, slots of whole spans are kept for the next wake (made once); elsewhere
        # (Metal's shared memory, the CPU) each wake makes slots of its own size and lets them go.
        # Where slots are kept, a ring's slots past its first are idle ones or none: a wake short of idle slots
        # decodes fewer spans ahead rather than make a slot (a long engine-thread job that a restart's other
        # wakes and every decoding call wait behind), so wakes at once make one slot each at most.
        keep = STAGING == "mapped" and cudart.active()
        shape = (rows if keep else self.span, size * plane_bytes)
        if keep and owner is not None:
            note_owner(owner, shape)
        made: list[tuple[mx.array, np.ndarray, Callable[[], None]]] = []
        try:
            for _ in range(self.slots):
                slot = _take_slot(shape, make=not (keep and made))
                if slot is None:
                    break
                made.append(slot)
        except BaseException:
            _give_back(shape, made)
            raise
        self.slots = len(made)
        self.arrays = [a for a, _, _ in made]
        self.views = [v for _, v, _ in made]
        self.close = weakref.finalize(self, _give_back, shape, made)

    def rows(self, k: int, planes: bool) -> list[np.ndarray]:
        """Block k's staging: one row per byte plane (planes), else one for the run's bytes."""
        row = self.views[(k // self.span) % self.slots][k % self.span]
        return planes_of(row, self.size) if planes else [row]

    def planes(self, first: int, count: int) -> list[mx.array]:
        """Blocks [first, first + count) of one span as planes ([count, plane bytes] each), to join."""
        return planes_of(self.raw(first, count), self.size)

    def raw(self, first: int, count: int) -> mx.array:
        """Blocks [first, first + count) of one span as stored by the raw codec ([count, run bytes])."""
        return self.arrays[(first // self.span) % self.slots][first % self.span : first % self.span + count]


# Idle slots of one shape kept between wakes where staging is mapped for a discrete GPU (made once: a
# slot is a fresh managed allocation the CPU writes zeros into, a fixed cost a small wake
# notices), still mapped; an engine's close releases those of its shapes but a ring's worth (`drop_owned`: a
# model loaded again finds its first wake's ring made; RING_SLOTS x SPAN_BYTES of host memory a shape stay
# after an unload), `drop_idle` releases any. Enough for the rings of a few
# wakes at once: a restart's agents wake together, and each ring made afresh is a long engine-thread job
# (its slots written and pinned) that every other wake and decode step waits behind (docs/decisions.md,
# "First start at the disk's speed"). The cost: KEEP_SLOTS x SPAN_BYTES of pinned host memory per model.
KEEP_SLOTS = 4 * RING_SLOTS
# A start that knows how many sessions will wake at once (the hot set read during start-up: kv/hot_set.py)
# makes a slot for each beside the load, as many as a leader's ring and one for each wake waiting for it take,
# up to MOST_KEPT: past KEEP_SLOTS, the waiting wakes made theirs afresh on the engine thread, between the
# leader's upload slices that every one of them waited for (docs/decisions.md, "The hot set read during
# start-up"). Kept for the process's life as KEEP_SLOTS' are: MOST_KEPT x SPAN_BYTES of pinned memory at most
MOST_KEPT = 32
_keep = KEEP_SLOTS  # the slots of one shape kept idle: KEEP_SLOTS, or more once `warm` was told of wakes ahead
_idle_lock = threading.RLock()  # a finalizer may run _give_back in a GC that a locked section set off
# Kept slots by shape: one shape per model's KV (two models loaded take turns on the device, and one
# model's rings must not push out the other's)
_idle: dict[tuple[int, int], list[tuple[mx.array, np.ndarray, Callable[[], None]]]] = {}
_owned: dict[int, set[tuple[int, int]]] = {}  # by owner (an engine's model, by id): the shapes its wakes kept


def _take_slot(shape: tuple[int, int], make: bool = True) -> tuple[mx.array, np.ndarray, Callable[[], None]] | None:
    """An idle slot of `shape`, else a new one (`make`), else None."""
    with _idle_lock:
        if _idle.get(shape):
            return _idle[shape].pop()
    return staging(shape) if make else None


def _give_back(shape: tuple[int, int], slots: list[tuple[mx.array, np.ndarray, Callable[[], None]]]) -> None:
    if not cudart.active():  # nothing mapped, nothing worth keeping
        release_all([release for _, _, release in slots])
        return
    with _idle_lock:
        kept = _idle.setdefault(shape, [])
        room = max(0, _keep - len(kept))
        kept.extend(slots[:room])
        stale = slots[room:]
    release_all([release for _, _, release in stale])


def warm(kv: mx.array, tensors: int, block_tokens: int, wakes: int = 0) -> bool:
    """Make the ring slots of a few wakes (KEEP_SLOTS; `wakes` sessions waking at once: a slot each past the
    first's ring, up to MOST_KEPT) for blocks of `tensors` tensors like `kv` (one layer's
    keys: [.., tokens, dim]) and keep them idle, and join a block from them both ways (planes, raw): a first restore then neither
    makes staging (a fresh managed allocation the CPU writes, a long job for a first restore:
    docs/decisions.md, "Engine", the ring's slots kept between wakes) nor compiles the joins. False
    (nothing kept) where staging is not mapped (no CUDA) or the dtype is not planar."""
    dtype = _MX_NAME.get(kv.dtype)
    if dtype is None:
        return False
    block_shape = (*kv.shape[:-2], block_tokens, kv.shape[-1])
    size = PLANAR_DTYPES[dtype][1].size
    shape = slot_shape(kv.shape, kv.dtype.size, tensors, block_tokens)
    global _keep
    with _idle_lock:  # never fewer than before: a later warm-up (the engine's, after "ready") names no wakes
        _keep = max(_keep, min(MOST_KEPT, wakes - 1 + RING_SLOTS))
        want = _keep
    slots: list[tuple[mx.array, np.ndarray, Callable[[], None]]] = []
    try:  # the slots made (or taken idle), then all kept idle
        while len(slots) < want:
            slots.append(_take_slot(shape))
        first = slots[0][0][0:1]
        mx.eval(join(planes_of(first, size), dtype, tensors, block_shape), join_raw(first, dtype, tensors, block_shape))
    finally:
        _give_back(shape, slots)
    return cudart.active()


def slot_shape(kv_shape: tuple[int, ...], itemsize: int, tensors: int, block_tokens: int) -> tuple[int, int]:
    """The shape of a kept slot (as Ring makes it) for blocks of `tensors` tensors shaped as one layer's keys
    (`kv_shape`: [.., tokens, dim]) of `itemsize` bytes a value."""
    block_bytes = tensors * math.prod((*kv_shape[:-2], block_tokens, kv_shape[-1])) * itemsize
    return (max(1, SPAN_BYTES // block_bytes), block_bytes)


def note_owner(owner: int, shape: tuple[int, int]) -> None:
    """Slots of `shape` are kept for `owner`'s wakes (an engine's model, by its id): `drop_owned` lets them go."""
    with _idle_lock:
        _owned.setdefault(owner, set()).add(shape)


def drop_owned(owner: int, keep: int = 0) -> None:
    """Release the idle slots of every shape `owner`'s wakes kept but `keep` of each (an engine's close)."""
    with _idle_lock:
        shapes = _owned.pop(owner, set())
    for shape in shapes:
        drop_idle(shape, keep)


def drop_idle(shape: tuple[int, int] | None = None, keep: int = 0) -> None:
    """Release the slots kept between wakes (their memory goes back to MLX): of one shape but `keep` of them,
    or all (and the count kept goes back to KEEP_SLOTS)."""
    global _keep
    with _idle_lock:
        if shape is None:
            stale = [slot for key in list(_idle) for slot in _idle.pop(key)]
            _keep = KEEP_SLOTS
        else:
            kept = _idle.pop(shape, [])
            stale = kept[keep:]
            if kept[:keep]:
                _idle[shape] = kept[:keep]
    release_all([release for _, _, release in stale])


def planes_of(stage: mx.array | np.ndarray, size: int) -> list:
    """The byte planes of one staged row set ([n, size * plane bytes] -> size x [n, plane bytes])."""
    plane_bytes = stage.shape[-1] // size
    return [stage[..., p * plane_bytes : (p + 1) * plane_bytes] for p in range(size)]


def release_all(releases: list[Callable[[], None]]) -> None:
    for release in releases:
        release()


def _join_words(planes: tuple[mx.array, ...], unsigned: Any, size: int) -> mx.array:
    """Byte planes (high first) -> the unsigned words they split."""
    x = planes[0].astype(unsigned) << (8 * (size - 1))
    for k, plane in enumerate(planes[1:], start=1):
        x = x | (plane.astype(unsigned) << (8 * (size - 1 - k)))
    return x


# One join per dtype. On the CPU compiled: the casts, shifts and ors fuse into one pass over the planes (op by op,
# each was a pass of its own with a temporary; docs/benchmarks.md, "Wake on the CPU (issue 50, point 7)"). On a
# GPU op by op: each op is a kernel MLX ships, its passes cost little at the device's bandwidth, and a compiled
# join is a kernel MLX compiles in a fresh cache, which a restart's first wake waited for (docs/benchmarks.md,
# "fleet").
_JOINS: dict[str, Callable[..., mx.array]] = {}


def _joiner(dtype: str) -> Callable[..., mx.array]:
    fn = _JOINS.get(dtype)
    if fn is None:
        unsigned, size = _bits(dtype)
        fn = lambda *planes: _join_words(planes, unsigned, size)  # noqa: E731
        _JOINS[dtype] = fn = mx.compile(fn) if mx.default_device() == mx.cpu else fn
    return fn


def join(planes: list[mx.array], dtype: str, tensors: int, block_shape: tuple[int, ...]) -> mx.array:
    """Staged planes ([blocks, plane bytes] uint8 each, high first) -> [tensors, *lead, blocks*B, dim]."""
    x = _joiner(dtype)(*planes)
    return _lay_out(x, planes[0].shape[0], tensors, block_shape).view(PLANAR_DTYPES[dtype][0])


def join_raw(data: mx.array, dtype: str, tensors: int, block_shape: tuple[int, ...]) -> mx.array:
    """Staged raw runs ([blocks, run bytes] uint8) -> [tensors, *lead, blocks*B, dim]: a view and one layout pass."""
    x = mx.contiguous(data).view(PLANAR_DTYPES[dtype][1])
    return _lay_out(x, data.shape[0], tensors, block_shape).view(PLANAR_DTYPES[dtype][0])


def _lay_out(x: mx.array, blocks: int, tensors: int, block_shape: tuple[int, ...]) -> mx.array:
    """[blocks, tensors * block values] of unsigned words -> [tensors, *lead, blocks*B, dim]."""
    lead, b, dim = block_shape[:-2], block_shape[-2], block_shape[-1]
    x = x.reshape(blocks, tensors, *lead, b, dim)
    x = mx.moveaxis(x, 0, len(lead) + 1)  # [tensors, *lead, blocks, B, dim]
    return x.reshape(tensors, *lead, blocks * b, dim)
