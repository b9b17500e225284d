"""The blocking client: `Client`, and `Stream` for streamed generation.

Threads: a `Client` may be shared by any number of threads. Each call checks
out a connection of its own from a small pool (opening a new one when none is
idle) and returns it when the call is over, so calls from several threads run
concurrently on the daemon; nothing is serialized behind a lock but the pool
itself. A `Stream` holds its connection until it is exhausted or closed.

Reconnection: a pooled connection the daemon has closed (it restarted, or it
dropped an idle peer) is noticed before it is reused and replaced by a new
one, so the next call after a daemon restart just works. A request is resent
only when it provably never reached the daemon (the send itself failed on a
reused connection); a connection lost while waiting for the answer raises
`ConnectionLostError`, since the call may have run (chat is not idempotent).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from kvwake.client.api import ClientAPI, Decode
from kvwake.client.autostart import autostart_enabled, ensure_daemon
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

__all__ = ["Client", "Stream"]

MAX_MSGID = 2**32 - 1


def connect_error(path: Path, exc: OSError) -> ClientConnectionError:
    """The user-facing error for a failed connect()."""
    if isinstance(exc, (FileNotFoundError, ConnectionRefusedError)):
        return DaemonNotRunningError(str(path))
    if isinstance(exc, PermissionError):
        return ClientConnectionError(f"permission denied on {path}: the daemon serves its owner's uid "
                                     "(and allow_uids) only")
    return ClientConnectionError(f"cannot connect to {path}: {exc}")


class Connection:
    """One Unix socket to the daemon, carrying one call at a time."""

    def __init__(self, path: Path, *, timeout: float | None, connect_timeout: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(connect_timeout)
            self.sock.connect(str(path))
        except OSError as exc:
            self.sock.close()
            raise connect_error(path, exc) from None
        self.sock.settimeout(timeout)
        self.timeout = timeout
        self.msgid = 0

    def alive(self) -> bool:
        """Whether this idle connection can carry a call: open, and nothing unread on it.

        The daemon closing its end (a restart) makes the socket readable with EOF.
        """
        self.sock.setblocking(False)  # a timeout would make recv wait for data first
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return True  # nothing to read: the normal idle state
        except OSError:
            return False
        finally:
            self.sock.settimeout(self.timeout)
        return False  # EOF, or bytes no call is waiting for

    def send(self, method: str, params: dict[str, Any]) -> CallReader:
        self.msgid = self.msgid % MAX_MSGID + 1
        self.sock.sendall(encode_request(self.msgid, method, params))
        return CallReader(self.msgid)

    def events(self, reader: CallReader) -> Iterator[Piece | Done]:
        """The call's events until Done; raises its server error, or ConnectionLostError."""
        while not reader.done:
            event = reader.next_event()
            if event is not None:
                yield event
                continue
            try:
                data = self.sock.recv(RECEIVE_BYTES)
            except TimeoutError:
                raise TimeoutError("no answer from the daemon in time") from None
            except OSError as exc:
                raise ConnectionLostError(f"connection to the daemon lost: {exc}") from None
            if not data:
                raise ConnectionLostError("the daemon closed the connection before answering")
            reader.feed(data)

    def close(self) -> None:
        self.sock.close()


class Stream(Streamed):
    """Text pieces of a streamed generation, as they come; the final `Reply` at the end.

    Iterate it for the text pieces (tool-call text included, so joined they are
    `result.text`), or iterate `events()` for every event map: {"text"} for content,
    {"text", "tool": True} for tool-call text, {"tool_call", "index"} when a call has
    parsed. `text` is what has been streamed so far, `tool_calls` the calls parsed so far;
    `result` is the final `Reply` (reading it drains any events not yet read). Closing
    it early (`close()`, or leaving a `with` block) cancels the generation after its
    current token; the tokens generated so far stay in the session.
    """

    def __init__(self, client: Client, conn: Connection, reader: CallReader, decode: Decode) -> None:
        super().__init__()
        self._client, self._conn, self._reader, self._decode = client, conn, reader, decode
        self._events = conn.events(reader)
        self._result: Any = None
        self.finished = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        while (event := self._next_event()) is not None:
            if "text" in event:
                return str(event["text"])
        raise StopIteration

    def events(self) -> Iterator[dict[str, Any]]:
        """Every event map of the stream, in order (see the class docstring)."""
        while (event := self._next_event()) is not None:
            yield event

    def _next_event(self) -> dict[str, Any] | None:
        """The next event, or None once the result has come (or the stream was closed)."""
        if self.finished:
            return None
        try:
            for event in self._events:
                if isinstance(event, Piece):
                    self._record(event.event)
                    return event.event
                self._result = self._decode(event.result) if self._decode else event.result
        except KvwakeError:
            self._finish(reusable=self._reader.done)  # a server error leaves the connection usable
            raise
        except BaseException:
            self._finish(reusable=False)
            raise
        self._finish(reusable=True)
        return None

    def _finish(self, *, reusable: bool) -> None:
        if not self.finished:
            self.finished = True
            self._client._release(self._conn, reusable=reusable)

    @property
    def result(self) -> Any:
        for _ in self.events():
            pass
        return self._result

    def collect(self) -> Any:
        """Read to the end; the final result (as `result`)."""
        return self.result

    def close(self) -> None:
        """Stop reading; an unfinished generation is cancelled (its connection is closed)."""
        self._finish(reusable=False)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "finished", True):
            self._conn.close()


