"""Which session a stateless request continues, and which hot session's KV a new one copies.

OpenAI clients send the whole conversation every turn. A request that names no
session is matched against the sessions earlier stateless requests made
(metadata `origin: "http"`), hot or asleep, by the longest common token prefix
of its rendered prompt with each session's tokens:

- the best session's last prompt lies wholly inside the request (the prefix
  reaches its `reply_start`): the request is that conversation's next turn, and
  it **continues the session in place** (the cache keeps the common prefix; a
  reply the client re-rendered differently costs only its own tokens);
- otherwise (the request branches off earlier: a retried turn, an edited
  message, another agent with the same system prompt; or nothing matched): a
  **new session**, whose first append copies the longest shared prefix's KV
  from a hot session in memory (the session manager's `_hot_prefix`: RPC
  sessions benefit too), or restores it from stored blocks, instead of
  prefilling it. The source is left as it was.

A busy session is never a candidate: another request is continuing it. Sessions
created over RPC are not candidates either: a request that did not name them
must not change them (give one `metadata.origin = "http"` to make it one).

How the best is found, whatever the number of sessions (matching by chain key): asleep
sessions are looked up in the store by the chain keys of the request's blocks
(`Store.deepest_heads`, on a worker thread: a binary search over the keys, then
the few stored pieces nearest the request's next tokens), so nothing is held
per asleep session beyond the manager's entry; hot ones (bounded by the hot-KV
budget, and indexed by the manager's `entries.hot`) are compared token by token.
A stored head counts its recorded pending tokens (the last generated one) when
the request contains the whole head. On a tie the oldest session wins.

A request may bring a `Hint` (the Responses API):
- `lineage` (its `prompt_cache_key`): sessions made under another key are
  never continued in place, only branched from; the key is kept in the
  metadata of the sessions made under it, and on a tie the request's own
  lineage wins;
- `session_id` and `position` (a stored response its `previous_response_id`
  names): only that session is continued in place, and only while it holds
  no more than `position` tokens (it has not moved on past that response)
  and the rule above holds; otherwise a new session branches from the shared
  prefix, and the session is left as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from anyio import to_thread

from kvwake.daemon.session_state import common_prefix, new_session_id
from kvwake.daemon.sessions.entries import Entry
from kvwake.daemon.sessions.hotkeys import shared_from
from kvwake.daemon.model.generation import OnEvent
from kvwake.daemon.sessions.manager import Prepared, SessionManager
from kvwake.daemon.sessions.responses import ResponseRecords
from kvwake.errors import BusyError, NotFoundError

__all__ = ["ORIGIN", "Hint", "Match", "Matcher", "expire"]

log = logging.getLogger("kvwake.matching")
ORIGIN = "http"  # the metadata origin of sessions stateless requests made (and may continue)


LINEAGE = "prompt_cache_key"  # the session metadata key of its lineage
EXPIRE_PAGE = 256  # stale sessions named per store read while expiring
LOOKUPS = 4  # store lookups per request while the best heads found are busy or hot (then matched without them)
MATCH_TRIES = 8  # a stateless request whose chosen session another took first is matched again


@dataclass(frozen=True)
class Hint:
    """What a request says of where it belongs: a lineage key, and the session and token position a
    previous response ended at (see the module docstring)."""

    lineage: str | None = None
    session_id: str | None = None
    position: int | None = None


@dataclass(frozen=True)
class Candidate:
    """A session a request may continue: its common prefix with the request and where its last reply starts."""

    session_id: str
    shared: int
    reply_start: int
    created: float
    lineage: str | None = None  # its prompt_cache_key (read only when the request has one)


@dataclass(frozen=True)
class Match:
    """The session a request runs in, and how it was found: "continued", "branched" (new, from a candidate's
    shared prefix) or "new"."""

    session_id: str
    how: str
    shared_tokens: int = 0  # the common prefix with the session it came from
    store_ms: float = 0.0  # of the finding, the store's lookups (on worker threads, with any wait for the store's lock)


class Matcher:
    """Finds (or makes) the session for a stateless request; see the module docstring for the rule."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager

    async def start(self, prepared: Prepared, session_id: str | None, hint: Hint | None, on_event: OnEvent | None,
                    cancelled: Callable[[], bool],
                    on_append: Callable[[dict[str, Any]], None] | None = None) -> tuple[dict[str, Any], asyncio.Task]:
        """Start the generation of a front's prepared request in its session: the one it names (made if new),
        else the one `find` picks, matched again (up to MATCH_TRIES) when another request claims that one
        first. Returns ({"session_id", "match", "shared_tokens"?}, the generation's task)."""
        m, matched, tries = self.manager, time.perf_counter(), 0
        while True:
            tries += 1
            if session_id is not None:
                await m.create(session_id, exist_ok=True)
                session = {"session_id": session_id, "match": "named"}
            else:
                match = await self.find(prepared.plan.target, prepared.plan.mode, hint)
                session = {"session_id": match.session_id, "match": match.how, "shared_tokens": match.shared_tokens}
            phases = {"match": session["match"], "render_ms": prepared.render_ms,
                      "match_ms": round((time.perf_counter() - matched) * 1000, 2),
                      **({} if session_id is not None else {"match_store_ms": match.store_ms})}
            claimed = asyncio.Event()
            task = asyncio.ensure_future(m.generate(session["session_id"], prepared.params, on_event, cancelled,
                                                    prepared, claimed.set, on_append, phases))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a departed client's: retrieved
            # Until it holds the session: a claim may wait for a prefix copy, then lose it to another request.
            waiting = asyncio.ensure_future(claimed.wait())
            try:
                await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiting.cancel()
            taken = not claimed.is_set() and not task.cancelled() and isinstance(task.exception(), BusyError)
            if not (taken and session_id is None and tries < MATCH_TRIES):
                return session, task

    async def find(self, target: list[int], mode: str, hint: Hint | None = None) -> Match:
        """The session `target` (a rendered prompt of `mode` "chat" or "raw") should run in: claimable now, or new."""
        hint = hint or Hint()
        want = np.asarray(target, dtype=np.int64)
        if hint.session_id is not None:
            return await self._follow(hint, want, mode)
        skip: set[str] = set()  # stored candidates found busy or gone: asked again without them
        store_s = 0.0
        for _ in range(LOOKUPS):
            hot = list(self.manager.entries.hot.values())  # their stored heads are stale: found in memory
            found = self._hot_candidates(target, mode, hint.lineage)
            exclude = {entry.id for entry in hot} | skip
            asked = time.perf_counter()
            # Every stored head is then a hot session's: the store would walk each one's rows to leave it out.
            asleep = len(self.manager.entries) > len(hot)
            stored = await to_thread.run_sync(lambda: self.manager.store.deepest_heads(  # the array: no list walk
                self.manager.engine.bundle.hash, want, origin=ORIGIN, mode=mode, exclude=exclude)) if asleep else []
            store_s += time.perf_counter() - asked
            fresh = [c for c in (self._stored(head, want, skip) for head in stored) if c is not None]
            slept = any(entry.session is None for entry in hot)  # meanwhile: its new head was left out
            if len(fresh) == len(stored) and not slept:
                break
        candidates = found + fresh
        if hint.lineage is not None:  # stored candidates' lineage, from their sessions' metadata (a few rows)
            candidates = await to_thread.run_sync(lambda: [self._with_lineage(c) for c in candidates])
        branch = max((c.shared for c in candidates), default=0)  # what a new session shares, whoever's it is
        own = [c for c in candidates if hint.lineage is None or c.lineage in (None, hint.lineage)]
        best = min(own, key=lambda c: (-c.shared, c.lineage != hint.lineage, c.created, c.session_id), default=None)
        if best is not None and best.shared > 0 and best.shared >= best.reply_start:
            return Match(best.session_id, "continued", best.shared, round(store_s * 1000, 2))
        return dataclasses.replace(await self._new(branch, branch > 0, hint.lineage), store_ms=round(store_s * 1000, 2))

    async def _follow(self, hint: Hint, want: np.ndarray, mode: str) -> Match:
        """The session a stored response names, while it still holds that response's state and runs on the
        request's model; else a new one branched from it (a session continues only on its own model)."""
        entry = self.manager.entries.get(hint.session_id or "")
        if entry is None or entry.busy or self.manager.model_of(entry) != self.manager.model_name():
            return await self._new(0, False, hint.lineage)
        s = entry.session
        if s is not None:
            if s.mode != mode or not s.tokens:
                return await self._new(0, False, hint.lineage)
            tokens, reply_start = s.tokens, s.reply_start
        else:
            heads = await to_thread.run_sync(lambda: self.manager.store.heads(self.manager.engine.bundle.hash,
                                                                              session_id=entry.id))
            if not heads or heads[0]["state"].get("mode") != mode:
                return await self._new(0, False, hint.lineage)
            state = heads[0]["state"]
            tokens = np.concatenate([heads[0]["token_ids"], np.asarray(state.get("pending", []), dtype=np.int64)])
            reply_start = state.get("reply_start")
        shared = common_prefix(tokens, want)
        if len(tokens) <= (hint.position or 0) and shared >= _start(reply_start, len(tokens)):
            return Match(entry.id, "continued", shared)
        return await self._new(shared, shared > 0, hint.lineage)

    def _with_lineage(self, c: Candidate) -> Candidate:
        """`c` with its session's lineage (worker thread: a stored one's is read from the store)."""
        if c.lineage is not None:
            return c
        entry = self.manager.entries.get(c.session_id)
        if entry is not None and entry.session is not None:
            return dataclasses.replace(c, lineage=entry.session.metadata.get(LINEAGE))
        with contextlib.suppress(NotFoundError):
            return dataclasses.replace(c, lineage=self.manager.store.session(c.session_id)["metadata"].get(LINEAGE))
        return c

    def _hot_candidates(self, target: list[int], mode: str, lineage: str | None) -> list[Candidate]:
        """The idle hot sessions sharing the longest prefix with `target` (by their keys, `entries.keys`), and
        when a lineage is asked and none of them is of it or of none, the best of it that shares less."""
        found: list[Candidate] = []
        for known, level in self.manager.entries.keys.levels(target):
            found += [c for c in (self._hot(entry, target, mode, known) for entry in level) if c is not None]
            if any(lineage is None or c.lineage in (None, lineage) for c in found):
                break  # a later level shares fewer tokens than every candidate of this one
        return found

    def _hot(self, entry: Entry, want: list[int], mode: str, known: int) -> Candidate | None:
        """A hot session as a candidate, compared from memory: its first `known` tokens are the request's."""
        s = entry.session
        if s is None or entry.busy or s.mode != mode or s.metadata.get("origin") != ORIGIN or not s.tokens:
            return None
        if self.manager.model_of(entry) != self.manager.model_name():  # the request's model's sessions only
            return None
        return Candidate(entry.id, shared_from(s.tokens, want, known), _start(s.reply_start, len(s.tokens)),
                         entry.created, s.metadata.get(LINEAGE))

    def _stored(self, head: Any, want: np.ndarray, skip: set[str]) -> Candidate | None:
        """A head the store found (a store.heads.HeadMatch) as a candidate, unless its session is busy, hot
        (woken since the lookup began) or unknown here; those go into `skip`, and the lookup is asked again."""
        entry = self.manager.entries.get(head.session_id)
        if entry is None or entry.busy or entry.session is not None:
            skip.add(head.session_id)
            return None
        shared = head.shared
        if shared == head.n_tokens and head.pending:  # the whole head is in the request: its pending ones may be too
            shared += common_prefix(head.pending, want[shared:])
        return Candidate(head.session_id, shared, _start(head.reply_start, head.n_tokens + len(head.pending)),
                         entry.created)

    async def _new(self, shared: int, branched: bool, lineage: str | None = None) -> Match:
        """A new stateless session (of `lineage`). Its first append copies the shared prefix's KV from a hot
        session (the manager's `_hot_prefix`), or restores it from stored blocks, instead of prefilling it."""
        session_id = f"http-{new_session_id()[2:]}"
        metadata = {"origin": ORIGIN, **({LINEAGE: lineage} if lineage is not None else {})}
        await self.manager.create(session_id, metadata=metadata)
        return Match(session_id, "branched" if branched else "new", shared)


