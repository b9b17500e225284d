"""File digests: the sha256 of a model's files, cached across restarts, computed on background threads.

The bundle hash (kv/bundle.py) names every counted file by the plain sha256 of its bytes. Reading them is
one of a first start's longest steps, so it runs on threads beside loading the weights
(`hash_in_background`: one file per thread, the largest first; reads and sha256 updates release the GIL),
and later starts take the digests from a `DigestCache` file while the files are unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any


__all__ = ["DigestCache", "DigestsCancelled", "Hashing", "file_digest", "hash_in_background", "stat_key"]

log = logging.getLogger("kvwake.daemon.bundle")  # the bundle's name: its logs are read by it

CACHE_FORMAT = 1

# A file modified this recently may change again within one mtime tick without
# its (size, mtime) changing (2 s: exFAT/FAT; HFS+ has 1 s); its digest is not
# cached ("racy git" problem).
RACY_WINDOW_NS = 2_000_000_000

# One read's size: large enough that a read and an update cost few calls per gigabyte (both release the GIL
# above a few KiB), small enough that a read stays in the core's cache while it is hashed.
READ_BYTES = 1 << 20


class DigestsCancelled(Exception):
    """Hashing stopped because the digests it was for were dropped unjoined."""


def _sha256_file(path: Path, stop: threading.Event | None = None) -> str:
    """sha256 hex of a file's bytes, read in READ_BYTES chunks into one buffer (never whole into memory).

    Raises DigestsCancelled between chunks once `stop` is set."""
    buffer = bytearray(READ_BYTES)
    view, digest = memoryview(buffer), hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        with contextlib.suppress(AttributeError, OSError):  # a hint: the kernel reads ahead further
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(buffer):
            if stop is not None and stop.is_set():
                raise DigestsCancelled(f"hashing of {path} stopped: its digests were dropped")
            digest.update(view[:n])
    return digest.hexdigest()


def stat_key(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


class DigestCache:
    """sha256 of files, persisted as a small JSON file so restarts skip re-hashing.

    An entry is keyed by the file's resolved path and trusted only while its
    size, mtime_ns, ctime_ns and inode are unchanged (ctime and inode also catch
    a file replaced by rename or with its mtime set back). Digests of files
    modified within RACY_WINDOW_NS of hashing are not recorded. `path=None`
    keeps the cache in memory only.

    File format: {"format": 1, "entries": {"<resolved path>": {"size": int,
    "mtime_ns": int, "ctime_ns": int, "ino": int, "sha256": "<hex>"}}}.
    `lookup` and `record` may run on several threads at once (each is one dict
    operation under the GIL); `save` after they are done.
    An unreadable or malformed file is treated as empty. `save()` merges with
    what is on disk, drops entries of files that no longer exist, and writes a
    temp file then renames it: two processes saving at once leave valid JSON
    (the last writer wins any conflicting entry).
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._entries: dict[str, dict] = self._read()
        self._new: dict[str, dict] = {}

    def _read(self) -> dict[str, dict]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            entries = data["entries"] if data.get("format") == CACHE_FORMAT else {}
            return {p: e for p, e in entries.items() if _valid_entry(e)}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("digest cache %s unreadable (%s); starting empty", self.path, exc)
            return {}

    def lookup(self, path: Path, st: os.stat_result) -> str | None:
        """The cached digest of resolved `path` if `st` matches its entry, else None."""
        entry = self._entries.get(str(path))
        if entry and {k: entry[k] for k in stat_key(st)} == stat_key(st):
            return entry["sha256"]
        return None

    def record(self, path: Path, st: os.stat_result, digest: str) -> None:
        """Remember `digest` for resolved `path` as it was when stat'ed as `st`."""
        entry = {**stat_key(st), "sha256": digest}
        self._entries[str(path)] = entry
        self._new[str(path)] = entry

    def save(self) -> None:
        """Write new entries to disk (no-op if none or in-memory). Raises OSError."""
        if self.path is None or not self._new:
            return
        merged = {**self._read(), **self._new}
        merged = {p: e for p, e in merged.items() if os.path.exists(p)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps({"format": CACHE_FORMAT, "entries": merged}, separators=(",", ":")).encode())
                f.flush()
                # the store's durable sync, imported here: the digests start before the store's imports may
                # run (client/cli.py serve, before the heavy imports)
                from kvwake.store.files import sync

                sync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._entries, self._new = merged, {}


def _valid_entry(entry: Any) -> bool:
    return (isinstance(entry, dict)
            and all(type(entry.get(k)) is int for k in ("size", "mtime_ns", "ctime_ns", "ino"))
            and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64)


def file_digest(path: str | os.PathLike, *, cache: DigestCache | None = None,
                stop: threading.Event | None = None) -> str:
    """sha256 hex of the file at `path` (symlinks followed), via `cache` when it is fresh.

    Raises OSError (FileNotFoundError, IsADirectoryError, ...) from reading, DigestsCancelled once `stop`
    is set.
    """
    resolved = Path(path).resolve()
    before = resolved.stat()
    if cache is not None and (hit := cache.lookup(resolved, before)) is not None:
        return hit
    started = time.time_ns()
    digest = _sha256_file(resolved, stop)
    if cache is not None:
        after = resolved.stat()
        settled = before.st_mtime_ns < started - RACY_WINDOW_NS
        if settled and stat_key(after) == stat_key(before):
            cache.record(resolved, before, digest)
    return digest


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # gone since it was listed: its read says so


def _hash_files(folder: Path, jobs: list[tuple[str, Future]], lock: threading.Lock,
                cache: DigestCache | None, stop: threading.Event) -> None:
    """One digest thread: takes the next file off `jobs` until none is left. It holds nothing of whoever
    waits for the futures, so that holder can be dropped and set `stop` (kv/bundle.py PendingDigests)."""
    while True:
        with lock:
            if not jobs:
                return
            name, future = jobs.pop()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(file_digest(folder / name, cache=cache, stop=stop))
        except Exception as exc:  # noqa: BLE001 - handed to whoever joins
            future.set_exception(exc)


def hash_in_background(folder: Path, names: list[str], cache: DigestCache | None, workers: int,
                       stop: threading.Event) -> dict[str, Future]:
    """A future of each file's digest (`file_digest` of `folder / name`), computed on up to `workers`
    daemon threads, the largest files first (the longest one starts at once). Setting `stop` ends the
    threads at their next read (their futures then hold DigestsCancelled)."""
    return Hashing(folder, names, cache, workers, stop).futures


class Hashing:
    """`hash_in_background`'s work, with workers that can be added while it runs (`add_workers`)."""

    def __init__(self, folder: Path, names: list[str], cache: DigestCache | None, workers: int,
                 stop: threading.Event) -> None:
        self.futures: dict[str, Future] = {name: Future() for name in names}
        # popped from the end: largest first
        self._jobs = sorted(self.futures.items(), key=lambda job: _size(folder / job[0]))
        self._lock = threading.Lock()
        self._args = (folder, self._jobs, self._lock, cache, stop)
        self.workers = 0
        self.add_workers(workers)

    def add_workers(self, workers: int) -> None:
        """Hash on up to `workers` threads in all from now on (more than it had, one per file still waiting)."""
        with self._lock:
            more = min(len(self._jobs), workers - self.workers)
            self.workers += max(0, more)
        for _ in range(more):
            threading.Thread(target=_hash_files, args=self._args, name="kvwake-digests", daemon=True).start()
