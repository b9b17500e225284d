"""Head lookups: which session's head snapshot shares the longest token prefix with a request, by index.

The daemon's matcher asks which stored conversation a stateless request
continues. Scanning every session's tokens costs O(sessions); this answers
with O(log(request blocks)) index seeks and a few neighbour reads, whatever
the number of sessions:

1. The request's full blocks hash to chain keys (format/keys.py). A chain
   key held by a head names that head's whole prefix up to it, so "some
   candidate head holds key i" is true for a run of keys from the first:
   a binary search finds the deepest one, `depth` blocks (one indexed
   EXISTS per step: snapshot_blocks by key, then sessions by head).
2. Every candidate sharing more than `depth` blocks' tokens would hold key
   depth+1, so the best shares depth*B + k tokens, k < B, and the k tokens
   are the ones after the run. They continue the run's last key either as
   a block (blocks by parent, ordered by token ids) or as the head's tail
   (snapshots by tail parent, ordered by tail tokens); when none shares a
   token, every holder of the run ties (a few are named). As in reuse.py, in
   token order the piece sharing the longest prefix with the request's next
   tokens is a neighbour of the request's own position, so NEIGHBOURS rows
   on each side are read, restricted to candidate heads in the query.

Candidates are the sessions whose `origin` (their metadata's, an indexed
column since m005) is given, whose head was made with the bundle (chain keys
include it) and whose head's recorded state has the given mode, minus the
sessions named in `exclude` (the daemon's hot and busy ones: their heads are
stale or taken). Unverified and cheap: a wake verifies what it restores.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvwake.store.core import StoreCore
from kvwake.store.format.keys import ROOT_KEY, chain_keys, tokens_to_bytes
from kvwake.store.index import Index
from kvwake.store.reuse import NEIGHBOURS, common_length

__all__ = ["HeadMatch", "deepest_head"]

TIES = 8  # candidates returned when several share the longest prefix (the caller breaks the tie)

# A candidate head: s is the session, p its head snapshot. :origin, :mode and :exclude (a JSON list).
# Every query below joins with CROSS JOIN, which SQLite never reorders: from the block key (or the tail's
# parent) to the few heads holding it. Left to choose, the planner scanned every session of the origin
# (sessions_origin) and looked each one's blocks up: O(sessions) per query. The unary + keeps the origin
# test off that index too, so a session is reached by its head (sessions_head), one row at a time.
_CANDIDATE = ("+s.origin = :origin AND s.id NOT IN (SELECT value FROM json_each(:exclude))"
              " AND json_extract(p.metadata, '$.mode') IS :mode")

_HELD = f"""
SELECT 1 FROM snapshot_blocks sb CROSS JOIN sessions s ON s.head = sb.snapshot_id CROSS JOIN snapshots p ON p.id = s.head
WHERE sb.block_key = :key AND {_CANDIDATE} LIMIT 1
"""

# What a candidate row carries: its session, the head's length, and of the head's recorded state (JSON that
# holds the whole conversation's messages: SQLite reads it, Python does not) the two numbers matching needs.
_FACTS = ("s.id, s.created, p.n_tokens, json_extract(p.metadata, '$.pending') AS pending,"
          " json_extract(p.metadata, '$.reply_start') AS reply_start")

_HELD_BY = f"""
SELECT {_FACTS} FROM snapshot_blocks sb CROSS JOIN sessions s ON s.head = sb.snapshot_id
CROSS JOIN snapshots p ON p.id = s.head WHERE sb.block_key = :key AND {_CANDIDATE} ORDER BY s.created, s.id LIMIT :ties
"""

_CHILD_BLOCKS = f"""
SELECT b.key, b.token_ids FROM blocks b WHERE b.parent = :parent AND b.bundle = :bundle AND b.token_ids {{op}} :probe
AND EXISTS (SELECT 1 FROM snapshot_blocks sb CROSS JOIN sessions s ON s.head = sb.snapshot_id
            CROSS JOIN snapshots p ON p.id = s.head WHERE sb.block_key = b.key AND {_CANDIDATE})
