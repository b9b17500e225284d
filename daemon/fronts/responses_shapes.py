"""OpenAI's Responses API shapes (requests, response objects, stream events), mapped to kvwake's own.

Only translation lives here (no I/O): `fronts/http.py` serves it beside chat
completions and Anthropic's Messages, on the same request path, sessions and
matcher. Shapes follow the official `openai` package's `types/responses` and
are checked with it (tests/test_responses.py).

A Responses body becomes what a chat completion is: chat messages, OpenAI-form
tools and GenerateParams. `instructions` is a system message before the input
(a leading run of system and developer messages is joined into one, as
templates want a single system message first); `input` becomes chat messages
as fronts/responses_items.py says, so the same conversation sent as chat
completions renders to the same tokens.

Fields: `model`, `input`, `instructions`, `tools` (function and namespace
tools; OpenAI's built-in ones refused or left out: fronts/responses_tools.py),
`tool_choice` `auto` or `none`,
`parallel_tool_calls`, `max_output_tokens` (default 4096), `temperature`
(default 1), `top_p`, `stream`, `store` (default true), `previous_response_id`,
`prompt_cache_key` (a lineage hint, sessions/matching.py), `metadata` (repeated
in the response), mlx-lm's extras (`top_k`, `min_p`, `repetition_penalty`,
`seed`) and `kvwake_session`. Structured output by constrained decoding
(model/grammar.py), as on the chat completions route: `tool_choice`
`required` or `{"type": "function", "name"}` (a forced call wins), and
`text.format` `json_object` or `json_schema`. A null reads as the field's
default. Refused by name (400): `background`, `conversation`, `prompt`,
`max_tool_calls`, `top_logprobs`, `truncation: "auto"`. Other fields
(`include`, `reasoning`, `user`, `service_tier`, ... and unknown ones) change
nothing kvwake does and are ignored, as on the chat completions route.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from kvwake.daemon.sessions.matching import Hint
from kvwake.daemon.fronts.openai_shapes import DEFAULT_MAX_TOKENS, ApiError, _params, forced_call, response_format
from kvwake.daemon.fronts.responses_items import bad, input_messages, listed_items, one_system
from kvwake.daemon.fronts.responses_tools import Tools
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.model.grammar import Structure

__all__ = ["ResponsesReply", "ResponsesRequest"]


SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")


KINDS = {str: "a string", bool: "true or false", dict: "an object"}


def _checked(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """`body[name]` of type `kind`, or `default` when absent or null (as OpenAI reads a null)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise bad(f"must be {KINDS[kind]}", name)
    return value


def _tools(body: dict[str, Any], hosted: str) -> tuple[Tools, list[dict[str, Any]] | None, bool, Structure | None]:
    """(the request's tools (fronts/responses_tools.py), the tools the template gets or None, whether only
    one call may come, the forced call: `tool_choice` "required" or {"type": "function", "name"}, decoded
    under the same grammar as chat completions' forced calls)."""
    tools, choice = Tools.parse(body.get("tools"), hosted), body.get("tool_choice", "auto")
    chat = tools.chat
    parallel = _checked(body, "parallel_tool_calls", bool, True)
    if isinstance(choice, dict):  # this API's {"type": "function", "name"}: chat completions' shape of it
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or not choice["name"]:
            raise bad("must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": ...} "
                      f"(function tools only); got {choice!r}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice not in ("auto", "none", "required", None):
        raise bad(f"must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"name\": ...}}; "
                  f"got {choice!r}", "tool_choice")
    try:
        forced = forced_call(choice, chat, not parallel)
    except ApiError as err:
        raise bad(err.message.removeprefix("tool_choice ").removeprefix("tool_choice: "), "tool_choice") from None
    return tools, (chat if chat and choice != "none" else None), bool(chat) and not parallel, forced


