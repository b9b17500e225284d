"""OpenAI's request, response, streaming and error shapes, mapped to kvwake's own.

Only translation lives here (no I/O): `fronts/http.py` serves it. Shapes are
copied from OpenAI's API reference and checked with the official `openai`
package (tests/test_http.py).

Requests: the usual sampling parameters (`max_tokens` or
`max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop`,
`presence_penalty`, `frequency_penalty`, `logit_bias`), mlx-lm
server's extras (`top_k`, `min_p`, `repetition_penalty`), `tools` with
`tool_choice` and `parallel_tool_calls`, `stream` with
`stream_options.include_usage`, and `kvwake_session` (or the
`X-Kvwake-Session` header) to name a session. Structured output
(model/grammar.py) by constrained decoding: `response_format` `json_object`
or `json_schema` (strict or not; beside tools under tool_choice "auto" the
reply is that JSON or tool calls), and `tool_choice` "required" or one named
function (the reply is calls in the model's own format, arguments valid
against the tool's schema; a forced call wins over `response_format`).
Unknown fields are ignored, as OpenAI's own clients send fields servers may
not know; a known field this server cannot honour (`n` > 1, `logprobs`,
legacy `functions`, audio, web search) is a 400 naming it, never silently
dropped; so is a message role templates do not know.
Defaults follow OpenAI where they differ from RPC: `temperature` 1, and
`max_tokens` 4096 (OpenAI's is "until the context ends").
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.model.grammar import Structure
from kvwake.errors import KvwakeError

__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "Reply", "error_body", "from_kvwake"]

DEFAULT_MAX_TOKENS = 4096
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
            "logit_bias", "seed", "stop")
ROLES = ("system", "developer", "user", "assistant", "tool")
UNSERVED = ("audio", "web_search_options")  # fields that would change the reply, which kvwake cannot honour
# kvwake error code -> HTTP status and OpenAI error type
STATUS = {"INVALID_PARAMS": (400, "invalid_request_error"), "NOT_FOUND": (404, "not_found_error"),
          "BUSY": (409, "conflict_error"), "BUNDLE_MISMATCH": (409, "conflict_error"),
          "STORAGE_FULL": (507, "server_error"), "CANCELLED": (503, "server_error"),
          "REMOTE_UNAVAILABLE": (503, "server_error"), "CORRUPT_BLOCK": (500, "server_error"),
          "CONTEXT_TOO_LONG": (400, "invalid_request_error")}
CODES = {"CONTEXT_TOO_LONG": "context_length_exceeded"}  # OpenAI's own code where it has one


class ApiError(Exception):
    """A request refused before it reached the engine, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_kvwake(exc: KvwakeError) -> ApiError:
    status, kind = STATUS.get(exc.code, (500, "server_error"))
    return ApiError(status, exc.message, param=exc.data.get("param"), code=CODES.get(exc.code, exc.code.lower()),
                    kind=kind)


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def _params(body: dict[str, Any], structure: Structure | None = None) -> GenerateParams:
    """Sampling and stopping, OpenAI's names and defaults, checked as RPC checks them; `structure`: what the
    reply must be (a forced tool call), else what `response_format` asks."""
    if body.get("n", 1) != 1:
        raise _bad("n must be 1: kvwake generates one choice per request", "n")
    for name in ("logprobs", "top_logprobs", "echo", "suffix"):
        if body.get(name) not in (None, False, 0, ""):
            raise _bad(f"{name} is not supported by kvwake", name)
    if body.get("best_of", 1) != 1:
        raise _bad("best_of must be 1", "best_of")
    for name in UNSERVED:
        if body.get(name) is not None:
            raise _bad(f"{name} is not supported by kvwake (a local text model)", name)
    if any(m != "text" for m in body.get("modalities") or ["text"]):
        raise _bad("modalities: kvwake replies with text only", "modalities")
    structure = structure or response_format(body.get("response_format"), bool(body.get("tools")),
                                             body.get("parallel_tool_calls") is False)
    given = {k: body[k] for k in SAMPLING if body.get(k) is not None}
    given.setdefault("temperature", 1.0)
    if given.get("top_p") == 1:
        given["top_p"] = 0.0  # OpenAI's 1 means off, as kvwake's 0 does
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    given["max_tokens"] = DEFAULT_MAX_TOKENS if limit is None else limit
    try:
        return dataclasses.replace(GenerateParams.from_params(given), structure=structure)
    except KvwakeError as exc:
        raise from_kvwake(exc) from None


