"""Block codec: lossless round trips, safetensors payloads, and hostile bytes refused."""

from __future__ import annotations

import hashlib
import struct


import blake3
import numpy as np
import pytest
import safetensors
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvwake.store.format.codec import DTYPES as HOLDERS
from kvwake.store.format.codec import (CODECS, FILE_HEADER, FORMAT_VERSION, SECTION, BlockFormatError, Planed, Tensor,
                                decode, decode_into, encode, payload, section_digest)
from kvwake.store.format.planes import CHUNK_BYTES, JOIN_BYTES, split

DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "U32": np.uint32, "I32": np.int32, "U8": np.uint8}


@st.composite
def tensors(draw):
    names = draw(st.lists(st.text("abcdefghij.0123456789", min_size=1, max_size=12), min_size=1, max_size=4, unique=True))
    out = {}
    for name in names:
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=9))
        # Raw bit patterns, so NaNs, infinities and denormals are all covered.
        bits = draw(hnp.arrays(np.dtype(DTYPES[dtype]).newbyteorder("=").str.replace("f", "u").replace("i", "u"), shape))
        out[name] = Tensor(dtype, np.ascontiguousarray(bits.view(DTYPES[dtype])))
    return out


@settings(max_examples=150, deadline=None)
@given(arrays=tensors(), codec=st.sampled_from(sorted(CODECS.values())), version=st.sampled_from([2, 3, 4]))
def test_round_trip_is_lossless_for_any_dtype_and_shape(arrays, codec, version):
    encoded = encode(arrays, metadata={"k": "v"}, codec=codec, version=version)
    got, meta, digest = decode(encoded.data)
    assert meta == {"k": "v"} and digest == encoded.digest and encoded.codec == codec
    assert list(got) == list(arrays)
    for name, t in arrays.items():
        assert got[name].dtype == t.dtype and got[name].array.shape == t.array.shape
        assert got[name].array.tobytes() == t.array.tobytes()


SECTION_HASH = {2: lambda b: blake3.blake3(b).digest(), 3: lambda b: xxhash.xxh3_128(b).digest(),
                4: lambda b: xxhash.xxh3_128(b).digest()}


@settings(max_examples=60, deadline=None)
@given(arrays=tensors(), codec=st.sampled_from(sorted(CODECS.values())), version=st.sampled_from([2, 3, 4]))
def test_digest_covers_every_decoded_section_and_the_payload_is_safetensors(arrays, codec, version):
    encoded = encode(arrays, metadata={"kvwake.kind": "block"}, codec=codec, version=version)
    raw = payload(arrays, metadata={"kvwake.kind": "block"})
    header_len = 8 + struct.unpack("<Q", raw[:8])[0]
    contents = [raw[:8], raw[8:header_len]]  # a digest of each section's decoded content, then BLAKE3 of those
    if codec == "zstd":
        contents += [t.array.tobytes() for t in arrays.values()]
    else:  # one run per stretch of one dtype: its payload ("raw") or its byte planes ("planes-zstd")
        runs: list[list[Tensor]] = []
        for t in arrays.values():
            runs[-1:] = [runs[-1] + [t]] if runs and runs[-1][0].dtype == t.dtype else runs[-1:] + [[t]]
        for run in runs:
            data = np.concatenate([t.array.reshape(-1) for t in run])
            holder, rotate = HOLDERS[run[0].dtype]
            rotate = rotate and version < 4  # format 4 splits every value as it is
            unsigned = data.view(f"<u{holder.itemsize}") if holder.itemsize > 1 else data.view(np.uint8)
            contents += [data.tobytes()] if codec == "raw" else [p.tobytes() for p in split(unsigned, rotate)]
    expected = blake3.blake3(b"".join(SECTION_HASH[version](c) for c in contents)).hexdigest()
    assert section_digest(contents, version) == expected == encoded.digest and len(raw) == encoded.raw_bytes
    assert encoded.data[4] == version and FORMAT_VERSION == 4
    assert decode(encoded.data)[2] == encoded.digest
    parsed = dict(safetensors.deserialize(raw))
    assert set(parsed) == set(arrays)
    for name, t in arrays.items():
        assert parsed[name]["dtype"] == t.dtype
        assert list(parsed[name]["shape"]) == list(t.array.shape)
        assert bytes(parsed[name]["data"]) == t.array.tobytes()


