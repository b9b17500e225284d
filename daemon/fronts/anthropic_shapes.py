"""Anthropic's Messages API shapes (requests, responses, stream events, errors), mapped to kvwake's own.

Only translation lives here (no I/O): `fronts/http.py` serves it beside the
OpenAI routes, on the same sessions and matcher. Shapes follow Anthropic's API
reference and are checked with the official `anthropic` package
(tests/test_anthropic.py).

A Messages body becomes what the OpenAI front makes of a chat request: messages
in OpenAI's form (an assistant's `tool_use` blocks become `tool_calls`, a user's
`tool_result` blocks become `tool` messages before the user's text), tools as
OpenAI functions, and GenerateParams. So a conversation renders through the chat
template exactly as the same conversation sent as chat completions would.

Fields: `model`, `messages`, `max_tokens` (required, as Anthropic requires it),
`system` (a string or text blocks), `stop_sequences`, `temperature` (default 1),
`top_p`, `top_k`, `stream`, `tools` (custom tools: `name`, `description`,
`input_schema`), `tool_choice` (with `disable_parallel_tool_use`): `auto`,
`none`, and by constrained decoding (model/grammar.py) `any` and `tool` (a
call to any tool or to the one named, in the model's own format, its input
valid against the tool's schema), `output_config.format` `json_schema` (the
reply's text is JSON valid against it), and `kvwake_session`. Ignored, as they change
nothing kvwake does: `metadata`, `cache_control` (anywhere: kvwake caches every
prefix), `context_management`, `service_tier`, `thinking`'s budget (the model thinks as
its template makes it; see docs/http.md), `output_config.effort`, `speed`,
`inference_geo`, `diagnostics`, `user_profile_id`, `workspace_id`. `thinking` enabled (or
adaptive) asks for the reasoning of a thinking model (its template's `<think>` span) as
`thinking` blocks; without it the reasoning is left out of the reply. Anything
else is a 400 naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvwake.daemon.fronts.openai_shapes import ApiError
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.model.grammar import Structure
from kvwake.errors import KvwakeError

__all__ = ["BILLING_HEADER", "MessagesRequest", "MessagesReply", "error_body", "model_info", "status_for"]

BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's first system block: new on every request
IGNORED = ("metadata", "cache_control", "context_management", "service_tier", "thinking", "speed", "inference_geo",
           "diagnostics", "user_profile_id", "workspace_id")
KNOWN = ("model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
         "tools", "tool_choice", "output_config", "kvwake_session", *IGNORED)
BLOCK_KEYS = {"text": ("text",), "tool_use": ("id", "name", "input", "caller"),
              "tool_result": ("tool_use_id", "content", "is_error"), "thinking": ("thinking", "signature"),
              "redacted_thinking": ("data",)}
# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def status_for(err: ApiError) -> tuple[int, str]:
    """Anthropic's status and error type for a refusal: a busy session is "overloaded" (its clients retry
    those), the rest by status."""
    if err.code == "busy":
        return 529, "overloaded_error"
    return err.status, ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")


def error_body(err: ApiError) -> tuple[int, dict[str, Any]]:
    """(status, body) of Anthropic's error shape."""
    status, kind = status_for(err)
    return status, {"type": "error", "error": {"type": kind, "message": err.message}}


def model_info(name: str) -> dict[str, Any]:
    return {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _params(body: dict[str, Any], counting: bool) -> GenerateParams:
    limit = body.get("max_tokens")
    if limit is None and not counting:
        raise _bad("required (the most tokens the reply may have)", "max_tokens")
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list):
        raise _bad("must be an array of strings", "stop_sequences")
    given = {"temperature": 1.0 if body.get("temperature") is None else body["temperature"],
             "top_p": body.get("top_p") or 0.0, "top_k": body.get("top_k") or 0, "stop": stop,
             "max_tokens": 1 if limit is None else limit}
    if isinstance(given["temperature"], (int, float)) and not 0 <= given["temperature"] <= 1:
        raise _bad(f"{given['temperature']} is out of range [0, 1]", "temperature")  # Anthropic's range
    if given["top_p"] == 1:
        given["top_p"] = 0.0  # 1 means off, as kvwake's 0 does
    try:
        return GenerateParams.from_params(given)
    except KvwakeError as exc:
        param = exc.data.get("param", "")
        raise _bad(exc.message, {"stop": "stop_sequences"}.get(param, param)) from None