def response_format(fmt: Any, tools: bool, one: bool) -> Structure | None:
    """`response_format`: text (None), json_object (any object) or json_schema ({name, schema, strict});
    `tools`: tools were given, so the reply may be tool calls instead (tool_choice "auto"), `one` of them."""
    where = "response_format"
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Structure.json({"type": "object"}, or_tools=tools, one=one)
    if kind != "json_schema":
        raise _bad(f'{where}.type must be "text", "json_object" or "json_schema"; got {kind!r}', where)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise _bad(f"{where}.json_schema must be an object with a name", f"{where}.json_schema")
    schema, strict = spec.get("schema", {}), spec.get("strict")
    if not isinstance(schema, dict) or not isinstance(strict, (bool, type(None))):
        raise _bad(f"{where}.json_schema.schema must be an object and strict a boolean", f"{where}.json_schema")
    return Structure.json(schema, strict=bool(strict), or_tools=tools, one=one, param=f"{where}.json_schema.schema")


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream, options = body.get("stream", False), body.get("stream_options") or {}
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false", "stream")
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    return stream, bool(options.get("include_usage"))


def _text(content: Any, where: str, role: Any) -> Any:
    """Message content: a string, null, or a list of text parts (joined); an assistant's `refusal`
    parts are its words too, as OpenAI renders them back to the model."""
    if content is None or isinstance(content, str):
        return content
    kinds = {"text": "text", **({"refusal": "refusal"} if role == "assistant" else {})}
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get(kinds.get(p.get("type"), "")), str)
                                         for p in content):
        return "".join(p[kinds[p["type"]]] for p in content)
    raise _bad(f"{where}: content must be a string or a list of text parts (kvwake serves text models)", where)


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) for m in raw):
        raise _bad("messages must be a non-empty array of message objects", "messages")
    messages = []
    for i, m in enumerate(raw):
        m = {k: v for k, v in m.items() if v is not None or k == "content"}
        if m.get("role") not in ROLES:  # a template would render an unknown role as if it meant something
            raise _bad(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {m.get('role')!r}"
                       + (" (the legacy function role: send tool messages)" if m.get("role") == "function" else ""),
                       f"messages[{i}].role")
        if "content" in m:
            m["content"] = _text(m["content"], f"messages[{i}]", m["role"])
        if m["role"] == "developer":  # OpenAI's newer name for the system role; templates know "system"
            m["role"] = "system"
        messages.append(m)
    return messages


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, bool, Structure | None]:
    """The tools the template gets, whether the reply may hold more than one call, and the forced call."""
    tools, choice = body.get("tools") or None, body.get("tool_choice", "auto")
    forced = forced_call(choice, tools, body.get("parallel_tool_calls", True) is False)
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools must be an array", "tools")
    for legacy in ("functions", "function_call"):  # the deprecated form of tools: refused, not dropped
        if body.get(legacy) is not None:
            raise _bad(f"{legacy} is the deprecated form of tools; send tools and tool_choice", legacy)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
    return (None if choice == "none" else tools), parallel, forced


def forced_call(choice: Any, tools: Any, one: bool) -> Structure | None:
    """tool_choice: "auto"/"none" force nothing; "required" any of the tools, {"type": "function",
    "function": {"name"}} that one (one call)."""
    if choice in ("auto", "none", None):
        return None
    if choice == "required":
        name = ""
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str) and choice["function"]["name"]:
        name, one = choice["function"]["name"], True
    else:
        raise _bad('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name"}}',
                   "tool_choice")
    if not tools:
        raise _bad("tool_choice forces a tool call, but no tools were given", "tool_choice")
    return Structure("tool_call", name, one=one)


def _session(body: dict[str, Any], header: str | None) -> str | None:
    named = body.get("kvwake_session", header)
    if named is not None and (not isinstance(named, str) or not named):
        raise _bad("kvwake_session must be a non-empty string", "kvwake_session")
    return named


