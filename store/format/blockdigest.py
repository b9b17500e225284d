"""The block digest: what a block file's header records and every read recomputes (codec.py).

- format 1: sha256 of the safetensors payload.
- format 2: BLAKE3 over the concatenated BLAKE3 digests (32 bytes each) of every section's decoded
  content, in file order.
- formats 3 and 4 (4 written now; it differs from 3 in its planes alone, codec.py): the same tree
  with XXH3-128 section digests (16 bytes each); the root is still BLAKE3 over their
  concatenation, so a block digest stays 32 bytes (64 hex characters) wherever the index, the
  snapshot digest and the S3 tier's objects record one.

The sections' digests are the only per-byte hashing a verified read does; XXH3-128 runs about ten
times as fast per core as BLAKE3 here (docs/benchmarks.md, "One core's verified read (h-vr)").
It guards against what invariant 3 is about: bytes damaged on disk, in transit or by a bug. It is
not a cryptographic hash; a store's writer can rewrite its index anyway (docs/decisions.md, issue
50 point 7).
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

import blake3
import xxhash

__all__ = ["BlockDigest", "NoDigest", "SectionHasher", "section_hasher"]


class SectionHasher(Protocol):
    def update(self, data: Any, /) -> Any: ...
    def digest(self) -> bytes: ...


def section_hasher(version: int) -> SectionHasher:
    """A new hasher of one section's decoded content, for block format `version` (2, 3 or 4)."""
    if version in (3, 4):
        return xxhash.xxh3_128()
    if version == 2:
        return blake3.blake3()
    raise ValueError(f"block format {version} has no section digests")


class BlockDigest:
    """The block digest being computed: formats 2-4's tree of section digests, or format 1's sha256."""

    enabled = True

    def __init__(self, version: int) -> None:
        self.version = version
        self._sha = hashlib.sha256() if version == 1 else None
        self._sections: list[bytes] = []

    def hasher(self) -> SectionHasher | None:
        """A hasher for the next section's content (None when digests are off)."""
        return section_hasher(self.version)

    def section(self, *contents: Any) -> None:
        """Digest one section's decoded content (formats 2-4), given as buffers in order."""
        h = section_hasher(self.version)
        for c in contents:
            h.update(c)
        self._sections.append(h.digest())

    def section_digest(self, digest: bytes) -> None:
        self._sections.append(digest)

    def payload(self, data: Any) -> None:
        """Digest payload bytes (format 1)."""
        self._sha.update(data)

    def hexdigest(self) -> str:
        if self._sha is not None:
            return self._sha.hexdigest()
        return blake3.blake3(b"".join(self._sections)).hexdigest()


class NoDigest(BlockDigest):
    """For benchmarks of the codec alone (decode(..., digest=False))."""

    enabled = False

    def hasher(self) -> None:
        return None

    def section(self, *contents: Any) -> None:
        pass

    def payload(self, data: Any) -> None:
        pass
