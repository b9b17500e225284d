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
# "zstd": plain level 3, the baseline. "planes-zstd": level 1 with min_match 7.
# On real bf16 KV of the default model (bench/codec_bench.py) the exponent
# planes are almost all literals; level 3's short matches disturb the literal
# statistics Huffman codes from, so level 1 compresses better (1.475x vs
# 1.43x) and decodes faster. Channel-major transposing gained 0.5% more but cost
# 15% decode speed, so it is not done.
_PARAMS = {
    "zstd": zstandard.ZstdCompressionParameters.from_level(3),
    "planes-zstd": zstandard.ZstdCompressionParameters.from_level(1, min_match=7),
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
    """A block file's bytes and the facts the index records about it."""

    data: bytes
    digest: str
    raw_bytes: int
    codec: str


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


def _scratch_u(dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A per-thread reusable array of `shape` (contents undefined)."""
    n = math.prod(shape) * dtype.itemsize
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.nbytes < n:
        buf = _scratch.buf = np.empty(max(n, 1 << 20), np.uint8)
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
    sections = [_section(header[:8], compressor), _section(header[8:], compressor)]
    for t in tensors.values():
        for piece in pieces(t.array):
            digest.update(piece)
        if codec == "planes-zstd":
            sections.extend(_section(p, compressor) for p in _planes(t))
        else:
            sections.append(_section(np.ascontiguousarray(t.array), compressor))
    raw_bytes = len(header) + sum(t.array.nbytes for t in tensors.values())
    head = FILE_HEADER.pack(MAGIC, FORMAT_VERSION, CODEC_IDS[codec], 0, raw_bytes, digest.digest())
    return Encoded(head + b"".join(sections), digest.hexdigest(), raw_bytes, codec)


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
    for name, spec in specs.items():
        dtype, shape = spec["dtype"], tuple(spec["shape"])
        holder = DTYPES[dtype][0]
        n = math.prod(shape)
        dest = _destination(place, name, dtype, shape)
        if codec == "planes-zstd":
            planes = [np.frombuffer(reader.section(n), np.uint8) for _ in range(holder.itemsize)]
            _unplanes_into(planes, dtype, dest)
        else:
            np.copyto(dest, np.frombuffer(reader.section(n * holder.itemsize), holder).reshape(shape))
        if hasher is not None:
            for piece in pieces(dest):
                hasher.update(piece)
        tensors[name] = Tensor(dtype, dest)
    if reader.pos != len(view):
        raise BlockFormatError(f"{len(view) - reader.pos} trailing bytes after the last section")
    return tensors, metadata, hasher.hexdigest() if hasher is not None else ""


def decode(
    data: bytes | memoryview, *, max_raw_bytes: int | None = None, digest: bool = True
) -> tuple[dict[str, Tensor], dict[str, str], str]:
    """Decode block-file bytes into new arrays: `decode_into` with no destinations."""
    return decode_into(data, None, max_raw_bytes=max_raw_bytes, digest=digest)
