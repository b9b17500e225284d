"""The byte-plane filter of the "planes-zstd" codec, and the per-plane writers of format 2.

Values are split into byte planes, high byte first. Block format 4 (written now) splits them as
they are; formats 1-3 rotated 16- and 32-bit floats left by one bit first (sign to the bottom, so
the exponent filled the top byte), which compressed bf16 KV slightly better but cost numpy's join
three more passes per value (docs/decisions.md, issue 50 point 7: "Block format 4"). `split` and
`join_into` are the two directions on the CPU; the daemon does the same on the GPU when the KV
lives there (daemon/kv/devplanes.py), producing and consuming format 4's planes; `unrotate` turns
an older block's planes into them.

A `PlaneSink` is one section of a format-2 run fed a chunk at a time: a large
compressible plane is one streamed zstd frame in which each tensor's bytes end
a zstd block (so each tensor gets Huffman tables of its own); a plane whose
first chunk's sample does not shrink by 3% (mantissas) is stored raw; a small
one is decided whole. Each sink digests the content it is given, in order, for
the block digest (blockdigest.py).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import zstandard

__all__ = ["CHUNK_BYTES", "JOIN_BYTES", "PLANES_PARAMS", "PlaneSink", "as_bytes", "compressor", "join_into", "scratch", "split",
           "unrotate", "whole_section"]

RAW_IF_RATIO_ABOVE = 0.97
SAMPLE_BYTES = 16 << 10  # planes larger than 4x this are judged by a sample of their first chunk
# Tensors are processed CHUNK_BYTES of payload at a time: few, large numpy/zstd/digest calls.
CHUNK_BYTES = 256 << 10
# A run is read and joined JOIN_BYTES of payload at a time: larger pieces leave the CPU's cache
# between the passes, smaller ones pay the calls' own cost more often; this size read fastest
# (docs/benchmarks.md, "One core's verified read (h-vr)").
JOIN_BYTES = 1 << 20
# Level 1, min_match 7, and a 64-entry match table searched once. On real bf16 KV exponent planes
# are almost all literals: the matches zstd finds there are short and spurious and disturb the
# literal statistics Huffman codes from. A higher level compresses worse; shrinking the match search
# to almost nothing compresses exponent planes better still, faster, and they decode faster.
# Channel-major transposing cost more decode speed than it gained in size. The figures:
# docs/decisions.md, Store: "Block codec planes-zstd" and "zstd for exponent planes".
PLANES_PARAMS = zstandard.ZstdCompressionParameters.from_level(1, min_match=7, hash_log=6, search_log=1)

_local = threading.local()


def scratch(dtype: np.dtype, shape: tuple[int, ...], slot: str) -> np.ndarray:
    """A per-thread reusable array of `shape` (contents undefined); one buffer per slot name."""
    n = math.prod(shape) * np.dtype(dtype).itemsize
    buf = getattr(_local, slot, None)
    if buf is None or buf.nbytes < n:
        buf = np.empty(max(n, CHUNK_BYTES), np.uint8)
        setattr(_local, slot, buf)
    return buf[:n].view(dtype).reshape(shape)


def compressor(k: int) -> zstandard.ZstdCompressor:
    """This thread's k-th planes compressor (made once: a compression context is not free)."""
    mine = getattr(_local, "compressors", None)
    if mine is None:
        mine = _local.compressors = []
    while len(mine) <= k:
        mine.append(zstandard.ZstdCompressor(compression_params=PLANES_PARAMS))
    return mine[k]


def decompressor(slot: str) -> zstandard.ZstdDecompressor:
    """This thread's decompressor for one section slot (made once). Sections decoded side by side,
    a piece of each in turn, each need their own: streams of one decompressor share its context,
    and interleaved they corrupt each other ("Data corruption detected")."""
    mine = getattr(_local, "decompressors", None)
    if mine is None:
        mine = _local.decompressors = {}
    if slot not in mine:
        mine[slot] = zstandard.ZstdDecompressor()
    return mine[slot]


