"""What the session manager keeps per session (`Entry`, in `Entries`).

An asleep session costs the daemon its `Entry` alone (slots: id, busy, two times; about 200 bytes with
its id and its place in the map); its tokens stay in the store, where matching finds them by chain key.
`Entries` indexes the hot ones, so what goes over hot sessions (budget sleeps, prefix copies, status,
matching) never walks the asleep thousands.
"""

from __future__ import annotations

import time

from kvwake.daemon.session_state import Session

__all__ = ["Entries", "Entry"]


class Entry:
    """A session the daemon knows: `session` is None while it sleeps."""

    __slots__ = ("id", "_session", "busy", "last_used", "created", "_hot")

    def __init__(self, id: str, session: Session | None = None, busy: str | None = None,
                 created: float | None = None) -> None:
        self.id, self._session, self.busy = id, session, busy
        self.last_used, self.created = time.monotonic(), time.time() if created is None else created
        self._hot: dict[str, Entry] | None = None  # the hot index of the Entries holding it

    @property
    def session(self) -> Session | None:
        return self._session

    @session.setter
    def session(self, session: Session | None) -> None:
        self._session = session
        if self._hot is not None:
            if session is None:
                self._hot.pop(self.id, None)
            else:
                self._hot[self.id] = self


class Entries(dict[str, Entry]):
    """Session id -> Entry, with `hot`: the entries whose session is hot, kept as sessions wake and sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.hot: dict[str, Entry] = {}

    def __setitem__(self, session_id: str, entry: Entry) -> None:
        self._forget(session_id)
        super().__setitem__(session_id, entry)
        entry._hot = self.hot
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

    def _forget(self, session_id: str) -> None:
        old = self.get(session_id)
        if old is not None:
            old._hot = None
            self.hot.pop(session_id, None)