class Client(ClientAPI):
    """Blocking client for the kvwake daemon; every method is documented on `ClientAPI`.

    socket: the daemon's Unix socket; default KVWAKE_SOCKET, then the config
      file's `socket`, then the platform default.
    timeout: seconds to wait for any one read from the daemon (None: no limit;
      generation can take long).
    connect_timeout: seconds to wait for a connection.
    autostart: start `kvwake serve` in the background when no daemon answers
      (default: KVWAKE_AUTOSTART); autostart_timeout bounds the wait for it.
    max_idle: connections kept open for reuse.

    Safe to share between threads (see the module docstring); a child process
    made by fork() opens connections of its own. Use it as a context manager,
    or call `close()`. Raises ValueError if the config file it would read the
    socket from is not valid TOML.
    """

    def __init__(self, socket: str | os.PathLike[str] | None = None, *, timeout: float | None = None,
                 connect_timeout: float = 5.0, autostart: bool | None = None, autostart_timeout: float = 120.0,
                 max_idle: int = 4) -> None:
        self.socket = resolve_socket(socket)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.autostart = autostart_enabled() if autostart is None else autostart
        self.autostart_timeout, self.max_idle = autostart_timeout, max_idle
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"Client({str(self.socket)!r})"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close idle connections; streams still open keep theirs until they finish."""
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for conn in idle:
            conn.close()

    # -- connections ----------------------------------------------------------

    def _connect(self) -> Connection:
        try:
            return Connection(self.socket, timeout=self.timeout, connect_timeout=self.connect_timeout)
        except DaemonNotRunningError:
            if not self.autostart:
                raise
        ensure_daemon(self.socket, self.autostart_timeout)
        return Connection(self.socket, timeout=self.timeout, connect_timeout=self.connect_timeout)

    def _checkout(self) -> tuple[Connection, bool]:
        """An idle live connection (reused=True), or a new one."""
        if self._closed:
            raise ClientConnectionError("this client is closed")
        if os.getpid() != self._pid:  # a forked child must not share the parent's sockets
            self._idle, self._lock, self._pid = [], threading.Lock(), os.getpid()
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect(), False
            if conn.alive():
                return conn, True
            conn.close()  # the daemon went away (restart): drop it, try the next

    def _release(self, conn: Connection, *, reusable: bool) -> None:
        with self._lock:
            if reusable and not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def _send(self, method: str, params: dict[str, Any]) -> tuple[Connection, CallReader]:
        while True:
            conn, reused = self._checkout()
            try:
                return conn, conn.send(method, params)
            except OSError as exc:
                conn.close()
                if not reused or isinstance(exc, TimeoutError):  # fresh, or maybe partly sent: give up
                    raise ConnectionLostError(f"connection to the daemon lost: {exc}") from None
                # A reused one the daemon closed under us: the request never left; resend on a new one.

    def _rpc(self, method: str, params: dict[str, Any], decode: Decode = None, stream: bool = False) -> Any:
        conn, reader = self._send(method, params)
        if stream:
            return Stream(self, conn, reader, decode)
        result, reusable = None, False
        try:
            for event in conn.events(reader):
                if isinstance(event, Done):
                    result = event.result
            reusable = True
        except KvwakeError:
            reusable = reader.done  # a server error leaves the connection usable
            raise
        finally:
            self._release(conn, reusable=reusable)
        return decode(result) if decode else result