def _start(reply_start: int | None, n_tokens: int) -> int:
    """Where a candidate's last reply starts: its whole length before it has one."""
    return reply_start if reply_start is not None else n_tokens


async def expire(manager: SessionManager, max_idle_s: float) -> int:
    """Delete stateless sessions (origin "http") asleep and unchanged for `max_idle_s`, and forget stored
    responses as old (the Responses API's); returns how many sessions.

    Nobody names them, so nobody would ever delete them: without this, every conversation a stateless
    client ever had would stay on disk. Their blocks stay as prefix cache until store gc evicts them.
    The store names them a page at a time, least recently updated first (an index range on a worker
    thread), so a store of many sessions is never read whole nor scanned on the event loop.
    """
    cutoff, deleted, after = time.time() - max_idle_s, 0, None
    forgotten = await ResponseRecords(manager).expire(cutoff)  # stored responses of the same age too
    while page := await to_thread.run_sync(lambda: manager.store.stale_sessions(ORIGIN, cutoff, EXPIRE_PAGE, after)):
        after = page[-1]
        for _, session_id in page:
            entry = manager.entries.get(session_id)
            if entry is None or entry.session is not None or entry.busy:
                continue
            with contextlib.suppress(BusyError, NotFoundError):  # taken or removed meanwhile: it stays, or is gone
                await manager.delete(session_id)
                deleted += 1
    if deleted or forgotten:
        log.info("stateless sessions expired", extra={"sessions": deleted, "responses": forgotten,
                                                      "max_idle_s": max_idle_s})
    return deleted
