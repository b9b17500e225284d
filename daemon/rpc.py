"""The RPC server: a Unix socket, one task per connection, one task per request.

Layers, smallest first: peer credentials (who is calling), framing (msgpack's
own Unpacker with bounded sizes), dispatch (METHODS by name), and the accept
loop that composes them. A connection whose framing breaks (not msgpack, a
frame over the limits, a message that is not msgpack-rpc and has no msgid)
is closed; anything else wrong with a request gets an error response and the
connection goes on. A peer stalled in the middle of a frame for
`read_timeout_s` is dropped; an idle connection between frames is kept.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import struct
import sys
from collections.abc import Callable
from typing import Any

import anyio
import msgpack
from anyio.abc import SocketAttribute, SocketStream

from kvwake.daemon.methods import METHODS, Context
from kvwake.daemon.manager import SessionManager
from kvwake.errors import CancelledError, InvalidParamsError, KvwakeError, UnknownMethodError
from kvwake.protocol import NOTIFICATION, REQUEST, RESPONSE, FrameError, pack, parse, unpacker

__all__ = ["Server", "peer_uid"]

log = logging.getLogger("kvwake.rpc")
RECEIVE_BYTES = 1 << 16


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED / LOCAL_PEERCRED)."""
    if sys.platform == "linux":
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return uid
    # macOS: struct xucred {u_int cr_version; uid_t cr_uid; short cr_ngroups; gid_t cr_groups[16];}
    local_peercred, sol_local = 0x001, 0
    raw = sock.getsockopt(sol_local, local_peercred, struct.calcsize("IIh16I"))
    return struct.unpack_from("II", raw)[1]


class Connection:
    """One client. Everything sent goes through one queue drained by one writer task,
    so streamed pieces queued from the engine thread always precede the response
    (the engine's completion reaches the loop after every piece it queued)."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.closed = False
        self.loop = asyncio.get_running_loop()
        self._out, self._queued = anyio.create_memory_object_stream[bytes](math.inf)

    def send(self, message: list[Any]) -> None:
        """Queue a message (event loop thread)."""
        if not self.closed:
            self._out.send_nowait(pack(message))

    def send_threadsafe(self, message: list[Any]) -> None:
        """Queue a message from another thread (streamed text from the engine thread)."""
        self.loop.call_soon_threadsafe(self.send, message)

    async def writer(self) -> None:
        async with self._queued:
            async for data in self._queued:
                try:
                    await self.stream.send(data)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    self.closed = True
                    return

    def close(self) -> None:
        self.closed = True
        self._out.close()


class Server:
    """Accepts connections from allowed uids and serves METHODS to them."""

    def __init__(self, manager: SessionManager, *, allow_uids: set[int], read_timeout_s: float,
                 shutdown: Callable[[], None]) -> None:
        self.manager, self.allow_uids, self.read_timeout_s = manager, allow_uids, read_timeout_s
        self.shutdown = shutdown
        self.connections = 0
        self.refused = 0

    async def serve(self, listener: anyio.abc.SocketListener) -> None:
        await listener.serve(self.handle)

    async def handle(self, stream: SocketStream) -> None:
        async with stream:
            uid = peer_uid(stream.extra(SocketAttribute.raw_socket))
            if uid not in self.allow_uids:
                self.refused += 1
                log.warning("refused connection", extra={"uid": uid})
                return
            self.connections += 1
            conn = Connection(stream)
            async with anyio.create_task_group() as writer:
                writer.start_soon(conn.writer)
                try:
                    async with anyio.create_task_group() as requests:
                        await self._read_loop(conn, requests)
                finally:
                    conn.close()

    async def _read_loop(self, conn: Connection, tg: anyio.abc.TaskGroup) -> None:
        decoder, fed, complete = unpacker(), 0, 0
        while True:
            # Mid-frame iff bytes arrived past the end of the last whole message.
            # (Unpacker.tell() also counts a partly parsed frame, so it cannot say.)
            partial = fed > complete
            try:
                with anyio.fail_after(self.read_timeout_s if partial else None):
                    data = await conn.stream.receive(RECEIVE_BYTES)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, TimeoutError, OSError):
                conn.closed = True
                return
            try:
                decoder.feed(data)
                fed += len(data)
                for obj in decoder:
                    complete = decoder.tell()
                    self._dispatch(conn, tg, obj)
            except (msgpack.exceptions.BufferFull, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
                    msgpack.exceptions.StackError, ValueError, FrameError) as exc:
                log.warning("closing connection: broken framing", extra={"error": str(exc)[:200]})
                conn.send([NOTIFICATION, "error", {"code": "PROTOCOL_ERROR", "message": str(exc)[:500]}])
                conn.close()
                return

    def _dispatch(self, conn: Connection, tg: anyio.abc.TaskGroup, obj: Any) -> None:
        try:
            msg = parse(obj)
        except FrameError:
            msgid = obj[1] if isinstance(obj, list) and len(obj) > 1 and obj[0] == REQUEST else None
            if isinstance(msgid, int) and not isinstance(msgid, bool) and 0 <= msgid < 2**32:
                error = {"code": "PROTOCOL_ERROR", "message": "request must be [0, msgid, method, params]", "data": None}
                conn.send([RESPONSE, msgid, error, None])
                return
            raise
        if msg.kind == REQUEST:
            tg.start_soon(self._request, conn, msg.msgid, msg.method, msg.params)
        # Clients send no notifications or responses we act on; they are ignored.

    async def _request(self, conn: Connection, msgid: int, method: str, params: Any) -> None:
        ctx = Context(self.manager, msgid, notify=lambda body: self._notify(conn, msgid, body),
                      closed=lambda: conn.closed, shutdown=self.shutdown)
        try:
            if self.manager.stopping:
                raise CancelledError("the daemon is shutting down", method=method[:100])
            fn = METHODS.get(method)
            if fn is None:
                raise UnknownMethodError(f"unknown method {method[:100]!r}", method=method[:100])
            if params is None:
                params = {}
            if not isinstance(params, dict):
                raise InvalidParamsError("params must be a map")
            result = await fn(ctx, params)
            conn.send([RESPONSE, msgid, None, result])
        except KvwakeError as exc:
            conn.send([RESPONSE, msgid, exc.to_wire(), None])
        except Exception as exc:
            log.exception("internal error", extra={"method": method[:100]})
            conn.send([RESPONSE, msgid, {"code": "INTERNAL", "message": f"{type(exc).__name__}: {exc}",
                                         "data": None}, None])

    def _notify(self, conn: Connection, msgid: int, body: dict[str, Any]) -> None:
        """Called on the engine thread with streamed output: hand it to the event loop."""
        if not conn.closed:
            conn.send_threadsafe([NOTIFICATION, "stream", {"msgid": msgid, **body}])


def default_allow(extra: tuple[int, ...]) -> set[int]:
    return {os.getuid(), *extra}
