"""Block codec: named arrays <-> a safetensors payload <-> a compressed block file.

A block's *payload* is a safetensors container (8-byte little-endian header
length, JSON header padded with spaces to 8 bytes, then the tensor data in
header order). The store never keeps the payload itself: it keeps a *block file*:

    offset  size  field
    0       4     magic b"KVWB"
    4       1     file format version: 1, 2, 3 or 4
    5       1     codec id (1 = "zstd", 2 = "planes-zstd", 3 = "raw"; raw needs version 2 or later)
    6       2     reserved, zero
    8       8     raw size: bytes of the safetensors payload (u64 LE)
    16      32    digest (below)
    48      ...   sections

A section is `u8 mode (0 raw, 1 zstd) | u64 LE stored length | bytes`. The
first section holds the safetensors header's 8-byte length prefix, the second
the JSON. The tensor data follows:

- format 1 (kvwake 0.1, still read): one section per tensor ("zstd") or one
  per byte plane of each tensor ("planes-zstd"); digest = sha256 of the payload.
- formats 2, 3 (still read) and 4 (written now): tensors are coded in *runs* of consecutive tensors of
  one dtype (a plain KV block is one run). "planes-zstd": one section per byte
  plane of the whole run, each tensor's bytes ending a zstd block (store/format/planes.py);
  "raw": one uncompressed section with the run's payload; "zstd": one section per
  tensor. Digest = BLAKE3 of the concatenated digests of every section's
  decoded content, in file order (header length, header JSON, then the planes
  or data): BLAKE3 digests in format 2, XXH3-128 in formats 3 and 4
  (store/format/blockdigest.py). Formats 1-3 rotate bf16 and f32 values left
  one bit before their planes; format 4 splits every value as it is (planes.py says why).
  The digest is checked before any byte is transformed, so a reader may join
  the planes wherever it likes (numpy here, the GPU in the daemon), and it pins
  the payload as surely as a digest of the payload itself: the planes are a
  bijection of it. Not sha256: BLAKE3 is a third of its cost, XXH3 less again (docs/decisions.md).

Decoding writes each tensor straight into a destination the caller chooses
(`decode_into`): a view into a preallocated KV buffer, or (formats 2-4) a staging
buffer for a run's planes. A run is decoded a chunk of tensors at a
time: each section's piece is digested and joined while it is in the CPU's
cache (`sections.Pieces`), read where it lies (raw) or decompressed (a section up to
`WHOLE_SECTION_BYTES` whole at its first piece). It never produces more than the recorded raw size
(bomb guard): every section is decompressed with the exact length the header
implies, checked before anything is allocated.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from kvwake.store.format.blockdigest import BlockDigest, NoDigest
from kvwake.store.format.header import DTYPES, BlockFormatError, Layout, parse_header, payload_header
from kvwake.store.format.planes import (CHUNK_BYTES, JOIN_BYTES, PLANES_PARAMS, PlaneSink, as_bytes, compressor, join_into,
                                        scratch, split, unrotate, whole_section)
from kvwake.store.format.sections import SECTION, Pieces, Reader

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
    "destination",
    "encode",
    "Planed",
    "Stage",
    "payload",
    "read_file_header",
    "read_specs",
    "section_digest",
]

FORMAT_VERSION = 4  # what writers write; every version is read
VERSIONS = (1, 2, 3, 4)
MAGIC = b"KVWB"
CODECS = {1: "zstd", 2: "planes-zstd", 3: "raw"}
CODEC_IDS = {name: cid for cid, name in CODECS.items()}
DEFAULT_CODEC = "planes-zstd"
FILE_HEADER = struct.Struct("<4sBBHQ32s")
MAX_HEADER_BYTES = 16 << 20
_ZSTD = zstandard.ZstdCompressionParameters.from_level(3)  # "zstd": plain level 3, the baseline

_NAME_OF = {holder: name for name, (holder, _) in DTYPES.items() if name != "BF16"}

# A staged section is read (decompressed or copied) and digested this many bytes at a time: each
# piece is one call that releases the GIL for each of the two, so smaller pieces stay in the
# CPU's cache and larger ones take the GIL less often (docs/decisions.md, Engine: "Staged sections are
# read and digested 2 MiB at a time").
STAGE_PIECE_BYTES = 2 << 20

# A destination for one tensor: given (name, dtype name, shape), an array of the
# holder dtype and that shape to decode into (any strides), or None for a new one.
Place = Callable[[str, str, tuple[int, ...]], "np.ndarray | None"]
# Staging for a format-2, 3 or 4 run: given (names, dtype name, values in the run, planes), for a
# "planes-zstd" run (planes true) one contiguous uint8 array per byte plane of `values` bytes each
# (given format 4's planes whatever the block's format: an older block's are unrotated there),
# for a "raw" run one of values * itemsize bytes (the tensors' bytes in order), or None to have the
# run decoded into place.
Stage = Callable[[tuple[str, ...], str, int, bool], "list[np.ndarray] | None"]


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
        return b"".join(as_bytes(p) for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(as_bytes(p).nbytes for p in self.parts)


def section_digest(contents: list[bytes], version: int = FORMAT_VERSION) -> str:
    """The digest (formats 2-4) of a block whose sections decode to `contents` (for tests and tools)."""
    d = BlockDigest(version)
    for c in contents:
        d.section(c)
    return d.hexdigest()


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


def _runs(items: list, dtype_of: Callable[[Any], str]) -> list[list]:
    """Consecutive items of one dtype, in order."""
    runs: list[list] = []
    for item in items:
        if runs and dtype_of(runs[-1][0]) == dtype_of(item):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _chunks(sizes: list[int], itemsize: int, limit: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """(first, stop) index ranges of tensors grouped to about `limit` bytes of payload each."""
    groups, first, acc = [], 0, 0
    for i, n in enumerate(sizes):
        acc += n * itemsize
        if acc >= limit or i == len(sizes) - 1:
            groups.append((first, i + 1))
            first, acc = i + 1, 0
    return groups


def _bounds(sizes: list[int]) -> list[int]:
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


@dataclass(frozen=True)
class Planed:
    """A block that is one run already split into byte planes (by the GPU, say): what encode would make.

    names/shapes: its tensors in order; dtype: theirs (one); planes: one contiguous uint8
    array per byte, high first, each the run's bytes of that plane in tensor order (format 4's
    planes: the values as they are, never rotated).
    """

    names: tuple[str, ...]
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    planes: tuple[np.ndarray, ...]


def _rotated(dtype: str, version: int) -> bool:
    """Whether a block of this format rotates this dtype's values before splitting them into planes."""
    return DTYPES[dtype][1] and version < 4


