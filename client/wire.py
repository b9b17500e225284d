"""The client's side of the wire, without any I/O: requests out, one call's replies in.

Both clients (sync `client.py`, async `aio.py`) use one connection per call in
flight, so everything read on a connection belongs to its current call:

    -> [0, msgid, method, params]                  the request
    <- [2, "stream", {"msgid": msgid, ...event}]   zero or more events (streaming calls):
                                                   {"text"}, {"text", "tool": true}, {"tool_call", "index"}
    <- [1, msgid, error, result]                   the response; the call is over
    <- [2, "error", {"code", "message"}]           broken framing: the server closes

`CallReader` turns the bytes read into `Piece`/`Done` events, and a server error
into its typed exception (kvwake.errors, one class per code).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kvwake.errors import KvwakeError, ProtocolError, error_for_code
from kvwake.protocol import NOTIFICATION, REQUEST, RESPONSE, FrameError, pack, parse, unpacker

__all__ = [
    "CallReader",
    "ClientConnectionError",
    "ConnectionLostError",
    "DaemonNotRunningError",
    "Done",
    "Piece",
    "Reply",
    "Streamed",
    "encode_request",
    "server_error",
]

RECEIVE_BYTES = 1 << 16


class ClientConnectionError(ConnectionError):
    """Base class: the client could not talk to the daemon."""


class DaemonNotRunningError(ClientConnectionError):
    """Nothing answers on the socket (no file, or nobody listening)."""

    def __init__(self, socket: str, reason: str = "") -> None:
        self.socket = socket
        detail = f" ({reason})" if reason else ""
        super().__init__(f"no daemon running at {socket}{detail}; start one with `kvwake serve`")


class ConnectionLostError(ClientConnectionError):
    """The daemon closed the connection before answering; the call may or may not have run."""


@dataclass(frozen=True)
class Reply:
    """What `generate` and `chat` return.

    text: the generated text, as generated (tool-call markup included); tokens: its token ids;
    finish_reason: "stop" (EOS or a stop string), "tool_calls" (stopped after parsed tool
    calls), "length" or "cancelled" (the daemon is stopping); usage: prompt/generated/
    reused/prefilled tokens, ttft_ms, tokens_per_s; append: for chat, what appending the
    messages did (tokens, prefilled, reused), else None; content: the text outside the tool
    calls that parsed; tool_calls: OpenAI's shape, [{"id", "type": "function", "function":
    {"name", "arguments" (JSON text)}}]; tool_call_errors: one line per call that did not
    parse (its text stays in content).
    """

    text: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    append: dict[str, Any] | None = None
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_call_errors: list[str] = field(default_factory=list)

    @classmethod
    def from_wire(cls, result: dict[str, Any]) -> Reply:
        """Build from the result map; keys this client does not know are ignored."""
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in result.items() if k in names}
        known.setdefault("content", known.get("text", ""))  # a daemon from before tool calls
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Piece:
    """A streamed event: the notification's map without its msgid (see the module docstring)."""

    event: dict[str, Any]


class Streamed:
    """What a stream (sync or async) has received so far: its text and its parsed tool calls."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []  # as they parsed, in order

    def _record(self, event: dict[str, Any]) -> None:
        if "text" in event:
            self._pieces.append(str(event["text"]))
        if "tool_call" in event:
            self.tool_calls.append(event["tool_call"])

    @property
    def text(self) -> str:
        """The text streamed so far (tool-call text included)."""
        return "".join(self._pieces)


@dataclass(frozen=True)
class Done:
    """The call's result map."""

    result: Any


def encode_request(msgid: int, method: str, params: dict[str, Any]) -> bytes:
    return pack([REQUEST, msgid, method, params])


def server_error(error: Any) -> KvwakeError:
    """The typed exception for a wire error map {"code", "message", "data"}."""
    if not isinstance(error, dict):
        return ProtocolError(f"malformed error from the daemon: {error!r}"[:500])
    code, message, data = error.get("code"), str(error.get("message", "")), error.get("data")
    try:
        return error_for_code(str(code), message, data)
    except TypeError:  # data keys that clash with the constructor's own argument names
        exc = error_for_code(str(code), message)
        exc.data = dict(data) if isinstance(data, dict) else {"detail": data}
        return exc


class CallReader:
    """Decodes the replies to one request: feed() bytes, then take events with next_event().

    Events are `Piece`s and finally one `Done`; a server error response is
    raised as its typed exception instead of `Done`. After either, `done` is
    true and the connection can carry another call. Broken framing (the
    server's "error" notification, bytes that are not msgpack-rpc) raises
    ProtocolError with `done` false: the connection is finished.
    """

    def __init__(self, msgid: int) -> None:
        self.msgid = msgid
        self.done = False
        self._decoder = unpacker()

    def feed(self, data: bytes) -> None:
        try:
            self._decoder.feed(data)
        except Exception as exc:  # BufferFull: a frame beyond the protocol's limits
            raise ProtocolError(f"unreadable reply from the daemon: {exc}") from None

    def next_event(self) -> Piece | Done | None:
        """The next event in the bytes fed so far, or None if more bytes are needed (or the call is over)."""
        while not self.done:
            try:
                obj = next(self._decoder)
            except StopIteration:
                return None
            except Exception as exc:  # bytes that are not msgpack
                raise ProtocolError(f"unreadable reply from the daemon: {exc}") from None
            event = self._event(obj)
            if event is not None:
                return event
        return None

    def _event(self, obj: Any) -> Piece | Done | None:
        try:
            msg = parse(obj)
        except FrameError as exc:
            raise ProtocolError(f"malformed reply from the daemon: {exc}") from None
        if msg.kind == NOTIFICATION:
            params = msg.params if isinstance(msg.params, dict) else {}
            if msg.method == "error":  # the server closes the connection after this; not done, not reusable
                raise server_error({"code": "PROTOCOL_ERROR", **params})
            if msg.method == "stream" and params.get("msgid") == self.msgid:
                return Piece({k: v for k, v in params.items() if k != "msgid"})
            return None  # notifications this client does not know are ignored
        if msg.kind == RESPONSE and msg.msgid == self.msgid:
            self.done = True
            if msg.error is not None:
                raise server_error(msg.error)
            return Done(msg.result)
        return None  # a stray response (a request we abandoned) is not ours
