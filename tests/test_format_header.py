"""The payload header: a layout remembered across blocks never lets a header through that a full parse refuses."""

from __future__ import annotations

import json
import struct

import pytest

from kvwake.store.format import header as H
from kvwake.store.format.header import BlockFormatError, parse_header, payload_header

SPECS = [("layers.0.keys", "BF16", (1, 3, 128, 64)), ("layers.0.values", "BF16", (1, 3, 128, 64))]
DATA = 2 * 3 * 128 * 64 * 2


def _raw(text: str) -> bytes:
    body = text.encode() + b" " * (-len(text.encode()) % 8)
    return struct.pack("<Q", len(body)) + body


@pytest.fixture(autouse=True)
def forget_layouts():
    H._LAYOUTS.clear()
    yield
    H._LAYOUTS.clear()


def test_blocks_of_one_layout_parse_once_and_each_keeps_its_own_metadata():
    first = payload_header(SPECS, {"kvwake.key": "a" * 64})
    second = payload_header(SPECS, {"kvwake.key": "b" * 64, "kvwake.bundle": "c" * 64})
    layout, meta = parse_header(first, len(first) + DATA)
    assert layout.entries == tuple(SPECS) and meta == {"kvwake.key": "a" * 64} and len(H._LAYOUTS) == 1
    again, meta2 = parse_header(second, len(second) + DATA)
    assert again is layout and meta2 == {"kvwake.key": "b" * 64, "kvwake.bundle": "c" * 64}


def test_a_remembered_layout_still_checks_the_metadata_and_the_payload_size():
    good = payload_header(SPECS, {"k": "v"})
    parse_header(good, len(good) + DATA)
    rest = good[8:].decode().rstrip()[len('{"__metadata__":{"k":"v"}'):]
    for metadata in ('{"k":1}', '["v"]', '"v"'):
        with pytest.raises(BlockFormatError, match="not a map of strings"):
            parse_header(_raw('{"__metadata__":' + metadata + rest), 10**6)
    with pytest.raises(BlockFormatError, match="file header says payload is"):
        parse_header(good, len(good) + DATA + 2)
    broken = '{"__metadata__":{"k":"v"' + rest  # the metadata object never closes
    with pytest.raises(BlockFormatError, match="not JSON"):
        parse_header(_raw(broken), 10**6)


def test_a_second_metadata_key_is_read_as_a_full_parse_reads_it():
    head = {"__metadata__": {"k": "first"}, "x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}
    text = json.dumps(head, separators=(",", ":"))[:-1] + ',"__metadata__":{"k":"last"}}'
    for _ in range(2):  # never remembered, so the second read parses in full as well
        layout, meta = parse_header(_raw(text), len(_raw(text)) + 4)
        assert meta == {"k": "last"} and layout.entries == (("x", "U8", (4,)),)
    assert not H._LAYOUTS


def test_a_header_without_metadata_is_remembered_whole_and_apart_from_one_with_metadata():
    bare = payload_header(SPECS, {})
    layout, meta = parse_header(bare, len(bare) + DATA)
    assert meta == {} and len(H._LAYOUTS) == 1
    assert parse_header(bare, len(bare) + DATA) == (layout, {})
    with_meta = payload_header(SPECS, {"k": "v"})
    assert parse_header(with_meta, len(with_meta) + DATA) == (layout, {"k": "v"}) and len(H._LAYOUTS) == 2
