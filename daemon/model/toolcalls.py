"""Tool calls in generated text: where they are (mlx-lm's markers) and what they say (mlx-lm's parsers).

mlx-lm's `TokenizerWrapper` names the model's tool-call format: `tool_call_start`
and `tool_call_end` mark a call's span in the text (an empty end marker: the
span runs to the end of the reply, as Mistral's `[TOOL_CALLS]`), and
`tool_parser(body, tools)` turns the text between them into
`{"name", "arguments"}` (or a list of them). `ToolSpans` follows one call's
final text as it grows and splits it into content and tool-call spans, the
way mlx-lm's server does, but keeps every character: the events it emits,
joined, are the text.

Events (the maps a streaming RPC call sends as notifications):
- `{"text": piece}`: content;
- `{"text": piece, "tool": True}`: a piece of a tool-call span, markers included;
- `{"tool_call": {"id", "type": "function", "function": {"name", "arguments"}}, "index": i}`:
  a span closed and parsed (i counts this reply's parsed calls from 0).

A span that does not parse (invalid JSON, cut by max_tokens) gives no call: its
text stays in `content` and an error line goes to `errors`. A parser's
exception never escapes: it is model output, not the client's fault.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Any

__all__ = ["ToolSpans", "held_back"]

Emit = Callable[[dict[str, Any]], None]
SHOWN = 80  # characters of a failed span quoted in its error


def held_back(text: str, marks: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could still begin one of `marks`."""
    hold = 0
    for s in marks:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold


class ToolSpans:
    """One reply's text, fed as it becomes final, split into content and tool-call spans.

    `feed(piece)` as text comes, `finish(reason)` once at the end; then `content`,
    `calls` and `errors` hold the outcome. Without a tool-call format (the tokenizer
    has none) everything is content.
    """

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None, emit: Emit | None) -> None:
        has = bool(getattr(tokenizer, "has_tool_calling", False))
        self.start: str | None = tokenizer.tool_call_start if has else None
        self.end: str = (tokenizer.tool_call_end or "") if has else ""
        self.parser = tokenizer.tool_parser if has else None
        self.parser_name = getattr(self.parser, "__module__", "tool parser").rsplit(".", 1)[-1]
        self.tools, self.emit = tools, emit
        self.text = ""
        self.sent = 0  # text[:sent] has been emitted
        self.open: int | None = None  # where the open span's start marker begins
        self.parsed: list[tuple[int, int]] = []  # (begin, end) of spans that parsed: cut from content
        self.calls: list[dict[str, Any]] = []
        self.errors: list[str] = []

    def feed(self, piece: str) -> None:
        self.text += piece
        self._scan(final=False)

    def finish(self, reason: str) -> None:
        """Flush held-back text; an unclosed span is parsed only if it may be whole.

        It may be whole when the reply stopped on its own (EOS or a stop string) or
        when the format has no end marker; after "length" or "cancelled" it was cut.
        """
        self._scan(final=True)
        if self.open is None:
            return
        body = self.text[self.open + len(self.start or ""):]
        if reason == "stop" or not self.end:
            self._parse(body, self.open, len(self.text))
        else:
            self.errors.append(f"{self.parser_name}: tool call cut off ({reason}) before {self.end!r}: "
                               f"{self.text[self.open:][:SHOWN]!r}")
        self.open = None

    @property
    def content(self) -> str:
        """The text without the spans that parsed."""
        parts, at = [], 0
        for begin, end in self.parsed:
            parts.append(self.text[at:begin])
            at = end
        return "".join(parts) + self.text[at:]

    def _scan(self, *, final: bool) -> None:
        while self.sent < len(self.text) and (self._span() if self.open is not None else self._content(final)):
            pass

    def _content(self, final: bool) -> bool:
        """Emit content up to the next start marker (True: a span opened); unless final, hold back
        what could begin one."""
        begin = self.text.find(self.start, self.sent) if self.start else -1
        if begin < 0:
            hold = held_back(self.text[self.sent:], (self.start,)) if self.start and not final else 0
            self._send(len(self.text) - hold, tool=False)
            return False
        self._send(begin, tool=False)
        self.open = begin
        return True

    def _span(self) -> bool:
        """Emit the open span's text; at its end marker close and parse it (True: more text may follow)."""
        assert self.open is not None and self.start is not None
        body = self.open + len(self.start)
        close = self.text.find(self.end, max(body, self.sent - len(self.end) + 1)) if self.end else -1
        if close < 0:
            self._send(len(self.text), tool=True)
            return False
        stop = close + len(self.end)
        self._send(stop, tool=True)
        self._parse(self.text[body:close], self.open, stop)
        self.open = None
        return True

    def _send(self, upto: int, *, tool: bool) -> None:
        if upto > self.sent:
            if self.emit is not None:
                piece = self.text[self.sent:upto]
                self.emit({"text": piece, "tool": True} if tool else {"text": piece})
            self.sent = upto

    def _parse(self, body: str, begin: int, end: int) -> None:
        assert self.parser is not None
        try:
            parsed = self.parser(body, self.tools)
            calls = [_openai_call(p) for p in (parsed if isinstance(parsed, list) else [parsed])]
            if not calls:
                raise ValueError("the parser found no call")
        except Exception as exc:  # any parser failure on model output: reported, never raised
            self.errors.append(f"{self.parser_name} could not parse tool call "
                               f"{self.text[begin:end][:SHOWN]!r}: {type(exc).__name__}: {exc}")
            return
        self.parsed.append((begin, end))
        for call in calls:
            if self.emit is not None:
                self.emit({"tool_call": call, "index": len(self.calls)})
            self.calls.append(call)


def _openai_call(parsed: Any) -> dict[str, Any]:
    """A parser's {"name", "arguments"} as OpenAI's tool call; arguments become JSON text."""
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) or not parsed["name"]:
        raise ValueError(f"the parser gave {type(parsed).__name__}, not a map with a name")
    arguments = parsed.get("arguments", {})
    if isinstance(arguments, str):
        json.loads(arguments)  # already JSON text: it must be valid
    else:
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": parsed["name"], "arguments": arguments}}
