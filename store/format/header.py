"""A block payload's safetensors header: written, parsed and checked, and its tensor layout remembered.

The header is an 8-byte little-endian length, then JSON padded with spaces to 8 bytes:
`{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}, ...}`. Every block of a model has
the same tensors; only the metadata (the block's key) differs. So a header whose text after the
metadata object (all of it, if it has none) was parsed and checked before is not parsed again: its `Layout` is taken from
`_LAYOUTS`, and only the metadata object and the total size are read (the metadata first: a
JSON object is whole once its closing brace is read, so what follows it is the same text it was).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DTYPES", "BlockFormatError", "Layout", "parse_header", "payload_header"]

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

_META_START = '{"__metadata__":'  # how payload_header begins a header with metadata
_DECODER = json.JSONDecoder()
_LAYOUTS_MAX = 64


class BlockFormatError(ValueError):
    """Bytes that are not a valid block file (wrong magic, sizes, header, codec)."""


@dataclass(frozen=True)
class Layout:
    """The tensors a payload holds, in order: (name, dtype name, shape); data_bytes: their bytes in all.

    memo: what a reader works out from the layout alone (codec.py's decoding plan), kept with it."""

    entries: tuple[tuple[str, str, tuple[int, ...]], ...]
    data_bytes: int
    memo: dict = field(default_factory=dict, compare=False, repr=False)


# text after the metadata object (less the padding) -> its layout, checked (bounded: a daemon sees a few shapes)
_LAYOUTS: dict[str, Layout] = {}


def payload_header(specs: list[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str]) -> bytes:
    """The header bytes (length prefix included) of a payload of `specs` (name, dtype, shape) in order."""
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * DTYPES[dtype][0].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def parse_header(raw: bytes, raw_bytes: int) -> tuple[Layout, dict[str, str]]:
    """(layout, metadata) of header bytes `raw` (length prefix included) of a payload of `raw_bytes`.

    Raises BlockFormatError for text that is not such a header, or tensors that do not end where the
    payload does."""
    try:
        text = raw[8:].decode()
    except UnicodeDecodeError as exc:
        raise BlockFormatError(f"safetensors header is not JSON: {exc}") from None
    layout, metadata = _remembered(text)
    if layout is None:
        layout, metadata, rest = _parsed(text)
        if rest is not None and len(_LAYOUTS) < _LAYOUTS_MAX:
            _LAYOUTS[rest] = layout
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BlockFormatError("safetensors __metadata__ is not a map of strings")
    if len(raw) + layout.data_bytes != raw_bytes:
        raise BlockFormatError(f"tensors end at byte {len(raw) + layout.data_bytes}, "
                               f"file header says payload is {raw_bytes}")
    return layout, metadata


def _metadata(text: str) -> tuple[object, str] | None:
    """(metadata object, the text after it) of a header that begins as payload_header writes it, or
    ({}, the whole text) of one that has no metadata; None for any other."""
    if not text.startswith(_META_START):
        metadata, rest = {}, text.rstrip(" ")  # begins with "{", where a text after metadata never does
    else:
        try:
            metadata, end = _DECODER.raw_decode(text, len(_META_START))
        except ValueError:
            return None
        rest = text[end:].rstrip(" ")  # the padding: its length follows the metadata's
    return (metadata, rest) if '"__metadata__"' not in rest else None  # a second one would win in a parse


def _remembered(text: str) -> tuple[Layout | None, object]:
    found = _metadata(text)
    layout = _LAYOUTS.get(found[1]) if found is not None else None
    return (layout, found[0] or {}) if layout is not None else (None, None)  # as json.loads's result is read


def _parsed(text: str) -> tuple[Layout, object, str | None]:
    """Parse and check the whole header: (layout, metadata, the text to remember the layout by or None)."""
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise BlockFormatError(f"safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise BlockFormatError("safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    entries, offset = [], 0
    for name, spec in header.items():
        try:
            dtype, shape, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]
            if type(shape) is not list or type(begin) is not int or type(end) is not int:
                raise TypeError("shape or offsets of the wrong type")
        except (KeyError, TypeError, ValueError) as exc:
            raise BlockFormatError(f"tensor {name!r}: malformed header entry ({exc})") from None
        # exact types: 128.0 or true is not 128
        if not isinstance(dtype, str) or dtype not in DTYPES or not all(type(s) is int and s >= 0 for s in shape):
            raise BlockFormatError(f"tensor {name!r}: bad dtype or shape {dtype} {shape}")
        if begin != offset or end - begin != math.prod(shape) * DTYPES[dtype][0].itemsize:
            raise BlockFormatError(f"tensor {name!r}: data offsets {begin}..{end} do not follow its shape")
        entries.append((name, dtype, tuple(shape)))
        offset = end
    found = _metadata(text)
    rest = found[1] if found is not None and found[0] == metadata else None
    return Layout(tuple(entries), offset), metadata, rest
