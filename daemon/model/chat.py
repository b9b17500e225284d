"""Chat templates: a conversation's messages rendered to token ids with the tokenizer's template.

Templates that reject a system role get the system text folded into the first
user turn ("{system}\\n\\n{user}"); it is never dropped. OpenAI's tool turns
(assistant `tool_calls`, `tool` results) are kept by the session as sent; the
template renders a copy in the form mlx-lm's server gives it (`for_template`).
"""

from __future__ import annotations

import threading
from typing import Any

from kvwake.daemon.model.piece_tokens import Pieces, special_ids
from kvwake.daemon.session_state import tool_arguments
from kvwake.errors import InvalidParamsError

__all__ = ["ChatTemplate", "for_template"]


class ChatTemplate:
    """Renders messages to token ids with the tokenizer's chat template."""

    _kept: dict[int, ChatTemplate] = {}  # id of a tokenizer -> its template (which holds it: the id stays its)
    _kept_lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer: Any) -> ChatTemplate:
        """The template of `tokenizer`, made once for the process and kept (model/weights.py keeps one tokenizer
        per model folder, and forgets a template with the tokenizer it replaces: `forget`). Made at a load, its
        probes (the template rendered, the system role tried) held the GIL beside the other models' decode steps:
        a reload takes it made, and the first start makes the other configured models' (`weights.preload`). Its
        kept pieces have their own lock, so engines of one tokenizer share them, across unloads too."""
        with cls._kept_lock:
            made = cls._kept.get(id(tokenizer))
            if made is None:
                made = cls._kept[id(tokenizer)] = cls(tokenizer)
            return made

    @classmethod
    def forget(cls, tokenizer: Any) -> None:
        """Let `tokenizer`'s template go (its tokenizer replaced: its files changed)."""
        with cls._kept_lock:
            made = cls._kept.get(id(tokenizer))
            if made is not None and made.tokenizer is tokenizer:
                del cls._kept[id(tokenizer)]

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.folds_system = not self._accepts_system()
        self.pieces = Pieces(tokenizer)  # a conversation's earlier messages are encoded once, not every turn

    def _accepts_system(self) -> bool:
        probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        try:
            text = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        except Exception:  # jinja raises TemplateError (or anything) for templates without a system role
            return False
        return "S" in text

    def message_marks(self) -> frozenset[int]:
        """The special token that opens a message's content in this template (`<|im_start|>`,
        `<start_of_turn>`, `<|end_header_id|>`): the last special token before the content of a one-message
        rendering. Empty when the template or tokenizer does not show one (restore points then go by block
        boundaries alone: kv/points.py)."""
        specials = special_ids(self.tokenizer)
        try:
            ids = self.render([{"role": "user", "content": "kvwake probe"}])
            content = self.pieces.encode("kvwake probe")
        except Exception:  # noqa: BLE001 (a template that refuses the probe: no marks, as documented)
            return frozenset()
        at = next((i for i in range(len(ids) - len(content) + 1) if ids[i : i + len(content)] == content), None)
        before = [t for t in ids[:at] if t in specials] if at is not None else []
        return frozenset(before[-1:])

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the conversation plus the generation prompt."""
        messages = for_template(messages)
        messages = self._fold_system(messages) if self.folds_system else messages
        options: dict[str, Any] = {"add_generation_prompt": True}
        if tools:
            options["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **options)
        except Exception as exc:
            raise InvalidParamsError(f"chat template rejected the messages: {exc}") from None
        return self.pieces.encode(text)

    @staticmethod
    def _fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        system = "\n\n".join(str(m.get("content", "")) for m in messages if m.get("role") == "system")
        rest = [dict(m) for m in messages if m.get("role") != "system"]
        if not system:
            return rest
        for m in rest:
            if m.get("role") == "user":
                m["content"] = f"{system}\n\n{m.get('content', '')}"
                return rest
        return [{"role": "user", "content": system}, *rest]


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them, as mlx-lm's server makes them: tool-call arguments
    as maps, null content as "". New maps: the session keeps what the client sent, and renders
    it the same way every time."""
    out = []
    for m in messages:
        if "tool_calls" in m or ("content" in m and m["content"] is None):
            m = {**m, "content": m.get("content") or ""}
            if isinstance(m.get("tool_calls"), list):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": tool_arguments(
                    c["function"].get("arguments", {}))}} for c in m["tool_calls"]]
        out.append(m)
    return out