def test_nan_and_negative_zero_bits_survive():
    bits = np.array([0x7FC0, 0xFFC1, 0x8000, 0x0000, 0x7F80, 0xFF80, 0x0001], np.uint16)
    got, _, _ = decode(encode({"x": Tensor("BF16", bits)}).data)
    assert got["x"].array.tobytes() == bits.tobytes()


def _header_sections(data: bytes) -> int:
    pos = FILE_HEADER.size
    for _ in range(2):
        _, n = SECTION.unpack_from(data, pos)
        pos += SECTION.size + n
    return pos


def test_decompression_bomb_is_refused():
    # A tensor section whose zstd frame inflates to far more than its header declares.
    arrays = {"x": np.zeros(16, np.uint8)}
    data = bytearray(encode(arrays, codec="zstd").data)
    pos = _header_sections(bytes(data))
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    data[pos:] = SECTION.pack(1, len(bomb)) + bomb
    with pytest.raises(BlockFormatError, match="header says 16|zstd"):
        decode(bytes(data))


def test_payload_larger_than_recorded_is_refused():
    data = encode({"x": np.zeros(1000, np.float32)}).data
    with pytest.raises(BlockFormatError, match="more than the 100 recorded"):
        decode(data, max_raw_bytes=100)


@pytest.mark.parametrize("cut", [0, 10, FILE_HEADER.size, FILE_HEADER.size + 5, -1])
def test_truncated_file_is_refused(cut):
    data = encode({"x": np.arange(500, dtype=np.float32)}).data
    with pytest.raises(BlockFormatError):
        decode(data[:cut])


def test_trailing_bytes_bad_magic_and_unknown_codec_are_refused():
    data = encode({"x": np.arange(10, dtype=np.int32)}).data
    with pytest.raises(BlockFormatError, match="trailing"):
        decode(data + b"junk")
    with pytest.raises(BlockFormatError, match="magic"):
        decode(b"XXXX" + data[4:])
    with pytest.raises(BlockFormatError, match="codec id 9"):
        decode(data[:5] + b"\x09" + data[6:])


def test_lying_tensor_offsets_are_refused():
    arrays = {"x": np.arange(4, dtype=np.float32)}
    header = b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,99]}}'
    header += b" " * (-len(header) % 8)
    raw = struct.pack("<Q", len(header)) + header + arrays["x"].tobytes()
    data = FILE_HEADER.pack(b"KVWB", 1, 1, 0, len(raw), hashlib.sha256(raw).digest())
    data += SECTION.pack(0, 8) + raw[:8] + SECTION.pack(0, len(header)) + header
    data += SECTION.pack(0, 16) + arrays["x"].tobytes()
    with pytest.raises(BlockFormatError, match="offsets"):
        decode(data)


def _format1_file(header: bytes, data: bytes) -> bytes:
    header += b" " * (-len(header) % 8)
    raw = struct.pack("<Q", len(header)) + header + data
    out = FILE_HEADER.pack(b"KVWB", 1, 1, 0, len(raw), hashlib.sha256(raw).digest())
    return out + SECTION.pack(0, 8) + raw[:8] + SECTION.pack(0, len(header)) + header + SECTION.pack(0, len(data)) + data


