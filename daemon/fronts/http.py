"""The OpenAI- and Anthropic-compatible HTTP API: `kvwake serve --http [HOST:]PORT`, off by default.

Starlette on Hypercorn, in the daemon's own process and event loop, calling the
same SessionManager as the socket's RPC methods. Routes: `GET /v1/models` (and
`/v1/models/{id}`), `POST /v1/chat/completions` and `POST /v1/completions`
(OpenAI's; shapes: fronts/openai_shapes.py), `POST /v1/messages` and
`POST /v1/messages/count_tokens` (Anthropic's; shapes: fronts/anthropic_shapes.py),
`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`
(OpenAI's Responses API; shapes: fronts/responses_shapes.py, stored responses: sessions/responses.py),
streamed as server-sent events when `stream` is true. The APIs run one request
path (`Api._complete`); they differ only in their shapes. Errors come in
Anthropic's shape on its routes and wherever an `anthropic-version` header is
sent (so `/v1/models` answers Anthropic's clients in theirs), else in OpenAI's.

Access (the token, its check, the address and socket): fronts/http_access.py.

Sessions. With `X-Kvwake-Session: ID` (or `kvwake_session` in the body) the
request runs in that session (created when new); its messages are the whole
conversation, which replaces the session's, and only tokens past the common
prefix are prefilled. Without one, sessions/matching.py picks the session. The
session used comes back in the `X-Kvwake-Session` response header and in the
body's `kvwake` object.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from hypercorn.asyncio import serve
from hypercorn.config import Config
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvwake.daemon.model.registry import ModelSpec, UnknownModelError
from kvwake.daemon.sessions.manager import SessionManager
from kvwake.daemon.fronts.http_access import BearerAuth, anthropic_client, refusal
from kvwake.daemon.fronts.anthropic_shapes import MessagesReply, MessagesRequest, model_info
from kvwake.daemon.fronts.openai_shapes import ApiError, ChatRequest, CompletionRequest, Reply, from_kvwake
from kvwake.daemon.fronts.responses_items import item_page
from kvwake.daemon.fronts.responses_shapes import ResponsesReply, ResponsesRequest
from kvwake.daemon.fronts.sse import (
    KEEPALIVE, AnthropicEvents, NamedEvents, OpenAiEvents, ResponsesEvents, stream, stream_error,
)
from kvwake.daemon.sessions.matching import Matcher
from kvwake.daemon.sessions.responses import ResponseRecord, ResponseRecords
from kvwake.errors import KvwakeError, NotFoundError

__all__ = ["Api", "make_app", "run_http"]

log = logging.getLogger("kvwake.http")
SESSION_HEADER = "x-kvwake-session"
DISCONNECT_POLL_S = 0.25
MAX_BODY_BYTES = 32 << 20  # a million-token conversation as JSON fits; a bigger body is a 413, unread


class Api:
    """The routes, over one SessionManager."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager, self.matcher, self.records = manager, Matcher(manager), ResponseRecords(manager)
        self.drop_system = manager.settings.anthropic_drop_system
        self.keepalive_s, self.hosted = manager.settings.http_keepalive_s, manager.settings.http_hosted_tools

    def _names(self) -> list[tuple[str, bool]]:
        """Every model served, by each of its names (its own, then its aliases), and whether it is loaded."""
        registry = self.manager.registry
        return [(n, self.manager.is_loaded(spec.name)) for spec in registry for n in registry.names(spec)]

    def _model(self) -> str:
        """The name replies give: the model the request runs on (the scope `_serving` opened)."""
        return self.manager.model_name()

    def _serving(self, requested: Any) -> Any:
        """The request's model, loaded (first, if it is not) and the model of its operations while the block
        runs (sessions/models.py); a 404 in the API's own shape for a name no model served answers to (with one
        model and no aliases configured, every name is that model)."""
        return self.manager.use(self._spec(requested).name)

    async def _on_model(self, spec: ModelSpec, streamed: bool, respond: Callable[[], Awaitable[Response]],
                        shape: Callable[[], OpenAiEvents | NamedEvents]) -> Response:
        """`respond()` with `spec`'s model loaded, the model of its operations. A streamed request whose model
        is not loaded opens its stream at once and sends keep-alive comments while the model loads (as during
        a long prefill), then the reply's own stream; a failure before that goes in the stream, in the API's
        shape (`shape().failure`). Such a stream has no X-Kvwake-Session header (its session is chosen after
        the headers went); the conversation's next request finds its session by matching, as always."""
        if not streamed or self.manager.is_loaded(spec.name):
            async with self.manager.use(spec.name):
                return await respond()
        return StreamingResponse(self._after_load(spec.name, respond, shape), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _after_load(self, name: str, respond: Callable[[], Awaitable[Response]],
                          shape: Callable[[], OpenAiEvents | NamedEvents]) -> AsyncIterator[str | bytes]:
        async def run() -> Response:  # in `use` from the start: counted as waiting, so no other load unloads
            async with self.manager.use(name):  # its model between its load and its turn
                return await respond()

        loading = asyncio.ensure_future(run())  # the load itself goes on if the client leaves (`ensure` shields it)
        try:
            while not loading.done():
                if not (await asyncio.wait([loading], timeout=self.keepalive_s))[0]:
                    yield KEEPALIVE
            response = loading.result()
        except Exception as exc:  # the stream is open: the failure goes in it
            for line in shape().failure(exc if isinstance(exc, ApiError) else stream_error(exc)):
                yield line
            return
        finally:
            loading.cancel()
        async for chunk in response.body_iterator:  # type: ignore[attr-defined]
            yield chunk

    def _spec(self, requested: Any) -> ModelSpec:
        """The model `requested` names; a 404 (OpenAI's `model_not_found`, Anthropic's `not_found_error`)."""
        try:
            return self.manager.registry.resolve(requested)
        except UnknownModelError as exc:
            raise ApiError(404, exc.message, param="model", code="model_not_found", kind="not_found_error") from None

    async def models(self, request: Request) -> Response:
        if "anthropic-version" in request.headers:
            data = [{**model_info(name), "loaded": loaded} for name, loaded in self._names()]
            return JSONResponse({"data": data, "has_more": False, "first_id": data[0]["id"], "last_id": data[-1]["id"]})
        return JSONResponse({"object": "list", "data": [_openai_model(name, loaded) for name, loaded in self._names()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model_id"]
        loaded = self.manager.is_loaded(self._spec(name).name)  # a 404 for a name not served; nothing loads
        info = model_info(name) if "anthropic-version" in request.headers else _openai_model(name, loaded)
        return JSONResponse({**info, "loaded": loaded})

    async def chat(self, request: Request) -> Response:
        body = await _body(request)
        spec = self._spec(body.get("model"))
        req = ChatRequest.parse(body, _header(request))
        shape = lambda: OpenAiEvents(Reply(spec.name, True, req.one_call), req.include_usage)  # noqa: E731
        return await self._on_model(spec, req.stream, lambda: self._complete(request, req, shape()), shape)

    async def completions(self, request: Request) -> Response:
        body = await _body(request)
        spec = self._spec(body.get("model"))
        req = CompletionRequest.parse(body, _header(request))
        shape = lambda: OpenAiEvents(Reply(spec.name, False), req.include_usage)  # noqa: E731
        return await self._on_model(spec, req.stream, lambda: self._complete(request, req, shape()), shape)

    async def messages(self, request: Request) -> Response:
        req = MessagesRequest.parse(await _body(request), _header(request), self.drop_system)
        spec = self._spec(req.model)
        shape = lambda: AnthropicEvents(MessagesReply(spec.name, req.one_call, req.thinking))  # noqa: E731
        return await self._on_model(spec, req.stream, lambda: self._complete(request, req, shape()), shape)

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens, rendered as /v1/messages renders it (nothing runs, no session is made)."""
        req = MessagesRequest.parse(await _body(request), _header(request), self.drop_system, counting=True)
        async with self._serving(req.model):
            return JSONResponse({"input_tokens": len((await self.manager.render(req.inputs())).target)})

    async def responses(self, request: Request) -> Response:
        body = await _body(request)
        spec = self._spec(body.get("model"))
        req = ResponsesRequest.parse(body, _header(request), self.hosted)
        return await self._on_model(spec, req.stream, lambda: self._respond(request, req),
                                    lambda: ResponsesEvents(ResponsesReply(spec.name, req)))

    async def _respond(self, request: Request, req: ResponsesRequest) -> Response:
        """A Responses request, parsed, under its model's scope."""
        if req.offered.omitted:
            log.info("responses: OpenAI's built-in tools left out of the prompt (http_hosted_tools = omit): %s",
                     ", ".join(req.offered.omitted))
        if req.previous_response_id is not None:
            before = await self._stored(req.previous_response_id, "previous_response_id")
            earlier = None if before.input_items is None else [*before.input_items, *before.response["output"]]
            req = req.following(before.conversation, before.session_id, before.position, earlier)
        reply = ResponsesReply(self._model(), req)

        async def keep(response: dict[str, Any], session_id: str, position: int) -> None:
            await self.records.put(ResponseRecord(reply.id, session_id, position, req.recorded(response), response,
                                                  req.input_items))

        omitted = {"X-Kvwake-Omitted-Tools": ", ".join(req.offered.omitted)} if req.offered.omitted else {}
        return await self._complete(request, req, ResponsesEvents(reply, keep if req.store else None), chosen=reply,
                                    headers=omitted)

    async def stored_response(self, request: Request) -> Response:
        return JSONResponse((await self._stored(request.path_params["response_id"])).response)

    async def input_items(self, request: Request) -> Response:
        record = await self._stored(request.path_params["response_id"])
        if record.input_items is None:
            raise ApiError(404, f"Response {record.id!r} was stored before its input items were kept.",
                           kind="not_found_error")
        return JSONResponse(item_page(record.input_items, request.query_params))

    async def delete_response(self, request: Request) -> Response:
        record = await self._stored(request.path_params["response_id"])
        await self.records.delete(record.id)
        return JSONResponse({"id": record.id, "object": "response", "deleted": True})

    async def _stored(self, response_id: str, param: str | None = None) -> ResponseRecord:
        """A stored response; a 404 (a 400 naming `param`, in a request that refers to one) when none has the id."""
        try:
            return await self.records.get(response_id)
        except NotFoundError:
            message = f"Response with id {response_id!r} not found."
            if param is None:
                raise ApiError(404, message, kind="not_found_error") from None
            raise ApiError(400, f"Previous response with id {response_id!r} not found.", param=param,
                           code="previous_response_not_found") from None

    async def _complete(self, request: Request, req: Any, shape: OpenAiEvents | NamedEvents,
                        chosen: ResponsesReply | None = None, headers: dict[str, str] | None = None) -> Response:
        """One generation, for any of the APIs: `req` is a parsed request, `shape` makes its responses;
        `chosen` is told the session once it is chosen; `headers` go with the response."""
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        loop, gone, called = asyncio.get_running_loop(), anyio.Event(), threading.Event()

        def on_event(event: dict[str, Any]) -> None:  # on the engine thread, as each piece becomes final
            if "tool_call" in event:
                called.set()
            if req.stream:
                self.manager.post(loop, events.put_nowait, event)  # one loop hop per decode step

        # Streamed: the prompt's counts, once it is in the cache, open the stream (Anthropic's message_start).
        on_append = (lambda counts: events.put_nowait({"append": counts})) if req.stream else None
        stop = lambda: gone.is_set() or (req.one_call and called.is_set())  # noqa: E731
        session, task = await self._start(req, on_event if req.stream or req.one_call else None, stop, on_append)
        if chosen is not None:
            chosen.session = session
        headers = {"X-Kvwake-Session": session["session_id"], **(headers or {})}
        if not req.stream:
            await _watch(request, [task], gone)
            body = shape.reply.full(task.result(), session)
            await shape.kept()
            return JSONResponse(body, headers=headers)
        first = asyncio.ensure_future(events.get())
        # Up to one keep-alive interval for the first event, so a quick failure is still a plain HTTP error;
        # a longer prefill opens the stream and sends keep-alive comments until its first event. Nothing
        # is sent meanwhile, so a client that leaves is seen by polling (it stops the prefill).
        await _watch(request, [first, task], gone, self.keepalive_s)
        if task.done() and task.exception() is not None and events.empty() and not first.done():
            first.cancel()
            task.result()  # failed before any output: a plain HTTP error is still possible
        return StreamingResponse(stream(shape, first, events, task, gone, self.keepalive_s),
                                 media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})

    async def _start(self, req: Any, on_event: Callable | None, cancelled: Callable[[], bool],
                     on_append: Callable | None = None) -> tuple[dict[str, Any], asyncio.Task]:
        """Check and render the request once (a refused request makes no session), then pick its session and
        start the generation (sessions/matching.py)."""
        prepared = await self.manager.prepare(req.inputs(), req.params)
        try:
            return await self.matcher.start(prepared, req.session_id, getattr(req, "hint", None), on_event,
                                            cancelled, on_append)
        except BaseException:  # no generation took the turn: it is not on its way any more
            prepared.land()
            raise


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


async def _watch(request: Request, waits: list[asyncio.Future], gone: anyio.Event,
                 timeout_s: float | None = None) -> None:
    """Wait until one of `waits` is done (a result, a stream's first event), or timeout_s; a client that
    hangs up meanwhile sets `gone`, which stops the call's prefill before its next chunk, or its generation."""
    until = None if timeout_s is None else time.monotonic() + timeout_s
    while not any(w.done() for w in waits) and (until is None or time.monotonic() < until):
        poll = DISCONNECT_POLL_S if until is None else max(0.0, min(DISCONNECT_POLL_S, until - time.monotonic()))
        await asyncio.wait(waits, timeout=poll, return_when=asyncio.FIRST_COMPLETED)
        if not any(w.done() for w in waits) and await request.is_disconnected():
            gone.set()


def _openai_model(name: str, loaded: bool) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvwake", "loaded": loaded}


def make_app(manager: SessionManager, token: str | None) -> Any:
    api = Api(manager)

    def refuse(request: Request, err: ApiError) -> Response:
        return refusal(err, anthropic_client(request.url.path, request.headers))

    async def api_error(request: Request, exc: Exception) -> Response:
        return refuse(request, exc if isinstance(exc, ApiError) else from_kvwake(exc))  # type: ignore[arg-type]

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        return refuse(request, ApiError(status, str(getattr(exc, "detail", exc)), kind=kind))

    async def internal(request: Request, exc: Exception) -> Response:
        log.exception("http request failed", exc_info=exc)
        return refuse(request, ApiError(500, f"internal error: {exc!r}", kind="server_error"))

    app = Starlette(routes=[
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/messages", api.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"]),
        Route("/v1/responses", api.responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", api.stored_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", api.delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", api.input_items, methods=["GET"]),
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
