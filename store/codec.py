"""Block codec: named arrays <-> a safetensors payload <-> a compressed block file.

A block's *payload* is a safetensors container (8-byte little-endian header
length, JSON header padded with spaces to 8 bytes, then the tensor data in
header order). Its sha256 is the block's digest, computed over exactly those
bytes. The store never keeps the payload itself: it keeps a *block file*:

    offset  size  field
    0       4     magic b"KVWB"
    4       1     file format version (1)
    5       1     codec id (1 = "zstd", 2 = "planes-zstd")
    6       2     reserved, zero
    8       8     raw size: bytes of the safetensors payload (u64 LE)
    16      32    sha256 of the safetensors payload
    48      ...   sections

A section is `u8 mode (0 raw, 1 zstd) | u64 LE stored length | bytes`. The
first section holds the safetensors header (length prefix + JSON). Then, in
header order, each tensor's data follows as one section ("zstd") or as one
section per byte plane ("planes-zstd").

The "planes-zstd" filter, chosen by `bench/codec_bench.py` on real KV:
16- and 32-bit floats are rotated left by one bit (sign to the bottom, so the
exponent fills the top byte), then split into byte planes, high byte first.
Each plane is compressed on its own and stored raw when zstd cannot shrink it
by 3% (mantissa planes are close to random; storing them raw keeps decoding
at memcpy speed). Integer data (packed quantized KV) is split into planes
without rotation.

Decoding never produces more than the recorded raw size (bomb guard): every
section is decompressed with the exact length the header implies.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import zstandard

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "BlockFormatError",
    "Encoded",
    "Tensor",
    "decode",
    "encode",
    "payload",
    "read_file_header",
]

FORMAT_VERSION = 1
MAGIC = b"KVWB"
CODECS = {1: "zstd", 2: "planes-zstd"}
CODEC_IDS = {name: cid for cid, name in CODECS.items()}
DEFAULT_CODEC = "planes-zstd"
FILE_HEADER = struct.Struct("<4sBBHQ32s")
SECTION = struct.Struct("<BQ")
MAX_HEADER_BYTES = 16 << 20
RAW_IF_RATIO_ABOVE = 0.97
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


class BlockFormatError(ValueError):
    """Bytes that are not a valid block file (wrong magic, sizes, header, codec)."""


@dataclass(frozen=True)
class Tensor:
    """One named array: its safetensors dtype name and a C-contiguous numpy array.

    numpy has no bfloat16, so BF16 data travels as uint16 with dtype "BF16".
    """

    dtype: str
    array: np.ndarray

    @classmethod
    def of(cls, value: Tensor | np.ndarray) -> Tensor:
        if isinstance(value, Tensor):
            return value
        array = np.ascontiguousarray(value)
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


def _payload_header(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        header[name] = {"dtype": t.dtype, "shape": list(t.array.shape), "data_offsets": [offset, offset + t.array.nbytes]}
        offset += t.array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _planes(t: Tensor) -> list[np.ndarray]:
    holder, rotate = DTYPES[t.dtype]
    x = t.array.reshape(-1).view(holder)
    if holder.itemsize == 1:
        return [x.view(np.uint8)]
    bits = holder.itemsize * 8
    u = x.view(f"<u{holder.itemsize}")
    if rotate:
        u = (u << np.array(1, u.dtype)) | (u >> np.array(bits - 1, u.dtype))
    b = u.view(np.uint8).reshape(-1, holder.itemsize)
    return [np.ascontiguousarray(b[:, i]) for i in reversed(range(holder.itemsize))]


def _unplanes(planes: list[np.ndarray], dtype: str, shape: list[int]) -> np.ndarray:
    holder, rotate = DTYPES[dtype]
    if holder.itemsize == 1:
        return planes[0].view(holder).reshape(shape)
    # Widen the high plane and shift the others in, in place: twice as fast as
    # scattering bytes into an interleaved buffer.
    u = planes[0].astype(f"<u{holder.itemsize}")
    for plane in planes[1:]:
        u <<= 8
        u |= plane
    if rotate:
        low = u >> 1
        u <<= holder.itemsize * 8 - 1
        u |= low
    return u.view(holder).reshape(shape)


def _section(data: bytes | memoryview | np.ndarray, compressor: zstandard.ZstdCompressor, allow_raw: bool) -> bytes:
    raw = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else memoryview(data.reshape(-1).view(np.uint8))
    packed = compressor.compress(raw)
    if allow_raw and len(packed) > RAW_IF_RATIO_ABOVE * len(raw):
        return SECTION.pack(0, len(raw)) + bytes(raw)
    return SECTION.pack(1, len(packed)) + packed


def encode(
    arrays: Mapping[str, Tensor | np.ndarray],
    *,
    metadata: Mapping[str, str] | None = None,
    codec: str = DEFAULT_CODEC,
) -> Encoded:
    """Encode named arrays into block-file bytes; returns them with digest and raw size.

    Raises TypeError for dtypes safetensors cannot name, ValueError for an unknown codec.
    """
    if codec not in CODEC_IDS:
        raise ValueError(f"unknown codec {codec!r}; known: {sorted(CODEC_IDS)}")
    tensors = {name: Tensor.of(a) for name, a in arrays.items()}
    header = _payload_header(tensors, metadata or {})
    digest = hashlib.sha256(header)
    compressor = zstandard.ZstdCompressor(compression_params=_PARAMS[codec])
    # The length prefix is its own section so a reader knows how much header to expect.
    sections = [_section(header[:8], compressor, allow_raw=True), _section(header[8:], compressor, allow_raw=True)]
    for t in tensors.values():
        digest.update(memoryview(t.array.reshape(-1).view(np.uint8)))
        parts = _planes(t) if codec == "planes-zstd" else [t.array]
        sections.extend(_section(p, compressor, allow_raw=True) for p in parts)
    raw_bytes = len(header) + sum(t.array.nbytes for t in tensors.values())
    head = FILE_HEADER.pack(MAGIC, FORMAT_VERSION, CODEC_IDS[codec], 0, raw_bytes, digest.digest())
    return Encoded(head + b"".join(sections), digest.hexdigest(), raw_bytes, codec)


def payload(arrays: Mapping[str, Tensor | np.ndarray], *, metadata: Mapping[str, str] | None = None) -> bytes:
    """The uncompressed safetensors payload `encode` digests (for tests and tools)."""
    tensors = {name: Tensor.of(a) for name, a in arrays.items()}
    return _payload_header(tensors, metadata or {}) + b"".join(t.array.tobytes() for t in tensors.values())


def read_file_header(data: bytes | memoryview) -> tuple[str, int, str]:
    """Return (codec, raw size, digest hex) from a block file's fixed header."""
    if len(data) < FILE_HEADER.size:
        raise BlockFormatError(f"block file is {len(data)} bytes, shorter than its {FILE_HEADER.size}-byte header")
    magic, version, codec_id, _, raw_bytes, digest = FILE_HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BlockFormatError(f"bad magic {magic!r}; not a kvwake block file")
    if version != FORMAT_VERSION or codec_id not in CODECS:
        raise BlockFormatError(f"unsupported block format version {version}, codec id {codec_id}")
    return CODECS[codec_id], raw_bytes, digest.hex()


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


