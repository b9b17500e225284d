"""The async client (anyio: asyncio or trio): `AsyncClient`, and `AsyncStream`.

The same methods as `Client` (both inherit them from `ClientAPI`), awaited.
Concurrency and reconnection work as in the blocking client: each call in
flight has a connection of its own from a pool, so concurrent tasks run their
calls concurrently; a pooled connection the daemon closed (restart) is
replaced before reuse, and a request is resent only when it never left.
One `AsyncClient` belongs to one event loop.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
from anyio import to_thread
from anyio.abc import SocketAttribute, SocketStream

from kvwake.client.api import ClientAPI, Decode
from kvwake.client.autostart import autostart_enabled, ensure_daemon
from kvwake.client.client import MAX_MSGID, connect_error
from kvwake.client.paths import resolve_socket
from kvwake.client.wire import (
    RECEIVE_BYTES,
    CallReader,
    ClientConnectionError,
    ConnectionLostError,
    DaemonNotRunningError,
    Done,
    Piece,
    Streamed,
    encode_request,
)
from kvwake.errors import KvwakeError

__all__ = ["AsyncClient", "AsyncStream"]


class AsyncConnection:
    """One Unix socket stream to the daemon, carrying one call at a time."""

    def __init__(self, stream: SocketStream, timeout: float | None) -> None:
        self.stream, self.timeout = stream, timeout
        self.msgid = 0

    @classmethod
    async def open(cls, path: Path, *, timeout: float | None, connect_timeout: float) -> AsyncConnection:
        try:
            with anyio.fail_after(connect_timeout):
                stream = await anyio.connect_unix(str(path))
        except TimeoutError:
            raise ClientConnectionError(f"cannot connect to {path}: timed out") from None
        except OSError as exc:
            raise connect_error(path, exc) from None
        return cls(stream, timeout)

    def alive(self) -> bool:
        """Whether this idle connection can carry a call: open, and nothing unread on it."""
        sock: socket.socket = self.stream.extra(SocketAttribute.raw_socket)
        try:
            sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # the event loop keeps it non-blocking
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        return False  # EOF (the daemon restarted), or bytes no call is waiting for

    async def send(self, method: str, params: dict[str, Any]) -> CallReader:
        self.msgid = self.msgid % MAX_MSGID + 1
        await self.stream.send(encode_request(self.msgid, method, params))
        return CallReader(self.msgid)

    async def next_event(self, reader: CallReader) -> Piece | Done:
        """The call's next event; raises its server error, ConnectionLostError or TimeoutError."""
        while True:
            event = reader.next_event()
            if event is not None:
                return event
            try:
                with anyio.fail_after(self.timeout):
                    data = await self.stream.receive(RECEIVE_BYTES)
            except TimeoutError:
                raise TimeoutError("no answer from the daemon in time") from None
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                raise ConnectionLostError("the daemon closed the connection before answering") from None
            reader.feed(data)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()


