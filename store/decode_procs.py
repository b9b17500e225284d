"""Block files decoded and verified in worker processes, into staging they share with the caller.

A thread decoding a block hands the GIL over between each of the block's C calls (zstd's reads, the
digest's updates, the planes' joins); on many cores those hand-overs are the queue, and threads stop
scaling where processes go on (docs/decisions.md, "Wake on the CPU: the GIL, measured"). Here the
decode runs in a process of its own, and the caller's thread copies each tensor from the staging into
its place: a GIL hand-over per tensor, not per piece.

Workers are started as new interpreters (`python -m kvwake.store.decode_worker`), never forked from the
caller: a daemon running MLX must not be forked. They import the codec and its libraries only (numpy,
zstandard, xxhash, blake3; no MLX), are started at first use, kept, and end when their pipe closes
(`close`, or the caller's death). A worker that dies is replaced at the next read.

Wire: each message is a little-endian u32 length and a msgpack map. Request:
  {"path": block file, "digest": the index's digest (hex), "raw": the recorded raw size,
   "staging": a staging file, "size": its bytes}
Reply, one of:
  {"tensors": [[name, dtype, shape, offset], ...] in the file's order, "meta": metadata, "digest": actual}
  {"other": the digest the file's own header names}   (not decoded: another payload than indexed)
  {"missing": true}  {"damaged": BlockFormatError's text}  {"failed": any other exception's repr}
Staging is a file in /dev/shm (where there is one; else the temporary folder) mapped by both sides;
each tensor starts on a 64-byte boundary, in the order decoded.
"""

from __future__ import annotations

import math
import mmap
import os
import queue
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import numpy as np

from kvwake.errors import InternalError
from kvwake.store.format.codec import DTYPES, BlockFormatError, Place, Tensor, decode_into, destination, read_file_header

__all__ = ["DecodeProcs", "DecodeProcessError", "OtherPayloadError", "serve"]

FRAME = struct.Struct("<I")
ALIGN = 64  # each tensor's first byte in the staging
SLACK = 1 << 16  # staging beyond a block's raw size, for the tensors' alignment
PREFIX = "kvwake-decode-"


class OtherPayloadError(Exception):
    """The block file's own header names another digest than the index's (the store says which file)."""


class DecodeProcessError(InternalError):
    """A worker process failed other than on the file (it died, or an error not the block's)."""


# -- the worker's side -----------------------------------------------------------------


def _read_exactly(f: BinaryIO, n: int) -> bytes | None:
    got = bytearray()
    while len(got) < n:
        chunk = f.read(n - len(got))
        if not chunk:
            return None
        got += chunk
    return bytes(got)


def _read_frame(f: BinaryIO) -> bytes | None:
    """A message's bytes; None once the pipe is closed."""
    head = _read_exactly(f, FRAME.size)
    return None if head is None else _read_exactly(f, FRAME.unpack(head)[0])


def _write_frame(f: BinaryIO, message: Mapping[str, Any]) -> None:
    body = msgpack.packb(message)
    f.write(FRAME.pack(len(body)) + body)
    f.flush()


class _Mapped:
    """A worker's mappings of the staging files it was given, remapped when one grows."""

    def __init__(self) -> None:
        self.maps: dict[str, tuple[int, mmap.mmap]] = {}

    def bytes_of(self, path: str, size: int) -> np.ndarray:
        kept = self.maps.get(path)
        if kept is None or kept[0] != size:
            if kept is not None:
                kept[1].close()
            with open(path, "r+b") as f:
                kept = self.maps[path] = (size, mmap.mmap(f.fileno(), size))
        return np.frombuffer(kept[1], np.uint8)