def split(array: np.ndarray, rotate: bool) -> list[np.ndarray]:
    """Byte planes (high first) of an unsigned-integer view of the data, rotated left one bit if asked."""
    size = array.dtype.itemsize
    if size == 1:
        return [np.ascontiguousarray(array).reshape(-1).view(np.uint8)]
    u = array
    if rotate:
        u = (u << np.array(1, u.dtype)) | (u >> np.array(size * 8 - 1, u.dtype))
    else:
        u = np.ascontiguousarray(u)
    b = u.reshape(-1).view(np.uint8).reshape(-1, size)
    return [np.ascontiguousarray(b[:, i]) for i in reversed(range(size))]


def join_into(planes: list[np.ndarray], rotate: bool, dest: np.ndarray,
              parts: list[tuple[int, int, np.ndarray]] | None = None) -> None:
    """Join byte planes (high first) into `dest` (unsigned ints of their count in bytes, any strides).

    parts: (start, stop, destination) spans of a flat `dest`, each of which belongs in a destination
    of its own (unsigned ints, any strides, stop - start values): the join's last pass writes them
    there instead of into `dest`, so no copy follows it (`dest` is then scratch, partly written)."""
    size = dest.dtype.itemsize
    shape = dest.shape
    if size == 1:
        _last(None, dest, planes[0].reshape(shape), None, parts)
        return
    # Each plane's bits land where no other plane's do, so adding is or-ing; a product by a power
    # of two (wrapping) is the shift that numpy does fastest with the widening from bytes in one
    # pass. Rotated right by one bit (`rotate`), a plane moves one bit less far up; the last one
    # moves down by one, its lowest bit to the top.
    bits, unsigned = 8 * size, dest.dtype.type
    for k, plane in enumerate(planes[:-1]):
        shift = bits - 8 * (k + 1) - rotate
        if k == 0:
            np.multiply(plane.reshape(shape), unsigned(1 << shift), out=dest, dtype=dest.dtype)
        else:
            up = scratch(dest.dtype, shape, "rotate")
            np.multiply(plane.reshape(shape), unsigned(1 << shift), out=up, dtype=dest.dtype)
            np.add(dest, up, out=dest)
    last = planes[-1].reshape(shape)
    if rotate:
        np.add(dest, np.right_shift(last, 1, out=scratch(np.dtype(np.uint8), shape, "half")), out=dest,
               dtype=dest.dtype)
        top = scratch(dest.dtype, shape, "rotate")
        np.multiply(last, unsigned(1 << (bits - 1)), out=top, dtype=dest.dtype)
        last = top
    _last(np.add, dest, dest, last, parts)


def _last(op: Any, dest: np.ndarray, x: np.ndarray, y: np.ndarray | None,
          parts: list[tuple[int, int, np.ndarray]] | None) -> None:
    """A join's last pass, `op(x, y) -> dest` (op None: `x -> dest`), then each part copied to its place.

    The op runs once over the whole (contiguous) group, then plain copies place the parts: an op that
    widens bytes costs numpy a buffered cast set up per call, several times a copy's cost for a
    tensor of a block (docs/benchmarks.md, "One core's verified read, again (h-vr2)")."""
    if op is not None:
        op(x, y, out=dest, dtype=dest.dtype)  # dest may be strided when there are no parts
        x = dest
    if parts is None:
        if op is None:
            np.copyto(dest, x)
        return
    flat = x.reshape(-1)
    for lo, hi, out in parts:
        out[...] = flat[lo:hi].reshape(out.shape)


def unrotate(planes: list[np.ndarray]) -> None:
    """Byte planes (high first, contiguous uint8) of values rotated left one bit (formats 1-3), made in
    place the planes of the values as they are (format 4's), a piece at a time.

    Rotated right, each byte takes the bits above its lowest from itself and its top bit from the
    lowest bit of the byte above it (the top byte: of the lowest byte). Eight bytes are worked on
    at once as one uint64 (masks keep each byte's bits in it): numpy does not vectorize shifts of
    bytes, and a byte at a time this cost more than a whole decode (docs/benchmarks.md, "One core's
    verified read, again (h-vr2)")."""
    n = planes[0].size
    for lo in range(0, n, CHUNK_BYTES):
        hi = min(n, lo + CHUNK_BYTES)
        whole = lo + (hi - lo) // 8 * 8
        _unrotate_piece([p[lo:whole].view(np.uint64) for p in planes], 0x7F7F7F7F7F7F7F7F, "words")
        _unrotate_piece([p[whole:hi] for p in planes], 0x7F, "bytes")