def _structure(body: dict[str, Any], fmt: Any, tools: list[dict[str, Any]] | None, one: bool) -> Structure | None:
    """What constrained decoding makes of the reply: a forced call (tool_choice any or tool) wins over
    output_config.format (json_schema: the text is that JSON, or tool calls beside tools under auto)."""
    choice = body.get("tool_choice") or {}
    if choice.get("type") in ("any", "tool"):
        name = choice.get("name") if choice["type"] == "tool" else ""
        if not isinstance(name, str) or (choice["type"] == "tool" and not name):
            raise _bad("a tool choice of type tool names the tool", "tool_choice.name")
        if not tools:
            raise _bad(f"tool_choice {choice['type']} forces a tool call, but no tools were given", "tool_choice")
        return Structure("tool_call", name, one=one or bool(name))
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config.format")
    return Structure.json(fmt["schema"], or_tools=bool(tools), one=one, param="output_config.format.schema")


def _text_of(content: Any, where: str) -> str:
    """A string, or text blocks joined (tool results, system blocks); anything else is refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("must be a string or an array of content blocks", where)
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _bad(f"a {kind!r} block: kvwake serves text models, only text blocks are accepted here",
                       f"{where}[{j}].type")
        parts.append(block["text"])
    return "\n".join(parts)


def _system(system: Any, drop: Sequence[str]) -> str | None:
    """The system text: a string, or its text blocks joined, less blocks that begin with a `drop` prefix
    (lines that change on every request and mean nothing to the model, such as Claude Code's billing header)."""
    if system is None or isinstance(system, str):
        return system or None
    if isinstance(system, list):
        system = [b for b in system if not (isinstance(b, dict) and isinstance(b.get("text"), str)
                                            and b["text"].startswith(tuple(drop)))]
    return _text_of(system, "system") or None


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise _bad("must be a string or an array of content blocks", where)
    for j, block in enumerate(content):
        keys = BLOCK_KEYS.get(block.get("type"))
        if keys is None:
            raise _bad(f"{block.get('type')!r} blocks are not supported: kvwake serves text models "
                       "(text, tool_use, tool_result and thinking blocks only)", f"{where}[{j}].type")
        extra = set(block) - {"type", "cache_control", "citations", *keys}
        if extra:
            raise _bad(f"unsupported fields {sorted(extra)}", f"{where}[{j}]")
    return content


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [b for b in blocks if b["type"] == "tool_use"]
    for j, b in enumerate(calls):
        if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str) and isinstance(b.get("input"), dict)):
            raise _bad("a tool_use block needs id, name and an input object", f"{where}[{j}]")
    if calls:
        message["tool_calls"] = [{"id": b["id"], "type": "function",
                                  "function": {"name": b["name"], "arguments": json.dumps(b["input"])}} for b in calls]
    thinking = "".join(b.get("thinking", "") for b in blocks if b["type"] == "thinking")
    if thinking:  # templates with a place for it render it (Qwen3's reasoning_content); others ignore the key
        message["reasoning_content"] = thinking
    return message


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results first, as tool messages (the calls they answer precede them), then its text."""
    out = []
    for j, b in enumerate(blocks):
        if b["type"] == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise _bad("a tool_result block needs tool_use_id", f"{where}[{j}]")
            text = _text_of(b.get("content", ""), f"{where}[{j}].content")
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                        "content": f"Error: {text}" if b.get("is_error") else text})
        elif b["type"] != "text":
            raise _bad(f"a user message cannot hold {b['type']} blocks", f"{where}[{j}].type")
    text = [b["text"] for b in blocks if b["type"] == "text"]
    if text or not out:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def _messages(raw: Any, system: str | None) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) for m in raw):
        raise _bad("must be a non-empty array of message objects", "messages")
    messages = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if m.get("role") not in ("user", "assistant"):
            raise _bad(f"must be \"user\" or \"assistant\"; got {m.get('role')!r}", f"{where}.role")
        blocks = _blocks(m.get("content"), f"{where}.content")
        if m["role"] == "assistant":
            messages.append(_assistant(blocks, f"{where}.content"))
        else:
            messages.extend(_user(blocks, f"{where}.content"))
    return messages


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, bool]:
    """OpenAI-form tools for the template (None: none or tool_choice none), and whether only one call may come."""
    tools, choice = body.get("tools") or None, body.get("tool_choice") or {"type": "auto"}
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "none", "any", "tool"):
        raise _bad("must be {\"type\": \"auto\"}, {\"type\": \"none\"}, {\"type\": \"any\"} or "
                   "{\"type\": \"tool\", \"name\": ...}", "tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise _bad("must be an array", "tools")
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"only custom tools (name, description, input_schema) are supported; got type {kind!r}",
                       f"tools[{i}]")
        function = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        if t.get("description"):
            function["description"] = t["description"]
        out.append({"type": "function", "function": function})
    one_call = bool(choice.get("disable_parallel_tool_use"))
    return (None if choice["type"] == "none" or not out else out), one_call


@dataclass(frozen=True)
class MessagesRequest:
    """A parsed /v1/messages (or count_tokens) body."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    params: GenerateParams
    stream: bool = False
    session_id: str | None = None
    one_call: bool = False  # disable_parallel_tool_use: the reply ends after its first tool call
    thinking: bool = False  # `thinking` enabled (or adaptive): the model's reasoning comes back as thinking blocks

    @classmethod
    def parse(cls, body: dict[str, Any], header_session: str | None, drop_system: Sequence[str],
              counting: bool = False) -> MessagesRequest:
        """`drop_system`: prefixes of system blocks left out (config `anthropic_drop_system`);
        `counting`: a count_tokens body (no max_tokens)."""
        unknown = sorted(set(body) - set(KNOWN))
        if unknown:
            raise _bad("not supported by kvwake", unknown[0])
        config = body.get("output_config") or {}
        if not isinstance(config, dict) or set(config) - {"effort", "format"}:
            raise _bad("only effort (ignored) and format are accepted", "output_config")
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise _bad("required: a model name (any name: the daemon serves the model it loaded)", "model")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("must be true or false", "stream")
        named = body.get("kvwake_session", header_session)
        if named is not None and (not isinstance(named, str) or not named):
            raise _bad("must be a non-empty string", "kvwake_session")
        tools, one_call = _tools(body)
        messages = _messages(body.get("messages"), _system(body.get("system"), drop_system))
        params = dataclasses.replace(_params(body, counting), structure=_structure(body, config.get("format"), tools,
                                                                                   one_call))
        thinking = isinstance(body.get("thinking"), dict) and body["thinking"].get("type") in ("enabled", "adaptive")
        return cls(body["model"], messages, tools, params, stream, named, one_call and bool(tools), thinking)

    def inputs(self) -> dict[str, Any]:
        """The whole conversation, as SessionManager.render takes it."""
        return {"messages": self.messages, **({"tools": self.tools} if self.tools else {})}


