"""kvwake.client: the Python client of the kvwake daemon, and the `kvwake` command.

    from kvwake.client import Client

    with Client() as client:                       # KVWAKE_SOCKET or the platform default
        session = client.session("agent-1", system="You are a helpful agent.")
        print(session.chat("Hello!").text)
        session.sleep()                            # KV to disk; memory freed

`AsyncClient` has the same methods, awaited. Server errors are raised as the
classes of kvwake.errors, one per code (NotFoundError for NOT_FOUND, ...).
Importing this package never imports mlx, numpy or the daemon.
"""

from __future__ import annotations

from kvwake.client.aio import AsyncClient, AsyncStream
from kvwake.client.api import ClientAPI, Session
from kvwake.client.client import Client, Stream
from kvwake.client.paths import openai_config, resolve_socket
from kvwake.client.wire import ClientConnectionError, ConnectionLostError, DaemonNotRunningError, Reply
from kvwake.errors import (
    BundleMismatchError,
    BusyError,
    CancelledError,
    CorruptBlockError,
    InternalError,
    InvalidParamsError,
    KvwakeError,
    NotFoundError,
    ProtocolError,
    StorageFullError,
    UnknownMethodError,
)

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "BundleMismatchError",
    "BusyError",
    "CancelledError",
    "Client",
    "ClientAPI",
    "ClientConnectionError",
    "ConnectionLostError",
    "CorruptBlockError",
    "DaemonNotRunningError",
    "InternalError",
    "InvalidParamsError",
    "KvwakeError",
    "NotFoundError",
    "ProtocolError",
    "Reply",
    "Session",
    "StorageFullError",
    "Stream",
    "UnknownMethodError",
    "openai_config",
    "resolve_socket",
]
