"""The Responses API's input items as the chat messages templates know (fronts/responses_shapes.py uses it).

Translation only. `input` is a string (one user message) or items: messages
(roles `system`, `developer` (as `system`), `user`, `assistant`; content a
string or `input_text`/`output_text` parts, an assistant's `refusal` parts
being its words), `function_call` (joined to the assistant message just
before it as `tool_calls`, as a chat client sends a reply that made calls),
`function_call_output` (a `tool` message) and `reasoning` (its text, or its
summary, as the next assistant message's `reasoning_content`, which templates
with a place for it render). Any other item or part is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from kvwake.daemon.fronts.openai_shapes import ApiError

__all__ = ["bad", "input_messages", "one_system"]

ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")  # "text": what some clients send for input_text


def bad(message: str, param: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


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
    if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise bad("a function_call needs call_id, name and arguments (JSON text)", where)
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                   "arguments": item["arguments"]}}


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