def _text_format(body: dict[str, Any], tools: bool, one: bool) -> tuple[Structure | None, dict[str, Any]]:
    """`text.format`: text, json_object or json_schema (this API's flat {"type", "name", "schema", "strict"}),
    as chat completions' `response_format` (the same grammar); and the format as the response repeats it."""
    text = body.get("text") or {}
    if not isinstance(text, dict):
        raise bad("must be an object", "text")
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise bad("must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = {"name": fmt.get("name"), "schema": fmt.get("schema", {}), "strict": fmt.get("strict")}
        chat = {"type": "json_schema", "json_schema": spec}
    elif kind in ("text", "json_object"):
        chat = {"type": kind}
    else:
        raise bad(f"must be \"text\", \"json_object\" or \"json_schema\"; got {kind!r}", "text.format.type")
    try:
        structure = response_format(chat, tools, one)
        return (dataclasses.replace(structure, param="text.format.schema") if structure else None), fmt
    except ApiError as err:  # in this API's names
        message = err.message.replace("response_format.json_schema.", "text.format.").replace(
            "response_format.json_schema", "text.format").replace("response_format", "text.format")
        raise ApiError(err.status, message, param="text.format", code=err.code, kind=err.kind) from None


def _refused(body: dict[str, Any]) -> None:
    """Fields whose effect kvwake cannot give: a 400 naming them."""
    text = body.get("text") or {}
    if not isinstance(text, dict):
        raise bad("must be an object", "text")
    for name, why in (("background", "responses run while the request is open"),
                      ("conversation", "send previous_response_id or the whole input"),
                      ("prompt", "prompt templates are OpenAI's"), ("max_tool_calls", "it cannot be honoured"),
                      ("top_logprobs", "logprobs are not returned")):
        if body.get(name) not in (None, False, 0):
            raise bad(f"not supported by kvwake: {why}", name)
    if body.get("truncation") not in (None, "disabled"):
        raise bad("only \"disabled\": kvwake does not drop input (a prompt over the context is a 400)",
                  "truncation")


def _number(body: dict[str, Any], name: str) -> float:
    """A sampling setting as the response repeats it (checked by _sampling); OpenAI's default is 1."""
    value = body.get(name)
    return 1.0 if value is None else value


def _sampling(body: dict[str, Any]) -> GenerateParams:
    given = {k: body[k] for k in SAMPLING if body.get(k) is not None}
    limit = body.get("max_output_tokens")
    try:
        return _params({**given, "max_tokens": DEFAULT_MAX_TOKENS if limit is None else limit})
    except ApiError as err:  # in this API's names, the message beginning with the field's
        param = "max_output_tokens" if err.param == "max_tokens" else err.param
        message = err.message.replace("max_tokens", "max_output_tokens")
        message = message if param is None or message.startswith(param) else f"{param}: {message}"
        raise ApiError(err.status, message, param=param, code=err.code, kind=err.kind) from None


@dataclass(frozen=True)


class ResponsesRequest:
    """A parsed /v1/responses body; `following` adds the conversation of the response it continues."""

    new: list[dict[str, Any]]  # this request's input, as chat messages
    tools: list[dict[str, Any]] | None
    params: GenerateParams
    echo: dict[str, Any]  # what the response object repeats of the request
    instructions: str | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    lineage: str | None = None  # prompt_cache_key
    session_id: str | None = None
    one_call: bool = False  # parallel_tool_calls false: the reply ends after its first call
    offered: Tools = field(default_factory=Tools)  # the tools: namespace members, omitted built-in tools
    listed: list[dict[str, Any]] = field(default_factory=list)  # this input as input_items lists it
    history: list[dict[str, Any]] = field(default_factory=list)  # the previous response's conversation
    follows: tuple[str, int] | None = None  # its session and token position
    earlier: list[dict[str, Any]] | None = field(default_factory=list)  # its items, input and output (None: unknown)

    @classmethod
    def parse(cls, body: dict[str, Any], header_session: str | None, hosted: str = "omit") -> ResponsesRequest:
        """`hosted`: the http_hosted_tools setting (what OpenAI's built-in tools get: "omit" or "refuse")."""
        _refused(body)
        offered, tools, one_call, forced = _tools(body, hosted)
        structure, text_format = _text_format(body, bool(tools), one_call)
        instructions = _checked(body, "instructions", str)
        stream, store = _checked(body, "stream", bool, False), _checked(body, "store", bool, True)
        named = body.get("kvwake_session", header_session)
        if named is not None and (not isinstance(named, str) or not named):
            raise bad("must be a non-empty string", "kvwake_session")
        params = dataclasses.replace(_sampling(body), structure=forced or structure)  # a forced call wins
        metadata = _checked(body, "metadata", dict) or {}
        reasoning = _checked(body, "reasoning", dict)
        echo = {"instructions": instructions, "metadata": metadata, "model": body.get("model"),
                "parallel_tool_calls": _checked(body, "parallel_tool_calls", bool, True),
                "temperature": _number(body, "temperature"), "top_p": _number(body, "top_p"),
                "tool_choice": body.get("tool_choice") or "auto", "tools": offered.echo,
                "max_output_tokens": body.get("max_output_tokens"),
                "previous_response_id": _checked(body, "previous_response_id", str),
                "prompt_cache_key": _checked(body, "prompt_cache_key", str),
                "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": (reasoning or {}).get("summary")},
                "store": store, "text": {"format": text_format}, "truncation": "disabled",
                "user": body.get("user"), "background": False}
        return cls(input_messages(body.get("input")), tools, params, echo, instructions, stream, store,
                   echo["previous_response_id"], echo["prompt_cache_key"], named, one_call, offered,
                   listed_items(body.get("input")))

    def following(self, conversation: list[dict[str, Any]], session_id: str, position: int,
                  items: list[dict[str, Any]] | None) -> ResponsesRequest:
        """This request after the stored response it continues (its conversation, session, position, and
        its items: its input items then its output; None if its record did not keep them)."""
        return dataclasses.replace(self, history=conversation, follows=(session_id, position), earlier=items)

    @property
    def input_items(self) -> list[dict[str, Any]] | None:
        """The items this response is made from, as GET .../input_items lists them (None: not all known)."""
        return None if self.earlier is None else [*self.earlier, *self.listed]

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The whole conversation to render: the instructions, the previous response's, this input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return one_system([*system, *self.history, *self.new])

    @property
    def hint(self) -> Hint:
        """Where the matcher looks first (sessions/matching.py)."""
        session_id, position = self.follows or (None, None)
        return Hint(self.lineage, session_id, position)

    def inputs(self) -> dict[str, Any]:
        """The whole conversation, as SessionManager.render takes it."""
        return {"messages": self.messages, **({"tools": self.tools} if self.tools else {})}

    def recorded(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """The conversation a stored response keeps: what came before, this input, and the reply as the
        client would send its output items back (so a continuation renders what a resend would)."""
        return [*self.history, *self.new, *(input_messages(response["output"]) if response["output"] else [])]


def _usage(result: dict[str, Any]) -> dict[str, Any]:
    """The whole prompt as `input_tokens`, and how much of it was not computed for this request."""
    u = result["usage"]
    total = result.get("append", {}).get("tokens", u["prompt_tokens"])
    return {"input_tokens": total, "input_tokens_details": {"cached_tokens": max(0, total - u["prompt_tokens"]),
                                                            "cache_write_tokens": 0},
            "output_tokens": u["generated_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": total + u["generated_tokens"]}


def _hex() -> str:
    return secrets.token_hex(24)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _part(kind: str, text: str) -> dict[str, Any]:
    """The content part of a message or reasoning item."""
    return {"type": "reasoning_text", "text": text} if kind == "reasoning" else _text_part(text)


@dataclass


class ResponsesReply:
    """One response's identity and its shapes; streamed, the state of its output items."""

    model: str
    request: ResponsesRequest
    id: str = field(default_factory=lambda: "resp_" + _hex())
    created: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: "msg_" + _hex())
    session: dict[str, Any] | None = None  # the session it runs in (the `kvwake` object), once chosen
    final: dict[str, Any] | None = None  # the finished response object
    position: int = 0  # then: the session's token count where the reply ended
    items: list[dict[str, Any]] = field(default_factory=list)  # streamed output items, in order
    open: dict[str, Any] | None = None  # the message or reasoning item being streamed: its id, type, text
    held: str = ""  # whitespace while no message is open: it opens none unless words follow
    sequence: int = 0

    def response(self, status: str, output: list[dict[str, Any]], **facts: Any) -> dict[str, Any]:
        """The response object, as OpenAI's `Response`."""
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": None, **self.request.echo, "model": self.model,
                "output": output, "usage": None, **facts}

    def _calls(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        return (result.get("tool_calls") or [])[: 1 if self.request.one_call else None]

    def _status(self, result: dict[str, Any]) -> str:
        """`incomplete` when the reply filled max_output_tokens (and holds no call), else `completed`."""
        return "incomplete" if result["finish_reason"] == "length" and not self._calls(result) else "completed"

    def _finish(self, result: dict[str, Any], status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        self.final = self.response(status, output, usage=_usage(result), completed_at=int(time.time()),
                                   incomplete_details=incomplete)
        self.position = result["append"]["tokens"] + len(result["tokens"])
        return self.final

    def full(self, result: dict[str, Any], session: dict[str, Any]) -> dict[str, Any]:
        """The whole response, not streamed: a reasoning item with the model's reasoning (if it thought), a
        message with the reply's text (unless it is blank), then its function calls."""
        status, text, reasoning = self._status(result), result.get("content", result["text"]), result.get("reasoning")
        output = [{"id": "rs_" + _hex(), "type": "reasoning", "summary": [], "status": status,
                   "content": [_part("reasoning", reasoning)]}] if reasoning else []
        if text.strip():
            output.append({"id": self.message_id, "type": "message", "role": "assistant", "status": status,
                           "content": [_text_part(text)]})
        return {**self._finish(result, status, output + [self._call_item(c) for c in self._calls(result)]),
                "kvwake": session}

    # -- streaming: each method returns the events to send, in order ----------

    def _call_item(self, call: dict[str, Any]) -> dict[str, Any]:
        """A parsed call (OpenAI chat's shape, toolcalls.py) as a function_call output item: a namespace's
        member by its bare name and its `namespace` (fronts/responses_tools.py)."""
        return {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call", "status": "completed",
                "call_id": call["id"], **self.request.offered.call(call["function"]["name"]),
                "arguments": call["function"]["arguments"]}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, **fields, "sequence_number": self.sequence - 1}

    def piece(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for one engine event (toolcalls.py's maps, or the manager's {"append": counts})."""
        if "append" in event or self.sequence == 0:
            opening = self.response("in_progress", [])
            out = [self._event("response.created", response=opening),
                   self._event("response.in_progress", response=opening)]
            return out if "append" in event else out + self.piece(event)
        if "tool_call" in event:
            if self.request.one_call and event["index"] > 0:
                return []
            closed, item, self.held = self._close("completed"), self._call_item(event["tool_call"]), ""
            index = len(self.items)
            self.items.append(item)
            return [*closed,
                    self._event("response.output_item.added", output_index=index,
                                item={**item, "status": "in_progress", "arguments": ""}),
                    self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=item["name"], arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        if event.get("thinking"):  # the model's reasoning (markers left out): a reasoning item
            return self._add("reasoning", event["reasoning"]) if event.get("reasoning") else []
        if event.get("tool") or not event.get("text"):
            return []  # markup of a tool call: it arrives parsed, as its own item
        text, self.held = self.held + event["text"], ""
        if (self.open is None or self.open["type"] != "message") and not text.strip():
            self.held = text  # the newlines around calls and thinking: a message only if words follow
            return []
        return self._add("message", text)

    def _add(self, kind: str, text: str) -> list[dict[str, Any]]:
        """`text` streamed into the open item of `kind` ("message" or "reasoning"), opened first if need be."""
        out = []
        if self.open is None or self.open["type"] != kind:
            out = [*self._close("completed"), *self._start(kind)]
        self.open["text"] += text
        index, item_id = len(self.items) - 1, self.open["id"]
        if kind == "reasoning":
            return out + [self._event("response.reasoning_text.delta", item_id=item_id, output_index=index,
                                      content_index=0, delta=text)]
        return out + [self._event("response.output_text.delta", item_id=item_id, output_index=index,
                                  content_index=0, delta=text, logprobs=[])]

    def _start(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item = {"id": "rs_" + _hex(), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
        else:
            used = any(i["id"] == self.message_id for i in self.items)  # text again after a call: another message
            item = {"id": "msg_" + _hex() if used else self.message_id, "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
        self.items.append(item)
        self.open = {"id": item["id"], "type": kind, "text": ""}
        index = len(self.items) - 1
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", item_id=item["id"], output_index=index,
                            content_index=0, part=_part(kind, ""))]

    def _close(self, status: str) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        index, kind, text, item_id = len(self.items) - 1, self.open["type"], self.open["text"], self.open["id"]
        self.open = None
        item = self.items[index] = {**self.items[index], "status": status, "content": [_part(kind, text)]}
        done = (self._event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                            text=text) if kind == "reasoning" else
                self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                            text=text, logprobs=[]))
        return [done, self._event("response.content_part.done", item_id=item_id, output_index=index,
                                  content_index=0, part=_part(kind, text)),
                self._event("response.output_item.done", output_index=index, item=item)]

    def last(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        """The closing events; the finished response holds the items as they were streamed."""
        status = self._status(result)
        closed = self._close(status)
        final = self._finish(result, status, self.items)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*closed, self._event(kind, response={**final, "kvwake": self.session})]

    def failure(self, err: ApiError) -> list[dict[str, Any]]:
        """A generation that failed after the stream began: `response.failed` (its error code one of those
        OpenAI's `ResponseError` allows), then an `error` event with kvwake's own code."""
        closed = self._close("incomplete")
        error = {"code": "server_error" if err.status >= 500 else "invalid_prompt", "message": err.message}
        return [*closed, self._event("response.failed", response=self.response("failed", self.items, error=error)),
                self._event("error", code=err.code or error["code"], message=err.message, param=err.param)]
