"""What the shared tier's pieces look like: its configuration, its health, block and tail objects,
gc runs and lease steps (store/remote/client.py makes the calls; the layout is in its docstring).

Block, tail and restore point objects (`ObjectHeader`, version 1):

    offset  size  field
    0       4     magic b"KVWO"
    4       1     version (1)
    5       3     reserved, zero
    8       4     u32 LE length n of the header JSON
    12      n     header JSON, UTF-8: {"kind": "block"|"tail", "bundle", "digest",
                  "codec", "raw_bytes", "stored_bytes", and for blocks "key",
                  "parent", "token_ids" (list of ints); for tails "snapshot_id";
                  for restore points (kind "point") "key" and "n_tokens"}
    12+n    ...   the block file (store/format/codec.py), stored_bytes long

A reader trusts none of it: the chain key is recomputed from parent, bundle
and token ids, and the block file is decoded and its digest checked against
the manifest (`kvwake.store.archive.check_encoded`).
"""

from __future__ import annotations

import datetime
import json
import struct
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlparse

from obstore.store import S3Store

from kvwake.errors import InvalidParamsError

__all__ = ["GcRun", "Health", "Lease", "ObjectHeader", "RemoteConfig"]

MAGIC = b"KVWO"
OBJECT_VERSION = 1
LEASE_VERSION = 1


@dataclass(frozen=True)
class RemoteConfig:
    """Where the shared tier is and how to sign in (the daemon fills it from flags, env, config file)."""

    url: str  # s3://BUCKET/PREFIX
    endpoint: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    region: str = "us-east-1"
    timeout_s: float = 10.0  # one request, connection included

    def bucket_prefix(self) -> tuple[str, str]:
        parsed = urlparse(self.url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise InvalidParamsError(f"remote must look like s3://BUCKET/PREFIX, not {self.url!r}", remote=self.url)
        return parsed.netloc, parsed.path.strip("/")

    def open(self) -> S3Store:
        bucket, prefix = self.bucket_prefix()
        options: dict[str, Any] = {"timeout": f"{self.timeout_s}s", "connect_timeout": f"{min(self.timeout_s, 3.0)}s"}
        if self.endpoint and self.endpoint.startswith("http://"):
            options["allow_http"] = True
        credentials = {k: v for k, v in (("access_key_id", self.access_key_id),
                                         ("secret_access_key", self.secret_access_key)) if v}
        # Few, quick retries: a dead server must surface as "down" within about timeout_s, not minutes.
        retry = {"max_retries": 2, "retry_timeout": datetime.timedelta(seconds=self.timeout_s),
                 "backoff": {"init_backoff": datetime.timedelta(milliseconds=50),
                             "max_backoff": datetime.timedelta(seconds=1), "base": 2}}
        return S3Store(bucket, prefix=prefix or None, endpoint=self.endpoint, region=self.region,
                       client_options=options, retry_config=retry, **credentials)


@dataclass
class Health:
    """What `status` shows of the remote: state is "connecting", "ok", "slow", "down" or "unauthorized".

    "slow": the last call answered, but took longer than `slow_s` (the daemon sets it to the prefix
    lookup's deadline); the next quick answer makes it "ok" again.
    """

    state: str = "connecting"
    error: str | None = None
    since: float = field(default_factory=time.time)
    last_ok: float | None = None
    slow_s: float = 2.0
    last_call_s: float | None = None

    def report(self, ok: bool, error: str | None = None, state: str = "down", took_s: float | None = None) -> None:
        if ok and took_s is not None:
            self.last_call_s = round(took_s, 3)
            if took_s > self.slow_s:  # it answered, but a prefix lookup would have given up on it
                ok, state, error = False, "slow", f"{error} took {took_s:.1f} s (more than {self.slow_s} s)"
        new = "ok" if ok else state
        if new != self.state:
            self.state, self.since = new, time.time()
        if ok:
            self.error, self.last_ok = None, time.time()
        else:
            self.error = error


@dataclass(frozen=True)
class ObjectHeader:
    """The header of a block, tail or restore point object (layout in the module docstring)."""

    kind: str
    bundle: str
    digest: str
    codec: str
    raw_bytes: int
    stored_bytes: int
    key: str | None = None
    parent: str | None = None
    token_ids: tuple[int, ...] | None = None
    snapshot_id: str | None = None
    n_tokens: int | None = None  # a restore point's: the tokens of the prefix its key names

    def pack(self, file: bytes | memoryview) -> bytes:
        head = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if v is not None}
        raw = json.dumps(head).encode()
        return b"".join((MAGIC, bytes([OBJECT_VERSION, 0, 0, 0]), struct.pack("<I", len(raw)), raw, bytes(file)))

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> tuple[ObjectHeader, memoryview]:
        """Split an object into its header and its block file; ValueError when malformed."""
        view = memoryview(data)
        if len(view) < 12 or bytes(view[:4]) != MAGIC or view[4] != OBJECT_VERSION:
            raise ValueError("not a kvwake object (bad magic or version)")
        (n,) = struct.unpack("<I", view[8:12])
        try:
            head = json.loads(bytes(view[12 : 12 + n]))
            header = cls(**{**head, "token_ids": tuple(head["token_ids"]) if "token_ids" in head else None})
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"header is malformed ({exc})") from None
        body = view[12 + n :]
        if len(body) != header.stored_bytes:
            raise ValueError(f"holds {len(body)} bytes of block file, its header says {header.stored_bytes}")
        return header, body


@dataclass(frozen=True)
class GcRun:
    """The newest remote gc run: `epoch` 0 when none ever ran; `active` while it may still delete."""

    epoch: int
    active: bool
    daemon: str | None = None
    until: float = 0.0


@dataclass(frozen=True)
class Lease:
    """One step of a session's ownership history, version 1; the greatest epoch is the current state.

    state "held": `daemon` owns the session (only it may append and publish snapshots).
    state "released": nobody does; any daemon may take it (epoch + 1, create-only).
    """

    epoch: int
    daemon: str
    state: str
    time: float
    version: int = LEASE_VERSION
