"""Block format 4 (planes of the values as they are, not rotated) against the formats before it.

tests/fixtures/block-v3-planes.kvb was written by the format-3 code (the commit before format 4) from
`_fixture_arrays()`: two layers of bf16 KV and an f32 tensor, planes-zstd, metadata {"kvwake.kind": "block"}.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwake.store import Store
from kvwake.store import writer as store_writer
from kvwake.store.format import sections
from kvwake.store.format.codec import FORMAT_VERSION, Tensor, decode_into, encode, read_file_header
from kvwake.store.format.planes import CHUNK_BYTES, split, unrotate
from testkit.kvdata import BUNDLE, assert_snapshot_exact, write_snapshot

FIXTURE = Path(__file__).parent / "fixtures" / "block-v3-planes.kvb"


def _fixture_arrays() -> dict[str, Tensor]:
    rng = np.random.default_rng(7)
    out = {}
    for i in range(2):
        for part in ("keys", "values"):
            x = (rng.standard_normal((1, 2, 8, 16)) * (1 + 3 * i)).astype(np.float32)
            out[f"layers.{i}.{part}"] = Tensor("BF16", (x.view(np.uint32) >> 16).astype(np.uint16))
    out["state.f32"] = Tensor("F32", (rng.standard_normal((3, 5)) * 7).astype(np.float32))
    return out


def _kv_block(layers: int = 30, heads: int = 3, tokens: int = 128, dim: int = 64) -> dict[str, np.ndarray]:
    """bf16 bits shaped like KV (the default model's block by default): channels of their own scale,
    a few outlier channels, and the special values (zeros of both signs, infinities, NaN, subnormals)."""
    rng = np.random.default_rng(11)
    out = {}
    for i in range(layers):
        for part in ("keys", "values"):
            scale = rng.lognormal(0.0, 1.0, dim).astype(np.float32) * (8.0 if part == "keys" else 1.0)
            x = (rng.standard_normal((1, heads, tokens, dim)).astype(np.float32) * scale).view(np.uint32)
            bits = (x >> 16).astype(np.uint16)
            bits[0, 0, 0, :6] = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001]
            out[f"layers.{i}.{part}"] = bits
    return out


@pytest.mark.parametrize("version", [2, 3, 4])
def test_real_kv_shapes_decode_exactly_into_strided_places_in_every_format(version):
    block = _kv_block()
    encoded = encode({n: Tensor("BF16", a) for n, a in block.items()}, metadata={"kvwake.kind": "block"},
                     version=version)
    assert encoded.data[4] == version
    buffers = {n: np.zeros((1, 3, 512, 64), np.uint16) for n in block}
    tensors, _, digest = decode_into(encoded.data, lambda name, dtype, shape: buffers[name][..., 128:256, :])
    assert digest == encoded.digest
    for name, a in block.items():
        assert tensors[name].array.base is buffers[name] or np.shares_memory(tensors[name].array, buffers[name])
        assert np.array_equal(buffers[name][..., 128:256, :], a), name
        assert not buffers[name][..., :128, :].any() and not buffers[name][..., 256:, :].any(), name


def test_format_4_planes_are_the_values_bytes_and_format_3s_their_rotation():
    block = _kv_block(layers=2)
    whole = np.concatenate([a.reshape(-1) for a in block.values()])
    staged = {}
    for version in (3, 4):
        data = encode({n: Tensor("BF16", a) for n, a in block.items()}, version=version).data
        planes = [np.zeros(whole.size, np.uint8), np.zeros(whole.size, np.uint8)]
        _, _, digest = decode_into(data, stage=lambda *_: planes)
        assert digest == encode({n: Tensor("BF16", a) for n, a in block.items()}, version=version).digest
        staged[version] = planes
    hi, lo = split(whole, False)
    # Staged planes are format 4's whatever the block's format: a format-3 block's are unrotated there.
    for version in (3, 4):
        assert np.array_equal(staged[version][0], hi) and np.array_equal(staged[version][1], lo)
    assert np.array_equal(hi, (whole >> 8).astype(np.uint8)) and np.array_equal(lo, (whole & 0xFF).astype(np.uint8))


@settings(max_examples=40, deadline=None)
@given(size=st.sampled_from([2, 4]), n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_unrotate_turns_rotated_planes_into_the_values_planes(size, n, seed):
    values = np.random.default_rng(seed).integers(0, 1 << (8 * size), n, dtype=f"<u{size}")
    planes = split(values, True)
    unrotate(planes)
    assert [p.tobytes() for p in planes] == [p.tobytes() for p in split(values, False)]


def test_unrotate_crosses_its_pieces():
    values = np.random.default_rng(2).integers(0, 1 << 32, CHUNK_BYTES + 1001, dtype="<u4")
    planes = split(values, True)
    unrotate(planes)
    assert [p.tobytes() for p in planes] == [p.tobytes() for p in split(values, False)]


def test_a_block_written_by_the_format_3_code_reads_back_exactly_and_encodes_the_same():
    data = FIXTURE.read_bytes()
    assert read_file_header(data)[3] == 3 and FORMAT_VERSION == 4
    arrays = _fixture_arrays()
    tensors, meta, digest = decode_into(data)
    assert meta == {"kvwake.kind": "block"} and digest == read_file_header(data)[2]
    for name, t in arrays.items():
        assert tensors[name].dtype == t.dtype and tensors[name].array.tobytes() == t.array.tobytes(), name
    assert encode(arrays, metadata={"kvwake.kind": "block"}, version=3).data == data
    assert encode(arrays, metadata={"kvwake.kind": "block"}).data != data  # format 4: other planes
    damaged = bytearray(data)
    damaged[-3] ^= 0x40
    try:
        wrong = decode_into(bytes(damaged))[2]
    except ValueError:  # BlockFormatError: refused before the digest
        wrong = None
    assert wrong != digest


def test_a_store_of_format_3_blocks_reads_exactly_beside_format_4_ones(tmp_path, monkeypatch):
    with Store(tmp_path / "store", block_tokens=4) as store:
        store.register_bundle(BUNDLE, {"model": "test"})
        with monkeypatch.context() as m:  # the writer as it was: format 3
            m.setattr(store_writer, "encode", functools.partial(encode, version=3))
            old = write_snapshot(store, "old", list(range(10)))
        new = write_snapshot(store, "new", list(range(10)) + [20, 21, 22, 23, 24, 25])
        assert new.reused_blocks == 2 and new.new_blocks == 2
        record = store.snapshot(new.id, bundle=BUNDLE)
        versions = [read_file_header(store.files.absolute(b.file).read_bytes())[3] for b in record.blocks]
        assert versions == [3, 3, 4, 4]
        assert_snapshot_exact(store, old.id)
        assert_snapshot_exact(store, new.id)
        assert store.fsck().ok


@pytest.mark.parametrize("whole_bytes", [0, 1 << 30])  # every section a piece at a time, or each whole
def test_sections_read_whole_or_a_piece_at_a_time_decode_the_same(whole_bytes, monkeypatch):
    monkeypatch.setattr(sections, "WHOLE_SECTION_BYTES", whole_bytes)
    block = _kv_block(layers=12, tokens=512)  # planes of 2.4 MB: several join groups
    encoded = encode({n: Tensor("BF16", a) for n, a in block.items()})
    buffers = {n: np.zeros((1, 3, 640, 64), np.uint16) for n in block}
    _, _, digest = decode_into(encoded.data, lambda name, dtype, shape: buffers[name][..., 64:576, :])
    assert digest == encoded.digest
    for name, a in block.items():
        assert np.array_equal(buffers[name][..., 64:576, :], a), name
    damaged = bytearray(encoded.data)
    damaged[20_000] ^= 0x08  # inside the compressed top plane (the header is a few KB)
    try:
        wrong = decode_into(bytes(damaged), lambda name, dtype, shape: buffers[name][..., 64:576, :])[2]
    except ValueError:
        wrong = None
    assert wrong != encoded.digest


def test_a_format_3_session_wakes_exactly_where_restores_stage_planes(model_dir, tmp_path, monkeypatch):
    # A GPU's path (here on MLX's CPU device): a format-3 block's rotated planes are staged, made format 4's
    # by the codec after their digest, and joined by devplanes, which knows format 4's form alone.
    import mlx.core as mx

    from kvwake.daemon.kv import restore_buffers
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.model.generation import GenerateParams
    from kvwake.daemon.session_state import Session

    tokens = [(i * 7) % 256 for i in range(150)]
    mode = {"now": "direct"}
    monkeypatch.setattr(restore_buffers, "restore_mode", lambda configured=None: configured or mode["now"])
    with Store(tmp_path / "store", block_tokens=16) as store:
        writer = Engine(store, tmp_path, model_dir, io_workers=2, warm=False)
        try:
            with monkeypatch.context() as m:  # a sleep as the format-3 code wrote it
                m.setattr(store_writer, "encode", functools.partial(encode, version=3))
                slept = Session("b")
                writer.append(slept, tokens=tokens)
                record = store.snapshot(writer.sleep(slept)["snapshot_id"])
        finally:
            writer.close()
        assert {read_file_header(store.files.absolute(b.file).read_bytes())[3] for b in record.blocks} == {3}
        mode["now"] = "staged"
        engine = Engine(store, tmp_path, model_dir, io_workers=2, warm=False)
        try:
            assert engine.restore_mode == "staged"
            hot = Session("a")
            engine.append(hot, tokens=tokens)
            woken = engine.wake("b")[0]
            for x, y in zip(hot.cache, woken.cache):
                assert mx.array_equal(x.keys[..., :149, :], y.keys[..., :149, :]).item()
                assert mx.array_equal(x.values[..., :149, :], y.values[..., :149, :]).item()
            params = GenerateParams(max_tokens=6)
            assert engine.generate(hot, params).tokens == engine.generate(woken, params).tokens
        finally:
            engine.close()
