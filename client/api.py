"""Every RPC method as a Python method, written once for both clients.

`ClientAPI` names each daemon method (daemon/fronts/methods.py is the source of truth
for names and params) and says how to decode its result. A transport subclass
supplies one primitive, `_rpc(method, params, decode, stream)`: the sync
`Client` returns the decoded result (or a `Stream`), `AsyncClient` returns an
awaitable of the same. So `client.status()` and `await aclient.status()` are
the same call by construction, and `Session` serves both: bound to an
`AsyncClient`, each of its methods returns an awaitable.

Params left as None are not sent, so the daemon's defaults apply (greedy
sampling, max_tokens 256).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import kvwake
from kvwake.client.wire import Reply
from kvwake.protocol import PROTOCOL_VERSION

__all__ = ["ClientAPI", "Messages", "Session"]

Messages = str | dict[str, Any] | Sequence[dict[str, Any]]
Decode = Callable[[Any], Any] | None


def messages_list(messages: Messages) -> list[dict[str, Any]]:
    """A string is one user message; a map is one message; a list is sent as is."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if isinstance(messages, dict):
        return [messages]
    return list(messages)


def _given(**params: Any) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


def _generate_params(max_tokens: int | None, temperature: float | None, top_p: float | None, top_k: int | None,
                     min_p: float | None, repetition_penalty: float | None, seed: int | None,
                     stop: str | Sequence[str] | None, stream: bool, structure: dict[str, Any]) -> dict[str, Any]:
    if stop is not None and not isinstance(stop, str):
        stop = list(stop)
    return _given(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                  repetition_penalty=repetition_penalty, seed=seed, stop=stop, stream=True if stream else None,
                  **_structure(**structure))


def _structure(json_schema: Any = None, grammar: str | None = None,
               tool_choice: str | dict[str, Any] | None = None) -> dict[str, Any]:
    """Structured output params: a schema map (or a pydantic model class: its JSON schema), a Lark grammar,
    or tool_choice "auto", "required" or a tool's name."""
    if json_schema is not None and hasattr(json_schema, "model_json_schema"):
        json_schema = json_schema.model_json_schema()
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "required"):
        tool_choice = {"name": tool_choice}
    return _given(json_schema=json_schema, grammar=grammar, tool_choice=tool_choice)


