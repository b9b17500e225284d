"""What the daemon reports of itself and its sessions, and the store's maintenance, for the fronts.

The fronts (RPC methods, HTTP routes) ask the session manager for sessions'
operations, and these for what reads across the manager's parts (the models,
their engines and threads, the store, the remote tier), so that no front
reaches into them. Each takes the manager; parameters are checked by the
fronts, these take checked values.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
from pathlib import Path
from typing import Any

from anyio import to_thread

import kvwake
from kvwake.daemon.sessions.entries import Entry
from kvwake.daemon.sessions.manager import SessionManager
from kvwake.errors import InvalidParamsError
from kvwake.protocol import PROTOCOL_VERSION

__all__ = ["export", "fsck", "gc", "hello", "remote_gc", "session_info", "session_list", "session_page", "snapshots",
           "stats", "status"]


def hello(m: SessionManager) -> dict[str, Any]:
    model = m.model if len(m.models) else None  # the default model, else the first loaded
    return {"server": "kvwake", "version": kvwake.__version__, "protocol": PROTOCOL_VERSION,
            "model": model.name if model is not None else m.model_names()[0],
            "bundle_hash": model.bundle.hash if model is not None else None}


async def status(m: SessionManager) -> dict[str, Any]:
    """The daemon's state: every model served (`models`: sessions/models.py model_states) and, of the default
    model (else the first loaded; none loaded: left out), its engine's memory, generation and thread."""
    hot = len(m.entries.hot)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    store = m.store
    model = m.model if len(m.models) else None
    # the points counted written are read before the store counts its points: a write lands between the
    # two reads, and read the other way round status showed a point written that the store did not count
    points = {**model.engine.points.status(), **model.engine.reply_points.status()} if model is not None else None
    report = {"pid": os.getpid(), "models": m.model_states(), "sessions": {"hot": hot, "asleep": len(m.entries) - hot},
              "tuning": dataclasses.asdict(m.settings.tuning),
              "store": {"stored_bytes": await to_thread.run_sync(store.stored_bytes),
                        "path": str(store.root), "codec": store.codec, "codec_choice": store.codec_choice,
                        "auto_among": list(store.auto_among) if store.auto_among else None,
                        **await to_thread.run_sync(store.points_summary)},  # restore points: how many, bytes
              "gc": m.collector.summary(), "gil": m.gil_watch.summary() if m.gil_watch is not None else None,
              "turns": list(m.turns), "startup_ms": m.started.ms, "counters": dict(m.counters),
              "restart_prefetch": m.hot_set.status() if m.hot_set is not None else None,
              **({"remote": m.remote.status()} if m.remote is not None else {})}
    if model is None:
        return {"model": None, "bundle_hash": None, **report}
    engine, thread = model.engine, model.thread
    return {**report, "model": model.name, "bundle_hash": engine.bundle.hash,
            "memory": {"hot_kv_bytes": m.hot_bytes(), "freeing_kv_bytes": m.freeing_bytes(),
                       # sessions whose KV is being freed (a paged one's bytes are its pages': 0 above)
                       "freeing_sessions": len(m.releasing),
                       "hot_budget_bytes": m.hot_budget(), "kv_room_bytes": engine.kv_room_bytes,
                       "ram_tier_bytes": engine.ram_tier.bytes, "peak_rss_bytes": rss,
                       "mlx_memory_limit_bytes": engine.limits.memory_bytes if engine.limits else None,
                       "mlx_cache_limit_bytes": engine.limits.cache_bytes if engine.limits else None,
                       "weights_bytes": engine.weights_bytes, "kv_bytes_per_token": engine.token_bytes,
                       "max_session_tokens": engine.max_tokens, **engine.mlx_memory()},
            "persistence": engine.persister.status(),
            "restore_points": points,
            **({"pages": engine.pages.status()} if engine.pages is not None else {}),
            "generation": {"mode": engine.decode_mode, "reason": engine.decode_reason,
                           "max_batch": engine.decoder.max_batch, "cuda_graphs": engine.cuda_graphs,
                           "quantized": engine.quantized_status(), **engine.decoder.status()},
            "engine_thread": thread.timing(),
            "counters": {**m.counters, **engine.counters}}