def _encode_run(run: list[tuple[str, Tensor]], codec: str, digest: BlockDigest) -> list[Any]:
    """Buffers of one run's sections: one per byte plane ("planes-zstd"), or its payload ("raw")."""
    dtype = run[0][1].dtype
    holder, rotate = DTYPES[dtype][0], _rotated(dtype, digest.version)
    sizes = [t.array.size for _, t in run]
    count = holder.itemsize if codec == "planes-zstd" else 1
    sinks = [PlaneSink(compressor(k) if codec == "planes-zstd" else None, sum(sizes) * holder.itemsize // count,
                       SECTION, digest.hasher()) for k in range(count)]
    for first, stop in _chunks(sizes, holder.itemsize):
        tensors = [t for _, t in run[first:stop]]
        if len(tensors) == 1 and tensors[0].array.flags.c_contiguous:
            chunk = tensors[0].array.reshape(-1)
        else:  # gather this chunk's tensors (strided views of the cache) into one contiguous buffer
            chunk = scratch(holder, (sum(sizes[first:stop]),), "gather")
            for t, lo, hi in zip(tensors, _bounds(sizes[first:stop]), _bounds(sizes[first:stop])[1:]):
                np.copyto(chunk[lo:hi].reshape(t.array.shape), t.array)
        bounds = _bounds(sizes[first:stop])
        if codec == "raw":
            sinks[0].add(chunk.view(np.uint8), [b * holder.itemsize for b in bounds], owned=False)
        else:
            unsigned = chunk.view(f"<u{holder.itemsize}") if holder.itemsize > 1 else chunk.view(np.uint8)
            for sink, plane in zip(sinks, split(unsigned, rotate)):
                sink.add(plane, bounds, owned=True)
    return _finish_sinks(sinks, digest)


