"""The fleet's agents: a shared system prompt and tool schemas, a task each, turns of tool results and replies.

An agent keeps its own conversation and sends all of it every turn, as agent frameworks do. Turn 1 is the
system prompt and the agent's task; each later turn adds the last reply as an assistant message that called a
tool, and that tool's result. Texts are cut to a count of the model's own tokens, so "a 2k prompt" means 2,048
tokens of that tokenizer. Two dialects of one conversation: OpenAI chat completions and Anthropic Messages.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.anthropic_turns import tools
from bench.lib import WORDS

__all__ = ["AnthropicAgent", "Fleet", "OpenAIAgent", "Texts", "Turn"]


@dataclass(frozen=True)
class Fleet:
    """The workload's shape, in the model's tokens."""

    agents: int = 4
    system_tokens: int = 2048
    task_tokens: int = 444
    result_tokens: int = 270
    reply_tokens: int = 128
    turns: int = 3
    tools: int = 2


@dataclass(frozen=True)
class Turn:
    """One streamed turn as the client saw it: seconds from sending to the first token and to the end."""

    first_token_s: float
    wall_s: float
    generated: int
    prompt_tokens: int  # as the server counted them (Anthropic: input and cache reads)
    sent_at: float  # perf_counter when it was sent
    first_at: float  # perf_counter of its first token


class Texts:
    """Texts of exact token counts in the model's tokenizer."""

    def __init__(self, model: Path) -> None:
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        self.tokenizer = load_tokenizer(model)

    def cut(self, head: str, tokens: int, offset: int = 0) -> str:
        """`head`, then words from WORDS (starting at `offset`), `tokens` tokens in all."""
        words = max(tokens, 16)
        while True:
            text = head + " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(words))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= tokens:
                return self.tokenizer.decode(ids[:tokens])
            words *= 2

    def system(self, fleet: Fleet) -> str:
        """The shared system prompt: with the tool schemas as the chat template renders them (a template that
        leaves them out: none), `fleet.system_tokens`."""
        messages = [{"role": "user", "content": "."}]
        schemas = len(self.tokenizer.apply_chat_template(messages, tools=openai_tools(fleet.tools))) - len(
            self.tokenizer.apply_chat_template(messages))
        return self.cut("You are one of a fleet of careful coding agents. Use the tools. ",
                        max(fleet.system_tokens - schemas, 64))

    def task(self, agent: int, fleet: Fleet) -> str:
        return self.cut(f"Agent {agent}, your task: migrate module {agent * 7 + 3} and verify it. ",
                        fleet.task_tokens, offset=agent)

    def result(self, agent: int, turn: int, fleet: Fleet) -> str:
        return self.cut(f"[agent {agent}, call {turn}] exit 0; output follows. ", fleet.result_tokens,
                        offset=agent * 5 + turn)


def openai_tools(n: int) -> list[dict[str, Any]]:
    """bench/anthropic_turns.py's n tool schemas (Claude Code's shape) as OpenAI function tools."""
    return [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["input_schema"]}} for t in tools(n)]


def _call(agent: int, turn: int, fleet: Fleet) -> tuple[str, str, dict[str, Any]]:
    """The tool call an agent's reply of `turn` makes: its id, the tool's name, the arguments."""
    return f"call_{agent}_{turn}", f"tool_{turn % fleet.tools}", {"path": f"src/module_{agent}/part_{turn}.py"}


class OpenAIAgent:
    """An agent over OpenAI chat completions (the `openai` package), streamed, greedy."""

    def __init__(self, index: int, fleet: Fleet, texts: Texts, system: str) -> None:
        self.index, self.fleet, self.texts, self.replies = index, fleet, texts, 0
        self.tools = openai_tools(fleet.tools)
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                               {"role": "user", "content": texts.task(index, fleet)}]

    def send(self, client: Any, model: str) -> Turn:
        started, first, text, usage = time.perf_counter(), None, [], None
        stream = client.chat.completions.create(
            model=model, messages=self.messages, tools=self.tools, max_tokens=self.fleet.reply_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None and (delta.content or delta.tool_calls) and first is None:
                first = time.perf_counter()
            if delta is not None and delta.content:
                text.append(delta.content)
            usage = chunk.usage or usage
        ended = time.perf_counter()
        self._continue("".join(text))
        first = first or ended
        return Turn(first - started, ended - started, usage.completion_tokens if usage else 0,
                    usage.prompt_tokens if usage else 0, started, first)

    def _continue(self, reply: str) -> None:
        self.replies += 1
        turn = self.replies
        call_id, name, arguments = _call(self.index, turn, self.fleet)
        self.messages += [
            {"role": "assistant", "content": reply,
             "tool_calls": [{"id": call_id, "type": "function",
                             "function": {"name": name, "arguments": json.dumps(arguments)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": self.texts.result(self.index, turn, self.fleet)}]


class AnthropicAgent:
    """An agent over Anthropic Messages (the `anthropic` package), streamed, greedy."""

    def __init__(self, index: int, fleet: Fleet, texts: Texts, system: str) -> None:
        self.index, self.fleet, self.texts, self.replies = index, fleet, texts, 0
        self.system, self.tools = system, tools(fleet.tools)
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": texts.task(index, fleet)}]

    def send(self, client: Any, model: str) -> Turn:
        started, first = time.perf_counter(), None
        # temperature through extra_body: anthropic 2.x's messages.stream has no argument for it
        with client.messages.stream(model=model, max_tokens=self.fleet.reply_tokens, system=self.system,
                                    tools=self.tools, messages=self.messages,
                                    extra_body={"temperature": 0}) as stream:
            for event in stream:
                if event.type == "content_block_delta" and first is None:
                    first = time.perf_counter()
            final = stream.get_final_message()
        ended = time.perf_counter()
        self._continue("".join(b.text for b in final.content if b.type == "text"))
        first = first or ended
        u = final.usage
        return Turn(first - started, ended - started, u.output_tokens,
                    u.input_tokens + (u.cache_read_input_tokens or 0), started, first)

    def _continue(self, reply: str) -> None:
        self.replies += 1
        turn = self.replies
        call_id, name, arguments = _call(self.index, turn, self.fleet)
        said = [{"type": "text", "text": reply}] if reply else []
        self.messages += [
            {"role": "assistant", "content": [*said, {"type": "tool_use", "id": call_id, "name": name,
                                                      "input": arguments}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                          "content": self.texts.result(self.index, turn, self.fleet)}]}]