@dataclass(frozen=True)
class ChatRequest:
    """A parsed /v1/chat/completions body."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    params: GenerateParams
    stream: bool = False
    include_usage: bool = False
    session_id: str | None = None
    one_call: bool = False  # parallel_tool_calls false: the reply ends after its first tool call

    @classmethod
    def parse(cls, body: dict[str, Any], header_session: str | None) -> ChatRequest:
        stream, include_usage = _stream(body)
        tools, parallel, forced = _tools(body)
        return cls(_messages(body.get("messages")), tools, _params(body, forced), stream, include_usage,
                   _session(body, header_session), one_call=bool(tools) and not parallel)

    def inputs(self) -> dict[str, Any]:
        """The whole conversation, as SessionManager.render takes it."""
        return {"messages": self.messages, **({"tools": self.tools} if self.tools else {})}


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed /v1/completions body: one prompt, as text or token ids."""

    prompt: str | list[int]
    params: GenerateParams
    stream: bool = False
    include_usage: bool = False
    session_id: str | None = None
    one_call: bool = False

    @classmethod
    def parse(cls, body: dict[str, Any], header_session: str | None) -> CompletionRequest:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        ok = (isinstance(prompt, str) and prompt) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt))
        if not ok:
            raise _bad("prompt must be a non-empty string or token array (one prompt per request)", "prompt")
        stream, include_usage = _stream(body)
        return cls(prompt, _params(body), stream, include_usage, _session(body, header_session))

    def inputs(self) -> dict[str, Any]:
        """The whole prompt, as SessionManager.render takes it."""
        return {"text" if isinstance(self.prompt, str) else "tokens": self.prompt}


@dataclass
class Reply:
    """One response's identity, and its OpenAI shapes built from kvwake results and stream events."""

    model: str
    chat: bool
    one_call: bool = False  # parallel_tool_calls false: only the first call is the reply's
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id, "object": kind,
                "created": self.created, "model": self.model}

    @staticmethod
    def usage(result: dict[str, Any]) -> dict[str, Any]:
        """OpenAI usage: the whole prompt, and how much of it was not computed for this request."""
        u, total = result["usage"], result.get("append", {}).get("tokens", result["usage"]["prompt_tokens"])
        computed = u["prompt_tokens"]
        return {"prompt_tokens": total, "completion_tokens": u["generated_tokens"],
                "total_tokens": total + u["generated_tokens"],
                "prompt_tokens_details": {"cached_tokens": max(0, total - computed)}}

    def full(self, result: dict[str, Any], session: dict[str, Any]) -> dict[str, Any]:
        finish = _finish(result)
        if self.chat:
            calls = (result.get("tool_calls") or [])[: 1 if self.one_call else None]
            message = {"role": "assistant", "content": result.get("content", result["text"]) if not calls
                       else (result.get("content") or None)}
            if calls:
                message["tool_calls"] = calls
            if result.get("reasoning"):  # a thinking model's reasoning, apart (DeepSeek's and vLLM's field)
                message["reasoning_content"] = result["reasoning"]
            choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": result["text"], "finish_reason": finish, "logprobs": None}
        return {**self._head(False), "choices": [choice], "usage": self.usage(result), "kvwake": session}

    def piece(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """A chunk for one stream event; None for events this API has no place for (tool-call text)."""
        if not self.chat:
            text = event.get("text")
            return {**self._head(True), "choices": [{"index": 0, "text": text, "finish_reason": None,
                                                     "logprobs": None}]} if text else None
        if "tool_call" in event:
            if self.one_call and event["index"] > 0:
                return None
            call = {"index": event["index"], **event["tool_call"]}
            return self._delta({"tool_calls": [call]})
        if event.get("thinking"):  # its reasoning, markers left out
            return self._delta({"reasoning_content": event["reasoning"]}) if event.get("reasoning") else None
        if event.get("tool") or not event.get("text"):
            return None  # markup of a tool call: it arrives parsed, as its own chunk
        return self._delta({"content": event["text"]})

    def first(self) -> dict[str, Any] | None:
        return self._delta({"role": "assistant", "content": ""}) if self.chat else None

    def last(self, result: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            return {**self._head(True), "choices": [{"index": 0, "delta": {}, "finish_reason": _finish(result),
                                                     "logprobs": None}]}
        return {**self._head(True), "choices": [{"index": 0, "text": "", "finish_reason": _finish(result),
                                                 "logprobs": None}]}

    def usage_chunk(self, result: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": self.usage(result)}

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(True), "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                                 "logprobs": None}]}


def _finish(result: dict[str, Any]) -> str:
    """OpenAI's finish reasons: a call cut short by a departing client or a stopping daemon reads "stop",
    or "tool_calls" once it holds a parsed call (parallel_tool_calls false stops it there)."""
    reason = result["finish_reason"]
    if reason == "cancelled" and result.get("tool_calls"):
        return "tool_calls"
    return reason if reason in ("stop", "length", "tool_calls") else "stop"
