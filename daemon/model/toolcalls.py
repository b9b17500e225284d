"""Tool calls and thinking in generated text: where they are (mlx-lm's markers) and what calls say (its parsers).

mlx-lm's `TokenizerWrapper` names the model's tool-call format: `tool_call_start`
and `tool_call_end` mark a call's span in the text (an empty end marker: the
span runs to the end of the reply, as Mistral's `[TOOL_CALLS]`), and
`tool_parser(body, tools)` turns the text between them into
`{"name", "arguments"}` (or a list of them). `ToolSpans` follows one call's
final text as it grows and splits it into content and tool-call spans, the
way mlx-lm's server does, but keeps every character: the events it emits,
joined, are the text.

Thinking: where the tokenizer names thinking markers (mlx-lm's `think_start` and
`think_end`: `<think>`, `</think>` for Qwen3 and DeepSeek-R1), the text between
them is the model's reasoning, not its answer. A reply may begin inside it (the
template opened it in the generation prompt: `thinking=True`). Its spans, markers
and the whitespace after the end marker included, are cut from `content` and
joined (markers left out, trimmed) into `reasoning`.

Events (the maps a streaming RPC call sends as notifications):
- `{"text": piece}`: content;
- `{"text": piece, "thinking": True, "reasoning": part}`: a piece of a thinking span, markers included;
  `reasoning` (when there is some) is its part of `reasoning`: the pieces' parts joined are `reasoning`;
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

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None, emit: Emit | None, *,
                 thinking: bool = False) -> None:
        has = bool(getattr(tokenizer, "has_tool_calling", False))
        thinks = bool(getattr(tokenizer, "has_thinking", False))
        self.think_start: str | None = tokenizer.think_start if thinks else None
        self.think_end: str = tokenizer.think_end if thinks else ""
        self.thinking: int | None = 0 if thinking and thinks else None  # where the open thinking span begins
        self.thought: list[tuple[int, int]] = []  # (begin, end) of closed thinking spans: cut from content
        self._said = 0  # text[:_said] has been streamed as reasoning (or skipped: markers, whitespace)
        self._spoke = False  # some reasoning has been streamed (the next span's begins with a blank line)
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
        """The text without the tool-call spans that parsed and the thinking spans."""
        parts, at = [], 0
        for begin, end in sorted(self.parsed + self._thinking_spans()):
            parts.append(self.text[at:begin])
            at = end
        return "".join(parts) + self.text[at:]

    @property
    def reasoning(self) -> str:
        """The thinking spans' text, markers left out, trimmed; "" when the model did not think."""
        bodies = []
        for begin, end in self._thinking_spans():
            body = self.text[begin:end].rstrip()
            body = body.removeprefix(self.think_start or "") if self.text.startswith(self.think_start or "\0", begin) else body
            bodies.append(body.removesuffix(self.think_end).strip())
        return "\n\n".join(b for b in bodies if b)

    def _thinking_spans(self) -> list[tuple[int, int]]:
        """Closed thinking spans, and one still open (cut off) up to the end of the text."""
        return self.thought + ([(self.thinking, len(self.text))] if self.thinking is not None else [])

    def _scan(self, *, final: bool) -> None:
        while self.sent < len(self.text) and (
                self._span() if self.open is not None else self._think(final) if self.thinking is not None
                else self._content(final)):
            pass

    def _content(self, final: bool) -> bool:
        """Emit content up to the next tool-call or thinking start marker (True: a span opened); unless final,
        hold back what could begin one."""
        marks = tuple(m for m in (self.start, self.think_start) if m)
        found = [(at, m) for m in marks if (at := self.text.find(m, self.sent)) >= 0]
        if not found:
            hold = held_back(self.text[self.sent:], marks) if not final else 0
            self._send(len(self.text) - hold, tool=False)
            return False
        begin, mark = min(found)
        self._send(begin, tool=False)
        if mark == self.start:
            self.open = begin
        else:
            self.thinking = begin
        return True

    def _think(self, final: bool) -> bool:
        """Emit the open thinking span; at its end marker (and the whitespace after it) close it (True: more
        text may follow). Unless final, hold back what could begin the end marker, and whitespace after it."""
        assert self.thinking is not None
        close = self.text.find(self.think_end, max(self.thinking, self.sent - len(self.think_end) + 1))
        if close < 0:
            hold = held_back(self.text[self.sent:], (self.think_end,)) if not final else 0
            self._send(len(self.text) - hold, thinking=True)
            return False
        stop = close + len(self.think_end)
        while stop < len(self.text) and self.text[stop].isspace():
            stop += 1
        if stop == len(self.text) and not final:  # more whitespace may follow: the span is not closed yet
            self._send(close, thinking=True)
            return False
        self._send(stop, thinking=True, closed=close)
        self.thought.append((self.thinking, stop))
        self.thinking = None
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

    def _send(self, upto: int, *, tool: bool = False, thinking: bool = False, closed: int | None = None) -> None:
        if upto > self.sent:
            if self.emit is not None:
                piece = self.text[self.sent:upto]
                event = {"text": piece, "tool": True} if tool else {"text": piece}
                if thinking:
                    event = {"text": piece, "thinking": True, **self._reasoning_part(upto, closed)}
                self.emit(event)
            self.sent = upto

    def _reasoning_part(self, upto: int, closed: int | None) -> dict[str, str]:
        """The open thinking span's reasoning in text[:upto] not yet streamed: markers left out, and trimmed
        as `reasoning` is (leading whitespace skipped; trailing held back until more text, or dropped at
        `closed`, where the end marker begins)."""
        assert self.thinking is not None
        body = self.thinking + len(self.think_start or "") if self.text.startswith(
            self.think_start or "\0", self.thinking) else self.thinking
        start = max(self._said, body)
        fresh = self._said <= body  # nothing of this span streamed yet
        end = min(upto, closed) if closed is not None else upto
        part = self.text[start:end]
        if fresh:
            part = part.lstrip()
        part = part.rstrip()
        if not part:
            return {}
        self._said = self.text.rindex(part[-1], start, end) + 1
        prefix = "\n\n" if fresh and self._spoke else ""
        self._spoke = True
        return {"reasoning": prefix + part}

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
