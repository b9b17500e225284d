"""Error codes shared by the daemon, the store and the client.

Every failure that crosses a boundary (RPC, CLI, store API) is a `KvwakeError`
carrying one of the stable codes below. The wire form is
`{"code": CODE, "message": str, "data": any}`; `data` holds the facts (which
session, which snapshot, which block, which hash) as a plain map.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CODES",
    "KvwakeError",
    "NotFoundError",
    "InvalidParamsError",
    "UnknownMethodError",
    "ProtocolError",
    "BusyError",
    "BundleMismatchError",
    "CorruptBlockError",
    "StorageFullError",
    "CancelledError",
    "InternalError",
    "RemoteUnavailableError",
    "ContextTooLongError",
    "error_for_code",
]


class KvwakeError(Exception):
    """Base class: a failure with a stable code, a message and its facts."""

    code = "INTERNAL"

    def __init__(self, message: str, **data: Any) -> None:
        super().__init__(message)
        self.message = message
        self.data = data

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "data": self.data}


class NotFoundError(KvwakeError):
    """A session, snapshot or block that does not exist."""

    code = "NOT_FOUND"


class InvalidParamsError(KvwakeError):
    """Parameters of the wrong type, range or shape; also unreadable import files."""

    code = "INVALID_PARAMS"


class UnknownMethodError(KvwakeError):
    """An RPC method name the server does not know."""

    code = "UNKNOWN_METHOD"


class ProtocolError(KvwakeError):
    """A frame that is not valid msgpack-rpc."""

    code = "PROTOCOL_ERROR"


class BusyError(KvwakeError):
    """The session is already running an operation."""

    code = "BUSY"


class BundleMismatchError(KvwakeError):
    """A snapshot or block computed with another model bundle than expected."""

    code = "BUNDLE_MISMATCH"


class CorruptBlockError(KvwakeError):
    """A block or tail whose bytes, digest or identity do not check out."""

    code = "CORRUPT_BLOCK"


class StorageFullError(KvwakeError):
    """The disk (or the store's budget) has no room for a write."""

    code = "STORAGE_FULL"


class CancelledError(KvwakeError):
    """The operation was cancelled (client gone, shutdown)."""

    code = "CANCELLED"


class RemoteUnavailableError(KvwakeError):
    """The shared tier (S3) could not be reached, refused the credentials, or is not configured."""

    code = "REMOTE_UNAVAILABLE"


class ContextTooLongError(KvwakeError):
    """A prompt that does not fit the model's context (with room for one generated token)."""

    code = "CONTEXT_TOO_LONG"


class InternalError(KvwakeError):
    """A bug: anything not covered by another code."""

    code = "INTERNAL"


_BY_CODE: dict[str, type[KvwakeError]] = {
    cls.code: cls
    for cls in (
        NotFoundError,
        InvalidParamsError,
        UnknownMethodError,
        ProtocolError,
        BusyError,
        BundleMismatchError,
        CorruptBlockError,
        StorageFullError,
        CancelledError,
        RemoteUnavailableError,
        ContextTooLongError,
        InternalError,
    )
}

CODES: tuple[str, ...] = tuple(_BY_CODE)


def error_for_code(code: str, message: str, data: Any = None) -> KvwakeError:
    """Rebuild a typed error from its wire form (unknown codes become INTERNAL)."""
    cls = _BY_CODE.get(code, InternalError)
    return cls(message, **(data if isinstance(data, dict) else {"detail": data}))
