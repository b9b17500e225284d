"""A block file's sections read back: `Reader` walks them, `Pieces` takes one's content a piece at a time.

A section is `u8 mode (0 raw, 1 zstd) | u64 LE stored length | bytes` (codec.py has the whole file).
Every read is bounded by what the caller expects: a zstd frame's declared size is checked before
anything is decompressed, and a section never yields more or fewer bytes than expected.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import zstandard

from kvwake.store.format.blockdigest import BlockDigest
from kvwake.store.format.header import BlockFormatError
from kvwake.store.format.planes import decompressor, scratch

__all__ = ["SECTION", "WHOLE_SECTION_BYTES", "Pieces", "Reader", "check_declared"]

SECTION = struct.Struct("<BQ")
# A compressed section up to this size is decompressed whole at its first piece, into this thread's
# scratch: zstd then decodes straight into it, where a piece at a time goes through the decoder's own
# window and a copy (docs/benchmarks.md, "One core's verified read, again (h-vr2)"). Larger ones (a
# large model's block) are read a piece at a time, so a thread's scratch stays a few MB.
WHOLE_SECTION_BYTES = 4 << 20


class Reader:
    """Walks the sections of a block file, never producing more than it is told."""

    def __init__(self, data: memoryview, pos: int) -> None:
        self.data, self.pos = data, pos
        self.dctx = decompressor("whole")  # this thread's: a fresh context costs more than a small section

    def next_section(self) -> tuple[int, memoryview, int]:
        """(mode, stored bytes, offset of those bytes) of the next section; the reader moves past it."""
        if self.pos + SECTION.size > len(self.data):
            raise BlockFormatError(f"truncated block file: section header at byte {self.pos}")
        mode, length = SECTION.unpack_from(self.data, self.pos)
        start, self.pos = self.pos + SECTION.size, self.pos + SECTION.size + length
        if self.pos > len(self.data):
            raise BlockFormatError(f"truncated block file: section of {length} bytes at byte {start}")
        if mode not in (0, 1):
            raise BlockFormatError(f"unknown section mode {mode} at byte {start - SECTION.size}")
        return mode, self.data[start : self.pos], start

    def section(self, expect: int) -> bytes | memoryview:
        """The next section's content, `expect` bytes: a view of the file (raw) or new bytes."""
        mode, body, start = self.next_section()
        if mode == 0:
            if len(body) != expect:
                raise BlockFormatError(f"section at byte {start} holds {len(body)} bytes, header says {expect}")
            return body
        try:
            check_declared(body, expect, start)
            out = self.dctx.decompress(body, max_output_size=expect)
        except zstandard.ZstdError as exc:
            raise BlockFormatError(f"zstd section at byte {start}: {exc}") from None
        if len(out) != expect:
            raise BlockFormatError(f"section at byte {start} holds {len(out)} bytes, header says {expect}")
        return out


def check_declared(body: memoryview, expect: int, start: int) -> None:
    # max_output_size is ignored when a frame declares its size, so check the declaration
    # first: a frame claiming gigabytes is refused before anything is allocated.
    declared = zstandard.frame_content_size(body)
    if declared != expect:
        raise BlockFormatError(f"zstd section at byte {start} declares {declared} bytes, header says {expect}")


class Pieces:
    """The next section's content (`expect` bytes) taken a piece at a time, each piece digested as
    it is taken, while it is in the CPU's cache, just before the join reads it."""

    def __init__(self, reader: Reader, expect: int, slot: str, digest: BlockDigest) -> None:
        self.mode, self.body, self.start = reader.next_section()
        self.expect, self.slot, self.got = expect, slot, 0
        self.hasher = digest.hasher()
        self.stream: Any = None
        self.whole: np.ndarray | None = None
        if self.mode == 0 and len(self.body) != expect:
            raise BlockFormatError(f"section at byte {self.start} holds {len(self.body)} bytes, header says {expect}")
        if self.mode == 1:
            try:
                check_declared(self.body, expect, self.start)
            except zstandard.ZstdError as exc:
                raise BlockFormatError(f"zstd section at byte {self.start}: {exc}") from None
            self.stream = decompressor(slot).stream_reader(self.body)  # its own: sections interleave

    def take(self, n: int, into: np.ndarray | None = None) -> np.ndarray:
        """The next n bytes (uint8): a view of the file (raw section), else decompressed into `into`
        (contiguous, n bytes) or this thread's scratch for the section (valid until the next take)."""
        if self.got + n > self.expect:
            raise BlockFormatError(f"section at byte {self.start}: {self.got + n} bytes asked of {self.expect}")
        if self.mode == 0:
            piece = np.frombuffer(self.body[self.got : self.got + n], np.uint8)
            if into is not None:
                np.copyto(into, piece)
                piece = into
        elif into is None and self.expect <= WHOLE_SECTION_BYTES:
            if self.whole is None:
                self.whole = scratch(np.dtype(np.uint8), (self.expect,), self.slot)
                self._read(self.whole)
            piece = self.whole[self.got : self.got + n]
        else:
            piece = into if into is not None else scratch(np.dtype(np.uint8), (n,), self.slot)
            self._read(piece)
        if self.hasher is not None:
            self.hasher.update(piece)
        self.got += n
        return piece

    def _read(self, piece: np.ndarray) -> None:
        view, got = memoryview(piece), 0
        try:
            while got < len(view) and (k := self.stream.readinto(view[got:])):
                got += k
        except zstandard.ZstdError as exc:
            raise BlockFormatError(f"zstd section at byte {self.start}: {exc}") from None
        if got != len(view):
            raise BlockFormatError(f"section at byte {self.start} holds {self.got + got} bytes, "
                                   f"header says {self.expect}")

    def finish(self) -> bytes:
        """The section's digest, once all of it was taken and nothing follows it."""
        if self.got != self.expect:
            raise BlockFormatError(f"section at byte {self.start}: {self.got} of {self.expect} bytes taken")
        if self.stream is not None:
            try:
                extra = self.stream.read(1)
            except zstandard.ZstdError as exc:
                raise BlockFormatError(f"zstd section at byte {self.start}: {exc}") from None
            if extra:
                raise BlockFormatError(f"zstd section at byte {self.start} holds more than {self.expect} bytes")
            self.stream.close()
        return self.hasher.digest() if self.hasher is not None else b""
