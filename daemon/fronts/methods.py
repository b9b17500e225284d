"""The RPC methods: names, parameters and results (docs/protocol.md is their reference).

Each method takes the request context and its params map and returns a map.
Params are checked here; anything wrong is INVALID_PARAMS naming the param.
Unknown params are refused too, so a typo never silently does nothing.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.model.grammar import GRAMMAR_KEYS
from kvwake.daemon.sessions import reports
from kvwake.daemon.sessions.manager import SessionManager
from kvwake.errors import InvalidParamsError
from kvwake.protocol import PROTOCOL_VERSION

__all__ = ["METHODS", "Context"]

GENERATE_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logit_bias", "seed", "stop", "stream", *GRAMMAR_KEYS}
INPUT_KEYS = {"messages", "text", "tokens", "tools"}


@dataclass
class Context:
    """What a method may use: the manager, the requesting connection's hooks, the server's."""

    manager: SessionManager
    msgid: int
    notify: Callable[[dict[str, Any]], None]  # sends [2, "stream", {...}] tied to this request
    closed: Callable[[], bool]  # the client went away
    shutdown: Callable[[], None]
    extra: dict[str, Any] = field(default_factory=dict)


def _check(params: dict[str, Any], allowed: set[str], required: set[str] = frozenset()) -> dict[str, Any]:
    unknown = set(params) - allowed
    if unknown:
        raise InvalidParamsError(f"unknown params {sorted(unknown)}; allowed: {sorted(allowed)}")
    missing = required - set(params)
    if missing:
        raise InvalidParamsError(f"missing params {sorted(missing)}")
    return params


def _id(p: dict[str, Any], name: str, *, required: bool = False) -> str | None:
    """A snapshot id param: a short string (or absent when not required)."""
    value = p.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= 128:
        raise InvalidParamsError(f"{name} must be a snapshot id string", param=name)
    return value


def _path(value: Any, name: str, ctx: Context, *, must_exist: bool) -> Path:
    """An absolute path outside the data dir; the file must exist (import) or its folder must (export)."""
    if not isinstance(value, str) or not value or "\0" in value or not os.path.isabs(value):
        raise InvalidParamsError(f"{name} must be an absolute path", param=name)
    path = Path(value).resolve()
    data = ctx.manager.settings.data_dir.resolve()
    if path.is_relative_to(data):
        raise InvalidParamsError(f"{name} {path} is inside the daemon's data dir", param=name)
    if must_exist and not path.is_file():
        raise InvalidParamsError(f"{name} {path} is not a file", param=name)
    if not must_exist and (not path.parent.is_dir() or path.exists()):
        raise InvalidParamsError(f"{name} {path}: folder must exist and the file must not", param=name)
    return path


async def hello(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"client", "protocol"})
    protocol = p.get("protocol", PROTOCOL_VERSION)
    if protocol != PROTOCOL_VERSION:
        raise InvalidParamsError(f"protocol {protocol!r} not supported; this server speaks {PROTOCOL_VERSION}",
                                 supported=[PROTOCOL_VERSION])
    return reports.hello(ctx.manager)


async def status(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, set())
    return await reports.status(ctx.manager)


async def stats(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, set())
    return reports.stats(ctx.manager)


async def session_create(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"session_id", "system", "metadata", "exist_ok", "model"})
    async with ctx.manager.using(p.get("model")):  # the session's model for good (None: the default)
        return await ctx.manager.create(p.get("session_id"), p.get("system"), p.get("metadata"),
                                        bool(p.get("exist_ok")))


async def model_list(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, set())
    m = ctx.manager  # and the one memory budget they share (model/budget.py)
    return {"models": m.model_states(), "memory": {"budget_bytes": m.budget(), "weights_bytes": m.weights_loaded(),
                                                   "hot_kv_bytes": m.hot_bytes()}}


def _model_name(ctx: Context, p: dict[str, Any]) -> str:
    """The `name` param: a model served, by its name or an alias (NOT_FOUND naming those served)."""
    _check(p, {"name"}, {"name"})
    return ctx.manager.registry.resolve(p["name"]).name


async def model_load(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    name = _model_name(ctx, p)
    loaded = ctx.manager.is_loaded(name)
    model = await ctx.manager.ensure(name)
    # where the load went (the engine's start, by phase): what a neighbour's stream saw during it lines up
    return {"model": name, "loaded": not loaded, "bundle_hash": model.bundle.hash,
            "phases_ms": model.started_ms if not loaded else {},
            "weight_pieces": model.weight_pieces if not loaded else []}


async def model_unload(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    return await ctx.manager.unload(_model_name(ctx, p))


LIST_PAGE_MAX = 1000  # sessions one paged session.list returns at most


async def session_list(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"limit", "after", "origin", "state"})
    if not p:
        return await reports.session_list(ctx.manager)
    limit, state = p.get("limit", 100), p.get("state")
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= LIST_PAGE_MAX:
        raise InvalidParamsError(f"limit must be an integer in [1, {LIST_PAGE_MAX}], got {limit!r}", param="limit")
    for name in ("after", "origin"):
        if p.get(name) is not None and not isinstance(p[name], str):
            raise InvalidParamsError(f"{name} must be a string, got {p[name]!r}", param=name)
    if state not in (None, "hot", "asleep"):
        raise InvalidParamsError(f'state must be "hot" or "asleep", got {state!r}', param="state")
    return await reports.session_page(ctx.manager, limit, p.get("after"), p.get("origin"), state)


async def session_info(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"session_id"}, {"session_id"})
    return await reports.session_info(ctx.manager, p["session_id"])


async def session_delete(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"session_id"}, {"session_id"})
    return await ctx.manager.delete(p["session_id"])


async def session_append(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"session_id"} | INPUT_KEYS, {"session_id"})
    inputs = {k: p[k] for k in INPUT_KEYS if k in p}
    return await ctx.manager.append(p["session_id"], ctx.closed, **inputs)


async def _generate(ctx: Context, p: dict[str, Any], inputs: dict[str, Any] | None) -> dict[str, Any]:
    params = GenerateParams.from_params({k: v for k, v in p.items() if k in GENERATE_KEYS})
    on_event = ctx.notify if p.get("stream") else None  # events are the notifications' maps (model/toolcalls.py)
    return await ctx.manager.generate(p["session_id"], params, on_event, ctx.closed, inputs)


async def session_generate(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"session_id"} | GENERATE_KEYS, {"session_id"})
    return await _generate(ctx, p, None)


async def session_chat(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"session_id", "messages", "tools"} | GENERATE_KEYS, {"session_id", "messages"})
    inputs = {"messages": p["messages"], **({"tools": p["tools"]} if "tools" in p else {})}
    return await _generate(ctx, p, inputs)


def _flag(p: dict[str, Any], name: str) -> bool:
    if not isinstance(p.get(name, False), bool):
        raise InvalidParamsError(f"{name} must be true or false", param=name)
    return p.get(name, False)


async def session_sleep(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"session_id", "remote_wait", "release"}, {"session_id"})
    return await ctx.manager.sleep(p["session_id"], remote_wait=_flag(p, "remote_wait"), release=_flag(p, "release"))


async def session_wake(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"session_id", "snapshot_id", "take_over"}, {"session_id"})
    return await ctx.manager.wake(p["session_id"], _id(p, "snapshot_id"), _flag(p, "take_over"))


async def session_fork(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"session_id", "new_session_id", "snapshot_id"}, {"session_id"})
    return await ctx.manager.fork(p["session_id"], p.get("new_session_id"), _id(p, "snapshot_id"))


async def session_checkpoint(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"session_id", "label"}, {"session_id", "label"})
    if not isinstance(p["label"], str) or not 0 < len(p["label"]) <= 200:
        raise InvalidParamsError("label must be a string of 1-200 characters", param="label")
    return {"snapshot_id": await ctx.manager.snapshot_now(p["session_id"], p["label"]), "label": p["label"]}


async def snapshot_list(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"session_id"})
    return {"snapshots": await reports.snapshots(ctx.manager, p.get("session_id"))}


async def snapshot_export(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"snapshot_id", "path"}, {"snapshot_id", "path"})
    path = _path(p["path"], "path", ctx, must_exist=False)
    return await reports.export(ctx.manager, _id(p, "snapshot_id", required=True), path)


async def snapshot_import(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"path", "session_id"}, {"path"})
    path = _path(p["path"], "path", ctx, must_exist=True)
    return await ctx.manager.import_snapshot(path, p.get("session_id"))


async def prefix_warm(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, INPUT_KEYS - {"tools"} | {"model"})
    async with ctx.manager.using(p.get("model")):  # the model whose blocks are stored (None: the default)
        return await ctx.manager.warm({k: p[k] for k in ("messages", "text", "tokens") if k in p})


async def store_gc(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, {"remote", "grace_s", "verify"})
    if _flag(p, "remote"):  # the shared tier's gc instead (store/remote/gc.py)
        grace = p.get("grace_s", 3600.0)
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace < 0:
            raise InvalidParamsError("remote gc needs a daemon serving with --remote, and grace_s seconds >= 0")
        return {"remote": await reports.remote_gc(ctx.manager, float(grace), _flag(p, "verify"))}
    if set(p) - {"remote"}:
        raise InvalidParamsError("grace_s and verify go with remote: true")
    return await reports.gc(ctx.manager)


async def store_fsck(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, set())
    return await reports.fsck(ctx.manager)


async def shutdown(ctx: Context, p: dict[str, Any]) -> dict[str, Any]:
    _check(p, set())
    ctx.shutdown()
    return {"stopping": True}


METHODS: dict[str, Callable[[Context, dict[str, Any]], Awaitable[dict[str, Any]]]] = {
    "hello": hello, "status": status, "stats": stats,
    "session.create": session_create, "session.list": session_list, "session.info": session_info,
    "session.delete": session_delete, "session.append": session_append, "session.generate": session_generate,
    "session.chat": session_chat, "session.sleep": session_sleep, "session.wake": session_wake,
    "session.fork": session_fork, "session.checkpoint": session_checkpoint,
    "snapshot.list": snapshot_list, "snapshot.export": snapshot_export, "snapshot.import": snapshot_import,
    "model.list": model_list, "model.load": model_load, "model.unload": model_unload,
    "prefix.warm": prefix_warm, "store.gc": store_gc, "store.fsck": store_fsck, "shutdown": shutdown,
}