@pytest.mark.parametrize("shape", ["[4.0]", "[true,4]", "[4,-1]", '["4"]'])
def test_a_shape_that_is_not_whole_numbers_is_refused_after_the_same_shape_was_read(shape):
    # Tensor specs once checked are remembered (a block's header repeats the same few); 4.0 == 4
    # and True == 1 in Python, so the memory must not let these through.
    data = np.arange(4, dtype=np.float32).tobytes()
    good = _format1_file(b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', data)
    assert decode(good)[0]["x"].array.shape == (4,)
    bad = _format1_file(b'{"x":{"dtype":"F32","shape":' + shape.encode() + b',"data_offsets":[0,16]}}', data)
    with pytest.raises(BlockFormatError, match="tensor 'x'"):
        decode(bad)


def test_unsupported_dtype_is_a_type_error():
    with pytest.raises(TypeError, match="complex"):
        encode({"x": np.zeros(3, np.complex64)})


def test_every_flipped_byte_is_refused_with_a_named_error():
    # Was: flips in the header region escaped as JSONDecodeError, KeyError, MemoryError (fsck crashed).
    data = encode({"layers.0.keys": Tensor("BF16", np.arange(96, dtype=np.uint16).reshape(1, 2, 3, 16)),
                   "layers.0.values": np.linspace(-1, 1, 96, dtype=np.float32)}, metadata={"kvwake.key": "k"})
    reference = decode(data.data)
    for pos in range(len(data.data)):
        for bit in (0x01, 0x10, 0x80):
            damaged = bytearray(data.data)
            damaged[pos] ^= bit
            try:
                got, meta, digest = decode(bytes(damaged), max_raw_bytes=data.raw_bytes)
            except BlockFormatError:
                continue
            # Decoded after all: then the digest, which every store read compares, must tell.
            assert digest != data.digest or (meta == reference[1] and all(
                got[k].array.tobytes() == reference[0][k].array.tobytes() for k in got)), (pos, bit)


def test_a_frame_declaring_a_huge_size_is_refused_before_allocating():
    # Was: max_output_size is ignored when the frame declares its size, so a tiny frame inflated to gigabytes.
    data = bytearray(encode({"x": np.zeros(16, np.uint8)}, codec="zstd").data)
    pos = _header_sections(bytes(data))
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (1 << 20))
    bomb = bomb[:4] + bytes([bomb[4] & 0x3F | 0xC0]) + (1 << 40).to_bytes(8, "little") + bomb[5 + 4:]
    data[pos:] = SECTION.pack(1, len(bomb)) + bomb
    with pytest.raises(BlockFormatError, match="declares"):
        decode(bytes(data))


def _v1_file(arrays: dict[str, np.ndarray]) -> bytes:
    """A format-1 file as kvwake 0.1 wrote it: sha256 digest, plain zstd sections."""
    raw = payload(arrays)
    header_len = struct.unpack("<Q", raw[:8])[0]
    cctx = zstandard.ZstdCompressor(level=3)
    sections = [raw[:8], raw[8 : 8 + header_len]] + [a.tobytes() for a in arrays.values()]
    body = b"".join(SECTION.pack(1, len(c := cctx.compress(x))) + c for x in sections)
    return FILE_HEADER.pack(b"KVWB", 1, 1, 0, len(raw), hashlib.sha256(raw).digest()) + body


def test_format_1_files_still_decode_with_their_sha256_digest():
    arrays = {"a": np.arange(40, dtype=np.float32).reshape(2, 20), "b": np.arange(7, dtype=np.int32)}
    got, _, digest = decode(_v1_file(arrays))
    assert digest == hashlib.sha256(payload(arrays)).hexdigest()
    assert all(got[k].array.tobytes() == a.tobytes() for k, a in arrays.items())


def test_raw_codec_in_a_format_1_file_is_refused():
    data = bytearray(encode({"x": np.arange(10, dtype=np.int32)}, codec="raw").data)
    data[4] = 1
    with pytest.raises(BlockFormatError, match="version 1, codec id 3"):
        decode(bytes(data))