ORDER BY b.token_ids {{order}} LIMIT :n
"""

_TAILS = f"""
SELECT {_FACTS}, p.tail_tokens FROM snapshots p CROSS JOIN sessions s ON s.head = p.id
WHERE p.tail_parent = :parent AND p.bundle = :bundle AND p.tail_tokens {{op}} :probe AND {_CANDIDATE}
ORDER BY p.tail_tokens {{order}} LIMIT :n
"""

_HOLDERS = f"""
SELECT {_FACTS} FROM snapshot_blocks sb CROSS JOIN sessions s ON s.head = sb.snapshot_id
CROSS JOIN snapshots p ON p.id = s.head WHERE sb.block_key = :key AND {_CANDIDATE} LIMIT :ties
"""


@dataclass(frozen=True)
class HeadMatch:
    """A session whose head snapshot shares `shared` leading tokens with the request (of its `n_tokens`);
    `pending` and `reply_start` are what the head's recorded state says of them (the daemon's session
    state: tokens after the KV, where the last reply starts), `created` the session's creation time."""

    session_id: str
    shared: int
    n_tokens: int
    created: float
    pending: list[int]
    reply_start: int | None


def _neighbours(index: Index, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of `sql` nearest `params["probe"]` in token order: NEIGHBOURS on each side."""
    rows = []
    for op, order in (("<=", "DESC"), (">", "ASC")):
        rows += index.rows(sql.format(op=op, order=order), {**params, "n": NEIGHBOURS})
    return rows


def _match(row: dict[str, Any], shared: int) -> HeadMatch:
    pending = json.loads(row["pending"]) if row["pending"] is not None else []
    return HeadMatch(row["id"], shared, row["n_tokens"], row["created"], pending, row["reply_start"])


def deepest_head(store: StoreCore, bundle: str, token_ids: Sequence[int], *, origin: str, mode: str | None,
                 exclude: Collection[str] = ()) -> list[HeadMatch]:
    """The candidate heads (see the module docstring) sharing the longest token prefix with `token_ids`,
    at most TIES of them, oldest session first; [] when none shares a token. Of many heads tied on one
    piece only those the neighbour reads reach are ranked (as in reuse.py)."""
    B = store.block_tokens
    keys = chain_keys(bundle, token_ids, B)
    where = {"origin": origin, "mode": mode, "exclude": json.dumps(sorted(exclude)), "bundle": bundle, "ties": TIES}
    with store.snapshot_read() as index:  # one commit's state, without waiting for a write under way
        lo, hi = 0, len(keys)  # keys[:lo] are held; keys[hi:] are not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if index.rows(_HELD, {**where, "key": keys[mid - 1]}):
                lo = mid
            else:
                hi = mid - 1
        depth, parent = lo, keys[lo - 1] if lo else ROOT_KEY
        probe = np.asarray(token_ids[depth * B : depth * B + B], dtype="<u4")
        found: list[HeadMatch] = []
        if len(probe):
            params = {**where, "parent": parent, "probe": tokens_to_bytes(probe)}
            found += [_match(r, depth * B + common_length(r["tail_tokens"], probe))
                      for r in _neighbours(index, _TAILS, params)]
            blocks = [(common_length(r["token_ids"], probe), r["key"]) for r in _neighbours(index, _CHILD_BLOCKS, params)]
            for k, key in blocks:
                if k == max(blocks)[0]:
                    found += [_match(r, depth * B + k) for r in index.rows(_HELD_BY, {**where, "key": key})]
        if depth and max((m.shared for m in found), default=depth * B) == depth * B:
            # No head goes on with the request's next token: every holder of the run ties (heads that end
            # there too); a few of them, not sorted (a new thread on a prompt thousands share is common).
            found = [_match(r, depth * B) for r in index.rows(_HOLDERS, {**where, "key": parent})]
    best = max((m.shared for m in found), default=0)
    top = {m.session_id: m for m in sorted(found, key=lambda m: (m.created, m.session_id)) if m.shared == best > 0}
    return list(top.values())[:TIES]
