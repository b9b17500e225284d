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

A request may bring a `Hint` (the Responses API):
- `lineage` (its `prompt_cache_key`): sessions made under another key are
  never continued in place, only branched from; the key is kept in the
  metadata of the sessions made under it;
- `session_id` and `position` (a stored response its `previous_response_id`
  names): only that session is continued in place, and only while it holds
  no more than `position` tokens (it has not moved on past that response)
  and the rule above holds; otherwise a new session branches from the shared
  prefix, and the session is left as it was.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import numpy as np
from anyio import to_thread

from kvwake.daemon.session import common_prefix, new_session_id
from kvwake.daemon.sessions.entries import Entry
from kvwake.daemon.sessions.manager import SessionManager
from kvwake.daemon.sessions.responses import ResponseRecords
from kvwake.errors import BusyError, NotFoundError

__all__ = ["ORIGIN", "Hint", "Match", "Matcher", "expire"]

log = logging.getLogger("kvwake.matching")
ORIGIN = "http"  # the metadata origin of sessions stateless requests made (and may continue)


# A candidate's tokens, reply start, input mode and lineage (prompt_cache_key)
Known = tuple[np.ndarray, "int | None", "str | None", "str | None"]
LINEAGE = "prompt_cache_key"  # the session metadata key of its lineage


@dataclass(frozen=True)
class Hint:
    """What a request says of where it belongs: a lineage key, and the session and token position a
    previous response ended at (see the module docstring)."""

    lineage: str | None = None
    session_id: str | None = None
    position: int | None = None


@dataclass(frozen=True)
class Match:
    """The session a request runs in, and how it was found: "continued", "branched" (new, from a candidate's
    shared prefix) or "new"."""

    session_id: str
    how: str
    shared_tokens: int = 0  # the common prefix with the session it came from


class Matcher:
    """Finds (or makes) the session for a stateless request; see the module docstring for the rule."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager
        # Asleep candidates: session id -> (tokens, reply_start), read from their head snapshots once,
        # then kept from the live session after each turn (a hot session is read directly).
        self.asleep: dict[str, Known] | None = None

    async def find(self, target: list[int], mode: str, hint: Hint | None = None) -> Match:
        """The session `target` (a rendered prompt of `mode` "chat" or "raw") should run in: claimable now, or new."""
        if self.asleep is None:
            self.asleep = await to_thread.run_sync(self._load)
        hint = hint or Hint()
        want = np.asarray(target, dtype=np.int64)
        for gone in [sid for sid in self.asleep if sid not in self.manager.entries]:  # deleted, or expired
            del self.asleep[gone]
        if hint.session_id is not None:
            return await self._follow(hint, want, mode)
        best: tuple[tuple[int, bool], Entry | None, Known | None] = ((0, False), None, None)
        branch = 0  # the longest shared prefix, with any candidate
        for entry in list(self.manager.entries.values()):
            known = self._tokens(entry)
            if known is None or entry.busy or known[2] != mode:
                continue
            shared = common_prefix(known[0], want)
            branch = max(branch, shared)
            if shared == 0:
                continue
            if hint.lineage is not None and known[3] not in (None, hint.lineage):
                continue  # another lineage's: branched from, never continued
            rank = (shared, known[3] == hint.lineage)  # a tie goes to the request's own lineage
            if rank > best[0]:
                best = (rank, entry, known)
        (shared, _), entry, known = best
        if entry is not None and known is not None and _continues(known, shared):
            return Match(entry.id, "continued", shared)
        return await self._new(branch, branch > 0, hint.lineage)

    async def _follow(self, hint: Hint, want: np.ndarray, mode: str) -> Match:
        """The session a stored response names, while it still holds that response's state; else a new one
        branched from it."""
        entry = self.manager.entries.get(hint.session_id or "")
        known = self._tokens(entry) if entry is not None and not entry.busy else None
        if entry is None or known is None or known[2] != mode:
            return await self._new(0, False, hint.lineage)
        shared = common_prefix(known[0], want)
        if len(known[0]) <= (hint.position or 0) and _continues(known, shared):
            return Match(entry.id, "continued", shared)
        return await self._new(shared, shared > 0, hint.lineage)

    def remember(self, session_id: str) -> None:
        """After a turn: keep the session's tokens, for when it is asleep."""
        entry = self.manager.entries.get(session_id)
        if self.asleep is not None and entry is not None and entry.session is not None:
            s = entry.session
            self.asleep[session_id] = (np.asarray(s.tokens, dtype=np.int64), s.reply_start, s.mode,
                                       s.metadata.get(LINEAGE))

    def _tokens(self, entry: Entry) -> Known | None:
        s = entry.session
        if s is not None:
            if s.metadata.get("origin") != ORIGIN or not s.tokens:
                return None
            return np.asarray(s.tokens, dtype=np.int64), s.reply_start, s.mode, s.metadata.get(LINEAGE)
        assert self.asleep is not None
        return self.asleep.get(entry.id)

    def _load(self) -> dict[str, Known]:
        """Tokens and reply starts of the stored stateless sessions (store work: a worker thread)."""
        known: dict[str, Known] = {}
        for head in self.manager.store.heads(self.manager.engine.bundle.hash):
            if head["metadata"].get("origin") != ORIGIN:
                continue
            state = head["state"]
            pending = np.asarray(state.get("pending", []), dtype=np.int64)
            known[head["id"]] = (np.concatenate([head["token_ids"], pending]), state.get("reply_start"),
                                 state.get("mode"), head["metadata"].get(LINEAGE))
        return known

    async def _new(self, shared: int, branched: bool, lineage: str | None = None) -> Match:
        """A new stateless session. Its first append copies the shared prefix's KV from a hot session
        (the manager's `_hot_prefix`), or restores it from stored blocks, instead of prefilling it."""
        session_id = f"http-{new_session_id()[2:]}"
        metadata = {"origin": ORIGIN, **({LINEAGE: lineage} if lineage is not None else {})}
        await self.manager.create(session_id, metadata=metadata)
        return Match(session_id, "branched" if branched else "new", shared)


def _continues(known: Known, shared: int) -> bool:
    """Whether a request sharing `shared` tokens with a candidate is its next turn: the prefix reaches the
    start of its last reply (all of it, when it has none)."""
    return shared >= (known[1] if known[1] is not None else len(known[0]))

async def expire(manager: SessionManager, max_idle_s: float) -> int:
    """Delete stateless sessions (origin "http") asleep and unchanged for `max_idle_s`, and forget stored
    responses as old; returns how many sessions.

    Nobody names them, so nobody would ever delete them: without this, every conversation a stateless
    client ever had would stay on disk. Their blocks stay as prefix cache until store gc evicts them.
    """
    cutoff, deleted = time.time() - max_idle_s, 0
    forgotten = await ResponseRecords(manager).expire(cutoff)  # stored responses of the same age too
    for row in await to_thread.run_sync(manager.store.sessions):
        entry = manager.entries.get(row["id"])
        if (row["metadata"].get("origin") != ORIGIN or row["updated"] > cutoff or entry is None
                or entry.session is not None or entry.busy):
            continue
        with contextlib.suppress(BusyError, NotFoundError):  # taken or removed meanwhile: it stays, or is gone
            await manager.delete(row["id"])
            deleted += 1
    if deleted or forgotten:
        log.info("stateless sessions expired", extra={"sessions": deleted, "responses": forgotten,
                                                      "max_idle_s": max_idle_s})
    return deleted
