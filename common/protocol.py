"""msgpack-rpc wire format, as neovim uses it, and kvwake's protocol constants.

Every message is one msgpack array, sent back to back on the stream:

    request       [0, msgid, method, params]     msgid: uint32, method: str, params: map
    response      [1, msgid, error, result]      exactly one of error / result is nil
    notification  [2, method, params]

What kvwake sends is exactly that. What it accepts is what the msgpack-rpc
spec and its clients send (pynvim, the Node and Go libraries): a method name
as str or UTF-8 bin, and params as the map itself, as an array holding that
one map, or as nil / an empty array for none (`request_params`).

Errors are maps {"code": str, "message": str, "data": any}. Output a request
streams (generated text) arrives as notifications
[2, "stream", {"msgid": <request id>, ...}] before that request's response.

Shared by the server and the client; imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from kvwake.errors import InvalidParamsError

__all__ = [
    "LIMITS",
    "NOTIFICATION",
    "PROTOCOL_VERSION",
    "REQUEST",
    "RESPONSE",
    "FrameError",
    "Limits",
    "Message",
    "pack",
    "parse",
    "request_params",
    "unpacker",
]

PROTOCOL_VERSION = 1
REQUEST, RESPONSE, NOTIFICATION = 0, 1, 2
MAX_MSGID = 2**32 - 1


@dataclass(frozen=True)
class Limits:
    """Bounds on what a peer may send; a frame beyond them closes the connection."""

    frame_bytes: int = 64 << 20  # one message, encoded
    str_len: int = 16 << 20
    bin_len: int = 64 << 20
    array_len: int = 1 << 20  # token id lists up to a million tokens
    map_len: int = 1 << 12
    ext_len: int = 0  # no msgpack extension types at all


LIMITS = Limits()


class FrameError(Exception):
    """A decoded message that is not msgpack-rpc. `msgid` is the request's id when one could be
    read (the peer can be answered), else None."""

    def __init__(self, message: str, msgid: int | None = None) -> None:
        super().__init__(message)
        self.msgid = msgid


@dataclass(frozen=True)
class Message:
    kind: int
    msgid: int | None
    method: str | None
    params: Any
    error: Any = None
    result: Any = None


def unpacker(limits: Limits = LIMITS) -> msgpack.Unpacker:
    """A streaming decoder: feed() bytes, iterate complete messages."""
    return msgpack.Unpacker(
        raw=False, strict_map_key=True, use_list=True,
        max_buffer_size=limits.frame_bytes, max_str_len=limits.str_len, max_bin_len=limits.bin_len,
        max_array_len=limits.array_len, max_map_len=limits.map_len, max_ext_len=limits.ext_len,
    )


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _msgid(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_MSGID:
        raise FrameError(f"msgid must be a uint32, got {value!r}"[:200])
    return value


def _method(value: Any, msgid: int | None) -> str:
    """A method name: str, or bin holding UTF-8 (pynvim sends its own notifications' names as bin)."""
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise FrameError("method name is bin but not UTF-8", msgid) from None
    if not isinstance(value, str):
        raise FrameError(f"method name must be a str or bin, got {type(value).__name__}", msgid)
    return value


def parse(obj: Any) -> Message:
    """Check the shape of a decoded message; FrameError when it is not msgpack-rpc."""
    if not isinstance(obj, list) or not obj or type(obj[0]) is not int or obj[0] not in (REQUEST, RESPONSE,
                                                                                          NOTIFICATION):
        raise FrameError("message must be an array starting with 0, 1 or 2")
    kind = obj[0]
    if kind == REQUEST:
        msgid = _msgid(obj[1] if len(obj) > 1 else None)
        if len(obj) != 4:
            raise FrameError("request must be [0, msgid, method, params]", msgid)
        return Message(kind, msgid, _method(obj[2], msgid), obj[3])
    if kind == RESPONSE:
        if len(obj) != 4:
            raise FrameError("response must be [1, msgid, error, result]")
        return Message(kind, _msgid(obj[1]), None, None, error=obj[2], result=obj[3])
    if len(obj) != 3:
        raise FrameError("notification must be [2, method, params]")
    return Message(kind, None, _method(obj[1], None), obj[2])


def request_params(params: Any) -> dict[str, Any]:
    """A request's params as the map methods take: a map, [map], or nil / [] for none.

    Raises InvalidParamsError for anything else (positional arguments, several
    maps) and for param names that are not strings.
    """
    if isinstance(params, list) and len(params) <= 1:
        params = params[0] if params else None
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InvalidParamsError("params must be a map, or an array holding one map "
                                 f"(got {type(params).__name__}{_length(params)})")
    if not all(isinstance(k, str) for k in params):
        raise InvalidParamsError("param names must be strings")
    return params


def _length(value: Any) -> str:
    return f" of {len(value)}" if isinstance(value, list) else ""
