"""Deterministic KV-like test data: the same tokens at the same position give the same arrays."""

from __future__ import annotations

import zlib

import numpy as np

from kvwake.store import Tensor

BUNDLE = "b0" * 32
OTHER_BUNDLE = "c1" * 32


def kv_arrays(tokens: list[int] | tuple[int, ...], start: int, *, layers: int = 2, heads: int = 2, dim: int = 8) -> dict[str, Tensor]:
    """Arrays shaped like one mlx-lm layer cache slice per layer: [1, heads, len(tokens), dim]."""
    seed = zlib.crc32(np.asarray(tokens, dtype="<u4").tobytes() + start.to_bytes(8, "little"))
    rng = np.random.default_rng(seed)
    n = len(tokens)
    out: dict[str, Tensor] = {}
    for layer in range(layers):
        keys = (rng.standard_normal((1, heads, n, dim)) * 3).astype(np.float32)
        out[f"layers.{layer}.keys"] = Tensor("BF16", (keys.view(np.uint32) >> 16).astype(np.uint16))
        out[f"layers.{layer}.values"] = Tensor("F16", rng.standard_normal((1, heads, n, dim)).astype(np.float16))
        out[f"layers.{layer}.packed"] = Tensor("U32", rng.integers(0, 2**32, (1, heads, n, dim // 8), dtype=np.uint32))
    return out


def write_snapshot(store, session_id: str, tokens: list[int], bundle: str = BUNDLE, **options):
    """Write a snapshot whose arrays come from kv_arrays; returns the SnapshotInfo."""
    b = store.block_tokens
    with store.writer(session_id, bundle, tokens, **options) as w:
        for i in w.needed:
            w.add_block(i, kv_arrays(w.block_tokens(i), i * b))
        full = len(tokens) // b * b
        if full < len(tokens):
            w.set_tail(kv_arrays(tokens[full:], full))
        return w.commit()


def assert_snapshot_exact(store, snapshot_id: str, bundle: str = BUNDLE) -> None:
    """Read a snapshot back and compare every array with what kv_arrays would give."""
    record = store.snapshot(snapshot_id, bundle=bundle)
    b = store.block_tokens
    for i, got in enumerate(store.iter_blocks(record)):
        _assert_same(got, kv_arrays(record.token_ids[i * b : (i + 1) * b], i * b), f"{snapshot_id} block {i}")
    full = len(record.token_ids) // b * b
    if full < len(record.token_ids):
        _assert_same(store.read_tail(record), kv_arrays(record.token_ids[full:], full), f"{snapshot_id} tail")
    else:
        assert record.tail is None


def _assert_same(got: dict, expected: dict, where: str) -> None:
    assert sorted(got) == sorted(expected), where
    for name, t in expected.items():
        assert got[name].dtype == t.dtype, f"{where} {name}"
        assert np.array_equal(got[name].array, t.array), f"{where} {name}"
