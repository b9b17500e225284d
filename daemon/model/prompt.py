"""Input to token ids: what an append will make of a session, computed once.

A `Plan` is the rendered result: the session's whole new token list, its input
mode and its chat state. `Prompter.plan` makes one from an addition to a
session; `Prompter.render` from a whole conversation, independent of any
session, so a front can render a request once, use its tokens to pick the
session (sessions/matching.py) and hand the same plan to the append.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from kvwake.daemon.model.chat import ChatTemplate
from kvwake.daemon.session_state import Session, check_json, check_messages
from kvwake.errors import InvalidParamsError

__all__ = ["Plan", "Prompter"]


def _renders_at_once(configured: int | None = None) -> int:
    """Renders at once: `configured` (the tuning knob renders_at_once), else a quarter of the cores, at least
    one. A render's encoding takes a core, and two at once on a small machine slowed a decoding neighbour and
    ended no sooner (docs/decisions.md, "Engine": a prompt is rendered on the append's worker thread)."""
    return configured or max(1, (os.cpu_count() or 1) // 4)


@dataclass(frozen=True)
class Plan:
    """What an append will make of a session: its new tokens and chat state."""

    target: list[int]
    mode: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


class Prompter:
    """Checks input and renders it with the model's tokenizer and chat template.

    On worker threads (an append's, or the one a front renders on), not the engine's, up to
    `renders_at_once` inputs at once: the kept pieces (model/piece_tokens.py) take their own lock. The
    tokenizer's encode lets the GIL go while it runs, and only reads the tokenizer, as the engine
    thread's detokenizing does meanwhile.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, model_name: str, renders_at_once: int | None = None) -> None:
        self.tokenizer, self.vocab_size, self.model_name = tokenizer, vocab_size, model_name
        self.template = ChatTemplate.of(tokenizer)  # made once per tokenizer (model/chat.py)
        self.at_once = threading.BoundedSemaphore(_renders_at_once(renders_at_once))

    def render(self, *, messages: Any = None, text: Any = None, tokens: Any = None, tools: Any = None) -> Plan:
        """A whole conversation (as OpenAI clients send it) rendered, for no session in particular."""
        return self.plan(Session("render"), messages=messages, text=text, tokens=tokens, tools=tools, whole=True)

    def plan(self, session: Session, *, messages: Any = None, text: Any = None, tokens: Any = None,
             tools: Any = None, whole: bool = False, prompt: Plan | None = None) -> Plan:
        """Validate input and compute the session's new token list; changes nothing.

        With `whole`, the input is the whole conversation, not an addition: it replaces the
        session's messages or tokens, and the cache keeps their common prefix. `prompt`, a
        whole conversation `render` made already, is taken as it is (its mode checked). The
        caller holds the session (its claim), so nothing changes it meanwhile.
        """
        with self.at_once:
            return self._plan(session, messages, text, tokens, tools, whole, prompt)

    def _plan(self, session: Session, messages: Any, text: Any, tokens: Any, tools: Any, whole: bool,
              prompt: Plan | None) -> Plan:
        if prompt is not None:
            if any(x is not None for x in (messages, text, tokens, tools)):
                raise InvalidParamsError("give a rendered prompt or input, not both")
            session.check_mode(prompt.mode)
            return prompt
        if sum(x is not None for x in (messages, text, tokens)) != 1:
            raise InvalidParamsError("give exactly one of messages, text or tokens")
        if messages is not None:
            session.check_mode("chat")
            if tools is not None:
                tools = self._check_tools(tools)
            elif not whole:  # a whole conversation brings its own tools, or has none
                tools = session.tools
            candidate = ([] if whole else session.messages) + check_messages(messages)
            return Plan(self.template.render(candidate, tools), "chat", candidate, tools)
        session.check_mode("raw")
        if text is not None:
            if not isinstance(text, str) or not text:
                raise InvalidParamsError("text must be a non-empty string")
            added = list(self.tokenizer.encode(text, add_special_tokens=whole or not session.tokens))
        else:
            added = self._check_tokens(tokens)
        return Plan(([] if whole else session.tokens) + added, "raw", session.messages, session.tools)

    def _check_tools(self, tools: Any) -> list[dict[str, Any]]:
        """Tools only for a model whose tool calls mlx-lm can parse: an agent given tools must get
        structured calls back, not raw text it would have to parse itself."""
        tools = check_json(tools, "tools")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise InvalidParamsError("tools must be a list of maps (OpenAI's tool definitions)", param="tools")
        if tools and not self.tokenizer.has_tool_calling:
            raise InvalidParamsError(
                f"model {self.model_name} has no tool-call format mlx-lm knows (its tokenizer names no tool parser), "
                "so its tool calls could not be parsed; send no tools, or set \"tool_parser_type\" (a module of "
                "mlx_lm.tool_parsers) in the model's tokenizer_config.json", param="tools")
        return tools

    def _check_tokens(self, tokens: Any) -> list[int]:
        vocab = self.vocab_size
        if (not isinstance(tokens, list) or not tokens
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens)):
            raise InvalidParamsError(f"tokens must be a non-empty list of ids in [0, {vocab})")
        return list(tokens)