def stats(m: SessionManager) -> dict[str, Any]:
    c = m.engine.counters
    blocks = c["blocks_ram"] + c["blocks_disk"]
    tokens = c["tokens_reused"] + c["tokens_prefilled"]
    return {"latency": {k: v.summary() for k, v in m.latency.items()},
            "blocks": {"from_memory": c["blocks_ram"], "from_disk": c["blocks_disk"],
                       "memory_hit_rate": round(c["blocks_ram"] / blocks, 4) if blocks else None},
            "tokens": {"reused": c["tokens_reused"], "prefilled": c["tokens_prefilled"],
                       "reuse_rate": round(c["tokens_reused"] / tokens, 4) if tokens else None},
            "engine_busy_s": round(m.thread.busy_s, 3), "counters": m.counters}


def summary(e: Entry) -> dict[str, Any]:
    s = e.session
    return {"session_id": e.id, "state": "hot" if s is not None else "asleep", "busy": e.busy,
            "tokens": len(s.tokens) if s is not None else None, "model": e.model}


async def session_list(m: SessionManager) -> dict[str, Any]:
    """Every session known, and those other daemons published to the remote tier (waking one makes it ours)."""
    listed: dict[str, Any] = {"sessions": [summary(e) for e in m.entries.values()]}
    if m.remote is not None:
        remote, error = await m.remote.sessions()
        listed["sessions"] += [{"session_id": sid, "state": "remote", "busy": None, "tokens": None}
                               for sid in remote if sid not in m.entries]
        listed["remote_error"] = error
    return listed


async def session_page(m: SessionManager, limit: int, after: str | None, origin: str | None,
                       state: str | None) -> dict[str, Any]:
    """One page of sessions, in id order after `after`: the store names the ids a page at a time (an index
    range on a worker thread) and the page is filtered here, so no step reads every session."""
    sessions: list[dict[str, Any]] = []
    while len(sessions) < limit:
        rows = await to_thread.run_sync(lambda: m.store.session_page(after=after, limit=limit, origin=origin))
        for row in rows:
            after, entry = row["id"], m.entries.get(row["id"])
            if entry is not None and state in (None, "hot" if entry.session is not None else "asleep"):
                sessions.append({**summary(entry), "origin": row["origin"]})
                if len(sessions) == limit:
                    break
        if len(rows) < limit:
            return {"sessions": sessions, "next": None}
    return {"sessions": sessions, "next": after}


async def session_info(m: SessionManager, session_id: Any) -> dict[str, Any]:
    e = m.entry(session_id)
    row = await to_thread.run_sync(m.store.session, e.id)
    snaps = await to_thread.run_sync(m.store.snapshots, e.id)
    info = {**summary(e), "metadata": row["metadata"], "head": row["head"], "snapshots": len(snaps),
            # tokens whose KV a crash keeps: the head's (a sleep's, or a persistence checkpoint's)
            "persisted_tokens": next((s["n_tokens"] for s in snaps if s["id"] == row["head"]), 0)}
    if e.session is not None:
        s = e.session
        info.update(tokens=len(s.tokens), processed=s.processed, mode=s.mode, messages=len(s.messages),
                    kv_bytes=m.engine.cache_bytes(s))
    elif row["head"] is not None:  # its tokens: the snapshot's KV plus the pending ones it recorded
        head = await to_thread.run_sync(m.store.snapshot_summary, row["head"])
        info.update(tokens=head["n_tokens"] + len(head["metadata"].get("pending", [])))
    return info


async def snapshots(m: SessionManager, session_id: Any = None) -> list[dict[str, Any]]:
    """The snapshots of one session (NotFoundError for an unknown one), or of all."""
    if session_id is not None:
        m.entry(session_id)
    return await to_thread.run_sync(m.store.snapshots, session_id)


async def export(m: SessionManager, snapshot_id: str, path: Path) -> dict[str, Any]:
    return await to_thread.run_sync(m.store.export, snapshot_id, path)


async def gc(m: SessionManager) -> dict[str, Any]:
    report = await to_thread.run_sync(lambda: m.store.gc(budget_bytes=m.settings.store_budget_bytes))
    return dict(report.__dict__)


async def fsck(m: SessionManager) -> dict[str, Any]:
    report = await to_thread.run_sync(m.store.fsck)
    return {**report.__dict__, "ok": report.ok}


async def remote_gc(m: SessionManager, grace_s: float, verify: bool) -> dict[str, Any]:
    """The shared tier's gc (store/remote/gc.py); InvalidParamsError without --remote."""
    if m.remote is None:
        raise InvalidParamsError("remote gc needs a daemon serving with --remote, and grace_s seconds >= 0")
    return await m.remote.gc(grace_s, verify)