def _decode(request: Mapping[str, Any], mapped: _Mapped) -> dict[str, Any]:
    """One request read, decoded and digested into its staging; the reply (module docstring)."""
    try:
        with open(request["path"], "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) if size else None
        data = memoryview(m if m is not None else b"")
        try:
            found = read_file_header(data)[2]
            if found != request["digest"]:
                return {"other": found}
            staging, placed = mapped.bytes_of(request["staging"], request["size"]), {}

            def place(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
                offset = -(-max([o + n for o, n in placed.values()], default=0) // ALIGN) * ALIGN
                n = math.prod(shape) * DTYPES[dtype][0].itemsize
                if offset + n > staging.size:
                    raise BlockFormatError(f"tensors past the {staging.size} bytes of staging for a payload of "
                                           f"{request['raw']}")
                placed[name] = (offset, n)
                return staging[offset : offset + n].view(DTYPES[dtype][0]).reshape(shape)
            tensors, meta, actual = decode_into(data, place, max_raw_bytes=request["raw"])
        finally:
            data.release()
            if m is not None:
                try:
                    m.close()
                except BufferError:  # a view of it outlives the read (a traceback's frame): unmapped when it goes
                    pass
    except FileNotFoundError:
        return {"missing": True}
    except BlockFormatError as exc:
        return {"damaged": str(exc)}
    except Exception as exc:  # noqa: BLE001 - returned as the block's failure; the worker goes on
        return {"failed": repr(exc)}
    return {"tensors": [[name, t.dtype, list(t.array.shape), placed[name][0]] for name, t in tensors.items()],
            "meta": meta, "digest": actual}


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """A worker's loop: requests from `inp`, replies to `out`, until `inp` closes."""
    mapped = _Mapped()
    while (frame := _read_frame(inp)) is not None:
        _write_frame(out, _decode(msgpack.unpackb(frame), mapped))


# -- the caller's side -----------------------------------------------------------------


def _staging_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _remove_stale(folder: Path) -> None:
    """Staging files left by a process that died without closing its workers (kill -9)."""
    for path in folder.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX):].split("-")[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except PermissionError:
            pass  # another user's, alive


class _Slot:
    """One staging file, grown to the largest block it was asked to hold."""

    def __init__(self, folder: Path) -> None:
        fd, name = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=folder)
        self.path, self.fd, self.size, self.map = name, fd, 0, None

    def fit(self, n: int) -> np.ndarray:
        if n > self.size:  # the old map goes with its last view (a traceback's frame may hold one)
            self.size = -(-n // (1 << 20)) << 20
            os.ftruncate(self.fd, self.size)
            self.map = mmap.mmap(self.fd, self.size)
        return np.frombuffer(self.map, np.uint8)

    def close(self) -> None:
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a view outlives it (a traceback's frame): unmapped when that goes
                pass
        os.close(self.fd)
        Path(self.path).unlink(missing_ok=True)


class _Worker:
    """One worker process and its pipes."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvwake.store.decode_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0)

    def ask(self, request: Mapping[str, Any]) -> dict[str, Any]:
        try:
            _write_frame(self.proc.stdin, request)
            frame = _read_frame(self.proc.stdout)
        except (BrokenPipeError, ValueError):
            frame = None
        if frame is None:
            raise DecodeProcessError(f"decode worker {self.proc.pid} exited ({self.proc.poll()})")
        return msgpack.unpackb(frame)

    def close(self, wait_s: float = 5.0) -> None:
        with _quiet():
            self.proc.stdin.close()
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)


class DecodeProcs:
    """`processes` worker processes decoding block files for the caller's threads (thread-safe).

    Started at first use and kept until `close`. Staging: two slots per process, so a thread copies one
    block out while the process decodes the next.
    """

    def __init__(self, processes: int) -> None:
        if processes < 1:
            raise ValueError(f"decode processes must be 1 or more, not {processes}")
        self.processes = processes
        self._folder = _staging_dir()
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        self._slots: queue.Queue[_Slot | None] = queue.Queue()
        for _ in range(processes):
            self._idle.put(None)  # None: a worker not started yet
        for _ in range(2 * processes):
            self._slots.put(None)
        self._started: list[_Worker] = []
        self._made: list[_Slot] = []
        self._lock = threading.Lock()
        self.closed = False

    def _take_slot(self) -> _Slot:
        slot = self._slots.get()
        if slot is None:
            with self._lock:
                if not self._made:
                    _remove_stale(self._folder)
                slot = _Slot(self._folder)
                self._made.append(slot)
        return slot

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        worker = self._idle.get()
        try:
            if worker is None:
                worker = _Worker()
                with self._lock:
                    self._started.append(worker)
            reply = worker.ask(request)
        except BaseException:
            if worker is not None:  # never handed out again: it may be mid-reply
                worker.close(0)
            self._idle.put(None)
            raise
        self._idle.put(worker)
        return reply

    def decode(self, path: Path, digest: str, raw_bytes: int,
               place: Place | None) -> tuple[dict[str, Tensor], dict[str, str], str]:
        """`codec.decode_into(file's bytes, place, max_raw_bytes=raw_bytes)` run by a worker: (tensors, metadata,
        the payload's digest), each tensor copied into `place`'s array (or a new one). Raises FileNotFoundError,
        BlockFormatError, OtherPayloadError (the file's header names another digest than `digest`: not
        decoded), DecodeProcessError."""
        if self.closed:
            raise DecodeProcessError("decode processes closed")
        slot = self._take_slot()
        try:
            staging = slot.fit(raw_bytes + SLACK)
            reply = self._ask({"path": str(path), "digest": digest, "raw": raw_bytes, "staging": slot.path,
                               "size": slot.size})
            if "other" in reply:
                raise OtherPayloadError(reply["other"])
            if "missing" in reply:
                raise FileNotFoundError(path)
            if "damaged" in reply:
                raise BlockFormatError(reply["damaged"])
            if "failed" in reply:
                raise DecodeProcessError(f"decoding {path} failed in a worker: {reply['failed']}")
            tensors = {}
            for name, dtype, shape, offset in reply["tensors"]:
                holder, shape = DTYPES[dtype][0], tuple(shape)
                src = staging[offset : offset + math.prod(shape) * holder.itemsize].view(holder).reshape(shape)
                dest = destination(place, name, dtype, shape)
                np.copyto(dest, src)
                tensors[name] = Tensor(dtype, dest)
            return tensors, reply["meta"], reply["digest"]
        finally:
            self._slots.put(slot)

    def close(self) -> None:
        """End the workers and remove the staging (after the last read: nothing may read meanwhile)."""
        self.closed = True
        with self._lock:
            started, self._started = self._started, []
            made, self._made = self._made, []
        for worker in started:
            worker.close()
        for slot in made:
            slot.close()
