"""The RPC server: a Unix socket, an asyncio Protocol per connection, one task per request.

Layers, smallest first: peer credentials (who is calling), framing (msgpack's
own Unpacker with bounded sizes, fed from `data_received`), dispatch (METHODS
by name), and `Server`, which composes them. What closes a connection: bytes
that are not msgpack or a frame over the limits (after an "error"
notification), a peer stalled in the middle of a frame for `read_timeout_s`,
and a peer that stops reading while more than `out_buffer_bytes` wait for it.
Everything else a client sends is answered with an error response when it
carries a msgid, and ignored (logged at debug) when it does not; an idle
connection between frames is kept.

Why a Protocol and not anyio's socket streams: on asyncio, anyio's UNIX stream
waits for each read on a Future that `add_reader` completes with
`Future.set_result`. A read cancelled in the same loop pass as its socket
turned readable (every connection at shutdown, under load) made asyncio log
"Exception in callback Future.set_result(None) ... InvalidStateError", and the
future, reader registration and writer task per message cost several times a
bare asyncio server's round trip (docs/decisions.md, "RPC front (issue 14)").
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from kvwake.daemon.sessions.manager import SessionManager
from kvwake.daemon.fronts.methods import METHODS, Context
from kvwake.errors import CancelledError, KvwakeError, UnknownMethodError
from kvwake.protocol import NOTIFICATION, REQUEST, RESPONSE, FrameError, pack, parse, request_params, unpacker

__all__ = ["Connection", "Server", "default_allow", "peer_uid", "unix_listener"]

log = logging.getLogger("kvwake.rpc")

# What msgpack's Unpacker raises for bytes it cannot decode or a frame beyond the limits.
UNDECODABLE = (msgpack.exceptions.BufferFull, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
               msgpack.exceptions.StackError, ValueError)


def peer_uid(sock: Any) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED / LOCAL_PEERCRED)."""
    if sys.platform == "linux":
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return uid
    # macOS: struct xucred {u_int cr_version; uid_t cr_uid; short cr_ngroups; gid_t cr_groups[16];}
    local_peercred, sol_local = 0x001, 0
    raw = sock.getsockopt(sol_local, local_peercred, struct.calcsize("IIh16I"))
    return struct.unpack_from("II", raw)[1]