def _thinking(reasoning: str) -> dict[str, Any]:
    """A thinking block. Its signature is a digest of the text, not Anthropic's encrypted one: kvwake
    keeps no secret to sign with, and takes thinking blocks back without checking them."""
    return {"type": "thinking", "thinking": reasoning,
            "signature": "kvwake-" + hashlib.sha256(reasoning.encode()).hexdigest()[:32]}


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A parsed call (OpenAI's shape, toolcalls.py) as a tool_use block; ids as Anthropic's (`toolu_`)."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


@dataclass
class MessagesReply:
    """One reply's identity and its Anthropic shapes; streamed, the state of its content blocks."""

    model: str
    one_call: bool = False
    thinking: bool = False  # the reasoning goes out as thinking blocks (else it is left out)
    id: str = field(default_factory=lambda: "msg_" + secrets.token_hex(12))
    blocks: int = 0  # content blocks started
    open: str | None = None  # the type of the open block
    started: bool = False
    reasoning: str = ""  # the open thinking block's text so far (its signature is made from it)

    @staticmethod
    def usage(computed: int, total: int, output: int) -> dict[str, Any]:
        """Anthropic's usage: `input_tokens` computed for this request, `cache_read_input_tokens` not."""
        return {"input_tokens": computed, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": max(0, total - computed), "output_tokens": output}

    def _usage(self, result: dict[str, Any]) -> dict[str, Any]:
        u = result["usage"]
        total = result.get("append", {}).get("tokens", u["prompt_tokens"])
        return self.usage(u["prompt_tokens"], total, u["generated_tokens"])

    def _calls(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        return (result.get("tool_calls") or [])[: 1 if self.one_call else None]

    def _stop(self, result: dict[str, Any]) -> tuple[str, str | None]:
        """stop_reason and stop_sequence: a call cut short (client gone, daemon stopping) ends its turn."""
        if self._calls(result):
            return "tool_use", None
        if result.get("stop_sequence"):
            return "stop_sequence", result["stop_sequence"]
        return STOP_REASONS.get(result["finish_reason"], "end_turn"), None

    def _message(self, content: list, stop: tuple[str | None, str | None], usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def full(self, result: dict[str, Any], session: dict[str, Any]) -> dict[str, Any]:
        text, reasoning = result.get("content", result["text"]), result.get("reasoning") if self.thinking else None
        content = ([_thinking(reasoning)] if reasoning else []) + ([{"type": "text", "text": text}] if text else []) \
            + [_tool_use(c) for c in self._calls(result)]
        return {**self._message(content, self._stop(result), self._usage(result)), "kvwake": session}

    # -- streaming: each method returns the events to send, in order ----------

    def piece(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for one engine event (toolcalls.py's maps, or the manager's {"append": counts})."""
        if "append" in event:
            a = event["append"]
            self.started = True
            return [{"type": "message_start", "message": self._message(
                [], (None, None), self.usage(a["computed"], a["tokens"], 0))}, {"type": "ping"}]
        out = [] if self.started else self.piece({"append": {"computed": 0, "tokens": 0}})
        if "tool_call" in event:
            if self.one_call and event["index"] > 0:
                return out
            block = _tool_use(event["tool_call"])
            return out + self._start({**block, "input": {}}) + [
                self._delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])}),
                *self._close()]
        if event.get("thinking"):
            if not self.thinking or not event.get("reasoning"):
                return out
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                self.reasoning = ""
            self.reasoning += event["reasoning"]
            return out + [self._delta({"type": "thinking_delta", "thinking": event["reasoning"]})]
        if event.get("tool") or not event.get("text"):
            return out  # markup of a tool call: it arrives parsed, as its own block
        if self.open != "text":
            out += self._start({"type": "text", "text": ""})
        return out + [self._delta({"type": "text_delta", "text": event["text"]})]

    def last(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        reason, sequence = self._stop(result)
        return [*self._close(), {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                 "usage": self._usage(result)}, {"type": "message_stop"}]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = [*self._close(), {"type": "content_block_start", "index": self.blocks, "content_block": block}]
        self.open = block["type"]
        self.blocks += 1
        return out

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self.open == "thinking":  # a thinking block ends with its signature, as Anthropic's do
            signed = [self._delta({"type": "signature_delta", "signature": _thinking(self.reasoning)["signature"]})]
            self.open = None
            return [*signed, {"type": "content_block_stop", "index": self.blocks - 1}]
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]
