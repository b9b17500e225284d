"""The shared tier: blocks, snapshots and session leases on an S3-compatible object store.

No MLX here: objects are keyed by chain key and hold block files exactly as
the local store writes them. All calls are blocking (obstore's sync API, which
releases the GIL while it waits); the daemon runs them on worker threads.
Objects fetched concurrently go through a small thread pool of our own.

Layout under `s3://BUCKET/PREFIX/` (format 1, `LAYOUT`):

    v1/<bundle>/identity.json                 create-only; compared at start
    v1/<bundle>/blocks/<chain key>            one block object (below), create-only
    v1/<bundle>/tails/<snapshot id>           a snapshot's tail object, create-only
    v1/<bundle>/points/<chain key>            a restore point object (store/remote/points.py), keyed
                                              by the chain key of the block it closes, create-only
    v1/<bundle>/snapshots/<sid>/<epoch:012d>-<snapshot id>.json
                                              the manifest, written last: the commit point
    v1/<bundle>/leases/<sid>/<epoch:012d>.json
                                              ownership history, create-only (see `Lease`)
    v1/<bundle>/prefixes/<parent>/<chain key>.json
                                              a warmed prefix's manifest (`prefix.warm`), named by
                                              its last piece's key under that piece's parent
                                              (store/remote/shared_prompts.py); written last
    v1/<bundle>/gc/<epoch:012d>-start.json, -end.json
                                              remote gc runs (store/remote/gc.py), create-only

`<sid>` is the session id percent-encoded (every byte but ASCII letters,
digits and "_.-~"). A namespace per bundle hash: two models never share an
object, and a daemon only ever lists its own model's sessions.

Block and tail objects: store/remote/objects.py (`ObjectHeader`).

Manifests are the export manifest (store/archive.py) plus `"remote":
{"epoch", "daemon", "keep_history"}` (keep_history: the history the remote gc
keeps for the session, named by its head; store/remote/gc.py). A session's head is its manifest with the greatest name
(epoch first, then the time-ordered snapshot id). A prefix manifest is
{"format": "kvwake-prefix", "version": 1, "bundle", "block_tokens",
"n_tokens", "last_tokens" (the last piece's token ids), "blocks": [{"key",
"digest", "raw_bytes"}]}; its last block may be short (fewer than
block_tokens tokens, keyed by the same layout). Both kinds of manifest may
name restore points, `"points": [{"key", "digest", "raw_bytes", "n_tokens"}]`:
those the uploader held closing the manifest's blocks (the remote gc keeps
them while a manifest names them).

Objects are deleted only by the remote gc (store/remote/gc.py), which never
removes what a snapshot or prefix manifest names.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any, TypeVar
from urllib.parse import quote, unquote

import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError, PermissionDeniedError, UnauthenticatedError

from kvwake.errors import BusyError, CorruptBlockError, InvalidParamsError, RemoteUnavailableError
from kvwake.store.remote.objects import GcRun, Health, Lease, RemoteConfig

__all__ = ["LAYOUT", "Remote"]

LAYOUT = "v1"
GC_SKEW_S = 30.0  # how far two machines' clocks may disagree; a gc run's deadline is stretched by it
T = TypeVar("T")
MISSING = (FileNotFoundError, NotFoundError)  # obstore raises either for a missing object, depending on the call


def session_part(session_id: str) -> str:
    return quote(session_id, safe="")


def _name(path: str) -> str:
    return path.rsplit("/", 1)[-1]


class Remote:
    """One bundle's namespace on the object store, as seen by one daemon (`daemon_id`)."""

    def __init__(self, config: RemoteConfig, bundle: str, daemon_id: str, *, workers: int = 16) -> None:
        self.config, self.bundle, self.daemon_id = config, bundle, daemon_id
        self.s3 = config.open()
        self.ns = f"{LAYOUT}/{bundle}"
        self.health = Health()
        self.keep_history: int | None = None  # named in our manifests: how much history the remote gc keeps
        self.counters = {"uploaded_blocks": 0, "uploaded_snapshots": 0, "fetched_blocks": 0,
                         "fetched_snapshots": 0, "refused_objects": 0, "uploaded_points": 0, "fetched_points": 0}
        self.pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvwake-s3")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- calls, and what their failures mean ----------------------------------

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one store call; record health; turn transport and auth failures into RemoteUnavailableError.

        AlreadyExistsError and FileNotFoundError (obstore raises it for a missing object) pass through: they are answers, not faults.
        """
        began = time.monotonic()
        try:
            result = fn()
        except (AlreadyExistsError, *MISSING):
            self.health.report(True, what, took_s=time.monotonic() - began)
            raise
        except (PermissionDeniedError, UnauthenticatedError) as exc:
            self._fail(what, exc, "unauthorized")
        except Exception as exc:  # obstore's GenericError and friends: connection refused, timeouts, 5xx
            self._fail(what, exc, "down")
        self.health.report(True, what, took_s=time.monotonic() - began)
        return result

    def _fail(self, what: str, exc: Exception, state: str) -> None:
        first = str(exc).splitlines()[0][:300]
        why = "the server refused the credentials" if state == "unauthorized" else "the server is unreachable or failing"
        message = f"remote {self.config.url} ({self.config.endpoint or 'AWS'}): {what}: {why}: {first}"
        self.health.report(False, message, state)
        raise RemoteUnavailableError(message, remote=self.config.url, state=state) from None

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None if it does not exist."""
        try:
            return bytes(self.call(f"GET {key}", lambda: self.s3.get(key).bytes()))
        except MISSING:
            return None

    def refused(self, what: str, why: str, **facts: Any) -> CorruptBlockError:
        """The error for a remote object that does not check out (counted)."""
        self.counters["refused_objects"] += 1
        return CorruptBlockError(f"remote {what} refused: {why}", remote=self.config.url, **facts)

    def get_checked(self, key: str, check: Callable[[bytes], T], what: str, **facts: Any) -> T:
        """`check(bytes)` of the object at `key`: KeyError when it does not exist; CorruptBlockError naming
        `what` (and `facts`) when `check` raises ValueError."""
        data = self.get(key)
        if data is None:
            raise KeyError(key)
        try:
            return check(data)
        except ValueError as exc:
            raise self.refused(what, str(exc), **facts) from None

    def put_new(self, key: str, data: bytes) -> bool:
        """Create-only put (If-None-Match: *); False if the key already exists."""
        try:
            self.call(f"PUT {key}", lambda: self.s3.put(key, data, mode="create"))
            return True
        except AlreadyExistsError:
            return False

    def delete(self, key: str) -> None:
        """Remove one object (only the remote gc does; a missing one is not an error)."""
        with contextlib.suppress(*MISSING):
            self.call(f"DELETE {key}", lambda: self.s3.delete(key))

    def listing(self, prefix: str) -> list[dict[str, Any]]:
        """Every object under `prefix`, recursively: dicts with "path", "last_modified" (datetime), "size"."""
        return self.call(f"LIST {prefix}", lambda: [o for page in obstore.list(self.s3, prefix) for o in page])

    def exists(self, key: str) -> bool:
        try:
            self.call(f"HEAD {key}", lambda: self.s3.head(key))
            return True
        except MISSING:
            return False

    def names(self, prefix: str) -> list[str]:
        """Object names directly under `prefix` (a folder), sorted."""
        result = self.call(f"LIST {prefix}", lambda: obstore.list_with_delimiter(self.s3, prefix))
        return sorted(_name(o["path"]) for o in result["objects"])

    def folders(self, prefix: str) -> list[str]:
        result = self.call(f"LIST {prefix}", lambda: obstore.list_with_delimiter(self.s3, prefix))
        return sorted(_name(p) for p in result["common_prefixes"])

    def parallel(self, fn: Callable[[Any], T], items: Iterable[Any]) -> list[T]:
        """fn over items on the pool, results in order; the first failure is raised."""
        return [f.result() for f in [self.pool.submit(fn, item) for item in items]]

    # -- namespace ------------------------------------------------------------

    def block_key(self, key: str) -> str:
        return f"{self.ns}/blocks/{key}"

    def point_key(self, key: str) -> str:
        return f"{self.ns}/points/{key}"

    def tail_key(self, snapshot_id: str) -> str:
        return f"{self.ns}/tails/{snapshot_id}"

    def prefix_key(self, parent: str, last_key: str) -> str:
        return f"{self.ns}/prefixes/{parent}/{last_key}.json"

    def manifest_key(self, session_id: str, epoch: int, snapshot_id: str) -> str:
        return f"{self.ns}/snapshots/{session_part(session_id)}/{epoch:012d}-{snapshot_id}.json"

    def connect(self, block_tokens: int, description: dict[str, Any]) -> None:
        """Write this bundle's identity object (create-only), or check the one there matches ours.

        Raises RemoteUnavailableError (unreachable, refused) or InvalidParamsError (another identity).
        """
        mine = {"format": "kvwake-remote", "layout": LAYOUT, "bundle": self.bundle, "block_tokens": block_tokens,
                "description": description}
        key = f"{self.ns}/identity.json"
        if self.put_new(key, json.dumps(mine, sort_keys=True).encode()):
            return
        raw = self.get(key)
        theirs = json.loads(raw) if raw else None
        if not isinstance(theirs, dict) or any(theirs.get(k) != mine[k] for k in ("format", "layout", "bundle", "block_tokens")):
            message = (f"remote {self.config.url}: the identity object {key} does not match this daemon "
                       f"(bundle {self.bundle[:12]}, {block_tokens}-token blocks); refusing to share it")
            self.health.report(False, message, "refused")
            raise InvalidParamsError(message, remote=self.config.url, key=key)

    def sessions(self) -> list[str]:
        """Ids of every session with a published snapshot in this namespace."""
        return [unquote(p) for p in self.folders(f"{self.ns}/snapshots/")]

    def head(self, session_id: str) -> str | None:
        """The object key of a session's newest manifest, or None."""
        names = self.names(f"{self.ns}/snapshots/{session_part(session_id)}/")
        return f"{self.ns}/snapshots/{session_part(session_id)}/{names[-1]}" if names else None

    # -- gc runs (the fence between gc and uploads: store/remote/gc.py) -----------

    def gc_run(self) -> GcRun:
        """The newest gc run. One whose end object is missing stays active until its `until` (plus
        GC_SKEW_S for clocks that disagree), after which it deletes nothing more."""
        names = self.names(f"{self.ns}/gc/")
        starts = [n for n in names if n.endswith("-start.json")]
        if not starts:
            return GcRun(0, False)
        epoch = int(starts[-1].split("-")[0])
        if f"{epoch:012d}-end.json" in names:
            return GcRun(epoch, False)
        raw = self.get(f"{self.ns}/gc/{starts[-1]}") or b"{}"
        try:
            start = json.loads(raw)
            until, daemon = float(start["until"]), str(start["daemon"])
        except (ValueError, TypeError, KeyError):
            raise CorruptBlockError(f"gc start object {starts[-1]} is malformed", block=starts[-1]) from None
        return GcRun(epoch, time.time() < until + GC_SKEW_S, daemon, until)

    def wait_for_gc(self, poll_s: float = 0.25) -> GcRun:
        """Block until no gc run is active; returns the newest run (then inactive)."""
        while (run := self.gc_run()).active:
            time.sleep(min(poll_s, max(0.01, run.until + GC_SKEW_S - time.time())))
        return run

    # -- leases ---------------------------------------------------------------

    def leases(self, session_id: str) -> list[Lease]:
        prefix = f"{self.ns}/leases/{session_part(session_id)}/"
        return [self._lease(prefix + name) for name in self.names(prefix)[-1:]]

    def _lease(self, key: str) -> Lease:
        raw = self.get(key)
        try:
            return Lease(**json.loads(raw or b""))
        except (ValueError, TypeError) as exc:
            raise CorruptBlockError(f"lease object {key} is malformed ({exc})", block=key) from None

    def current_lease(self, session_id: str) -> Lease | None:
        found = self.leases(session_id)
        return found[-1] if found else None

    def _write_lease(self, session_id: str, epoch: int, state: str) -> Lease | None:
        lease = Lease(epoch, self.daemon_id, state, time.time())
        key = f"{self.ns}/leases/{session_part(session_id)}/{epoch:012d}.json"
        return lease if self.put_new(key, json.dumps(asdict(lease)).encode()) else None

    def acquire(self, session_id: str, *, take_over: bool = False, only_new: bool = False) -> Lease:
        """Become the session's owner: a new "held" epoch, written create-only.

        Raises BusyError naming the owner when another daemon holds it (unless take_over: for an
        owner that died) or wins the same epoch at the same moment; with only_new, also when the
        session has any lease history (a session of that id was made elsewhere).
        """
        current = self.current_lease(session_id)
        if only_new and current is not None and not (current.state == "held" and current.daemon == self.daemon_id):
            raise BusyError(f"session {session_id} already exists on the remote (lease epoch {current.epoch}, "
                            f"{current.state} by {current.daemon}); this daemon's copy stays local",
                            session_id=session_id, owner=current.daemon, epoch=current.epoch)
        if current is not None and current.state == "held":
            if current.daemon == self.daemon_id:
                return current
            if not take_over:
                raise BusyError(f"session {session_id} is owned by daemon {current.daemon} (lease epoch "
                                f"{current.epoch}); sleep it there with release, or take it over if that daemon "
                                "is gone", session_id=session_id, owner=current.daemon, epoch=current.epoch)
        lease = self._write_lease(session_id, (current.epoch if current else 0) + 1, "held")
        if lease is None:
            raise BusyError(f"another daemon took session {session_id} at the same moment", session_id=session_id)
        return lease

    def release(self, session_id: str, held: Lease) -> bool:
        """Give up ownership: the epoch after `held`, state "released"; False if we no longer held it."""
        current = self.current_lease(session_id)
        if current != held:
            return False
        return self._write_lease(session_id, held.epoch + 1, "released") is not None
