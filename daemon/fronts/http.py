"""The OpenAI-compatible HTTP API: `kvwake serve --http [HOST:]PORT`, off by default.

Starlette on Hypercorn, in the daemon's own process and event loop, calling the
same SessionManager as the socket's RPC methods. Routes: `GET /v1/models`,
`POST /v1/chat/completions` and `POST /v1/completions` (streamed as
server-sent events when `stream` is true). Shapes: fronts/openai_shapes.py.

Access. The Unix socket admits only its owner's uid; a TCP port admits every
local user, and sessions hold private conversations. So every request needs
`Authorization: Bearer <token>`: the token is `--http-token` /
`KVWAKE_HTTP_TOKEN` when given, else generated once into `<data dir>/http-token`
(mode 0600, as Jupyter keeps its token), where `kvwake http` and
`kvwake.client.openai_config()` find it. `--http-no-token` turns the check
off, and only on a loopback address. A bare port binds 127.0.0.1.

Sessions. With `X-Kvwake-Session: ID` (or `kvwake_session` in the body) the
request runs in that session (created when new); its messages are the whole
conversation, which replaces the session's, and only tokens past the common
prefix are prefilled. Without one, fronts/matching.py picks the session. The
session used comes back in the `X-Kvwake-Session` response header and in the
body's `kvwake` object.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
from hypercorn.asyncio import serve
from hypercorn.config import Config
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvwake.daemon.sessions.manager import SessionManager
from kvwake.daemon.fronts.matching import Matcher
from kvwake.daemon.fronts.openai_shapes import ApiError, ChatRequest, CompletionRequest, Reply, error_body, from_kvwake
from kvwake.errors import BusyError, KvwakeError

__all__ = ["HttpTokenError", "bind", "make_app", "parse_address", "read_token", "run_http"]

log = logging.getLogger("kvwake.http")
SESSION_HEADER = "x-kvwake-session"
DISCONNECT_POLL_S = 0.25
MAX_BODY_BYTES = 32 << 20  # a million-token conversation as JSON fits; a bigger body is a 413, unread
MATCH_TRIES = 8  # a stateless request whose chosen session another took first is matched again


class HttpTokenError(RuntimeError):
    """The token file cannot be made or trusted."""


def parse_address(value: str) -> tuple[str, int]:
    """`PORT` (loopback) or `HOST:PORT` (IPv6 in brackets); raises ValueError."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--http {value!r}: expected PORT or HOST:PORT")
    return host, int(port)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def read_token(path: Path, *, create: bool) -> str:
    """The token in `path`: made once (0600) when `create`; refused if others may read it."""
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another process made it first: read theirs
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
    mode = path.stat().st_mode
    if mode & 0o077:
        raise HttpTokenError(f"{path} is readable by others (mode {oct(mode & 0o777)}); chmod 600 it")
    token = path.read_text().strip()
    if len(token) < 16:
        raise HttpTokenError(f"{path} holds no usable token (16 characters at least)")
    return token


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (made here, so a port 0 is known before the server starts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


class BearerAuth:
    """ASGI middleware: every HTTP request carries `Authorization: Bearer <token>` (compared in constant time)."""

    def __init__(self, app: Any, token: str | None) -> None:
        self.app, self.expected = app, token.encode() if token else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and self.expected is not None:
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            # The scheme is case-insensitive (RFC 9110); the token is compared in constant time.
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.expected)):
                body = error_body("missing or wrong bearer token (see `kvwake http`)", "invalid_request_error",
                                  code="invalid_api_key")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


