"""Block codec: named arrays <-> a safetensors payload <-> a compressed block file.

A block's *payload* is a safetensors container (8-byte little-endian header
length, JSON header padded with spaces to 8 bytes, then the tensor data in
header order). Its digest is the block's digest, computed over exactly those
bytes. The store never keeps the payload itself: it keeps a *block file*:

    offset  size  field
    0       4     magic b"KVWB"
    4       1     file format version: 1 (digest sha256) or 2 (digest BLAKE3-256)
    5       1     codec id (1 = "zstd", 2 = "planes-zstd", 3 = "raw"; raw needs version 2)
    6       2     reserved, zero
    8       8     raw size: bytes of the safetensors payload (u64 LE)
    16      32    digest of the safetensors payload
    48      ...   sections

A section is `u8 mode (0 raw, 1 zstd) | u64 LE stored length | bytes`. The
first section holds the safetensors header's 8-byte length prefix, the second
the JSON. Then, in header order, each tensor's data follows as one section
("zstd", "raw") or as one section per byte plane ("planes-zstd").

Writers write version 2; version 1 files (kvwake 0.1) stay readable. The
digest moved from sha256 to BLAKE3 because verification was a third of the
cost of a read (docs/decisions.md has the numbers and why not xxh3).

The "planes-zstd" filter, chosen by `bench/codec_bench.py` on real KV:
16- and 32-bit floats are rotated left by one bit (sign to the bottom, so the
exponent fills the top byte), then split into byte planes, high byte first.
Each plane is compressed on its own and stored raw when zstd cannot shrink it
by 3% (mantissa planes are close to random; storing them raw keeps decoding
at memcpy speed). A writer first compresses a 16 KiB sample of each large
plane and stores the plane raw at once when the sample does not shrink, so
sleep does not spend its time failing to compress mantissas. Integer data
(packed quantized KV) is split into planes without rotation. "raw" stores
every tensor uncompressed: for machines whose disks outrun their cores.

Decoding writes each tensor straight into a destination array the caller
chooses (`decode_into`), such as a view into a preallocated KV buffer, and
digests it there: a read copies each byte once from the file buffer (or the
decompressor) into place. It never produces more than the recorded raw size
(bomb guard): every section is decompressed with the exact length the header
implies.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import zstandard

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "BlockFormatError",
    "Encoded",
    "Place",
    "Tensor",
    "decode",
    "decode_into",
    "encode",
    "new_digest",
    "payload",
    "read_file_header",
    "read_specs",
]

FORMAT_VERSION = 2  # what writers write; READ_VERSIONS are accepted
READ_VERSIONS = {1: hashlib.sha256, 2: blake3.blake3}
MAGIC = b"KVWB"
CODECS = {1: "zstd", 2: "planes-zstd", 3: "raw"}
CODEC_IDS = {name: cid for cid, name in CODECS.items()}
DEFAULT_CODEC = "planes-zstd"
FILE_HEADER = struct.Struct("<4sBBHQ32s")
SECTION = struct.Struct("<BQ")
MAX_HEADER_BYTES = 16 << 20
RAW_IF_RATIO_ABOVE = 0.97
SAMPLE_BYTES = 16 << 10  # planes larger than 4x this are judged by a sample first
# Format 2 codes the tensors of a run (consecutive tensors of one dtype: a KV block is one run)
# together, CHUNK_BYTES of payload at a time: few, large numpy/zstd/BLAKE3 calls, each of which
# releases the GIL, so worker threads scale; per-tensor calls on small tensors did not (GIL hand-offs).
CHUNK_BYTES = 256 << 10
# "zstd": plain level 3, the baseline. "planes-zstd": level 1, min_match 7, and a
# 64-entry match table searched once. On real bf16 KV of the default model
# (bench/codec_bench.py) the exponent planes are almost all literals: the matches
# zstd finds there are short and spurious, and they disturb the literal
# statistics Huffman codes from. Level 3 compressed worse than level 1 (1.43x vs
# 1.475x); shrinking the match search to almost nothing (hash_log 6, search_log
# 1) compresses the exponent planes better still (0.347 vs 0.364 of their size)
# and 2.4x faster, and they decode about 2x faster. Each tensor's plane ends a
# zstd block, so every tensor gets Huffman tables of its own (0.3465 vs 0.3556
# for one table across tensors). Channel-major transposing gained 0.5% more but
# cost 15% decode speed, so it is not done.
_PARAMS = {
    "zstd": zstandard.ZstdCompressionParameters.from_level(3),
    "planes-zstd": zstandard.ZstdCompressionParameters.from_level(1, min_match=7, hash_log=6, search_log=1),
}

# safetensors dtype name -> (numpy dtype used to hold it, rotate before planes)
DTYPES: dict[str, tuple[np.dtype, bool]] = {
    "BF16": (np.dtype("<u2"), True),
    "F16": (np.dtype("<f2"), False),
    "F32": (np.dtype("<f4"), True),
    "F64": (np.dtype("<f8"), False),
    "U8": (np.dtype("u1"), False),
    "I8": (np.dtype("i1"), False),
    "U16": (np.dtype("<u2"), False),
    "I16": (np.dtype("<i2"), False),
    "U32": (np.dtype("<u4"), False),
    "I32": (np.dtype("<i4"), False),
    "U64": (np.dtype("<u8"), False),
    "I64": (np.dtype("<i8"), False),
    "BOOL": (np.dtype("?"), False),
}
_NAME_OF = {holder: name for name, (holder, _) in DTYPES.items() if name != "BF16"}

# A destination for one tensor: given (name, dtype name, shape), an array of the
# holder dtype and that shape to decode into (any strides), or None for a new one.
Place = Callable[[str, str, tuple[int, ...]], "np.ndarray | None"]


class BlockFormatError(ValueError):
    """Bytes that are not a valid block file (wrong magic, sizes, header, codec)."""


@dataclass(frozen=True)
class Tensor:
    """One named array: its safetensors dtype name and a numpy array.

    numpy has no bfloat16, so BF16 data travels as uint16 with dtype "BF16".
    The array may be a strided view (a block's slice of a whole KV buffer):
    the codec reads it in C order without making it contiguous first.
    """

    dtype: str
    array: np.ndarray

    @classmethod
    def of(cls, value: Tensor | np.ndarray) -> Tensor:
        if isinstance(value, Tensor):
            return value
        array = np.asarray(value)
        name = _NAME_OF.get(array.dtype)
        if name is None:
            raise TypeError(f"unsupported array dtype {array.dtype}")
        return cls(name, array)


@dataclass(frozen=True)
class Encoded:
    """A block file's bytes, as the buffers that make it up in order, and the facts the index records.

    `parts` are written as they are (os.writev); `data` joins them for callers that want one bytes.
    """

    parts: tuple[Any, ...]
    digest: str
    raw_bytes: int
    codec: str

    @property
    def data(self) -> bytes:
        return b"".join(memoryview(p).cast("B") for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(memoryview(p).nbytes for p in self.parts)


def new_digest(version: int = FORMAT_VERSION) -> Any:
    """A fresh payload hasher for block files of `version` (hashlib-like: update, hexdigest)."""
    return READ_VERSIONS[version]()


def pieces(array: np.ndarray) -> Iterator[memoryview]:
    """The array's bytes in C order, as few contiguous memoryviews as its strides allow."""
    if array.size == 0:
        return
    if array.flags.c_contiguous:
        yield memoryview(array.reshape(-1).view(np.uint8))
        return
    lead = 1  # leading axes to iterate over; what is left below them is contiguous
    while not array[(0,) * lead + (...,)].flags.c_contiguous:
        lead += 1
    for index in np.ndindex(*array.shape[:lead]):
        yield memoryview(array[index + (...,)].reshape(-1).view(np.uint8))


def _payload_header(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        header[name] = {"dtype": t.dtype, "shape": list(t.array.shape), "data_offsets": [offset, offset + t.array.nbytes]}
        offset += t.array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


# -- scratch buffers -----------------------------------------------------------

_scratch = threading.local()


def _scratch_u(dtype: np.dtype, shape: tuple[int, ...], slot: str = "rotate") -> np.ndarray:
    """A per-thread reusable array of `shape` (contents undefined); one buffer per slot name."""
    n = math.prod(shape) * dtype.itemsize
    buf = getattr(_scratch, slot, None)
    if buf is None or buf.nbytes < n:
        buf = np.empty(max(n, CHUNK_BYTES), np.uint8)
        setattr(_scratch, slot, buf)
    return buf[:n].view(dtype).reshape(shape)


# -- byte planes ---------------------------------------------------------------


def _planes(t: Tensor) -> list[np.ndarray]:
    holder, rotate = DTYPES[t.dtype]
    if holder.itemsize == 1:
        return [np.ascontiguousarray(t.array).reshape(-1).view(np.uint8)]
    bits = holder.itemsize * 8
    u = t.array.view(f"<u{holder.itemsize}")
    if rotate:
        u = (u << np.array(1, u.dtype)) | (u >> np.array(bits - 1, u.dtype))
    else:
        u = np.ascontiguousarray(u)
    b = u.reshape(-1).view(np.uint8).reshape(-1, holder.itemsize)
    return [np.ascontiguousarray(b[:, i]) for i in reversed(range(holder.itemsize))]


def _unplanes_into(planes: list[np.ndarray], dtype: str, dest: np.ndarray) -> None:
    """Join byte planes (high first) into `dest` (holder dtype, any strides), undoing the rotation."""
    holder, rotate = DTYPES[dtype]
    shape = dest.shape
    if holder.itemsize == 1:
        np.copyto(dest, planes[0].view(holder).reshape(shape))
        return
    u = dest.view(f"<u{holder.itemsize}")
    # Widen the high plane straight into place and shift the others in: no temporaries
    # but one scratch array for the rotation, reused by this thread.
    np.left_shift(planes[0].reshape(shape), 8 * (holder.itemsize - 1), out=u, dtype=u.dtype)
    for k, plane in enumerate(planes[1:], start=2):
        shifted = plane.reshape(shape)
        if k < holder.itemsize:
            low = _scratch_u(u.dtype, shape)
            np.left_shift(shifted, 8 * (holder.itemsize - k), out=low, dtype=u.dtype)
            shifted = low
        np.bitwise_or(u, shifted, out=u)
    if rotate:
        low = _scratch_u(u.dtype, shape)
        np.right_shift(u, 1, out=low)
        np.left_shift(u, holder.itemsize * 8 - 1, out=u)
        np.bitwise_or(u, low, out=u)


def _compressible(raw: memoryview, compressor: zstandard.ZstdCompressor) -> bool:
    """False when a sample from the middle of a large plane does not shrink (mantissas)."""
    if len(raw) < 4 * SAMPLE_BYTES:
        return True
    mid = len(raw) // 2
    sample = raw[mid : mid + SAMPLE_BYTES]
    return len(compressor.compress(sample)) <= RAW_IF_RATIO_ABOVE * len(sample)


def _section(data: bytes | memoryview | np.ndarray, compressor: zstandard.ZstdCompressor | None) -> bytes:
    raw = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else memoryview(data.reshape(-1).view(np.uint8))
    if compressor is not None and _compressible(raw, compressor):
        packed = compressor.compress(raw)
        if len(packed) <= RAW_IF_RATIO_ABOVE * len(raw):
            return SECTION.pack(1, len(packed)) + packed
    return SECTION.pack(0, len(raw)) + bytes(raw)


def _runs(items: list, dtype_of: Callable[[Any], str]) -> list[list]:
    """Consecutive items of one dtype, in order."""
    runs: list[list] = []
    for item in items:
        if runs and dtype_of(runs[-1][0]) == dtype_of(item):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _chunks(sizes: list[int], itemsize: int) -> list[tuple[int, int]]:
    """(first, stop) index ranges of tensors grouped to about CHUNK_BYTES of payload each."""
    groups, first, acc = [], 0, 0
    for i, n in enumerate(sizes):
        acc += n * itemsize
        if acc >= CHUNK_BYTES or i == len(sizes) - 1:
            groups.append((first, i + 1))
            first, acc = i + 1, 0
    return groups


class _PlaneSink:
    """One plane (or the raw payload) of a run, fed chunk by chunk, in one of three modes.

    "stream": a large compressible plane, one zstd frame in which each tensor's
    bytes end a block; "raw": no compressor, or a large plane whose first chunk's
    sample does not shrink (mantissas); "whole": a small plane, decided whole as
    `_section` does. Parts are kept as they are (no joining): the writer writes
    them in one go.
    """

    def __init__(self, compressor: zstandard.ZstdCompressor | None, total: int) -> None:
        self.compressor, self.total, self.parts, self.obj = compressor, total, [], None
        self.mode = "raw" if compressor is None else ("stream" if total >= 4 * SAMPLE_BYTES else "whole")

    def add(self, chunk: np.ndarray, bounds: list[int], owned: bool) -> None:
        """Append a chunk; bounds are the tensor boundaries in it; owned: the sink may keep the array."""
        raw = memoryview(chunk)
        if self.mode == "stream" and self.obj is None:
            if _compressible(raw, self.compressor):
                self.obj = self.compressor.compressobj(size=self.total)
            else:
                self.mode = "raw"
        if self.mode == "stream":
            for lo, hi in zip(bounds, bounds[1:]):
                self.parts.append(self.obj.compress(raw[lo:hi]))
                self.parts.append(self.obj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
        else:
            self.parts.append(chunk if owned else chunk.copy())

    def sections(self) -> list[Any]:
        if self.mode == "stream":
            self.parts.append(self.obj.flush())
            return [SECTION.pack(1, sum(len(x) for x in self.parts)), *self.parts]
        if self.mode == "whole":
            return [_section(b"".join(memoryview(x).cast("B") for x in self.parts), self.compressor)]
        return [SECTION.pack(0, sum(memoryview(x).nbytes for x in self.parts)), *self.parts]


def _compressor(k: int) -> zstandard.ZstdCompressor:
    """This thread's k-th "planes-zstd" compressor (made once: a compression context is not free)."""
    mine = getattr(_scratch, "compressors", None)
    if mine is None:
        mine = _scratch.compressors = []
    while len(mine) <= k:
        mine.append(zstandard.ZstdCompressor(compression_params=_PARAMS["planes-zstd"]))
    return mine[k]


def _encode_run(run: list[Tensor], compressor: zstandard.ZstdCompressor | None, digest: Any) -> list[Any]:
    """Buffers of one run's sections: one per byte plane ("planes-zstd"), or its payload ("raw")."""
    holder = DTYPES[run[0].dtype][0]
    sizes = [t.array.size for t in run]
    planes = holder.itemsize if compressor is not None else 1
    # One compressor per plane: a ZstdCompressor streams one frame at a time.
    sinks = [_PlaneSink(_compressor(k) if compressor is not None else None, sum(sizes)) for k in range(planes)]
    for first, stop in _chunks(sizes, holder.itemsize):
        if stop - first == 1 and run[first].array.flags.c_contiguous:
            chunk = run[first].array.reshape(-1)
        else:  # gather this chunk's tensors (strided views of the cache) into one contiguous buffer
            chunk = _scratch_u(holder, (sum(sizes[first:stop]),), "gather")
            offset = 0
            for t in run[first:stop]:
                np.copyto(chunk[offset : offset + t.array.size].reshape(t.array.shape), t.array)
                offset += t.array.size
        digest.update(memoryview(chunk.view(np.uint8)))
        bounds = [0]
        for n in sizes[first:stop]:
            bounds.append(bounds[-1] + n)
        if compressor is None:
            sinks[0].add(chunk.view(np.uint8), [b * holder.itemsize for b in bounds], owned=False)
        else:
            for sink, plane in zip(sinks, _planes(Tensor(run[0].dtype, chunk))):
                sink.add(plane, bounds, owned=True)
    return [part for sink in sinks for part in sink.sections()]


def encode(
    arrays: Mapping[str, Tensor | np.ndarray],
    *,
    metadata: Mapping[str, str] | None = None,
    codec: str = DEFAULT_CODEC,
) -> Encoded:
    """Encode named arrays into block-file bytes (format 2); returns them with digest and raw size.

    Arrays may be strided views; they are read in place. Raises TypeError for
    dtypes safetensors cannot name, ValueError for an unknown codec.
    """
    if codec not in CODEC_IDS:
        raise ValueError(f"unknown codec {codec!r}; known: {sorted(CODEC_IDS)}")
    tensors = {name: Tensor.of(a) for name, a in arrays.items()}
    header = _payload_header(tensors, metadata or {})
    digest = new_digest()
    digest.update(header)
    compressor = None if codec == "raw" else zstandard.ZstdCompressor(compression_params=_PARAMS[codec])
    # The length prefix is its own section so a reader knows how much header to expect.
    sections: list[Any] = [_section(header[:8], compressor), _section(header[8:], compressor)]
    if codec == "zstd":  # the baseline: one frame per tensor
        for t in tensors.values():
            for piece in pieces(t.array):
                digest.update(piece)
            sections.append(_section(np.ascontiguousarray(t.array), compressor))
    else:
        for run in _runs(list(tensors.values()), lambda t: t.dtype):
            sections.extend(_encode_run(run, compressor if codec == "planes-zstd" else None, digest))
    raw_bytes = len(header) + sum(t.array.nbytes for t in tensors.values())
    head = FILE_HEADER.pack(MAGIC, FORMAT_VERSION, CODEC_IDS[codec], 0, raw_bytes, digest.digest())
    return Encoded((head, *sections), digest.hexdigest(), raw_bytes, codec)


def payload(arrays: Mapping[str, Tensor | np.ndarray], *, metadata: Mapping[str, str] | None = None) -> bytes:
    """The uncompressed safetensors payload `encode` digests (for tests and tools)."""
    tensors = {name: Tensor.of(a) for name, a in arrays.items()}
    return _payload_header(tensors, metadata or {}) + b"".join(t.array.tobytes() for t in tensors.values())


def read_file_header(data: bytes | memoryview) -> tuple[str, int, str, int]:
    """Return (codec, raw size, digest hex, format version) from a block file's fixed header."""
    if len(data) < FILE_HEADER.size:
        raise BlockFormatError(f"block file is {len(data)} bytes, shorter than its {FILE_HEADER.size}-byte header")
    magic, version, codec_id, _, raw_bytes, digest = FILE_HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BlockFormatError(f"bad magic {magic!r}; not a kvwake block file")
    if version not in READ_VERSIONS or codec_id not in CODECS or (codec_id == CODEC_IDS["raw"] and version < 2):
        raise BlockFormatError(f"unsupported block format version {version}, codec id {codec_id}")
    return CODECS[codec_id], raw_bytes, digest.hex(), version


class _Reader:
    """Walks the sections of a block file, never producing more than it is told."""

    def __init__(self, data: memoryview, pos: int) -> None:
        self.data, self.pos = data, pos
        self.dctx = zstandard.ZstdDecompressor()

    def section(self, expect: int) -> bytes | memoryview:
        if self.pos + SECTION.size > len(self.data):
            raise BlockFormatError(f"truncated block file: section header at byte {self.pos}")
        mode, length = SECTION.unpack_from(self.data, self.pos)
        start, self.pos = self.pos + SECTION.size, self.pos + SECTION.size + length
        if self.pos > len(self.data):
            raise BlockFormatError(f"truncated block file: section of {length} bytes at byte {start}")
        body = self.data[start : self.pos]
        if mode == 0:
            out: bytes | memoryview = body
        elif mode == 1:
            # max_output_size is ignored when a frame declares its size, so check the declaration
            # first: a frame claiming gigabytes is refused before anything is allocated.
            try:
                declared = zstandard.frame_content_size(body)
                if declared != expect:
                    raise BlockFormatError(f"zstd section at byte {start} declares {declared} bytes, header says {expect}")
                out = self.dctx.decompress(body, max_output_size=expect)
            except zstandard.ZstdError as exc:
                raise BlockFormatError(f"zstd section at byte {start}: {exc}") from None
        else:
            raise BlockFormatError(f"unknown section mode {mode} at byte {start - SECTION.size}")
        if len(out) != expect:
            raise BlockFormatError(f"section at byte {start} holds {len(out)} bytes, header says {expect}")
        return out


def _parse_header(raw: bytes | memoryview, raw_bytes: int) -> tuple[dict, dict[str, str]]:
    try:
        header = json.loads(bytes(raw[8:]))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise BlockFormatError(f"safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise BlockFormatError("safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BlockFormatError("safetensors __metadata__ is not a map of strings")
    offset = len(raw)
    for name, spec in header.items():
        try:
            dtype, shape, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]
            if not isinstance(shape, list) or not all(isinstance(x, int) for x in (begin, end)):
                raise TypeError("shape or offsets of the wrong type")
        except (KeyError, TypeError, ValueError) as exc:
            raise BlockFormatError(f"tensor {name!r}: malformed header entry ({exc})") from None
        if not isinstance(dtype, str) or dtype not in DTYPES or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise BlockFormatError(f"tensor {name!r}: bad dtype or shape {dtype} {shape}")
        if begin + len(raw) != offset or end - begin != math.prod(shape) * DTYPES[dtype][0].itemsize:
            raise BlockFormatError(f"tensor {name!r}: data offsets {begin}..{end} do not follow its shape")
        offset = end + len(raw)
    if offset != raw_bytes:
        raise BlockFormatError(f"tensors end at byte {offset}, file header says payload is {raw_bytes}")
    return header, metadata


def _open(view: memoryview, max_raw_bytes: int | None) -> tuple[str, int, _Reader, bytes, dict, dict[str, str]]:
    """Check the fixed header and read the safetensors header: (codec, version, reader, header bytes, specs, metadata)."""
    codec, raw_bytes, _, version = read_file_header(view)
    if max_raw_bytes is not None and raw_bytes > max_raw_bytes:
        raise BlockFormatError(f"payload claims {raw_bytes} bytes, more than the {max_raw_bytes} recorded")
    reader = _Reader(view, FILE_HEADER.size)
    prefix = reader.section(8)
    (header_len,) = struct.unpack("<Q", prefix[:8]) if len(prefix) == 8 else (0,)
    if not 0 < header_len <= min(MAX_HEADER_BYTES, raw_bytes - 8):
        raise BlockFormatError(f"safetensors header length {header_len} out of range")
    header_raw = bytes(prefix) + bytes(reader.section(header_len))
    specs, metadata = _parse_header(header_raw, raw_bytes)
    return codec, version, reader, header_raw, specs, metadata


def read_specs(data: bytes | memoryview) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor, from the header alone (not verified: decoding verifies)."""
    specs = _open(memoryview(data), None)[4]
    return {name: (spec["dtype"], tuple(spec["shape"])) for name, spec in specs.items()}


def _destination(place: Place | None, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    dest = place(name, dtype, shape) if place is not None else None
    holder = DTYPES[dtype][0]
    if dest is None:
        return np.empty(shape, holder)
    if dest.shape != shape or dest.dtype != holder:
        raise BlockFormatError(f"tensor {name!r}: {dtype}{list(shape)} does not fit its destination "
                               f"{dest.dtype}{list(dest.shape)}")
    return dest


def _decode_tensor(reader: _Reader, codec: str, name: str, dtype: str, shape: tuple[int, ...],
                   place: Place | None, hasher: Any) -> Tensor:
    holder = DTYPES[dtype][0]
    n = math.prod(shape)
    dest = _destination(place, name, dtype, shape)
    if codec == "planes-zstd":
        _unplanes_into([np.frombuffer(reader.section(n), np.uint8) for _ in range(holder.itemsize)], dtype, dest)
    else:
        np.copyto(dest, np.frombuffer(reader.section(n * holder.itemsize), holder).reshape(shape))
    if hasher is not None:
        for piece in pieces(dest):
            hasher.update(piece)
    return Tensor(dtype, dest)


def _decode_run(reader: _Reader, codec: str, run: list[tuple[str, str, tuple[int, ...]]], place: Place | None,
                hasher: Any, tensors: dict[str, Tensor]) -> None:
    """A format-2 run: its planes (or raw payload) decoded a chunk of tensors at a time, straight into place."""
    dtype = run[0][1]
    holder = DTYPES[dtype][0]
    sizes = [math.prod(shape) for _, _, shape in run]
    total = sum(sizes)
    if codec == "raw":
        planes = [np.frombuffer(reader.section(total * holder.itemsize), holder)]
    else:
        planes = [np.frombuffer(reader.section(total), np.uint8) for _ in range(holder.itemsize)]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    for first, stop in _chunks(sizes, holder.itemsize):
        dests = [_destination(place, name, dtype, shape) for name, _, shape in run[first:stop]]
        lo, hi = starts[first], starts[stop]
        if stop - first == 1:  # a large tensor: joined straight into its destination
            if codec == "raw":
                np.copyto(dests[0], planes[0].reshape(dests[0].shape))
            else:
                _unplanes_into([p[lo:hi] for p in planes], dtype, dests[0])
            if hasher is not None:
                for piece in pieces(dests[0]):
                    hasher.update(piece)
        else:  # small tensors: joined together, digested in one call, then copied into place
            if codec == "raw":
                chunk = planes[0][lo:hi]
            else:
                chunk = _scratch_u(holder, (hi - lo,), "join")
                _unplanes_into([p[lo:hi] for p in planes], dtype, chunk)
            if hasher is not None:
                hasher.update(memoryview(chunk.view(np.uint8)))
            for dest, k in zip(dests, range(first, stop)):
                np.copyto(dest, chunk[starts[k] - lo : starts[k + 1] - lo].reshape(dest.shape))
        for (name, _, _), dest in zip(run[first:stop], dests):
            tensors[name] = Tensor(dtype, dest)


def decode_into(
    data: bytes | memoryview, place: Place | None = None, *, max_raw_bytes: int | None = None, digest: bool = True
) -> tuple[dict[str, Tensor], dict[str, str], str]:
    """Decode block-file bytes, each tensor into `place(name, dtype, shape)` or a new array.

    Returns (tensors, metadata, payload digest hex); `tensors` holds every
    tensor, placed ones as the destination arrays themselves. The caller
    compares the digest with the one it expects (the store always does);
    `digest=False` skips hashing and returns "" (benchmarks only). Raises
    BlockFormatError for anything malformed, including a payload larger than
    `max_raw_bytes` (the size the index recorded) or a tensor that does not fit
    its destination. A destination may be partly written when that happens.
    """
    view = memoryview(data)
    codec, version, reader, header_raw, specs, metadata = _open(view, max_raw_bytes)
    hasher = new_digest(version) if digest else None
    if hasher is not None:
        hasher.update(header_raw)
    tensors: dict[str, Tensor] = {}
    entries = [(name, spec["dtype"], tuple(spec["shape"])) for name, spec in specs.items()]
    if version == 1 or codec == "zstd":  # one section (or one per plane, format 1) per tensor
        for name, dtype, shape in entries:
            tensors[name] = _decode_tensor(reader, codec, name, dtype, shape, place, hasher)
    else:
        for run in _runs(entries, lambda e: e[1]):
            _decode_run(reader, codec, run, place, hasher, tensors)
    if reader.pos != len(view):
        raise BlockFormatError(f"{len(view) - reader.pos} trailing bytes after the last section")
    return tensors, metadata, hasher.hexdigest() if hasher is not None else ""


def decode(
    data: bytes | memoryview, *, max_raw_bytes: int | None = None, digest: bool = True
) -> tuple[dict[str, Tensor], dict[str, str], str]:
    """Decode block-file bytes into new arrays: `decode_into` with no destinations."""
    return decode_into(data, None, max_raw_bytes=max_raw_bytes, digest=digest)
