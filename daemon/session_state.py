"""A session: its token ids, its chat messages, and the checks on what goes in them.

A session holds `tokens`, every token id of the conversation, and (while hot)
an mlx-lm prompt cache covering `tokens[:processed]`. Tokens past `processed`
are *pending*: they are fed to the model when generation starts, which yields
the logits of the next token. Append prefills all new tokens but the last, so
there is always a pending token to generate from.

Two ways to add input, not mixed in one session:
- **chat**: `messages` is the truth. Every append re-renders the whole
  conversation through the tokenizer's chat template (with the generation
  prompt); the engine keeps the longest common token prefix with what the
  cache holds and prefills only the rest. Generated replies are recorded as
  assistant messages.
- **raw**: text or token ids are appended as they are.
Mixing them is refused (INVALID_PARAMS): a chat re-render would otherwise drop
the raw tokens silently.

Templates that reject a system role get the system text folded into the
first user turn ("{system}\\n\\n{user}"); it is never dropped. OpenAI's tool
turns (assistant `tool_calls`, `tool` results) are checked on input and kept
as sent; the template renders a copy in the form mlx-lm's server gives it
(daemon/model/chat.py renders them).

This module is the daemon's shared vocabulary: every layer may import it; it
imports nothing of the daemon.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvwake.errors import CorruptBlockError, InvalidParamsError

__all__ = ["Session", "check_json", "check_messages", "check_session_id", "common_prefix", "new_session_id",
           "tool_arguments"]

MAX_SESSION_ID = 128


def new_session_id() -> str:
    return f"s-{secrets.token_hex(8)}"


def check_session_id(session_id: Any) -> str:
    """Session ids are 1-128 printable characters without '/' or NUL."""
    if (not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID
            or not session_id.isprintable() or "/" in session_id):
        raise InvalidParamsError(f"bad session id {session_id!r}: 1-{MAX_SESSION_ID} printable characters, no '/'",
                                 session_id=str(session_id)[:MAX_SESSION_ID])
    return session_id


def _run_into(done: Future, fn: Callable[[], Any]) -> None:
    try:
        done.set_result(fn())
    except BaseException as exc:  # the waiter raises it
        done.set_exception(exc)


PREFIX_PIECE = 4096  # tokens two lists are compared by at a time


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Length of the longest common prefix of two token sequences (lists or integer arrays).

    Two lists are compared as lists, a piece at a time (C-level compares, no conversion: converting a
    long conversation's lists to arrays cost more than comparing them; docs/history/benchmarks-journal.md,
    "Session 13: turns over 75k tokens share one attention graph; first tokens at 89-128 ms"); anything
    else as int64 arrays."""
    n = min(len(a), len(b))
    if isinstance(a, list) and isinstance(b, list):
        for start in range(0, n, PREFIX_PIECE):
            x, y = a[start : min(n, start + PREFIX_PIECE)], b[start : min(n, start + PREFIX_PIECE)]
            if x != y:
                return start + next(i for i, (p, q) in enumerate(zip(x, y)) if p != q)
        return n
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n