class AsyncStream(Streamed):
    """Text pieces of a streamed generation (`async for`), then the final `Reply`.

    As `Stream`: `async for` gives the text pieces (tool-call text included),
    `events()` every event map, `tool_calls` the calls parsed so far. `result` is
    the final `Reply` once the stream is exhausted (before that it raises
    RuntimeError); `await collect()` reads to the end and returns it. Closing
    early (`await aclose()`, or leaving an `async with` block) cancels the
    generation after its current token.
    """

    def __init__(self, client: AsyncClient, conn: AsyncConnection, reader: CallReader, decode: Decode) -> None:
        super().__init__()
        self._client, self._conn, self._reader, self._decode = client, conn, reader, decode
        self._result: Any = None
        self.finished = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> str:
        while (event := await self._next_event()) is not None:
            if "text" in event:
                return str(event["text"])
        raise StopAsyncIteration

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Every event map of the stream, in order (see `Stream`)."""
        while (event := await self._next_event()) is not None:
            yield event

    async def _next_event(self) -> dict[str, Any] | None:
        """The next event, or None once the result has come (or the stream was closed)."""
        if self.finished:
            return None
        try:
            event = await self._conn.next_event(self._reader)
        except KvwakeError:
            await self._finish(reusable=self._reader.done)
            raise
        except BaseException:
            await self._finish(reusable=False)
            raise
        if isinstance(event, Piece):
            self._record(event.event)
            return event.event
        self._result = self._decode(event.result) if self._decode else event.result
        await self._finish(reusable=True)
        return None

    async def _finish(self, *, reusable: bool) -> None:
        if not self.finished:
            self.finished = True
            await self._client._release(self._conn, reusable=reusable)

    @property
    def result(self) -> Any:
        if not self.finished:
            raise RuntimeError("the stream is not finished: iterate it to the end, or await collect()")
        return self._result

    async def collect(self) -> Any:
        """Read to the end; the final result."""
        async for _ in self.events():
            pass
        return self._result

    async def aclose(self) -> None:
        """Stop reading; an unfinished generation is cancelled (its connection is closed)."""
        await self._finish(reusable=False)

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncClient(ClientAPI):
    """Async client for the kvwake daemon: `Client`'s methods and options, awaited.

        async with AsyncClient() as client:
            session = await client.session("agent-1")
            reply = await session.chat("Hello")
    """

    def __init__(self, socket: str | os.PathLike[str] | None = None, *, timeout: float | None = None,
                 connect_timeout: float = 5.0, autostart: bool | None = None, autostart_timeout: float = 120.0,
                 max_idle: int = 4) -> None:
        self.socket = resolve_socket(socket)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.autostart = autostart_enabled() if autostart is None else autostart
        self.autostart_timeout, self.max_idle = autostart_timeout, max_idle
        self._idle: list[AsyncConnection] = []
        self._closed = False

    def __repr__(self) -> str:
        return f"AsyncClient({str(self.socket)!r})"

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close idle connections; streams still open keep theirs until they finish."""
        self._closed, idle, self._idle = True, self._idle, []
        for conn in idle:
            await conn.aclose()

    async def _connect(self) -> AsyncConnection:
        try:
            return await AsyncConnection.open(self.socket, timeout=self.timeout, connect_timeout=self.connect_timeout)
        except DaemonNotRunningError:
            if not self.autostart:
                raise
        await to_thread.run_sync(ensure_daemon, self.socket, self.autostart_timeout)
        return await AsyncConnection.open(self.socket, timeout=self.timeout, connect_timeout=self.connect_timeout)

    async def _checkout(self) -> tuple[AsyncConnection, bool]:
        if self._closed:
            raise ClientConnectionError("this client is closed")
        while self._idle:
            conn = self._idle.pop()
            if conn.alive():
                return conn, True
            await conn.aclose()
        return await self._connect(), False

    async def _release(self, conn: AsyncConnection, *, reusable: bool) -> None:
        if reusable and not self._closed and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            await conn.aclose()

    async def _send(self, method: str, params: dict[str, Any]) -> tuple[AsyncConnection, CallReader]:
        while True:
            conn, reused = await self._checkout()
            try:
                return conn, await conn.send(method, params)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                await conn.aclose()
                if not reused:
                    raise ConnectionLostError(f"connection to the daemon lost: {exc!r}") from None

    def _rpc(self, method: str, params: dict[str, Any], decode: Decode = None, stream: bool = False) -> Any:
        return self._stream(method, params, decode) if stream else self._call(method, params, decode)

    async def _stream(self, method: str, params: dict[str, Any], decode: Decode) -> AsyncStream:
        conn, reader = await self._send(method, params)
        return AsyncStream(self, conn, reader, decode)

    async def _call(self, method: str, params: dict[str, Any], decode: Decode) -> Any:
        conn, reader = await self._send(method, params)
        reusable = False
        try:
            while not isinstance(event := await conn.next_event(reader), Done):
                pass
            reusable = True
        except KvwakeError:
            reusable = reader.done
            raise
        finally:
            await self._release(conn, reusable=reusable)
        return decode(event.result) if decode else event.result