def _key(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda result: result[name]


class ClientAPI:
    """The daemon's methods; see `Client` and `AsyncClient` for the transports."""

    def _rpc(self, method: str, params: dict[str, Any], decode: Decode = None, stream: bool = False) -> Any:
        raise NotImplementedError

    def call(self, method: str, params: dict[str, Any] | None = None, *, stream: bool = False) -> Any:
        """Call any RPC method by name with a params map; returns its raw result map (or a Stream)."""
        return self._rpc(method, dict(params or {}), None, stream)

    # -- daemon ---------------------------------------------------------------

    def hello(self, client: str = "kvwake-python") -> Any:
        """Server name, version, protocol, model and bundle hash; INVALID_PARAMS if protocols differ."""
        return self._rpc("hello", {"client": f"{client}/{kvwake.__version__}", "protocol": PROTOCOL_VERSION})

    def status(self) -> Any:
        """Model, bundle hash, pid, sessions hot/asleep, memory, store size, counters."""
        return self._rpc("status", {})

    def stats(self) -> Any:
        """Latency summaries (sleep, wake, ttft), block and token reuse rates."""
        return self._rpc("stats", {})

    def shutdown(self) -> Any:
        """Ask the daemon to stop; it sleeps every hot session first."""
        return self._rpc("shutdown", {})

    # -- models ---------------------------------------------------------------

    def models(self) -> Any:
        """Every model served → [{name, aliases, patterns, pinned, state: loaded|loading|unloaded, sessions}]."""
        return self._rpc("model.list", {}, _key("models"))

    def models_memory(self) -> Any:
        """The models' one memory budget as the daemon counts it → {budget_bytes, weights_bytes, hot_kv_bytes}."""
        return self._rpc("model.list", {}, _key("memory"))

    def load_model(self, name: str) -> Any:
        """Load a model now (it would load at its first request) → {model, loaded, bundle_hash, phases_ms}."""
        return self._rpc("model.load", {"name": name})

    def unload_model(self, name: str) -> Any:
        """Sleep the model's hot sessions and unload it → {model, unloaded, slept}; INVALID_PARAMS if pinned."""
        return self._rpc("model.unload", {"name": name})

    # -- sessions -------------------------------------------------------------

    def create_session(self, session_id: str | None = None, *, system: str | None = None,
                       metadata: dict[str, Any] | None = None, exist_ok: bool = False,
                       model: str | None = None) -> Any:
        """Create a session → {session_id, created}, on `model` (a name the daemon serves; None: its default),
        for good. INVALID_PARAMS if it exists and not exist_ok; NOT_FOUND for a model not served."""
        params = _given(session_id=session_id, system=system, metadata=metadata, model=model)
        return self._rpc("session.create", {**params, **({"exist_ok": True} if exist_ok else {})})

    def session(self, session_id: str | None = None, *, system: str | None = None,
                metadata: dict[str, Any] | None = None, model: str | None = None) -> Any:
        """Create or get a session → `Session`. system/metadata/model apply only when it is created."""
        params = _given(session_id=session_id, system=system, metadata=metadata, model=model)
        return self._rpc("session.create", {**params, "exist_ok": True},
                         lambda r: Session(self, r["session_id"], created=r.get("created")))

    def list_sessions(self) -> Any:
        """Every session the daemon knows → [{session_id, state: hot|asleep, busy, tokens}]."""
        return self._rpc("session.list", {}, _key("sessions"))

    def session_page(self, *, limit: int | None = None, after: str | None = None, origin: str | None = None,
                     state: str | None = None) -> Any:
        """One page of sessions in id order → {sessions: [{session_id, state, busy, tokens, origin}], next}:
        at most `limit` (default 100, at most 1000) after the id `after`, of metadata `origin` and `state`
        ("hot" or "asleep") when given; pass `next` as `after` for the following page (None: no more)."""
        return self._rpc("session.list", {"limit": 100 if limit is None else limit,
                                          **_given(after=after, origin=origin, state=state)})

    def session_info(self, session_id: str) -> Any:
        """One session: state, tokens, metadata, head snapshot, snapshot count (and KV bytes when hot)."""
        return self._rpc("session.info", {"session_id": session_id})

    def delete_session(self, session_id: str) -> Any:
        """Forget a session and its snapshots → {session_id, snapshots_removed}."""
        return self._rpc("session.delete", {"session_id": session_id})

    def append(self, session_id: str, messages: Messages | None = None, *, text: str | None = None,
               tokens: list[int] | None = None, tools: list[dict[str, Any]] | None = None) -> Any:
        """Add input without generating (one of messages, text, tokens) → {tokens, prefilled, reused}."""
        params = _given(session_id=session_id, messages=None if messages is None else messages_list(messages),
                        text=text, tokens=tokens, tools=tools)
        return self._rpc("session.append", params)

    def generate(self, session_id: str, *, max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
                 repetition_penalty: float | None = None, seed: int | None = None,
                 stop: str | Sequence[str] | None = None, stream: bool = False, json_schema: Any = None,
                 grammar: str | None = None, tool_choice: str | dict[str, Any] | None = None) -> Any:
        """Generate from what the session holds → `Reply`, or a `Stream` of text pieces if stream=True.

        temperature 0 (the default) is greedy; seed makes sampling repeatable; stop
        strings end generation (they are not part of the text). Structured output (at most one):
        `json_schema` (a schema map or a pydantic model class) makes the text JSON valid against
        it; `grammar`, an llguidance Lark grammar; `tool_choice` "required" or a tool's name makes
        the reply a call to the session's tools. A reply cut first finishes "length".
        """
        gen = _generate_params(max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, seed, stop, stream,
                               {"json_schema": json_schema, "grammar": grammar, "tool_choice": tool_choice})
        return self._rpc("session.generate", {"session_id": session_id, **gen}, Reply.from_wire, stream)

    def chat(self, session_id: str, messages: Messages, *, tools: list[dict[str, Any]] | None = None,
             max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
             top_k: int | None = None, min_p: float | None = None, repetition_penalty: float | None = None,
             seed: int | None = None, stop: str | Sequence[str] | None = None, stream: bool = False,
             json_schema: Any = None, grammar: str | None = None, tool_choice: str | dict[str, Any] | None = None) -> Any:
        """Append messages (a string is one user message), then generate: as `generate` (structured
        output too: `tool_choice` picks among `tools`).

        The reply is kept in the session as the assistant's turn.
        """
        gen = _generate_params(max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, seed, stop, stream,
                               {"json_schema": json_schema, "grammar": grammar, "tool_choice": tool_choice})
        params = {"session_id": session_id, "messages": messages_list(messages), **_given(tools=tools), **gen}
        return self._rpc("session.chat", params, Reply.from_wire, stream)

    def sleep(self, session_id: str) -> Any:
        """Write the session's KV to disk and free it → {snapshot_id, tokens, raw_bytes, stored_bytes, ms, ...}."""
        return self._rpc("session.sleep", {"session_id": session_id})

    def wake(self, session_id: str, snapshot_id: str | None = None) -> Any:
        """Restore the session (from its latest or a given snapshot) → {snapshot_id, tokens, ms, ...}."""
        return self._rpc("session.wake", _given(session_id=session_id, snapshot_id=snapshot_id))

    def fork(self, session_id: str, new_session_id: str | None = None, *, snapshot_id: str | None = None) -> Any:
        """A new session starting where this one is now (or at snapshot_id) → {session_id, snapshot_id, ...}."""
        params = _given(session_id=session_id, new_session_id=new_session_id, snapshot_id=snapshot_id)
        return self._rpc("session.fork", params)

    def checkpoint(self, session_id: str, label: str) -> Any:
        """A labeled snapshot of the session now (gc keeps it); the session stays hot → {snapshot_id, label}."""
        return self._rpc("session.checkpoint", {"session_id": session_id, "label": label})

    # -- snapshots and the store ----------------------------------------------

    def list_snapshots(self, session_id: str | None = None) -> Any:
        """Snapshots, oldest first, of one session or all → [{id, session_id, n_tokens, label, ...}]."""
        return self._rpc("snapshot.list", _given(session_id=session_id), _key("snapshots"))

    def export_snapshot(self, snapshot_id: str, path: str | os.PathLike[str]) -> Any:
        """Write a portable snapshot file at path (the daemon writes it: the folder must exist)."""
        return self._rpc("snapshot.export", {"snapshot_id": snapshot_id, "path": _absolute(path)})

    def import_snapshot(self, path: str | os.PathLike[str], *, session_id: str | None = None) -> Any:
        """Import a portable snapshot file (as session_id, or its own session) → {session_id, snapshot_id, ...}."""
        return self._rpc("snapshot.import", _given(path=_absolute(path), session_id=session_id))

    def warm_prefix(self, messages: Messages | None = None, *, text: str | None = None,
                    tokens: list[int] | None = None) -> Any:
        """Prefill a shared prompt once and pin its blocks, so sessions that start with it reuse them."""
        params = _given(messages=None if messages is None else messages_list(messages), text=text, tokens=tokens)
        return self._rpc("prefix.warm", params)

    def gc(self, *, remote: bool = False, grace_s: float | None = None, verify: bool = False) -> Any:
        """Prune old unlabeled snapshots, evict prefix blocks over budget, sweep orphan files; with remote,
        collect the shared tier instead (objects no manifest names, older than grace_s; verify: damaged ones)."""
        params = {"remote": True, "verify": verify, **({"grace_s": grace_s} if grace_s is not None else {})}
        return self._rpc("store.gc", params if remote else {})

    def fsck(self) -> Any:
        """Verify every block and snapshot → {ok, bad_blocks, damaged_snapshots, orphans, ...}."""
        return self._rpc("store.fsck", {})


def _absolute(path: str | os.PathLike[str]) -> str:
    """The daemon resolves no relative paths (its cwd is not ours): send an absolute one."""
    return str(Path(path).expanduser().absolute())


class Session:
    """One conversation on the daemon, bound to a `Client` (or `AsyncClient`: then await each method).

    `created` says whether `client.session(...)` created it (None when unknown).
    Options of `chat` and `generate` are those of `Client.generate`.
    """

    def __init__(self, client: ClientAPI, session_id: str, *, created: bool | None = None) -> None:
        self.client, self.id, self.created = client, session_id, created

    def __repr__(self) -> str:
        return f"Session({self.id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Session) and (self.client, self.id) == (other.client, other.id)

    def __hash__(self) -> int:
        return hash((id(self.client), self.id))

    def chat(self, messages: Messages, **options: Any) -> Any:
        """Append messages (a string is one user message) and generate → `Reply` or `Stream`."""
        return self.client.chat(self.id, messages, **options)

    def append(self, messages: Messages | None = None, **inputs: Any) -> Any:
        """Add input without generating: messages, or text=..., or tokens=[...]."""
        return self.client.append(self.id, messages, **inputs)

    def generate(self, **options: Any) -> Any:
        """Generate from what the session holds → `Reply` or `Stream`."""
        return self.client.generate(self.id, **options)

    def sleep(self) -> Any:
        return self.client.sleep(self.id)

    def wake(self, snapshot_id: str | None = None) -> Any:
        return self.client.wake(self.id, snapshot_id)

    def fork(self, new_session_id: str | None = None, *, snapshot_id: str | None = None) -> Any:
        """A new `Session` that starts where this one is now (or at snapshot_id)."""
        params = _given(session_id=self.id, new_session_id=new_session_id, snapshot_id=snapshot_id)
        return self.client._rpc("session.fork", params, lambda r: Session(self.client, r["session_id"], created=True))

    def checkpoint(self, label: str) -> Any:
        return self.client.checkpoint(self.id, label)

    def info(self) -> Any:
        return self.client.session_info(self.id)

    def snapshots(self) -> Any:
        return self.client.list_snapshots(self.id)

    def delete(self) -> Any:
        return self.client.delete_session(self.id)
