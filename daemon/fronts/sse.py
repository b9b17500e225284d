"""Server-sent events of the three APIs, and the loop that streams a generation as them.

`OpenAiEvents`, `AnthropicEvents` and `ResponsesEvents` turn one request's
stream (engine events, the result, or an error) into SSE text through its API's
shapes; `stream` sends them as the engine makes them. Used by fronts/http.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio

from kvwake.daemon.fronts import anthropic_shapes
from kvwake.daemon.fronts.anthropic_shapes import MessagesReply
from kvwake.daemon.fronts.openai_shapes import ApiError, Reply, from_kvwake
from kvwake.daemon.fronts.responses_shapes import ResponsesReply
from kvwake.errors import KvwakeError

__all__ = ["KEEPALIVE", "AnthropicEvents", "NamedEvents", "OpenAiEvents", "ResponsesEvents", "stream", "stream_error"]

log = logging.getLogger("kvwake.http")
Keep = Callable[[dict[str, Any], str, int], Awaitable[None]]


def _data(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class OpenAiEvents:
    """OpenAI's server-sent events over a Reply: `data:` lines, the usage chunk if asked, `[DONE]` last."""

    def __init__(self, reply: Reply, include_usage: bool) -> None:
        self.reply, self.include_usage = reply, include_usage

    def opening(self) -> list[str]:
        return [_data(head)] if (head := self.reply.first()) is not None else []

    def piece(self, event: dict[str, Any]) -> list[str]:
        return [_data(chunk)] if (chunk := self.reply.piece(event)) is not None else []

    def closing(self, result: dict[str, Any]) -> list[str]:
        usage = [_data(self.reply.usage_chunk(result))] if self.include_usage else []
        return [_data(self.reply.last(result)), *usage, "data: [DONE]\n\n"]

    def failure(self, err: ApiError) -> list[str]:
        return [_data(err.body())]  # as OpenAI streams do: the error object, and no [DONE]

    async def kept(self) -> None:
        """Awaited once the reply is finished (closing, or the whole reply made), before it is sent."""


class NamedEvents:
    """Server-sent events each named (`event:`) by its data's type, over a reply that makes them
    (`piece`, `last`): Anthropic's and the Responses API's."""

    def __init__(self, reply: MessagesReply | ResponsesReply) -> None:
        self.reply = reply

    def opening(self) -> list[str]:
        return []

    def piece(self, event: dict[str, Any]) -> list[str]:
        return _lines(self.reply.piece(event))

    def closing(self, result: dict[str, Any]) -> list[str]:
        return _lines(self.reply.last(result))

    async def kept(self) -> None:
        """Awaited once the reply is finished (closing, or the whole reply made), before it is sent."""


class AnthropicEvents(NamedEvents):
    """Anthropic's server-sent events over a MessagesReply."""

    def failure(self, err: ApiError) -> list[str]:
        return _lines([anthropic_shapes.error_body(err)[1]])


class ResponsesEvents(NamedEvents):
    """The Responses API's server-sent events over a ResponsesReply, each with its `sequence_number`;
    a failure is `response.failed`, then `error`. `keep(response, session_id, position)`, when given,
    stores the finished response before it is sent."""

    def __init__(self, reply: ResponsesReply, keep: Keep | None = None) -> None:
        super().__init__(reply)
        self.keep = keep

    def failure(self, err: ApiError) -> list[str]:
        return _lines(self.reply.failure(err))  # type: ignore[union-attr]

    async def kept(self) -> None:
        reply = self.reply
        assert isinstance(reply, ResponsesReply) and reply.final is not None and reply.session is not None
        if self.keep is not None:
            await self.keep(reply.final, reply.session["session_id"], reply.position)


def _lines(events: list[dict[str, Any]]) -> list[str]:
    return [f"event: {e['type']}\n{_data(e)}" for e in events]


KEEPALIVE = ": keepalive\n\n"  # an SSE comment: every client's parser skips it (the spec's own keep-alive)


async def stream(shape: OpenAiEvents | NamedEvents, first: asyncio.Future, events: asyncio.Queue,
                 task: asyncio.Task, gone: anyio.Event, keepalive_s: float | None = None) -> AsyncIterator[str]:
    """Server-sent events: what the engine makes as it makes it, then the closing events (or the error).
    While nothing comes for `keepalive_s` (a long prefill, before Anthropic's message_start can be sent),
    a comment line keeps proxies and clients' read timeouts from closing the connection."""
    pending = first
    try:
        for line in shape.opening():
            yield line
        while True:
            done, _ = await asyncio.wait([pending, task], timeout=keepalive_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                yield KEEPALIVE
                continue
            if not pending.done():  # the call ended: what it queued is all there is
                pending.cancel()
                break
            for line in shape.piece(pending.result()):
                yield line
            pending = asyncio.ensure_future(events.get())
        while not events.empty():
            for line in shape.piece(events.get_nowait()):
                yield line
        try:
            result = task.result()
        except Exception as exc:  # the stream has begun: the error goes in it
            for line in shape.failure(stream_error(exc)):
                yield line
            return
        lines = shape.closing(result)
        await shape.kept()
        for line in lines:
            yield line
    finally:
        pending.cancel()  # a client that left mid-wait leaves this queue read pending: end it, not leak it
        gone.set()  # the client left (or the stream ended): a running generation stops at its next token


def stream_error(exc: Exception) -> ApiError:
    """A failure once a stream is open, as the error its API's shape sends (an unforeseen one logged, a 500)."""
    if isinstance(exc, KvwakeError):
        return from_kvwake(exc)
    log.error("generation failed mid-stream", exc_info=exc)
    return ApiError(500, f"internal error: {exc!r}", kind="server_error")
