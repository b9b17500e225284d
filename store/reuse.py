"""Prefix reuse: which stored KV can start a request's tokens, to the token.

A hit is a run of whole blocks (their chain keys name the request's own full
blocks) and then, optionally, a *partial*: a stored piece whose parent is the
run's last block (or the root) and whose first k token ids equal the request's
next k. The KV at position i depends only on tokens 0..i, so those k tokens of
it are exactly what a prefill would compute. Two kinds of piece qualify:

- a block that continues the run with other tokens after the shared ones (the
  second block of a session that shared a 200-token system prompt), or a short
  block prefix.warm stored for a prompt's last partial block;
- a snapshot's tail (the last n mod B tokens of a slept session: plain KV for
  models whose cache cuts by token). Its snapshot is verified before use.

The candidates come from one SQL statement: the children of the parent are
indexed by (parent, bundle, token ids), and in token order the child sharing
the longest common prefix with the request is a neighbour of the request's own
position, so the statement reads at most NEIGHBOURS rows on each side, of
blocks and of tails. Longest match wins; on a tie a block (shared, maybe in
RAM) before a tail, then the most recently used (a block's last_used, a tail's
snapshot time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvwake.store.core import StoreCore
from kvwake.store.format.keys import ROOT_KEY, chain_keys, tokens_to_bytes
from kvwake.store.index import BlockRef

__all__ = ["NEIGHBOURS", "Partial", "common_length", "PrefixHit", "find", "longest_prefix", "partial_candidate"]

NEIGHBOURS = 4  # rows read on each side of the request in token order (ties beyond them are not ranked)

_CHILDREN = """
SELECT 1 AS is_block, key AS id, token_ids AS tokens, last_used AS used FROM (
  SELECT key, token_ids, last_used FROM blocks WHERE parent = :parent AND bundle = :bundle AND quarantined = 0
  AND token_ids <= :probe ORDER BY token_ids DESC LIMIT :n)
UNION ALL SELECT 1, key, token_ids, last_used FROM (
  SELECT key, token_ids, last_used FROM blocks WHERE parent = :parent AND bundle = :bundle AND quarantined = 0
  AND token_ids > :probe ORDER BY token_ids LIMIT :n)
UNION ALL SELECT 0, id, tail_tokens, created FROM (
  SELECT id, tail_tokens, created FROM snapshots WHERE tail_parent = :parent AND bundle = :bundle
  AND tail_tokens <= :probe ORDER BY tail_tokens DESC LIMIT :n)
UNION ALL SELECT 0, id, tail_tokens, created FROM (
  SELECT id, tail_tokens, created FROM snapshots WHERE tail_parent = :parent AND bundle = :bundle
  AND tail_tokens > :probe ORDER BY tail_tokens LIMIT :n)
"""


@dataclass(frozen=True)
class Partial:
    """A stored piece whose first `tokens` token ids continue a run: a block, or a snapshot's tail."""

    tokens: int
    parent: str
    block: BlockRef | None = None
    snapshot_id: str | None = None


@dataclass(frozen=True)
class PrefixHit:
    """Whole blocks that start a request, then maybe a partial piece."""

    blocks: list[BlockRef]
    partial: Partial | None = None

    def tokens(self, block_tokens: int) -> int:
        return len(self.blocks) * block_tokens + (self.partial.tokens if self.partial else 0)


def common_length(stored: bytes, probe: np.ndarray) -> int:
    """How many leading token ids of `stored` (u32 LE bytes) equal `probe`'s."""
    ids = np.frombuffer(stored or b"", dtype="<u4")
    n = min(len(ids), len(probe))
    differ = np.flatnonzero(ids[:n] != probe[:n])
    return int(differ[0]) if differ.size else n


def partial_candidate(store: StoreCore, bundle: str, parent: str, following: Sequence[int],
                      min_tokens: int) -> Partial | None:
    """The child of `parent` sharing the most leading tokens with `following` (at least min_tokens), or None."""
    probe = np.asarray(following[: store.block_tokens], dtype="<u4")
    if len(probe) < max(min_tokens, 1):
        return None
    rows = store.rows(_CHILDREN, {"parent": parent, "bundle": bundle, "probe": tokens_to_bytes(probe),
                                  "n": NEIGHBOURS})
    ranked = sorted(((common_length(r["tokens"], probe), r["is_block"], r["used"], r["id"]) for r in rows), reverse=True)
    if not ranked or ranked[0][0] < max(min_tokens, 1):
        return None
    k, is_block, _, ident = ranked[0]
    if not is_block:
        return Partial(k, parent, snapshot_id=ident)
    with store.locked():
        ref = store.index.blocks_by_key([ident]).get(ident)
    return Partial(k, parent, block=ref) if ref is not None and not ref.quarantined else None


def longest_prefix(store: StoreCore, bundle: str, token_ids: Sequence[int], *,
                   partial: bool = False) -> list[BlockRef]:
    """The longest run of stored, usable full blocks that starts `token_ids` under `bundle`
    (with `partial`, ending in the short block of the trailing tokens when that is stored too)."""
    keys = chain_keys(bundle, token_ids, store.block_tokens, partial=partial)
    usable = store.usable_blocks(keys, token_ids)
    run = []
    for key in keys:
        if key not in usable:
            break
        run.append(usable[key])
    return run


def find(store: StoreCore, bundle: str, token_ids: Sequence[int], min_partial: int) -> PrefixHit:
    """The longest whole-block run that starts `token_ids`, then the best partial piece after it."""
    run = longest_prefix(store, bundle, token_ids)
    start = len(run) * store.block_tokens
    parent = run[-1].key if run else ROOT_KEY
    return PrefixHit(run, partial_candidate(store, bundle, parent, token_ids[start:], min_partial))