def _unrotate_piece(pieces: list[np.ndarray], low7: int, slot: str) -> None:
    """unrotate's step on one piece of every plane, as unsigned words of whole bytes."""
    kind = pieces[0].dtype.type
    low7, top = kind(low7), kind(low7 ^ ((1 << (8 * pieces[0].itemsize)) - 1))  # each byte's 0x7F, 0x80
    n = pieces[0].size
    carry = scratch(pieces[0].dtype, (n,), slot + "_carry")
    np.bitwise_and(np.left_shift(pieces[-1], kind(7), out=carry), top, out=carry)
    spare = scratch(pieces[0].dtype, (n,), slot + "_spare")
    for piece in pieces:
        np.bitwise_and(np.left_shift(piece, kind(7), out=spare), top, out=spare)  # its lowest bits, for below
        np.bitwise_and(np.right_shift(piece, kind(1), out=piece), low7, out=piece)
        np.bitwise_or(piece, carry, out=piece)
        carry, spare = spare, carry


def as_bytes(x: Any) -> memoryview:
    """A flat byte view of a contiguous buffer (numpy arrays of any shape, empty ones too)."""
    if isinstance(x, np.ndarray):
        return memoryview(x.reshape(-1).view(np.uint8))
    view = memoryview(x)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def compressible(raw: memoryview, zc: zstandard.ZstdCompressor) -> bool:
    """False when a sample from the middle of a large plane does not shrink (mantissas)."""
    if len(raw) < 4 * SAMPLE_BYTES:
        return True
    mid = len(raw) // 2
    sample = raw[mid : mid + SAMPLE_BYTES]
    return len(zc.compress(sample)) <= RAW_IF_RATIO_ABOVE * len(sample)


def whole_section(data: Any, zc: zstandard.ZstdCompressor | None, mode_struct: Any) -> list[Any]:
    """A section compressed in one go, or raw when zstd cannot shrink it by 3%."""
    raw = as_bytes(data)
    if zc is not None and compressible(raw, zc):
        packed = zc.compress(raw)
        if len(packed) <= RAW_IF_RATIO_ABOVE * len(raw):
            return [mode_struct.pack(1, len(packed)), packed]
    return [mode_struct.pack(0, len(raw)), raw]


class PlaneSink:
    """One section of a run (a plane, or a raw payload), fed chunk by chunk; see the module docstring."""

    def __init__(self, zc: zstandard.ZstdCompressor | None, total: int, mode_struct: Any, hasher: Any) -> None:
        """hasher: the section digest's (update/digest), given by the block format (blockdigest.py)."""
        self.zc, self.total, self.mode_struct = zc, total, mode_struct
        self.parts: list[Any] = []
        self.obj: Any = None
        self.hasher = hasher
        self.mode = "raw" if zc is None else ("stream" if total >= 4 * SAMPLE_BYTES else "whole")

    def add(self, chunk: np.ndarray, bounds: list[int], owned: bool) -> None:
        """Append a chunk (contiguous bytes); bounds: tensor boundaries in it; owned: the sink may keep it."""
        raw = as_bytes(chunk)
        self.hasher.update(raw)
        if self.mode == "stream" and self.obj is None:
            if compressible(raw, self.zc):
                self.obj = self.zc.compressobj(size=self.total)
            else:
                self.mode = "raw"
        if self.mode == "stream":
            for lo, hi in zip(bounds, bounds[1:]):
                self.parts.append(self.obj.compress(raw[lo:hi]))
                self.parts.append(self.obj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
        else:
            self.parts.append(chunk if owned else chunk.copy())

    def sections(self) -> list[Any]:
        """The section's buffers, in order (mode and length first)."""
        if self.mode == "stream":
            self.parts.append(self.obj.flush())
            return [self.mode_struct.pack(1, sum(len(x) for x in self.parts)), *self.parts]
        if self.mode == "whole":
            return whole_section(b"".join(as_bytes(x) for x in self.parts), self.zc, self.mode_struct)
        return [self.mode_struct.pack(0, sum(as_bytes(x).nbytes for x in self.parts)), *self.parts]

    def digest(self) -> bytes:
        return self.hasher.digest()
