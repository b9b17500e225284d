"""Structured output: what a call's text must be (a `Structure`), as an llguidance grammar, compiled once.

A `Structure` says what a call must write: JSON valid against a schema
("json"), text in an llguidance Lark grammar ("lark"), or tool calls in the
model's own format whose arguments validate against the tools' schemas
("tool_call"). `Grammars` turns one into llguidance's grammar text, compiles
it against the model's tokenizer (an `LLMatcher`) and keeps the compiled
matchers in an LRU keyed by that text, so an agent that sends the same schema
every turn compiles it once; each call gets a copy (`deep_copy`). A schema or
grammar llguidance cannot compile is an InvalidParamsError naming the problem.

Tool calls (tool_choice "required" or one named tool): the grammar covers the
template's call wrapper, so what comes out is what the model's parser
(model/toolcalls.py) reads. Formats: mlx-lm's `json_tools` (Qwen, Hermes:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) and `mistral`
(`[TOOL_CALLS]name[ARGS]{...}`); a model that thinks may think first
(`<think>...</think>`), and must close the thought first when its prompt
opened one (templates that start the reply with `<think>`). Markers that are one special token are matched as that
token, as the template renders them.

JSON is written without free whitespace (`{"a": 1, "b": [2, 3]}`): llguidance's
flexible whitespace lets a model pad an object with blanks until max_tokens.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance as llg

from kvwake.errors import InvalidParamsError

__all__ = ["GRAMMAR_KEYS", "Grammars", "Structure"]

GRAMMAR_KEYS = ("json_schema", "grammar", "tool_choice")  # the RPC params that make a Structure
CACHED = 128  # compiled grammars kept
JSON_OPTIONS: Any = {"whitespace_flexible": False}
TOOL_FORMATS = ("json_tools", "mistral")


@dataclass(frozen=True)
class Structure:
    """What one call's output must be.

    kind "json": `source` is the JSON schema as JSON text (`{"type": "object"}`: any object); with
    `strict` false, schema keywords llguidance does not know are ignored instead of refused; with
    `or_tools`, a reply may instead be tool calls (tool_choice "auto" beside tools: an agent's turn).
    kind "lark": `source` is an llguidance Lark grammar.
    kind "tool_call": `source` is the tool that must be called, "" for any of the tools; `one` limits
    the reply to one call (else one or more).
    """

    kind: str
    source: str = ""
    strict: bool = True
    one: bool = False
    or_tools: bool = False
    param: str = ""  # the request field it came from, named when it cannot be compiled ("" : by kind)

    @classmethod
    def json(cls, schema: Any, *, strict: bool = True, or_tools: bool = False, one: bool = False,
             param: str = "json_schema") -> Structure:
        if not isinstance(schema, dict):
            raise InvalidParamsError(f"{param} must be a JSON schema object, got {type(schema).__name__}", param=param)
        return cls("json", json.dumps(schema, ensure_ascii=False), strict, one, or_tools, param)

    @classmethod
    def from_params(cls, p: dict[str, Any]) -> Structure | None:
        """The RPC form: at most one of `json_schema` (a schema map), `grammar` (Lark text) and
        `tool_choice` ("auto", "required": one or more calls, or {"name": tool}: one call to it)."""
        given = [k for k in GRAMMAR_KEYS if p.get(k) is not None and p.get(k) != "auto"]
        if len(given) > 1:
            raise InvalidParamsError(f"give at most one of json_schema, grammar and tool_choice; got {given}",
                                     param=given[1])
        if not given:
            return None
        key, value = given[0], p[given[0]]
        if key == "json_schema":
            return cls.json(value)
        if key == "grammar":
            if not isinstance(value, str) or not value.strip():
                raise InvalidParamsError("grammar must be a non-empty llguidance Lark grammar", param="grammar")
            return cls("lark", value)
        if value == "required":
            return cls("tool_call")
        if isinstance(value, dict) and set(value) == {"name"} and isinstance(value["name"], str) and value["name"]:
            return cls("tool_call", value["name"], one=True)
        raise InvalidParamsError('tool_choice must be "auto", "required" or {"name": TOOL}', param="tool_choice")


def _tool_schemas(tools: list[dict[str, Any]] | None, name: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, parameters schema) of the tools a call may name: all, or the one named."""
    found = []
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            found.append((fn["name"], params if isinstance(params, dict) else {"type": "object"}))
    if not found:
        raise InvalidParamsError("tool_choice forces a tool call but the request names no tools", param="tool_choice")
    if name:
        found = [(n, s) for n, s in found if n == name]
        if not found:
            names = ", ".join(n for n, _ in _tool_schemas(tools, ""))
            raise InvalidParamsError(f"tool_choice names {name!r}, which is not among the tools ({names})",
                                     param="tool_choice")
    return found


class ToolFormat:
    """The model's tool-call format, as mlx-lm's tokenizer names it, written as Lark pieces."""

    def __init__(self, tokenizer: Any, llt: Callable[[], llg.LLTokenizer] | None = None) -> None:
        # `llt`: gives llguidance's tokenizer, asked for only when a marker might be one special token
        self.tokenizer, self.llt = tokenizer, llt
        parser = getattr(tokenizer, "tool_parser", None) if getattr(tokenizer, "has_tool_calling", False) else None
        self.name = getattr(parser, "__module__", "").rsplit(".", 1)[-1] if parser is not None else None
        self.start, self.end = getattr(tokenizer, "tool_call_start", None), getattr(tokenizer, "tool_call_end", None)
        self.think = (tokenizer.think_start, tokenizer.think_end) if getattr(tokenizer, "has_thinking", False) \
            else None

    def literal(self, marker: str) -> str:
        """A marker in Lark: its token when it is one added token (`<[id]>`: llguidance matches added
        tokens, `<tool_call>` and `</think>` in Qwen's vocabulary, only as themselves), else the quoted text."""
        token = getattr(self.tokenizer, "vocab", {}).get(marker)
        if token is not None and self.llt is not None and self.llt().is_special_token(token):
            return f"<[{token}]>"
        return json.dumps(marker)

    def lark(self, tools: list[dict[str, Any]] | None, name: str, one: bool, alternative: str = "",
             thinking: bool = False) -> str:
        """The grammar of a reply that is tool calls (optionally after a thought), or `alternative` (Lark);
        `thinking`: the prompt opened a thought, so the reply begins inside it."""
        if self.name not in TOOL_FORMATS:
            raise InvalidParamsError(
                f"kvwake cannot constrain tool calls for this model: its tool-call format is "
                f"{self.name or 'unknown (its chat template names none)'}; kvwake constrains "
                f"{', '.join(TOOL_FORMATS)}", param="tool_choice")
        schemas = _tool_schemas(tools, name)
        if self.name == "json_tools":
            body = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": s},
                               "required": ["name", "arguments"], "additionalProperties": False}
                              for n, s in schemas], "x-guidance": JSON_OPTIONS}
            call = f'{self.literal(self.start)} "\\n"? %json {json.dumps(body)} "\\n"? {self.literal(self.end)}'
            calls = "call" if one else 'call ("\\n"? call)*'
        else:  # mistral: [TOOL_CALLS]name[ARGS]{...}, repeated
            call = " | ".join(f'{json.dumps(n)} {self.literal("[ARGS]")} %json {json.dumps({**s, "x-guidance": JSON_OPTIONS})}'
                              for n, s in schemas)
            calls = f"{self.literal(self.start)} call" + ("" if one else " call*")
        first, thought = self.thought(thinking)
        rules = [f"start: {first}({calls}{f' | {alternative}' if alternative else ''})", f"call: {call}", *thought]
        return "\n".join(rules) + "\n"

    def thought(self, thinking: bool) -> tuple[str, list[str]]:
        """What comes before a constrained reply on a thinking model: (the start of its `start` rule, the rules
        it needs). `thinking`: the prompt opened a thought, which the reply closes first; else it may think
        first. Nothing without thinking markers."""
        if not self.think:
            return "", []
        begin, end = self.think
        rules = [f"think: {self.literal(begin)} after_thought", "WS: /[ \\t\\n]+/"]
        if self.literal(end).startswith("<["):  # a token text cannot hold: the thought is any text before it
            rules += [f"after_thought: THOUGHT? {self.literal(end)} WS?", "THOUGHT: /(.|\\n)+/"]
        else:
            rules += ["after_thought: thought WS?", f'thought[stop={json.dumps(end)}]: /(.|\\n)*/']
        return ("after_thought " if thinking else "think? "), rules


