"""Block and tail files on disk: durable writes, paths, and the store lock.

Layout under the store root:

    index.sqlite            the SQLite index (WAL mode)
    store.lock              flock target: writers and readers share it, gc takes it alone
    store.gate              flock turnstile in front of it (`StoreFiles.lock`)
    blocks/ab/<key>.<nonce>.kvb        one file per block (ab = key[:2])
    tails/<snapshot id>.<nonce>.kvb    one file per snapshot tail
    quarantine/             files fsck found bad, moved aside, never deleted

A file becomes durable in four steps: write a uniquely named temp file in the
target directory, fsync it, rename it over the final name, fsync the
directory. Only then does the index learn of it. A crash leaves at most a temp
file or a renamed file the index does not name: both are orphans, swept by gc.
Every "fsync" here is `sync`: on macOS, `fcntl(F_FULLFSYNC)`, since macOS's
fsync leaves the data in the drive's write cache, which power loss empties.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any
from pathlib import Path, PurePosixPath

from kvwake.errors import StorageFullError
from kvwake.store.format.planes import as_bytes

__all__ = ["TEMP_SUFFIX", "StoreFiles", "fsync_dir", "fsync_dirs", "sync", "write_durable"]

TEMP_SUFFIX = ".tmp"
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_FULLFSYNC = {errno.ENOTSUP, errno.EINVAL, errno.ENOTTY}  # file systems without it (some network, FUSE ones)
_refused_fullfsync: set[int] = set()  # devices whose refusal was logged
log = logging.getLogger("kvwake.store")


def sync(fd: int) -> None:
    """Put an open file's or directory's data and metadata on stable storage.

    On macOS (`sys.platform` "darwin") fsync only hands the data to the drive, whose write cache a
    power loss empties; `fcntl(F_FULLFSYNC)` also flushes that cache (what SQLite's `fullfsync` does).
    A file system that refuses F_FULLFSYNC gets fsync, as SQLite does (logged once per device: its
    writes are not safe from a power loss). Elsewhere: fsync.
    """
    if sys.platform == "darwin":
        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError as exc:
            if exc.errno not in _NO_FULLFSYNC:
                raise
            device = os.fstat(fd).st_dev
            if device not in _refused_fullfsync:
                _refused_fullfsync.add(device)
                log.warning("this file system refuses F_FULLFSYNC: its writes are synced with fsync only, which a "
                            "power loss may undo", extra={"device": device, "error": exc.strerror})
    os.fsync(fd)


def fsync_dir(path: Path) -> None:
    """Sync a directory (`sync`) so a rename or create inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sync(fd)
    finally:
        os.close(fd)


def fsync_dirs(paths: Sequence[Path]) -> None:
    """fsync several directories at once: concurrent fsyncs share journal commits
    (docs/decisions.md, "Figures behind the store's comments")."""
    paths = list(paths)
    if len(paths) <= 1:
        for path in paths:
            fsync_dir(path)
        return
    with cf.ThreadPoolExecutor(max_workers=min(16, len(paths)), thread_name_prefix="kvwake-fsync") as ex:
        list(ex.map(fsync_dir, paths))


def write_durable(path: Path, data: bytes | memoryview | Sequence[Any], *, sync_dir: bool = True) -> None:
    """Write `data` (bytes, or buffers written in order) to `path` atomically and durably
    (temp, fsync, rename, dir fsync).

    sync_dir=False leaves the directory fsync to the caller, who must do it
    before anything points to the file (a writer syncs each directory once at
    commit instead of once per file). Raises StorageFullError when the disk is
    full; the temp file is removed.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            buffers = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
            for buf in buffers:
                view = as_bytes(buf)
                while view:
                    view = view[os.write(fd, view) :]
            sync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if exc.errno in _FULL:
            raise StorageFullError(f"no room to write {path.name}: {exc.strerror}", path=str(path)) from exc
        raise
    if sync_dir:
        fsync_dir(path.parent)


_buffers = threading.local()


class StoreFiles:
    """Paths and locking for one store root."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._real_root = root.resolve()
        self.blocks = root / "blocks"
        self.tails = root / "tails"
        self.quarantine = root / "quarantine"
        self.points = root / "points"  # restore points (points.py)
        for d in (root, self.blocks, self.tails, self.quarantine, self.points):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.lock_path = root / "store.lock"
        self.gate_path = root / "store.gate"
        self._held = threading.local()  # shared locks this thread holds

    def block_path(self, key: str) -> Path:
        """A fresh file name for block `key`.

        The nonce makes every writer's file its own: two writers racing on the
        same block never share a path, so the one whose commit loses (or that
        aborts) deletes only its own file, never the one the index names.
        """
        return self.blocks / key[:2] / f"{key}.{secrets.token_hex(6)}.kvb"

    def tail_path(self, snapshot_id: str) -> Path:
        """A fresh file name for a snapshot's tail (a nonce for the same reason as blocks)."""
        return self.tails / f"{snapshot_id}.{secrets.token_hex(6)}.kvb"

    def read(self, relative: str) -> memoryview:
        """A file's bytes in this thread's reusable buffer (valid until this thread's next read).

        One copy from the page cache into a buffer that is allocated once per
        thread and grown as needed, rather than a new bytes object per file.
        """
        with open(self.absolute(relative), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            buf = getattr(_buffers, "buf", None)
            if buf is None or len(buf) < size:
                buf = _buffers.buf = bytearray(max(size, 1 << 20))
            view = memoryview(buf)[:size]
            got = 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        return view[:got]

    @contextlib.contextmanager
    def mapped(self, relative: str) -> Iterator[memoryview]:
        """A file's bytes mapped from the page cache, valid inside the `with`: no copy at all.

        For verified reads of block and tail files: decoding reads each byte where the kernel
        keeps it (raw sections are copied once, into place or staging; compressed ones are
        decompressed from there), instead of first copying the whole file into a buffer.
        Pages are mapped as the decode first reads them (Linux maps a fault's neighbours with it);
        MAP_POPULATE, which maps every page first, made a verified read slower (docs/benchmarks.md,
        "One core's verified read, again (h-vr2)"). Block files are
        never written in place (temp, fsync, rename), so what is mapped does not change; a file
        another program truncates while it is mapped would fault the process (SIGBUS), which
        `read` would not.
        """
        with open(self.absolute(relative), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                yield memoryview(b"")
                return
            m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        view = memoryview(m)
        try:
            yield view
        finally:
            view.release()
            try:
                m.close()
            except BufferError:  # a view of it outlives the read (a traceback's frame): unmapped when it goes
                pass

    def relative(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def absolute(self, relative: str) -> Path:
        """The path of a file the index names, refused if the name leaves the store (absolute, or a
        `..` part). Checked on the name, not by resolving it: two realpath walks per block read were a
        share of a wake's decoding threads (docs/decisions.md, "Figures behind the store's comments");
        the store writes no links, and its folders are its owner's."""
        parts = PurePosixPath(relative).parts
        if not parts or relative.startswith("/") or any(p in ("..", "") for p in parts) or "\0" in relative:
            raise ValueError(f"index names a file outside the store: {relative!r}")
        return self._real_root.joinpath(*parts)

    def ensure_parent(self, path: Path) -> None:
        if not path.parent.is_dir():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fsync_dir(path.parent.parent)

    @contextlib.contextmanager
    def lock(self, exclusive: bool) -> Iterator[None]:
        """Hold the store lock: shared for writers and readers, exclusive for gc's moments.

        Each call opens its own descriptor, so threads of one process exclude
        each other the same way separate processes do. The kernel drops the
        lock when the holder dies, so `kill -9` never leaves the store locked.

        A turnstile (`store.gate`) keeps a stream of readers and writers from
        starving an exclusive locker (flock queues nobody): it takes the gate
        exclusively before the lock, and a shared locker passes through the gate
        first, so new ones wait behind it while those holding the lock finish.
        A thread that already holds the lock shared skips the gate (a fork's
        writer inside its read): it would wait for an exclusive locker that
        waits for it.
        """
        held = getattr(self._held, "n", 0)
        gate = None
        if exclusive or not held:
            gate = os.open(self.gate_path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(gate, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            if not exclusive:
                os.close(gate)  # passed through
                gate = None
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            self._held.n = held + (not exclusive)
            yield
        finally:
            self._held.n = held
            os.close(fd)
            if gate is not None:
                os.close(gate)

    def walk(self) -> Iterator[Path]:
        """Every file under blocks/, tails/ and points/ (temp files included)."""
        for top in (self.blocks, self.tails, self.points):
            for dirpath, _, names in os.walk(top):
                for name in names:
                    yield Path(dirpath) / name
