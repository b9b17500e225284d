"""Stored responses of the Responses API (`store: true`): their table and the calls that read and write it.

A record names the session a response ran in and the token position its reply
ended at, with the conversation as the client would resend it (chat messages,
JSON) and the response object GET returns (JSON). What a record means to the
API is daemon/sessions/responses.py's business; this module only keeps rows.
The table is the index's migration m004 (index.py places it in the sequence).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import sqlite_utils

from kvwake.errors import NotFoundError

__all__ = ["StoredResponses", "m004_responses"]


def m004_responses(db: sqlite_utils.Database) -> None:
    # No foreign key to sessions: a record outlives its session (deleted, expired), and continuing it
    # then starts a new session from the conversation, served from stored blocks where they remain.
    db.execute("""CREATE TABLE responses (
        id TEXT PRIMARY KEY, session_id TEXT NOT NULL, position INTEGER NOT NULL, created REAL NOT NULL,
        conversation TEXT NOT NULL, response TEXT NOT NULL)""")
    db.execute("CREATE INDEX responses_created ON responses(created)")


class StoredResponses:
    """The `responses` table of one store (`Store.responses`), under the store's index lock. `core`: the
    store's core (store/core.py; not imported here: the index imports this module for its migration)."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def put(self, response_id: str, session_id: str, position: int, conversation: list[Any],
            response: Mapping[str, Any]) -> None:
        """Record a response: the session and token position it ended at, the conversation as chat
        messages (what continuing it renders) and the response object (what GET returns)."""
        with self.core.transaction() as db:
            db.execute("INSERT INTO responses (id, session_id, position, created, conversation, response) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (response_id, session_id, position, time.time(),
                                                     json.dumps(conversation), json.dumps(dict(response))))

    def get(self, response_id: str) -> dict[str, Any]:
        """A recorded response: {"id", "session_id", "position", "created", "conversation", "response"}
        (both decoded); NotFoundError if absent."""
        with self.core.locked():
            row = self.core.index.one("SELECT * FROM responses WHERE id = ?", (response_id,))
        if row is None:
            raise NotFoundError(f"no response {response_id!r}", response_id=response_id)
        return {**row, "conversation": json.loads(row["conversation"]), "response": json.loads(row["response"])}

    def delete(self, response_id: str) -> None:
        """Forget a recorded response (its session is left as it is); NotFoundError if absent."""
        with self.core.transaction() as db:
            if db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount == 0:
                raise NotFoundError(f"no response {response_id!r}", response_id=response_id)

    def expire(self, before: float) -> int:
        """Forget responses recorded before `before` (a time.time()); returns how many."""
        with self.core.transaction() as db:
            return db.execute("DELETE FROM responses WHERE created < ?", (before,)).rowcount
