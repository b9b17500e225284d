"""The snapshot digest: what pins a snapshot's blocks, tail, tokens and session state together.

The snapshot digest is sha256 over this exact layout:

    b"kvwake-snapshot\\x00"  16 bytes
    u32 LE                 1 (layout version)
    bundle hash            32 raw bytes
    u64 LE n_tokens, then n_tokens x u32 LE token ids
    u32 LE n_blocks, then per block: key (32 raw bytes), payload digest (32 raw bytes)
    u8 has_tail, then the tail's payload digest (32 raw bytes) if present
    u64 LE length, then the snapshot's metadata as stored: JSON, UTF-8
        (the session's pending tokens, messages, tools: what a wake restores besides the KV)

Session id and label are not covered: fork and import may rename them.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from kvwake.store.format.keys import tokens_to_bytes

__all__ = ["metadata_json", "snapshot_digest"]


def snapshot_digest(
    bundle: str, token_ids: Sequence[int], blocks: Sequence[tuple[str, str]], tail_digest: str | None,
    metadata: Mapping[str, Any],
) -> str:
    """The snapshot digest (layout in the module docstring); blocks are (key, digest)."""
    h = hashlib.sha256(b"kvwake-snapshot\x00" + struct.pack("<I", 1) + bytes.fromhex(bundle))
    h.update(struct.pack("<Q", len(token_ids)) + tokens_to_bytes(token_ids))
    h.update(struct.pack("<I", len(blocks)))
    for key, digest in blocks:
        h.update(bytes.fromhex(key) + bytes.fromhex(digest))
    h.update(b"\x01" + bytes.fromhex(tail_digest) if tail_digest else b"\x00")
    meta = metadata_json(metadata).encode()
    h.update(struct.pack("<Q", len(meta)) + meta)
    return h.hexdigest()


def metadata_json(metadata: Mapping[str, Any]) -> str:
    """A snapshot's metadata as stored and digested: JSON, keys in insertion order."""
    # Insertion order is kept: chat templates render maps (tools) in their order, so
    # sorting keys here would make a woken session render different tokens.
    return json.dumps(dict(metadata))