class Grammars:
    """Compiles structures for one tokenizer; compiled matchers are kept by grammar text (LRU).

    Thread-safe: the HTTP and RPC fronts check a request's structure on their threads, the
    engine compiles on its own; a compile drops the GIL.

    llguidance's tokenizer (`tokenizer`) is built at the first structure that needs it unless `eager`: its build
    holds the GIL throughout, longer the larger the vocabulary, and built in a load it stopped every other
    loaded model's decode steps for that long (docs/decisions.md, "Several models"). The daemon
    builds it eagerly for the model it starts with (nothing decodes yet), lazily for a model loaded on demand:
    there the first structured request pays it, on the thread that checks its structure first (a request's
    check runs on the event loop: sessions/conversations.py `prepare`), and since the build holds the GIL,
    everything in the process waits that once wherever it runs.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, capacity: int = CACHED, eager: bool = True) -> None:
        backend = getattr(tokenizer._tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise InvalidParamsError("structured output needs a fast (Rust) Hugging Face tokenizer")
        # One EOS id for llguidance (a list needs llguidance 1.7+): the mask gives the others its bit (masks.py).
        eos = sorted(tokenizer.eos_token_ids)
        self.eos = tokenizer.eos_token_id if tokenizer.eos_token_id in eos else eos[0]
        self.eos_ids = set(eos)
        self._hf, self._backend, self._vocab_size = tokenizer, backend, vocab_size
        self._llt: llg.LLTokenizer | None = None
        self._building = threading.Lock()
        self.tools = ToolFormat(tokenizer, lambda: self.tokenizer)
        self.capacity = capacity
        self.compiled: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self.lock = threading.Lock()
        self.counters = {"grammar_compiles": 0, "grammar_cache_hits": 0}
        if eager:
            self.tokenizer  # noqa: B018 - built now

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        """llguidance's view of the model's tokenizer, built once (by whichever thread asks first)."""
        with self._building:
            if self._llt is None:
                # n_vocab: the logits' width, which may exceed the tokenizer's: masks cover every logit
                self._llt = llg.LLTokenizer(self._backend.to_str(), eos_token=self.eos,
                                            n_vocab=max(self._vocab_size, len(self._hf.vocab)))
            return self._llt

    @property
    def built(self) -> bool:
        """Whether llguidance's tokenizer is built yet."""
        return self._llt is not None

    def opened_thought(self, prompt: list[int]) -> bool:
        """Whether the prompt ends inside a thought the template opened (the reply begins thinking)."""
        think = self.tools.think
        return think is not None and self.tools.tokenizer.decode(prompt[-16:]).rstrip().endswith(think[0])

    def grammar(self, structure: Structure, tools: list[dict[str, Any]] | None = None, thinking: bool = False) -> str:
        """llguidance's grammar text for `structure` (`tools`: the call's, for kind "tool_call"; `thinking`:
        the prompt opened a thought, which the reply closes first). On a thinking model a reply may think
        first, JSON replies too: the thought is cut from the content (model/toolcalls.py), which is the JSON."""
        if structure.kind == "json":
            options = JSON_OPTIONS if structure.strict else {**JSON_OPTIONS, "lenient": True}
            inline = {**json.loads(structure.source), "x-guidance": options}
            if structure.or_tools and tools and self.tools.name is not None:
                return llg.LLMatcher.grammar_from_lark(
                    self.tools.lark(tools, "", structure.one, f"%json {json.dumps(inline)}", thinking=thinking))
            first, thought = self.tools.thought(thinking)
            if thought:
                return llg.LLMatcher.grammar_from_lark(
                    "\n".join([f"start: {first}%json {json.dumps(inline)}", *thought]) + "\n")
            return llg.LLMatcher.grammar_from_json_schema(structure.source, defaults=options)
        if structure.kind == "lark":
            return llg.LLMatcher.grammar_from_lark(structure.source)
        if structure.kind == "tool_call":
            return llg.LLMatcher.grammar_from_lark(self.tools.lark(tools, structure.source, structure.one,
                                                                   thinking=thinking))
        raise InvalidParamsError(f"unknown structure kind {structure.kind!r}")

    def matcher(self, structure: Structure, tools: list[dict[str, Any]] | None = None,
                thinking: bool = False) -> llg.LLMatcher:
        """A fresh matcher for `structure`, compiled once per grammar; InvalidParamsError names what is wrong."""
        text = self.grammar(structure, tools, thinking)
        with self.lock:
            compiled = self.compiled.get(text)
            if compiled is not None:
                self.compiled.move_to_end(text)
                self.counters["grammar_cache_hits"] += 1
                return compiled.deep_copy()
        compiled = llg.LLMatcher(self.tokenizer, text, log_level=0)
        if compiled.is_error():
            param = structure.param or {"json": "json_schema", "lark": "grammar", "tool_call": "tools"}[structure.kind]
            raise InvalidParamsError(f"{param}: {_what(structure)} cannot be compiled: {compiled.get_error()}",
                                     param=param)
        with self.lock:
            self.counters["grammar_compiles"] += 1
            self.compiled[text] = compiled
            while len(self.compiled) > self.capacity:
                self.compiled.popitem(last=False)
        return compiled.deep_copy()


def _what(structure: Structure) -> str:
    return {"json": "the JSON schema", "lark": "the grammar", "tool_call": "a tool's parameters schema"}[structure.kind]
