"""Which session a stateless request continues (the HTTP API, with no session named).

OpenAI clients send the whole conversation every turn. A request that names no
session is matched against the sessions earlier stateless requests made
(metadata `origin: "http"`), hot or asleep, by the longest common token prefix
of its rendered prompt with each session's tokens:

- the best session's last prompt lies wholly inside the request (the prefix
  reaches its `reply_start`): the request is that conversation's next turn, and
  it **continues the session in place** (the cache keeps the common prefix; a
  reply the client re-rendered differently costs only its own tokens);
- the request branches off earlier (a retried turn, an edited message, another
  agent with the same system prompt) and the session is hot: a **new session
  starts from a copy of the shared prefix's KV** in memory, and the source is
  left as it was;
- otherwise (nothing shared, the source asleep or busy, a model whose cache
  cannot be cut): a **new session**, which still restores whatever stored
  prefix blocks match (the prefix cache) instead of prefilling them.

A busy session is never a candidate: another request is continuing it. Sessions
created over RPC are not candidates either: a request that did not name them
must not change them (give one `metadata.origin = "http"` to make it one).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from anyio import to_thread

from kvwake.daemon import kvstate
from kvwake.daemon.session import new_session_id
from kvwake.errors import BusyError

if TYPE_CHECKING:
    from kvwake.daemon.manager import Entry, SessionManager

__all__ = ["ORIGIN", "Match", "Matcher"]

log = logging.getLogger("kvwake.matching")
ORIGIN = "http"  # the metadata origin of sessions stateless requests made (and may continue)


Known = tuple[np.ndarray, "int | None", "str | None"]  # a candidate's tokens, reply start and input mode


@dataclass(frozen=True)
class Match:
    """The session a request runs in, and how it was found: "continued", "copied" or "new"."""

    session_id: str
    how: str
    shared_tokens: int = 0  # the common prefix with the session it came from


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class Matcher:
    """Finds (or makes) the session for a stateless request; see the module docstring for the rule."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager
        # Asleep candidates: session id -> (tokens, reply_start), read from their head snapshots once,
        # then kept from the live session after each turn (a hot session is read directly).
        self.asleep: dict[str, Known] | None = None

    async def find(self, target: list[int], mode: str) -> Match:
        """The session `target` (a rendered prompt of `mode` "chat" or "raw") should run in: claimable now, or new."""
        if self.asleep is None:
            self.asleep = await to_thread.run_sync(self._load)
        want = np.asarray(target, dtype=np.int64)
        best: tuple[int, Entry | None, int | None] = (0, None, None)
        for entry in list(self.manager.entries.values()):
            known = self._tokens(entry)
            if known is None or entry.busy or known[2] != mode:
                continue
            shared = common_prefix(known[0], want)
            if shared > best[0]:
                best = (shared, entry, known[1])
        shared, entry, reply_start = best
        if entry is None:
            return await self._new(target, None, 0)
        if shared >= (reply_start if reply_start is not None else len(self._tokens(entry)[0])):
            return Match(entry.id, "continued", shared)
        return await self._new(target, entry, shared)

    def remember(self, session_id: str) -> None:
        """After a turn: keep the session's tokens, for when it is asleep."""
        entry = self.manager.entries.get(session_id)
        if self.asleep is not None and entry is not None and entry.session is not None:
            s = entry.session
            self.asleep[session_id] = (np.asarray(s.tokens, dtype=np.int64), s.reply_start, s.mode)

    def _tokens(self, entry: Entry) -> Known | None:
        s = entry.session
        if s is not None:
            if s.metadata.get("origin") != ORIGIN or not s.tokens:
                return None
            return np.asarray(s.tokens, dtype=np.int64), s.reply_start, s.mode
        assert self.asleep is not None
        return self.asleep.get(entry.id)

    def _load(self) -> dict[str, Known]:
        """Tokens and reply starts of the stored stateless sessions (store work: a worker thread)."""
        store, known = self.manager.store, {}
        rows = store.rows("SELECT s.id, s.metadata, p.token_ids, p.metadata AS state FROM sessions s "
                          "JOIN snapshots p ON p.id = s.head WHERE p.bundle = ?", (self.manager.engine.bundle.hash,))
        for row in rows:
            if json.loads(row["metadata"]).get("origin") != ORIGIN:
                continue
            state = json.loads(row["state"])
            tokens = np.frombuffer(row["token_ids"], dtype="<u4").astype(np.int64)
            known[row["id"]] = (np.concatenate([tokens, np.asarray(state.get("pending", []), dtype=np.int64)]),
                                state.get("reply_start"), state.get("mode"))
        return known

    async def _new(self, target: list[int], source: Entry | None, shared: int) -> Match:
        """A new stateless session; from a hot source, it starts with a copy of the shared prefix's KV."""
        m = self.manager
        session_id = f"http-{new_session_id()[2:]}"
        await m.create(session_id, metadata={"origin": ORIGIN})
        keep = min(shared, len(target) - 1)  # one token stays pending: it yields the first logits
        if source is None or source.session is None or source.busy or keep < 1 or not m.engine.cuttable:
            return Match(session_id, "new", shared)
        try:
            async with m.claim(source.id, "copy"), m.claim(session_id, "copy") as fresh:
                src, dst = source.session, fresh.session
                if src is None or src.cache is None or src.processed < keep or dst is None:
                    return Match(session_id, "new", shared)  # it slept or failed meanwhile: the prefix cache serves
                dst.cache = await m.thread.run(lambda: kvstate.copy_prefix(src.cache, keep))
                dst.mode, dst.tokens, dst.processed = src.mode, src.tokens[:keep], keep
        except BusyError:  # another request took the source while this one was being made
            return Match(session_id, "new", shared)
        log.info("session copied", extra={"session": session_id, "source": source.id, "tokens": keep})
        return Match(session_id, "copied", shared)
