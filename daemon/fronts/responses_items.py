"""The Responses API's input items as the chat messages templates know (fronts/responses_shapes.py uses it).

Translation only. `input` is a string (one user message) or items: messages
(roles `system`, `developer` (as `system`), `user`, `assistant`; content a
string or `input_text`/`output_text` parts, an assistant's `refusal` parts
being its words), `function_call` (joined to the assistant message just
before it as `tool_calls`, as a chat client sends a reply that made calls; a
call with a `namespace` under the flat name its member was offered by,
fronts/responses_tools.py),
`function_call_output` (a `tool` message) and `reasoning` (its text, or its
summary, as the next assistant message's `reasoning_content`, which templates
with a place for it render). Any other item or part is a 400 naming it.
"""

from __future__ import annotations

import secrets
from typing import Any

from kvwake.daemon.fronts.responses_tools import bad, flat_name

__all__ = ["bad", "input_messages", "item_page", "listed_items", "one_system"]

ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")  # "text": what some clients send for input_text


def _text(content: Any, where: str, role: str) -> str:
    """A message's content: a string, or its text parts joined (an assistant's refusals are its words)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad("must be a string or an array of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" and role == "assistant" else "text" if kind in TEXT_PARTS else None
        if key is None or not isinstance(part.get(key), str):
            raise bad(f"{kind!r} parts are not supported: kvwake serves text models (input_text and output_text "
                      "parts only)", f"{where}[{j}].type")
        texts.append(part[key])
    return "".join(texts)


def _reasoning(item: dict[str, Any]) -> str:
    """A reasoning item's text: its content, else its summary (encrypted content means nothing here)."""
    parts = item.get("content") or item.get("summary") or []
    return "\n".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A call as chat's tool_calls entry; a namespace's member under the name it was offered by."""
    if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise bad("a function_call needs call_id, name and arguments (JSON text)", where)
    namespace = item.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or not namespace):
        raise bad("must be a non-empty string", f"{where}.namespace")
    name = flat_name(namespace, item["name"]) if namespace else item["name"]
    return {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": item["arguments"]}}


def _output(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise bad("a function_call_output needs call_id", where)
    output = item.get("output")
    return {"role": "tool", "tool_call_id": item["call_id"],
            "content": output if isinstance(output, str) else _text(output, f"{where}.output", "tool")}


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """`input` (a string or items) as chat messages; a refused item is a 400 naming it."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad("must be a string or a non-empty array of input items", "input")
    out: list[dict[str, Any]] = []
    reasoning = ""  # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad("must be an input item object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            reasoning = "\n".join(text for text in (reasoning, _reasoning(item)) if text)
        elif kind == "function_call_output":
            out.append(_output(item, where))
        elif kind == "function_call":
            call, last = _function_call(item, where), out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)  # the calls of the reply that holds them
                continue
            out.append(_assistant(None, reasoning) | {"tool_calls": [call]})
            reasoning = ""
        elif kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(f"must be one of {', '.join(ROLES)}; got {role!r}", f"{where}.role")
            text = _text(item.get("content"), f"{where}.content", role)
            if role == "assistant":
                out.append(_assistant(text, reasoning))
                reasoning = ""
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        else:
            raise bad(f"{kind!r} items are not supported by kvwake (message, function_call, "
                      "function_call_output and reasoning items only)", f"{where}.type")
    return out


def _assistant(text: str | None, reasoning: str) -> dict[str, Any]:
    """An assistant message; the reasoning before it as `reasoning_content`, the key templates render."""
    return {"role": "assistant", "content": text, **({"reasoning_content": reasoning} if reasoning else {})}


def one_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leading system messages (instructions, developer messages) joined into one."""
    n = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if n < 2:
        return messages
    return [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:n])}, *messages[n:]]


# -- input items as `GET /v1/responses/{id}/input_items` lists them -------------

ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_items(raw: Any) -> list[dict[str, Any]]:
    """`input` (already accepted by input_messages) as OpenAI's input items list them: each with an `id`
    (the client's, else one made here, so a stored list keeps its ids), a message's content as parts."""
    items = [{"type": "message", "role": "user", "content": raw}] if isinstance(raw, str) else raw
    out = []
    for item in items:
        kind = item.get("type", "message")
        listed = {**item, "type": kind, "id": item.get("id") or f"{ID_PREFIX[kind]}_{secrets.token_hex(24)}"}
        if kind == "message":
            listed["content"] = _listed_parts(item["role"], item["content"])
        if kind in ("message", "function_call", "function_call_output"):
            listed.setdefault("status", "completed")
        out.append(listed)
    return out


def _listed_parts(role: str, content: Any) -> list[dict[str, Any]]:
    """A message's content as the parts OpenAI lists: an assistant's `output_text` (with annotations),
    the other roles' `input_text`."""
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if role != "assistant":
        return [{**p, "type": "input_text"} if p["type"] == "text" else p for p in parts]
    return [{"annotations": [], **p, "type": "output_text"} if p["type"] in TEXT_PARTS else p for p in parts]


def item_page(items: list[dict[str, Any]], query: Any) -> dict[str, Any]:
    """One page of `items` (oldest first) as OpenAI's list object; `query` holds `order` ("desc", the
    default, newest first, or "asc"), `after` (an item id: the items that follow it in that order) and
    `limit` (1 to 100, default 20). A bad value is a 400 naming it."""
    order, after, limit = query.get("order", "desc"), query.get("after"), query.get("limit", "20")
    if order not in ("asc", "desc"):
        raise bad(f"must be \"asc\" or \"desc\"; got {order!r}", "order")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise bad(f"must be an integer from 1 to 100; got {limit!r}", "limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad(f"no input item {after!r} in this response", "after")
        start = ids.index(after) + 1
    page = ordered[start:start + int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < len(ordered)}
