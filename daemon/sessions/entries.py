"""What the session manager keeps per session (`Entry`, in `Entries`).

An asleep session costs the daemon its `Entry` alone (slots: id, busy, two times; about 200 bytes with
its id and its place in the map); its tokens stay in the store, where matching finds them by chain key.
`Entries` indexes the hot ones, so what goes over hot sessions (budget sleeps, prefix copies, status,
matching) never walks the asleep thousands; and in `keys` (sessions/hotkeys.py) the idle hot ones by
the chain keys of their tokens, so matching a request to a hot session never compares every one; and in
`kv_bytes` their KV's bytes, each measured once per claim, so the memory policy's sum is not a walk
either.

Both rest on one rule of the session manager: a session's tokens and its cache change only while its
entry is claimed (`busy`), so what was measured of an idle session holds until its next claim.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvwake.daemon.session_state import Session
from kvwake.daemon.sessions.hotkeys import HotKeys
from kvwake.daemon.sessions.model_counts import ModelCounts

__all__ = ["Entries", "Entry", "HotBytes"]


class Entry:
    """A session the daemon knows: `session` is None while it sleeps; `busy` names the claim on it (None:
    idle). Both keep the indexes of the Entries holding it. `model`: the name of the model it runs on
    (sessions/models.py); None: the default one."""

    __slots__ = ("id", "_session", "_busy", "last_used", "created", "_owner", "model", "woke")

    def __init__(self, id: str, session: Session | None = None, busy: str | None = None,
                 created: float | None = None, model: str | None = None) -> None:
        self.id, self._session, self._busy, self.model = id, session, busy, model
        self.last_used, self.created = time.monotonic(), time.time() if created is None else created
        self._owner: Entries | None = None  # the Entries holding it
        self.woke: dict[str, Any] | None = None  # its last wake's result

    @property
    def session(self) -> Session | None:
        return self._session

    @session.setter
    def session(self, session: Session | None) -> None:
        self._session = session
        if self._owner is not None:
            if session is None:
                self._owner.hot.pop(self.id, None)
                self._owner.keys.forget(self)
                self._owner.kv_bytes.forget(self)
            else:
                self._owner.hot[self.id] = self
                self._owner.keys.stale(self)
                self._owner.kv_bytes.changing(self)

    @property
    def busy(self) -> str | None:
        return self._busy

    @busy.setter
    def busy(self, op: str | None) -> None:
        # Tokens and cache change only under a claim: its keys are dropped for the claim, computed again after;
        # its bytes are measured at each sum while claimed, once after.
        was, self._busy = self._busy, op
        if self._owner is not None:
            self._owner.models.claimed(self, was, op)
        if self._owner is not None and self._session is not None:
            self._owner.kv_bytes.changing(self)
            if op is None:
                self._owner.keys.stale(self)
            else:
                self._owner.keys.forget(self)


class HotBytes:
    """The hot sessions' KV bytes: an idle one's as measured after its last claim, a claimed (or just woken)
    one's measured at every `total`."""

    def __init__(self) -> None:
        self._measured: dict[str, int] = {}
        self._sum = 0  # of _measured
        self._changing: dict[str, Entry] = {}

    def changing(self, entry: Entry) -> None:
        self._sum -= self._measured.pop(entry.id, 0)
        self._changing[entry.id] = entry

    def forget(self, entry: Entry) -> None:
        self._sum -= self._measured.pop(entry.id, 0)
        self._changing.pop(entry.id, None)

    def total(self, measure: Callable[[Session], int]) -> int:
        """Bytes of every hot session's KV; `measure` gives one session's (Engine.cache_bytes)."""
        live = 0
        for entry in list(self._changing.values()):
            session = entry.session
            if session is None:
                del self._changing[entry.id]
                continue
            nbytes = measure(session)
            if entry.busy:
                live += nbytes
            else:  # idle: it holds until its next claim
                del self._changing[entry.id]
                self._measured[entry.id] = nbytes
                self._sum += nbytes
        return self._sum + live


class Entries(dict[str, Entry]):
    """Session id -> Entry, with `hot`: the entries whose session is hot, kept as sessions wake and sleep, and
    `keys`: the idle hot ones by their tokens' chain keys (sessions/hotkeys.py), and `kv_bytes`: their KV's."""

    def __init__(self) -> None:
        super().__init__()
        self.hot: dict[str, Entry] = {}
        self.keys = HotKeys()
        self.kv_bytes = HotBytes()
        self.models = ModelCounts()  # each model's sessions known and claimed (sessions/model_counts.py)

    def __setitem__(self, session_id: str, entry: Entry) -> None:
        self._forget(session_id)
        super().__setitem__(session_id, entry)
        entry._owner = self
        self.models.add(entry)
        entry.session = entry.session  # indexed if hot

    def __delitem__(self, session_id: str) -> None:
        self._forget(session_id)
        super().__delitem__(session_id)

    def pop(self, session_id: str, *default: Entry | None) -> Entry | None:  # type: ignore[override]
        self._forget(session_id)
        return super().pop(session_id, *default)

    def setdefault(self, session_id: str, entry: Entry) -> Entry:  # type: ignore[override]
        if session_id not in self:
            self[session_id] = entry
        return self[session_id]

    def rebind(self, entry: Entry, model: str) -> None:
        """Move an asleep entry to `model` (its bundle's model, known only now: sessions/models.py)."""
        self.models.remove(entry)
        entry.model = model
        self.models.add(entry)

    def _forget(self, session_id: str) -> None:
        old = self.get(session_id)
        if old is not None:
            old._owner = None
            self.models.remove(old)
            self.hot.pop(session_id, None)
            self.keys.forget(old)
            self.kv_bytes.forget(old)