def unix_listener(path: Path) -> socket.socket:
    """A listening Unix socket at `path`, mode 0600 (its folder is private too: serve.prepare_socket)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def default_allow(extra: tuple[int, ...]) -> set[int]:
    return {os.getuid(), *extra}


class Connection(asyncio.Protocol):
    """One client. Replies are written to the transport in the order they are produced; streamed
    pieces from the engine thread reach the loop through the engine thread's `post`, in the same
    hop as (or one before) the engine's completion of that call, so they always precede its response."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.transport: asyncio.Transport | None = None
        self._decoder = unpacker()
        self._fed = self._complete = 0  # bytes fed to the decoder / ending the last whole message
        self._last_data = 0.0
        self._stall_timer: asyncio.TimerHandle | None = None

    # -- bytes in -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport
        uid = peer_uid(transport.get_extra_info("socket"))
        if uid not in self.server.allow_uids:
            self.server.refused += 1
            log.warning("refused connection", extra={"uid": uid})
            self.abort()
            return
        self.server.connections += 1
        self.server.live.add(self)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            self._decoder.feed(data)
            self._fed += len(data)
            for obj in self._decoder:
                self._complete = self._decoder.tell()
                self.server.dispatch(self, obj)
        except UNDECODABLE as exc:
            log.warning("closing connection: broken framing", extra={"error": str(exc)[:200]})
            self.send([NOTIFICATION, "error", {"code": "PROTOCOL_ERROR", "message": str(exc)[:500]}])
            self.close()
            return
        self._watch_stall()

    def eof_received(self) -> bool:
        return False  # the client is gone: close, and let its generations stop

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._stall_timer is not None:
            self._stall_timer.cancel()
        self.server.live.discard(self)

    def _watch_stall(self) -> None:
        """Drop a peer stalled mid-frame; keep one idle between frames. (Unpacker.tell() also
        counts a partly parsed frame, hence the byte counts.)"""
        if self._fed > self._complete:
            self._last_data = self.loop.time()
            if self._stall_timer is None:
                self._stall_timer = self.loop.call_later(self.server.read_timeout_s, self._check_stall)
        elif self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _check_stall(self) -> None:
        quiet = self.loop.time() - self._last_data
        if quiet < self.server.read_timeout_s:
            self._stall_timer = self.loop.call_later(self.server.read_timeout_s - quiet, self._check_stall)
            return
        self._stall_timer = None
        log.info("dropping a peer stalled mid-message", extra={"read_timeout_s": self.server.read_timeout_s,
                                                                "partial_bytes": self._fed - self._complete})
        self.abort()

    # -- bytes out ------------------------------------------------------------

    def send(self, message: list[Any]) -> None:
        """Write a message (event loop thread)."""
        self.write(pack(message))

    def write(self, data: bytes) -> None:
        """Write, unless more than out_buffer_bytes already wait for this client: then it has stopped
        reading, and it is dropped (its calls in flight see `closed` and stop)."""
        if self.closed or self.transport is None:
            return
        queued = self.transport.get_write_buffer_size()
        if queued > self.server.out_buffer_bytes:
            log.warning("dropping a client that stopped reading",
                        extra={"queued_bytes": queued, "out_buffer_bytes": self.server.out_buffer_bytes,
                               "calls_in_flight": self.server.in_flight(self)})
            self.abort()
            return
        self.transport.write(data)

    def close(self) -> None:
        """Close after what is already written has been sent."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close now, discarding what is queued."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Server:
    """Serves METHODS to connections from allowed uids; `protocol()` is the asyncio protocol factory."""

    def __init__(self, manager: SessionManager, *, allow_uids: set[int], read_timeout_s: float,
                 out_buffer_bytes: int, shutdown: Callable[[], None]) -> None:
        self.manager, self.allow_uids, self.read_timeout_s = manager, allow_uids, read_timeout_s
        self.out_buffer_bytes, self.shutdown = out_buffer_bytes, shutdown
        self.connections = 0
        self.refused = 0
        self.live: set[Connection] = set()
        self.tasks: dict[asyncio.Task[None], Connection] = {}  # requests in flight

    def protocol(self) -> Connection:
        return Connection(self)

    def in_flight(self, conn: Connection) -> int:
        return sum(1 for c in self.tasks.values() if c is conn)

    def dispatch(self, conn: Connection, obj: Any) -> None:
        try:
            msg = parse(obj)
        except FrameError as exc:
            if exc.msgid is not None:
                conn.send([RESPONSE, exc.msgid, {"code": "PROTOCOL_ERROR", "message": str(exc), "data": None}, None])
            else:  # no msgid: nothing to answer to
                log.debug("ignored a message that is not msgpack-rpc", extra={"error": str(exc)})
            return
        if msg.kind != REQUEST:  # clients' notifications and responses are not acted on
            log.debug("ignored a client message", extra={"kind": msg.kind, "method": (msg.method or "")[:100]})
            return
        task = conn.loop.create_task(self._request(conn, msg.msgid, msg.method, msg.params))
        self.tasks[task] = conn
        task.add_done_callback(self.tasks.pop)

    async def _request(self, conn: Connection, msgid: int, method: str, params: Any) -> None:
        ctx = Context(self.manager, msgid, notify=lambda body: self._notify(conn, msgid, body),
                      closed=lambda: conn.closed, shutdown=self.shutdown)
        try:
            if self.manager.stopping:
                raise CancelledError("the daemon is shutting down", method=method[:100])
            fn = METHODS.get(method)
            if fn is None:
                raise UnknownMethodError(f"unknown method {method[:100]!r}", method=method[:100])
            result = await fn(ctx, request_params(params))
            conn.send([RESPONSE, msgid, None, result])
        except KvwakeError as exc:
            conn.send([RESPONSE, msgid, exc.to_wire(), None])
        except Exception as exc:
            log.exception("internal error", extra={"method": method[:100]})
            conn.send([RESPONSE, msgid, {"code": "INTERNAL", "message": f"{type(exc).__name__}: {exc}",
                                         "data": None}, None])

    def _notify(self, conn: Connection, msgid: int, body: dict[str, Any]) -> None:
        """Called on the engine thread with streamed output: hand it to the event loop."""
        if not conn.closed:  # the step's output of every call goes to the loop in one hop (manager.post)
            self.manager.post(conn.loop, conn.write, pack([NOTIFICATION, "stream", {"msgid": msgid, **body}]))

    async def close(self) -> None:
        """Close every connection, then end the requests still in flight (none touches a session
        by now: the drain waited for those)."""
        for conn in list(self.live):
            conn.close()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks))