@dataclass
class Session:
    """One conversation. `cache` is None while asleep (or before any input)."""

    id: str
    mode: str | None = None  # "chat" | "raw" | None (no input yet)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tokens: list[int] = field(default_factory=list)
    processed: int = 0
    cache: list | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    head: str | None = None  # latest snapshot id
    last_used: float = 0.0
    reply_start: int | None = None  # where the last generated reply begins in `tokens` (None: no reply yet)
    # The first tokens whose KV is the stored blocks' bytes: a wake restored them and no trim has cut into them
    # since. Another wake may copy them instead of reading those blocks (a prefill's may differ in the last bits).
    restored: int = field(default=0, compare=False)
    # (position, a device copy of each layer that no token cut rewinds, None for the others): the state at this
    # session's latest restore point (kv/points.py `hold`). A resend that parts from its tokens after there goes
    # back to it, the plain layers trimmed, instead of reading the point and its blocks from the store.
    held_point: tuple[int, list] | None = field(default=None, repr=False, compare=False)
    # While it leads a shared prefill (sessions/conversations.py `_point_flight`): every point it holds as it
    # prefills, the latest TRAIL_KEPT, for the appends waiting on it to copy on the device; None otherwise.
    point_trail: list[tuple[int, list]] | None = field(default=None, repr=False, compare=False)
    # Engine-thread state, never recorded: a prefill chunk is queued on `cache` and computed a slice of layers
    # per job (model/scheduler/slices.py); until it ends, reading the cache would compute all of it at once.
    computing: bool = field(default=False, repr=False, compare=False)
    _settled: list[tuple[Callable[[], Any], Future]] = field(default_factory=list, repr=False, compare=False)

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.processed :]

    def when_settled(self, fn: Callable[[], Any]) -> Future:
        """Engine thread: run fn now, or when the chunk in flight ends if one is (`settle`); its Future.

        A checkpoint's capture of the cache goes through here: run between two slices of a chunk, it made
        the chunk's remaining layers its own work: one long capture job, then a slice waiting for the GPU,
        each many of a decoding neighbour's steps (docs/history/benchmarks-journal.md, "Session 12: a
        checkpoint no longer computes a neighbour's chunk")."""
        done: Future = Future()
        if self.computing:
            self._settled.append((fn, done))
        else:
            _run_into(done, fn)
        return done

    def settle(self, later: Callable[[Callable[[], Any]], Future | None] | None = None) -> None:
        """Engine thread: the chunk in flight ended (computed, or failed and its cache dropped); what waited
        runs, each as a job of its own through `later` when it takes it (the engine thread's, handed over in
        EngineThread.attach: a decode step then
        runs between the chunk's last slice and each, and between them; if the engine stops first, its
        waiter gets the engine's error), else here.

        Here, a checkpoint's capture made the last slice's job its own, several times a slice of one or
        two layers without persistence (docs/decisions.md, "Many agents at once (issue 24)")."""
        self.computing = False
        waiting, self._settled = self._settled, []
        for fn, done in waiting:
            def job(fn: Callable[[], Any] = fn, done: Future = done) -> None:
                _run_into(done, fn)
            job.__qualname__ = getattr(fn, "__qualname__", "Session.settled")  # the slow-work record says whose
            queued = later(job) if later is not None else None
            if queued is None:
                job()
            else:  # never run (the engine stopped first): its waiter learns why
                queued.add_done_callback(lambda f, done=done: done.done() or done.set_exception(f.exception()))

    def check_mode(self, mode: str) -> None:
        if self.mode not in (None, mode):
            raise InvalidParamsError(
                f"session {self.id} takes {self.mode} input; {mode} input would be lost at the next chat render",
                session_id=self.id,
            )

    def state(self) -> dict[str, Any]:
        """What a snapshot records beside the KV (its metadata), so a wake needs nothing else."""
        return {"mode": self.mode, "messages": self.messages, "tools": self.tools,
                "pending": self.pending, "metadata": self.metadata, "reply_start": self.reply_start}

    @classmethod
    def from_state(cls, session_id: str, token_ids: list[int], state: Any, head: str, vocab: int) -> Session:
        """Rebuild a session from a snapshot's recorded state, checking it (an imported file is untrusted).

        Raises CorruptBlockError naming the snapshot when the state is malformed.
        """
        ok = isinstance(state, dict)
        if ok:
            pending, messages, tools = state.get("pending", []), state.get("messages", []), state.get("tools")
            ok = (state.get("mode") in (None, "chat", "raw") and isinstance(state.get("metadata", {}), dict)
                  and isinstance(pending, list) and isinstance(messages, list)
                  and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in pending)
                  and (tools is None or isinstance(tools, list))
                  and (state.get("reply_start") is None or isinstance(state.get("reply_start"), int)))
        try:
            if ok and messages:
                check_messages(messages)
        except InvalidParamsError:
            ok = False
        if not ok:
            raise CorruptBlockError(f"snapshot {head} of session {session_id}: its recorded session state is malformed",
                                    session_id=session_id, snapshot_id=head, block="state")
        return cls(id=session_id, mode=state.get("mode"), messages=list(messages), tools=tools,
                   tokens=list(token_ids) + list(pending), processed=len(token_ids),
                   metadata=dict(state.get("metadata", {})), head=head, reply_start=state.get("reply_start"))


def check_json(value: Any, name: str) -> Any:
    """Refuse what a snapshot could not hold exactly: it must survive a JSON round trip unchanged."""
    try:
        same = json.loads(json.dumps(value)) == value
    except (TypeError, ValueError):
        same = False
    if not same:
        raise InvalidParamsError(f"{name} must be plain JSON data (string keys; no bytes, NaN or other types)",
                                 param=name)
    return value


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate chat messages: a list of {"role": str, "content": str, ...} maps of plain JSON data.

    OpenAI's tool turns are accepted as OpenAI clients send them: an assistant message may carry
    `tool_calls` (each `{"id"?, "type"?: "function", "function": {"name", "arguments"}}`, arguments
    a JSON object or its JSON text) and then null or no content; a `tool` message answers one call
    and names it with `tool_call_id`. They are kept as sent; `ChatTemplate` adapts a copy.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidParamsError("messages must be a non-empty list of {role, content} maps")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidParamsError(f"message {i} must be a map with string 'role' and 'content'", index=i)
        _check_tool_turn(i, m)
        if not isinstance(m.get("content", ""), str) and not (m["content"] is None and m.get("tool_calls")):
            raise InvalidParamsError(f"message {i} must have string 'content' (null only beside tool_calls)",
                                     index=i)
    return [dict(m) for m in check_json(messages, "messages")]


def _check_tool_turn(i: int, m: dict[str, Any]) -> None:
    if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise InvalidParamsError(f"message {i}: a tool message needs 'tool_call_id', the id of the call it answers",
                                 index=i)
    if "tool_calls" not in m:
        return
    calls = m["tool_calls"]
    if m["role"] != "assistant" or not isinstance(calls, list):
        raise InvalidParamsError(f"message {i}: tool_calls must be a list, on an assistant message", index=i)
    for j, call in enumerate(calls):
        f = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]
                or not isinstance(call.get("id", ""), str) or call.get("type", "function") != "function"
                or not isinstance(tool_arguments(f.get("arguments", {})), dict)):
            raise InvalidParamsError(
                f"message {i}: tool_calls[{j}] must be {{id?, type?: \"function\", function: {{name, arguments}}}} "
                "with arguments a JSON object (or its JSON text)", index=i)


def tool_arguments(arguments: Any) -> Any:
    """A tool call's arguments as data: OpenAI clients send them as JSON text, templates want a map."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return None
