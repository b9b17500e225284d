"""Chain keys: content addresses for token blocks.

A block's key names the whole prefix that produced it, not just its own tokens:

    key_i = sha256(key_{i-1} || bundle_hash || token_ids_i)

byte layout, exactly:
    key_{i-1}     32 bytes, the raw digest of the previous block's key;
                  32 zero bytes for the first block of a sequence
    bundle_hash   32 bytes, the raw sha256 of the model bundle
    token_ids_i   4 bytes per token, unsigned 32-bit little-endian, in order

Keys are shown and stored as 64 lowercase hex characters. The layout never
involves Python's `hash()`, so keys are identical across processes, machines
and Python versions (checked against vectors in tests/fixtures/chain_keys.json).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["ROOT_KEY", "block_key", "chain_keys", "tokens_to_bytes", "tokens_from_bytes"]

ROOT_KEY = "0" * 64


def tokens_to_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes; raises ValueError outside 0..2**32-1."""
    array = np.asarray(token_ids, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in an unsigned 32-bit integer")
    return array.astype("<u4").tobytes()


def tokens_from_bytes(data: bytes) -> list[int]:
    """Inverse of tokens_to_bytes."""
    if len(data) % 4:
        raise ValueError(f"token bytes length {len(data)} is not a multiple of 4")
    return np.frombuffer(data, dtype="<u4").tolist()


def _raw(hex_digest: str, what: str) -> bytes:
    try:
        raw = bytes.fromhex(hex_digest)
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"{what} must be 64 hex characters, got {hex_digest!r}")
    return raw


def block_key(parent_key: str, bundle_hash: str, token_ids: Sequence[int] | np.ndarray) -> str:
    """The chain key of one block given its parent's key (ROOT_KEY for the first)."""
    return _key(parent_key, _raw(bundle_hash, "bundle hash"), tokens_to_bytes(token_ids))


def chain_keys(bundle_hash: str, token_ids: Sequence[int] | np.ndarray, block_tokens: int, *,
               partial: bool = False) -> list[str]:
    """Keys of every full block of `block_tokens` tokens in `token_ids`, in order.

    A trailing partial block gets no key (it belongs to a snapshot's tail), unless
    `partial`: then it gets one too, by the same layout over its fewer tokens
    (prefix.warm stores a prompt's last, short block this way).
    """
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    # The tokens as bytes once, not block by block from a list (a long conversation's keys then took
    # a share of its matching: docs/decisions.md, "Figures behind the store's comments"), then each
    # block's slice of them: the same bytes block_key hashes.
    keyed = len(token_ids) if partial else len(token_ids) // block_tokens * block_tokens  # a tail is not keyed
    data, bundle, width = tokens_to_bytes(token_ids[:keyed]), _raw(bundle_hash, "bundle hash"), 4 * block_tokens
    keys, parent = [], ROOT_KEY
    for start in range(0, len(data) - width + 1, width):
        parent = _key(parent, bundle, data[start : start + width])
        keys.append(parent)
    rest = len(data) % width
    if partial and rest:
        keys.append(_key(parent, bundle, data[len(data) - rest :]))
    return keys


def _key(parent_key: str, bundle: bytes, token_bytes: bytes) -> str:
    h = hashlib.sha256(_raw(parent_key, "parent key"))
    h.update(bundle)
    h.update(token_bytes)
    return h.hexdigest()