def _finish_sinks(sinks: list[PlaneSink], digest: BlockDigest) -> list[Any]:
    out = []
    for sink in sinks:
        out.extend(sink.sections())
        digest.section_digest(sink.digest())
    return out


def _encode_planed(block: Planed, digest: BlockDigest) -> list[Any]:
    sizes = [math.prod(shape) for shape in block.shapes]
    total = sum(sizes)
    sinks = [PlaneSink(compressor(k), total, SECTION, digest.hasher()) for k in range(len(block.planes))]
    for first, stop in _chunks(sizes, len(block.planes)):
        lo, hi = sum(sizes[:first]), sum(sizes[:stop])
        for sink, plane in zip(sinks, block.planes):
            sink.add(plane[lo:hi], _bounds(sizes[first:stop]), owned=True)
    return _finish_sinks(sinks, digest)


def encode(
    arrays: Mapping[str, Tensor | np.ndarray] | Planed,
    *,
    metadata: Mapping[str, str] | None = None,
    codec: str = DEFAULT_CODEC,
    version: int = FORMAT_VERSION,
) -> Encoded:
    """Encode named arrays (or one already planed run) into block-file bytes, format 4
    (`version=2` or `3`: the formats before, for tests of their reads).

    Arrays may be strided views; they are read in place. Returns the file's
    buffers with digest and raw size. Raises TypeError for dtypes safetensors
    cannot name, ValueError for an unknown codec or version or a Planed block with another codec
    or format.
    """
    if codec not in CODEC_IDS:
        raise ValueError(f"unknown codec {codec!r}; known: {sorted(CODEC_IDS)}")
    if version not in (2, 3, 4):
        raise ValueError(f"block format {version} is read, not written; written: 2, 3, 4")
    if isinstance(arrays, Planed):
        if codec != "planes-zstd" or version != FORMAT_VERSION:
            raise ValueError(f"a planed block is format {FORMAT_VERSION} planes-zstd, not format {version} {codec}")
        specs = [(n, arrays.dtype, tuple(s)) for n, s in zip(arrays.names, arrays.shapes)]
    else:
        tensors = {name: Tensor.of(a) for name, a in arrays.items()}
        specs = [(n, t.dtype, tuple(t.array.shape)) for n, t in tensors.items()]
    header = payload_header(specs, metadata or {})
    digest = BlockDigest(version)
    zc = zstandard.ZstdCompressor(compression_params=PLANES_PARAMS if codec != "zstd" else _ZSTD)
    sections: list[Any] = []
    for part in (header[:8], header[8:]):  # the length prefix alone first: a reader knows how much header to expect
        sections.extend(whole_section(part, zc if codec != "raw" else None, SECTION))
        digest.section(part)
    if isinstance(arrays, Planed):
        sections.extend(_encode_planed(arrays, digest))
    elif codec == "zstd":  # the baseline: one frame per tensor
        for t in tensors.values():
            sections.extend(whole_section(np.ascontiguousarray(t.array), zc, SECTION))
            digest.section(*pieces(t.array))
    else:
        for run in _runs(list(tensors.items()), lambda item: item[1].dtype):
            sections.extend(_encode_run(run, codec, digest))
    raw_bytes = len(header) + sum(math.prod(shape) * DTYPES[dtype][0].itemsize for _, dtype, shape in specs)
    digest_hex = digest.hexdigest()
    head = FILE_HEADER.pack(MAGIC, version, CODEC_IDS[codec], 0, raw_bytes, bytes.fromhex(digest_hex))
    return Encoded((head, *sections), digest_hex, raw_bytes, codec)


