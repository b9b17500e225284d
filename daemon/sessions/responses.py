"""Stored responses of the Responses API: what a `previous_response_id` continues.

A record names the session a response ran in and the token position its reply
ended at, and holds the conversation as chat messages (instructions left out:
OpenAI does not carry them over), the response object `GET
/v1/responses/{id}` returns and the input items `GET
/v1/responses/{id}/input_items` lists. The records live in the store's index
(the `responses` table, store/responses.py): its `response` column holds
{"response": the object, "input_items": [...]}; a record written before input
items were kept holds the bare object (its `input_items` read as None). Store
work runs on worker threads.
Which session a continuation runs in is sessions/matching.py's `Matcher.find`
with a `Hint`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from anyio import to_thread

from kvwake.daemon.sessions.manager import SessionManager

__all__ = ["ResponseRecord", "ResponseRecords"]


@dataclass(frozen=True)
class ResponseRecord:
    """One stored response."""

    id: str
    session_id: str
    position: int  # the session's token count when the reply ended
    conversation: list[dict[str, Any]]  # chat messages, the reply last
    response: dict[str, Any]  # the Responses API's response object
    input_items: list[dict[str, Any]] | None  # the items it was made from, oldest first (None: not kept)


class ResponseRecords:
    """The stored responses of one daemon's store."""

    def __init__(self, manager: SessionManager) -> None:
        self.stored = manager.store.responses

    async def put(self, record: ResponseRecord) -> None:
        await to_thread.run_sync(lambda: self.stored.put(
            record.id, record.session_id, record.position, record.conversation,
            {"response": record.response, "input_items": record.input_items}))

    async def get(self, response_id: str) -> ResponseRecord:
        """The record; NotFoundError if none has this id."""
        row = await to_thread.run_sync(self.stored.get, response_id)
        kept = row["response"]
        response, items = (kept, None) if kept.get("object") == "response" else (kept["response"], kept["input_items"])
        return ResponseRecord(row["id"], row["session_id"], row["position"], row["conversation"], response, items)

    async def delete(self, response_id: str) -> None:
        """Forget the record (its session is left as it is); NotFoundError if none has this id."""
        await to_thread.run_sync(self.stored.delete, response_id)

    async def expire(self, before: float) -> int:
        """Forget records made before `before` (time.time()); returns how many."""
        return await to_thread.run_sync(self.stored.expire, before)
