"""Tokenizing a rendered conversation piece by piece, each piece once.

A stateless client (OpenAI's chat API, Anthropic's Messages, an agent) sends
its whole conversation every turn, and the chat template renders all of it
again: for a long conversation, encoding the text took a long job a turn
(docs/decisions.md, "Engine": a rendered conversation is tokenized piece by
piece), for tokens that were the same as the turn before's but the last few
hundred.

A fast tokenizer splits its input at its added tokens (`<|im_start|>`, ...)
before anything else and encodes the text between them independently, so a
rendered prompt cut just before each added token that starts a message
encodes to the same ids piece by piece as whole. `Pieces` cuts it there,
keeps each piece's ids (keyed by the piece's text, least recently used first
out, bounded in bytes), and encodes only the pieces it has not seen, all in
one batch call. Turn after turn that is the new messages.

Where a tokenizer could break that (an added token matched on normalized text
or that strips its neighbours, a pre-tokenizer that treats the start of the
input specially, Llama's "prepend a space to the first word"), the pieces
would not add up: `Pieces` checks at start, on probe texts, that pieced
encoding equals whole encoding for every added token it cuts at, and on each
of its first `VERIFY_FIRST` real prompts too; any difference turns it off for
the process (logged) and every render encodes whole, as before.

Renders run on worker threads, several at once (model/prompt.py): the kept
pieces and the counters are touched under a lock, the encoding itself (the
tokenizer lets the GIL go) outside it, so one conversation's new pieces do
not wait for another's.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from array import array
from collections import OrderedDict
from typing import Any

__all__ = ["Pieces", "special_ids"]

log = logging.getLogger("kvwake.pieces")

# Bytes the kept pieces may take, their texts and ids (int32) counted: dozens of long agent conversations.
KEEP_BYTES = 64 << 20
VERIFY_FIRST = 1  # real prompts also encoded whole and compared, after the probes (the first one: a cold turn)
_PROBES = ("{t}", "a{t}b", " x {t} y ", "\n{t}\n\n", "user\nHi there!{t}\n{t}assistant\n", "12{t}34 .{t}.")


class Pieces:
    """Token ids of texts cut before each of the tokenizer's clean added tokens, each piece encoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.backend = _backend(tokenizer)
        self._ids: OrderedDict[str, array] = OrderedDict()
        self._lock = threading.Lock()  # the kept pieces, their bytes, the countdown and the counters
        self._kept = 0
        self._verify = VERIFY_FIRST
        self.split: re.Pattern[str] | None = None
        self.stats = {"pieces_reused": 0, "pieces_encoded": 0}
        marks = _clean_added(self.backend) if self.backend is not None else []
        if marks:
            self.split = re.compile("|".join(re.escape(m) for m in sorted(marks, key=len, reverse=True)))
            if not all(self._agrees(p.format(t=m)) for m in marks for p in _PROBES):
                self._off("pieced encoding differs from whole encoding on a probe text")

    @property
    def on(self) -> bool:
        return self.split is not None

    def encode(self, text: str) -> list[int]:
        """text's token ids (no special tokens added), as `tokenizer.encode(text, add_special_tokens=False)`."""
        if self.split is None:
            return self._whole(text)
        ids = self._pieced(text)
        with self._lock:
            verify = self._verify > 0
            self._verify -= verify
        if verify and ids != self._whole(text):
            self._off("pieced encoding differs from whole encoding on a prompt")
            return self._whole(text)
        return ids

    def _pieced(self, text: str) -> list[int]:
        split = self.split  # once: another render may turn pieces off meanwhile
        if split is None:
            return self._whole(text)
        cuts = [0, *(m.start() for m in split.finditer(text) if m.start()), len(text)]
        parts = [text[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
        known: dict[str, array] = {}  # this text's pieces, held here: keeping new ones may evict old ones
        with self._lock:
            for part in parts:
                ids = self._ids.get(part)
                if ids is not None:
                    known[part] = ids
                    self._ids.move_to_end(part)
        missing = [p for p in dict.fromkeys(parts) if p not in known]
        if missing:  # outside the lock: the encoding lets the GIL go, and another render its own pieces
            encoded = [array("i", enc.ids) for enc in self.backend.encode_batch(missing, add_special_tokens=False)]
            with self._lock:
                for part, ids in zip(missing, encoded):
                    known[part] = ids
                    self._keep(part, ids)
        out: list[int] = []
        for part in parts:
            out.extend(known[part])
        with self._lock:
            self.stats["pieces_encoded"] += len(missing)
            self.stats["pieces_reused"] += len(parts) - len(missing)
        return out

    def _keep(self, part: str, ids: array) -> None:
        """Under the lock. A piece another render kept meanwhile is replaced (the same ids): counted once."""
        old = self._ids.pop(part, None)
        if old is not None:
            self._kept -= cost(part, old)
        self._ids[part] = ids
        self._kept += cost(part, ids)
        while self._kept > KEEP_BYTES and len(self._ids) > 1:
            old_part, old = self._ids.popitem(last=False)
            self._kept -= cost(old_part, old)

    def _whole(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _agrees(self, text: str) -> bool:
        return self._pieced(text) == self._whole(text)

    def _off(self, why: str) -> None:
        log.warning("tokenizing prompts whole: %s", why)
        with self._lock:
            self.split = None
            self._ids.clear()
            self._kept = 0


def cost(part: str, ids: array) -> int:
    """Bytes one kept piece takes: its text, its ids and about what the dict entry and array add."""
    return sys.getsizeof(part) + ids.itemsize * len(ids) + 160


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special added tokens (a chat template's markers); empty when its backend
    cannot say."""
    backend = _backend(tokenizer)
    if backend is None:
        return frozenset()
    return frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)


def _backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` under mlx-lm's wrapper and transformers' fast tokenizer, or None."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    return backend if hasattr(backend, "encode_batch") and hasattr(backend, "get_added_tokens_decoder") else None


def _clean_added(backend: Any) -> list[str]:
    """The special added tokens to cut before: each matched on the raw text, anywhere. Empty when an added
    token strips its neighbours or matches whole words only (a cut beside one might not be the
    tokenizer's own), or a special one is matched on normalized text."""
    tokens = list(backend.get_added_tokens_decoder().values())
    if any(t.lstrip or t.rstrip or t.single_word or (t.special and t.normalized) for t in tokens):
        return []
    marks = [t.content for t in tokens if t.special and t.content]
    others = [t.content for t in tokens if not t.special and t.content]
    # An added token that starts before a mark and runs into it (or holds it) is matched first, leftmost:
    # the tokenizer would not split where the mark begins.
    if any(m in o or any(o.endswith(m[:k]) for k in range(1, min(len(o), len(m)) + 1))
           for o in others for m in marks):
        return []
    return marks