def payload(arrays: Mapping[str, Tensor | np.ndarray], *, metadata: Mapping[str, str] | None = None) -> bytes:
    """The uncompressed safetensors payload a block file decodes to (for tests and tools)."""
    tensors = {name: Tensor.of(a) for name, a in arrays.items()}
    specs = [(n, t.dtype, tuple(t.array.shape)) for n, t in tensors.items()]
    return payload_header(specs, metadata or {}) + b"".join(t.array.tobytes() for t in tensors.values())


def read_file_header(data: bytes | memoryview) -> tuple[str, int, str, int]:
    """Return (codec, raw size, digest hex, format version) from a block file's fixed header."""
    if len(data) < FILE_HEADER.size:
        raise BlockFormatError(f"block file is {len(data)} bytes, shorter than its {FILE_HEADER.size}-byte header")
    magic, version, codec_id, _, raw_bytes, digest = FILE_HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BlockFormatError(f"bad magic {magic!r}; not a kvwake block file")
    if version not in VERSIONS or codec_id not in CODECS or (codec_id == CODEC_IDS["raw"] and version < 2):
        raise BlockFormatError(f"unsupported block format version {version}, codec id {codec_id}")
    return CODECS[codec_id], raw_bytes, digest.hex(), version


def _open(view: memoryview, max_raw_bytes: int | None) -> tuple[str, int, Reader, bytes, Layout, dict[str, str]]:
    """Check the fixed header and read the safetensors header: (codec, version, reader, header bytes, layout, metadata)."""
    codec, raw_bytes, _, version = read_file_header(view)
    if max_raw_bytes is not None and raw_bytes > max_raw_bytes:
        raise BlockFormatError(f"payload claims {raw_bytes} bytes, more than the {max_raw_bytes} recorded")
    reader = Reader(view, FILE_HEADER.size)
    prefix = reader.section(8)
    (header_len,) = struct.unpack("<Q", prefix[:8]) if len(prefix) == 8 else (0,)
    if not 0 < header_len <= min(MAX_HEADER_BYTES, raw_bytes - 8):
        raise BlockFormatError(f"safetensors header length {header_len} out of range")
    header_raw = bytes(prefix) + bytes(reader.section(header_len))
    layout, metadata = parse_header(header_raw, raw_bytes)
    return codec, version, reader, header_raw, layout, metadata


def read_specs(data: bytes | memoryview) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor, from the header alone (not verified: decoding verifies)."""
    return {name: (dtype, shape) for name, dtype, shape in _open(memoryview(data), None)[4].entries}


def destination(place: Place | None, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Where tensor `name` decodes: `place`'s array, checked to fit (BlockFormatError), or a new one."""
    dest = place(name, dtype, shape) if place is not None else None
    holder = DTYPES[dtype][0]
    if dest is None:
        return np.empty(shape, holder)
    if dest.shape != shape or dest.dtype != holder:
        raise BlockFormatError(f"tensor {name!r}: {dtype}{list(shape)} does not fit its destination "
                               f"{dest.dtype}{list(dest.shape)}")
    return dest


def _decode_tensor(reader: Reader, codec: str, entry: tuple[str, str, tuple[int, ...]], place: Place | None,
                   digest: BlockDigest) -> Tensor:
    """One tensor coded alone: every format-1 tensor, and formats 2-4 "zstd"."""
    name, dtype, shape = entry
    holder, rotate = DTYPES[dtype]
    n = math.prod(shape)
    dest = destination(place, name, dtype, shape)
    if codec == "planes-zstd":  # format 1 only
        planes = [np.frombuffer(reader.section(n), np.uint8) for _ in range(holder.itemsize)]
        join_into(planes, rotate, _unsigned(dest))
    else:
        content = reader.section(n * holder.itemsize)
        np.copyto(dest, np.frombuffer(content, holder).reshape(shape))
    if digest.version == 1:
        for piece in pieces(dest):
            digest.payload(piece)
    else:
        digest.section(*pieces(dest))
    return Tensor(dtype, dest)