@pytest.mark.parametrize("codec", sorted(CODECS.values()))
def test_decode_into_fills_strided_views_of_a_larger_buffer_in_place(codec):
    # A block is tokens [8, 16) of a [1, heads, 24, dim] KV buffer: encode reads the strided
    # slice in place, decode writes into the same slice of another buffer and nothing else.
    rng = np.random.default_rng(1)
    source = rng.integers(0, 1 << 16, (1, 3, 24, 16), dtype=np.uint16)
    block = {"layers.0.keys": Tensor("BF16", source[..., 8:16, :]), "other": Tensor("F32", rng.random(5, np.float32))}
    encoded = encode(block, codec=codec)
    target = np.full_like(source, 0xAAAA)
    got, _, digest = decode_into(encoded.data, lambda name, dtype, shape: target[..., 8:16, :] if name == "layers.0.keys" else None)
    assert digest == encoded.digest
    assert np.array_equal(target[..., 8:16, :], source[..., 8:16, :])
    assert (target[..., :8, :] == 0xAAAA).all() and (target[..., 16:, :] == 0xAAAA).all()
    assert np.shares_memory(got["layers.0.keys"].array, target)
    assert got["other"].array.tobytes() == block["other"].array.tobytes()


def test_a_destination_of_the_wrong_shape_is_refused():
    encoded = encode({"x": np.zeros((2, 4), np.float32)})
    with pytest.raises(BlockFormatError, match="does not fit its destination"):
        decode_into(encoded.data, lambda *_: np.zeros((4, 2), np.float32))


def test_incompressible_planes_are_stored_raw_and_compressible_ones_packed():
    rng = np.random.default_rng(2)
    # bf16 with few exponents but random signs and mantissas: after the rotation the high plane holds
    # the exponents (compressible), the low one sign and mantissa (random, so stored raw)
    n = 1 << 17
    bits = ((rng.integers(0, 2, n).astype(np.uint16) << 15) | (rng.integers(120, 124, n).astype(np.uint16) << 7)
            | rng.integers(0, 128, n).astype(np.uint16))
    encoded = encode({"x": Tensor("BF16", bits)})
    assert len(encoded.data) < 0.8 * bits.nbytes
    pos = _header_sections(encoded.data)
    modes = []
    for _ in range(2):
        mode, n = SECTION.unpack_from(encoded.data, pos)
        modes.append(mode)
        pos += SECTION.size + n
    assert modes == [1, 0]
    assert decode(encoded.data)[0]["x"].array.tobytes() == bits.tobytes()


def test_a_planed_block_encodes_to_the_same_file_and_decodes_into_staged_planes():
    # What the daemon does on a GPU: the planes are made there; the file must be the one encode makes.
    rng = np.random.default_rng(3)
    parts = {f"layers.{i}.{p}": rng.integers(0, 1 << 16, (1, 2, 64, 128), dtype=np.uint16) for i in range(3)
             for p in ("keys", "values")}
    arrays = {n: Tensor("BF16", a) for n, a in parts.items()}
    hi, lo = split(np.concatenate([a.reshape(-1) for a in parts.values()]), False)
    planed = Planed(tuple(parts), "BF16", tuple(a.shape for a in parts.values()), (hi, lo))
    meta = {"kvwake.key": "k"}
    assert encode(planed, metadata=meta).data == encode(arrays, metadata=meta).data
    staged = [np.full(hi.size, 7, np.uint8), np.full(lo.size, 7, np.uint8)]
    seen = []
    got, _, digest = decode_into(encode(arrays).data,
                                 stage=lambda names, dtype, n, planes: seen.append((names, dtype, n, planes)) or staged)
    assert got == {} and digest == encode(arrays).digest and seen == [(tuple(parts), "BF16", hi.size, True)]
    assert np.array_equal(staged[0], hi) and np.array_equal(staged[1], lo)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_raw_or_zstd_block_decodes_into_staging_as_a_raw_run(codec):
    # Was: neither was staged, so on a GPU every block went through host arrays the size of the session
    # (raw) or was decoded on the CPU into the device's arrays (zstd, which codec "auto" can pick): a long
    # session's wake took minutes. Now a raw run lands as stored, a zstd run's tensors one after the other:
    # the same bytes either way.
    rng = np.random.default_rng(5)
    parts = {f"layers.{i}.{p}": rng.integers(0, 1 << 16, (1, 2, 64, 128), dtype=np.uint16) for i in range(3)
             for p in ("keys", "values")}
    encoded = encode({n: Tensor("BF16", a) for n, a in parts.items()}, codec=codec)
    whole = np.concatenate([a.reshape(-1) for a in parts.values()])
    staged = [np.zeros(whole.nbytes, np.uint8)]
    seen = []
    got, _, digest = decode_into(encoded.data,
                                 stage=lambda names, dtype, n, planes: seen.append((names, dtype, n, planes)) or staged)
    assert got == {} and digest == encoded.digest and seen == [(tuple(parts), "BF16", whole.size, False)]
    assert staged[0].tobytes() == whole.tobytes()
    got, _, _ = decode_into(encoded.data, stage=lambda *_: None)  # not taken: decoded as before
    assert all(np.array_equal(got[n].array, a) for n, a in parts.items())
    with pytest.raises(BlockFormatError, match="staging of 7 bytes for a"):
        decode_into(encoded.data, stage=lambda *_: [np.zeros(7, np.uint8)])
    damaged = bytearray(encoded.data)
    damaged[-40] ^= 0xFF  # a byte of the last tensor's section: refused, or a digest that differs
    try:
        _, _, wrong = decode_into(bytes(damaged), stage=lambda *_: [np.zeros(whole.nbytes, np.uint8)])
    except BlockFormatError:
        wrong = None
    assert wrong != encoded.digest