def decode(
    data: bytes | memoryview, *, max_raw_bytes: int | None = None, digest: bool = True
) -> tuple[dict[str, Tensor], dict[str, str], str]:
    """Decode block-file bytes into (tensors, metadata, sha256 hex of the payload).

    The caller compares the returned digest with the one it expects (the store
    always does). `digest=False` skips hashing and returns "" (benchmarks only).
    Raises BlockFormatError for anything malformed, including a payload larger
    than `max_raw_bytes` (the size the index recorded).
    """
    view = memoryview(data)
    codec, raw_bytes, _ = read_file_header(view)
    if max_raw_bytes is not None and raw_bytes > max_raw_bytes:
        raise BlockFormatError(f"payload claims {raw_bytes} bytes, more than the {max_raw_bytes} recorded")
    reader = _Reader(view, FILE_HEADER.size)
    prefix = reader.section(8)
    (header_len,) = struct.unpack("<Q", prefix[:8]) if len(prefix) == 8 else (0,)
    if not 0 < header_len <= min(MAX_HEADER_BYTES, raw_bytes - 8):
        raise BlockFormatError(f"safetensors header length {header_len} out of range")
    header_raw = bytes(prefix) + bytes(reader.section(header_len))
    specs, metadata = _parse_header(header_raw, raw_bytes)
    hasher = hashlib.sha256(header_raw) if digest else None
    tensors: dict[str, Tensor] = {}
    for name, spec in specs.items():
        holder = DTYPES[spec["dtype"]][0]
        n = math.prod(spec["shape"])
        if codec == "planes-zstd":
            planes = [np.frombuffer(reader.section(n), np.uint8) for _ in range(holder.itemsize)]
            array = _unplanes(planes, spec["dtype"], spec["shape"])
        else:
            array = np.frombuffer(reader.section(n * holder.itemsize), holder).reshape(spec["shape"]).copy()
        if hasher is not None:
            hasher.update(memoryview(array.reshape(-1).view(np.uint8)))
        tensors[name] = Tensor(spec["dtype"], array)
    if reader.pos != len(view):
        raise BlockFormatError(f"{len(view) - reader.pos} trailing bytes after the last section")
    return tensors, metadata, hasher.hexdigest() if hasher is not None else ""