class Api:
    """The routes, over one SessionManager."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager, self.matcher = manager, Matcher(manager)

    async def models(self, request: Request) -> Response:
        engine = self.manager.engine
        return JSONResponse({"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                                         "owned_by": "kvwake"}]})

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, ChatRequest.parse(await _body(request), _header(request)), True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, CompletionRequest.parse(await _body(request), _header(request)), False)

    async def _complete(self, request: Request, req: ChatRequest | CompletionRequest, chat: bool) -> Response:
        reply = Reply(self.manager.engine.model_name, chat, req.one_call)
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        loop, gone, called = asyncio.get_running_loop(), anyio.Event(), threading.Event()

        def on_event(event: dict[str, Any]) -> None:  # on the engine thread, as each piece becomes final
            if "tool_call" in event:
                called.set()
            if req.stream:
                loop.call_soon_threadsafe(events.put_nowait, event)

        stop = lambda: gone.is_set() or (req.one_call and called.is_set())  # noqa: E731
        session, task = await self._start(req, on_event if req.stream or req.one_call else None, stop)
        headers = {"X-Kvwake-Session": session["session_id"]}
        if not req.stream:
            return JSONResponse(reply.full(await _watch(request, task, gone), session), headers=headers)
        first = asyncio.ensure_future(events.get())
        await asyncio.wait([first, task], return_when=asyncio.FIRST_COMPLETED)
        if task.done() and task.exception() is not None and events.empty() and not first.done():
            first.cancel()
            task.result()  # failed before any output: a plain HTTP error is still possible
        return StreamingResponse(_sse(reply, first, events, task, gone, req.include_usage),
                                 media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})

    async def _start(self, req: ChatRequest | CompletionRequest, on_event: Callable | None,
                     cancelled: Callable[[], bool]) -> tuple[dict[str, Any], asyncio.Task]:
        """Pick the session and start the generation; a session another request took meanwhile is matched
        again. Parameters are checked first: a refused request makes no session."""
        m = self.manager
        m.check_params(req.params)
        prompt = await m.render(req.inputs())  # once: it picks the session, then it is what is appended
        for attempt in range(MATCH_TRIES):
            if req.session_id is not None:
                await m.create(req.session_id, exist_ok=True)
                session = {"session_id": req.session_id, "match": "named"}
            else:
                match = await self.matcher.find(prompt.target, prompt.mode)
                session = {"session_id": match.session_id, "match": match.how, "shared_tokens": match.shared_tokens}
            claimed = asyncio.Event()
            task = asyncio.ensure_future(m.generate(session["session_id"], req.params, on_event, cancelled, prompt,
                                                    claimed.set))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a departed client's: retrieved
            # Until it holds the session: a claim may wait for a prefix copy, then lose it to another request.
            waiting = asyncio.ensure_future(claimed.wait())
            try:
                await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiting.cancel()
            taken = not claimed.is_set() and not task.cancelled() and isinstance(task.exception(), BusyError)
            if taken and req.session_id is None and attempt < MATCH_TRIES - 1:
                continue
            task.add_done_callback(lambda _t, sid=session["session_id"]: self.matcher.remember(sid))
            return session, task
        raise AssertionError("unreachable")


async def _body(request: Request) -> dict[str, Any]:
    """The JSON object sent, at most MAX_BODY_BYTES (413 past that: refused before it is all read)."""
    too_big = ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > MAX_BODY_BYTES:
            raise too_big
    try:
        body = json.loads(data)
    except ValueError:
        raise ApiError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def _header(request: Request) -> str | None:
    return request.headers.get(SESSION_HEADER)


async def _watch(request: Request, task: asyncio.Task, gone: anyio.Event) -> dict[str, Any]:
    """Wait for a non-streamed result; a client that hangs up stops the generation."""
    while not task.done():
        await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            gone.set()
    return task.result()


def _sse_line(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _sse(reply: Reply, first: asyncio.Future, events: asyncio.Queue, task: asyncio.Task, gone: anyio.Event,
               include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: chunks as the engine makes them, the finish, usage if asked, then [DONE]."""
    pending = first
    try:
        if (head := reply.first()) is not None:
            yield _sse_line(head)
        while True:
            await asyncio.wait([pending, task], return_when=asyncio.FIRST_COMPLETED)
            if not pending.done():  # the call ended: what it queued is all there is
                pending.cancel()
                break
            if (chunk := reply.piece(pending.result())) is not None:
                yield _sse_line(chunk)
            pending = asyncio.ensure_future(events.get())
        while not events.empty():
            if (chunk := reply.piece(events.get_nowait())) is not None:
                yield _sse_line(chunk)
        try:
            result = task.result()
        except Exception as exc:  # the stream has begun: the error goes in it, as OpenAI streams do
            yield _sse_line(_stream_error(exc).body())
            return
        yield _sse_line(reply.last(result))
        if include_usage:
            yield _sse_line(reply.usage_chunk(result))
        yield "data: [DONE]\n\n"
    finally:
        pending.cancel()  # a client that left mid-wait leaves this queue read pending: end it, not leak it
        gone.set()  # the client left (or the stream ended): a running generation stops at its next token


def _stream_error(exc: Exception) -> ApiError:
    if isinstance(exc, KvwakeError):
        return from_kvwake(exc)
    log.error("generation failed mid-stream", exc_info=exc)
    return ApiError(500, f"internal error: {exc!r}", kind="server_error")


def make_app(manager: SessionManager, token: str | None) -> Any:
    api = Api(manager)

    async def api_error(request: Request, exc: Exception) -> Response:
        err = exc if isinstance(exc, ApiError) else from_kvwake(exc)  # type: ignore[arg-type]
        return JSONResponse(err.body(), status_code=err.status)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        return JSONResponse(error_body(str(getattr(exc, "detail", exc)), "invalid_request_error"), status_code=status)

    async def internal(request: Request, exc: Exception) -> Response:
        log.exception("http request failed", exc_info=exc)
        return JSONResponse(error_body(f"internal error: {exc!r}", "server_error"), status_code=500)

    app = Starlette(routes=[
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
    ], exception_handlers={ApiError: api_error, KvwakeError: api_error, HTTPException: http_error,
                           Exception: internal})
    return BearerAuth(app, token)


async def run_http(manager: SessionManager, sock: socket.socket, token: str | None, stop: anyio.Event) -> None:
    """Serve until `stop`; open streams get a few seconds to end (their generations stop with the daemon)."""
    config = Config()
    config.bind = [f"fd://{os.dup(sock.fileno())}"]  # Hypercorn closes the fd it is given; ours closes at exit
    config.accesslog = None
    config.errorlog = logging.getLogger("kvwake.http.server")  # JSON lines, as the daemon's own log
    config.graceful_timeout = 5.0
    config.keep_alive_timeout = 75.0
    await serve(make_app(manager, token), config, shutdown_trigger=stop.wait)