@pytest.mark.parametrize("codec", sorted(CODECS.values()))
@pytest.mark.parametrize("tokens", [256, 2 * JOIN_BYTES // (4 * 128 * 2) + 64])  # 256 KiB, and more than a join
def test_tensors_larger_than_a_chunk_round_trip_into_strided_views(codec, tokens):
    # Was: "raw" copied a whole run's payload into the first large tensor (seen on the 8B shape).
    rng = np.random.default_rng(4)
    source = {f"layers.{i}.keys": rng.integers(0, 1 << 16, (1, 4, tokens + 256, 128), dtype=np.uint16)
              for i in range(3)}
    source["layers.1.keys"][..., ::2] &= 0x7F7F  # compressible planes as well as incompressible ones
    block = {n: Tensor("BF16", a[..., 128 : 128 + tokens, :]) for n, a in source.items()}
    encoded = encode(block, codec=codec)
    targets = {n: np.zeros_like(a) for n, a in source.items()}
    _, _, digest = decode_into(encoded.data, lambda name, dtype, shape: targets[name][..., 128 : 128 + tokens, :])
    assert digest == encoded.digest
    for n, a in source.items():
        assert np.array_equal(targets[n], np.pad(a[..., 128 : 128 + tokens, :], ((0, 0), (0, 0), (128, 128), (0, 0)))), n


def test_compressible_planes_larger_than_a_chunk_decode_side_by_side():
    # Was: every plane's zstd stream came from one decompressor; decoded a chunk of each plane in turn,
    # they corrupted each other ("Data corruption detected", on a tail's planes).
    rng = np.random.default_rng(5)
    values = (np.round(rng.standard_normal(3 * CHUNK_BYTES) * 4) / 4).astype(np.float32)  # both planes compress
    keys = (values.view(np.uint32) >> 16).astype(np.uint16).reshape(1, 8, -1, 128)
    block = {"layers.0.keys": Tensor("BF16", keys), "layers.0.values": Tensor("BF16", keys[..., ::-1].copy())}
    encoded = encode(block, codec="planes-zstd")
    assert encoded.data.count(b"\x28\xb5\x2f\xfd") >= 2  # at least two zstd frames (planes), side by side
    tensors, _, digest = decode_into(encoded.data)
    assert digest == encoded.digest
    for name, t in block.items():
        assert np.array_equal(np.asarray(tensors[name].array), t.array), name
