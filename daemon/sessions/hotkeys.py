"""Which idle hot sessions share the longest token prefix with a request, without comparing every one.

Matching a stateless request (sessions/matching.py) and copying a hot session's prefix for a new one
(the manager's `_hot_prefix`) both ask which hot sessions share the most leading tokens with a rendered
prompt. Comparing each hot session's tokens costs O(hot sessions x prompt length) per request: with
hundreds of agents hot over one long system prompt that was most of a request's time
(docs/benchmarks.md, "matching: hot conversations (issue 50, point 6)").

`HotKeys` keeps, per idle hot session, the chain keys of its tokens' full blocks of BLOCK tokens
(store/format/keys.py: a key names its whole prefix), and, per key, the sessions holding it. A request's
keys are looked up the same way `Store.deepest_heads` looks up stored heads: the sessions holding its
first d keys share at least d*BLOCK tokens with it, so a binary search finds the deepest d, and only
those sessions' tokens after d*BLOCK are compared (`levels`). The keys are those of `tokens`, whatever
`processed` says; callers compare what they need.

When keys go stale: a session's tokens change only while its entry is claimed (`Entry.busy`: an
append, a decode, a wake), so an entry's keys are dropped when it is claimed or its session goes, and
computed again at the next lookup after the claim ends. Busy entries are never in the index (no caller
takes them as a candidate).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from kvwake.daemon.session_state import common_prefix
from kvwake.store.format.keys import chain_keys

__all__ = ["BLOCK", "HotKeys", "shared_from"]


class Entry(Protocol):
    """What the index reads of a session's entry (sessions/entries.py's `Entry`, which imports this module)."""

    id: str
    session: Any
    busy: Any

BLOCK = 64  # tokens per key: a smaller block leaves fewer tokens to compare, a larger one fewer keys to hash
NO_BUNDLE = "0" * 64  # the keys never leave this process: the model's bundle is the same for all of them


class HotKeys:
    """Chain keys of the idle hot sessions' tokens, and the sessions holding each (module docstring)."""

    def __init__(self) -> None:
        self._keys: dict[str, tuple[Entry, list[str]]] = {}  # session id -> its entry and keys, in order
        self._holders: dict[str, dict[str, Entry]] = {}  # key -> the entries holding it
        self._stale: dict[str, Entry] = {}  # hot entries whose keys are to be computed at the next lookup

    def forget(self, entry: Entry) -> None:
        """Drop the entry's keys (claimed, gone to sleep or removed); nothing is computed for it until `stale`."""
        self._stale.pop(entry.id, None)
        for key in self._keys.pop(entry.id, (entry, []))[1]:
            holders = self._holders[key]
            holders.pop(entry.id, None)
            if not holders:
                del self._holders[key]

    def stale(self, entry: Entry) -> None:
        """The entry's tokens may have changed (its claim ended, it woke): keyed again at the next lookup."""
        self.forget(entry)
        self._stale[entry.id] = entry

    def _refresh(self) -> None:
        """Key the stale entries that are idle and hot now (a claimed one waits for its claim's end)."""
        for entry in list(self._stale.values()):
            session = entry.session
            if entry.busy:
                continue
            del self._stale[entry.id]
            if session is None:
                continue
            keys = chain_keys(NO_BUNDLE, session.tokens, BLOCK)
            self._keys[entry.id] = entry, keys
            for key in keys:
                self._holders.setdefault(key, {})[entry.id] = entry

    def levels(self, target: Sequence[int]) -> Iterator[tuple[int, list[Entry]]]:
        """The idle hot entries by how many of `target`'s leading tokens they surely share, deepest first:
        (tokens, entries), where every entry shares at least `tokens` (a multiple of BLOCK) and fewer than
        `tokens + BLOCK`. The last level is (0, those sharing no full block). A caller stops once no later
        level can beat what it found (`shared_from` gives an entry's exact length)."""
        self._refresh()
        if not self._keys:
            return
        keys = chain_keys(NO_BUNDLE, target, BLOCK)
        lo, hi = 0, len(keys)  # keys[:lo] are held by some entry; keys[hi:] by none
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if keys[mid - 1] in self._holders else (lo, mid - 1)
        seen: set[str] = set()
        for depth in range(lo, 0, -1):
            level = [e for sid, e in self._holders[keys[depth - 1]].items() if sid not in seen]
            seen.update(e.id for e in level)
            if level:
                yield depth * BLOCK, level
        yield 0, [e for sid, (e, _) in self._keys.items() if sid not in seen]

    def __len__(self) -> int:
        return len(self._keys)


def shared_from(tokens: Sequence[int], target: Sequence[int], known: int) -> int:
    """The common prefix length of the tokens of an entry `levels` gave at `known` tokens, and `target`:
    the first `known` are equal and fewer than BLOCK more can be (else it would have come deeper), so
    only those are compared."""
    end = known + BLOCK
    return known + common_prefix(tokens[known:end], target[known:end])