_UNSIGNED = {1: np.dtype(np.uint8), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def _unsigned(a: np.ndarray) -> np.ndarray:
    unsigned = _UNSIGNED[a.dtype.itemsize]
    return a if a.dtype == unsigned else a.view(unsigned)


@dataclass(frozen=True)
class _RunPlan:
    """How a run of a layout is decoded: its entries, their bounds in values, and the groups of
    tensors read and joined together (JOIN_BYTES each): (first, stop, start value, stop value,
    each tensor's (start, stop) in the group's values)."""

    entries: tuple[tuple[str, str, tuple[int, ...]], ...]
    starts: tuple[int, ...]
    groups: tuple[tuple[int, int, int, int, tuple[tuple[int, int], ...]], ...]


def _plan(layout: Layout) -> tuple[_RunPlan, ...]:
    """The layout's runs, planned once per layout (kept in its memo)."""
    plan = layout.memo.get("runs")
    if plan is None:
        plan = []
        for run in _runs(list(layout.entries), lambda e: e[1]):
            sizes = [math.prod(shape) for _, _, shape in run]
            starts = _bounds(sizes)
            groups = tuple((a, b, starts[a], starts[b], tuple((starts[k] - starts[a], starts[k + 1] - starts[a])
                                                             for k in range(a, b)))
                           for a, b in _chunks(sizes, DTYPES[run[0][1]][0].itemsize, JOIN_BYTES))
            plan.append(_RunPlan(tuple(run), tuple(starts), groups))
        plan = layout.memo["runs"] = tuple(plan)
    return plan


def _decode_run(reader: Reader, codec: str, plan: _RunPlan, place: Place | None,
                stage: Stage | None, digest: BlockDigest, tensors: dict[str, Tensor]) -> None:
    """A format-2, 3 or 4 run: its sections read (into `stage`'s buffers when it takes the run), digested,
    then joined a group of tensors at a time straight into place."""
    run, starts = plan.entries, plan.starts
    dtype = run[0][1]
    holder, rotate = DTYPES[dtype][0], _rotated(dtype, digest.version)
    unsigned = _UNSIGNED[holder.itemsize]
    total = starts[-1]
    staged = stage(tuple(name for name, _, _ in run), dtype, total, codec != "raw") if stage is not None else None
    if codec == "raw":
        sections = [Pieces(reader, total * holder.itemsize, "plane0", digest)]
    else:
        sections = [Pieces(reader, total, f"plane{k}", digest) for k in range(holder.itemsize)]
    if staged is not None:
        for section, plane in zip(sections, staged):
            if plane.size != section.expect:
                raise BlockFormatError(f"staging of {plane.size} bytes for a section of {section.expect}")
            step = STAGE_PIECE_BYTES
            for lo in range(0, plane.size, step):
                section.take(min(step, plane.size - lo), plane[lo : lo + step])
            digest.section_digest(section.finish())
        if rotate and codec != "raw":
            unrotate(staged)
        return
    for first, stop, lo, hi, spans in plan.groups:
        dests = [destination(place, name, dtype, shape) for name, _, shape in run[first:stop]]
        target = dests[0] if len(dests) == 1 else scratch(holder, (hi - lo,), "join")  # a large tensor: in place
        if codec == "raw":
            raw = sections[0].take((hi - lo) * holder.itemsize).view(holder)
            for (a, b), dest in zip(spans, dests):
                np.copyto(dest, raw[a:b].reshape(dest.shape))
        else:  # each plane's piece digested and joined while it is in cache (decompressed with it, or
            # whole at the first: Pieces); small tensors joined together, then each copied into its place
            views = dests if holder == unsigned else [d.view(unsigned) for d in dests]
            parts = None if len(dests) == 1 else [(a, b, v) for (a, b), v in zip(spans, views)]
            join_into([section.take(hi - lo) for section in sections], rotate, target.view(unsigned), parts)
        for (name, _, _), dest in zip(run[first:stop], dests):
            tensors[name] = Tensor(dtype, dest)
    for section in sections:
        digest.section_digest(section.finish())


def _decode_zstd_run(reader: Reader, run: list[tuple[str, str, tuple[int, ...]]], place: Place | None,
                     stage: Stage | None, digest: BlockDigest, tensors: dict[str, Tensor]) -> None:
    """A "zstd" run (formats 2-4): one section per tensor. When `stage` takes the run, its tensors' bytes are
    decompressed one after the other into the staged buffer, a raw run's layout (on a GPU the device
    joins it: decoding each into the device's arrays from the CPU made a long wake many times slower,
    docs/decisions.md, Store: `codec = "auto"` is the default); else each tensor into place."""
    dtype = run[0][1]
    holder = DTYPES[dtype][0]
    sizes = [math.prod(shape) for _, _, shape in run]
    staged = stage(tuple(name for name, _, _ in run), dtype, sum(sizes), False) if stage is not None else None
    if staged is None:
        for entry in run:
            tensors[entry[0]] = _decode_tensor(reader, "zstd", entry, place, digest)
        return
    (plane,) = staged
    if plane.size != sum(sizes) * holder.itemsize:
        raise BlockFormatError(f"staging of {plane.size} bytes for a run of {sum(sizes) * holder.itemsize}")
    lo = 0
    for n in sizes:
        section, nbytes = Pieces(reader, n * holder.itemsize, "plane0", digest), n * holder.itemsize
        for off in range(0, nbytes, STAGE_PIECE_BYTES):
            k = min(STAGE_PIECE_BYTES, nbytes - off)
            section.take(k, plane[lo + off : lo + off + k])
        digest.section_digest(section.finish())
        lo += nbytes


def decode_into(
    data: bytes | memoryview, place: Place | None = None, *, stage: Stage | None = None,
    max_raw_bytes: int | None = None, digest: bool = True,
) -> tuple[dict[str, Tensor], dict[str, str], str]:
    """Decode block-file bytes, each tensor into `place(name, dtype, shape)` or a new array.

    stage(names, dtype, values, planes): for a format-2, 3 or 4 run, where to read
    its sections as stored (`Stage`): a "planes-zstd" run's byte planes left
    unjoined (format 4's), a "raw" run's bytes as they are, a "zstd" run's tensors
    decompressed one after the other (the layout of a raw run) (the run's
    tensors are then not in the result), or None.
    Returns (tensors, metadata, digest hex); `tensors` holds every tensor not
    staged, placed ones as the destination arrays themselves. The caller
    compares the digest with the one it expects (the store always does);
    `digest=False` skips hashing and returns "" (benchmarks only).
    Raises BlockFormatError for anything malformed, including a payload larger
    than `max_raw_bytes` (the size the index recorded) or a tensor that does
    not fit its destination. A destination may be partly written when that happens.
    """
    view = memoryview(data)
    codec, version, reader, header_raw, layout, metadata = _open(view, max_raw_bytes)
    hasher = BlockDigest(version) if digest else NoDigest(version)
    if version == 1:
        hasher.payload(header_raw)
    else:
        hasher.section(header_raw[:8])
        hasher.section(header_raw[8:])
    tensors: dict[str, Tensor] = {}
    if version == 1:
        for entry in layout.entries:
            tensors[entry[0]] = _decode_tensor(reader, codec, entry, place, hasher)
    elif codec == "zstd":
        for run in _plan(layout):
            _decode_zstd_run(reader, list(run.entries), place, stage, hasher, tensors)
    else:
        for run in _plan(layout):
            _decode_run(reader, codec, run, place, stage, hasher, tensors)
    if reader.pos != len(view):
        raise BlockFormatError(f"{len(view) - reader.pos} trailing bytes after the last section")
    return tensors, metadata, hasher.hexdigest() if digest else ""


def decode(
    data: bytes | memoryview, *, max_raw_bytes: int | None = None, digest: bool = True
) -> tuple[dict[str, Tensor], dict[str, str], str]:
    """Decode block-file bytes into new arrays: `decode_into` with no destinations."""
    return decode_into(data, None, max_raw_bytes=max_raw_bytes, digest=digest)
