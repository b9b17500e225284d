"""Generation parameters, sampling and text output: what one generate call is, batched or not.

The decoder (decoder.py) feeds every token to the model before handing it
here, so when a call ends every generated token is in the cache (`processed`
catches up with `tokens`). Streaming uses the tokenizer's streaming
detokenizer; text that could be the start of a stop string is held back until
it is known not to be, so the pieces streamed, joined, always equal the final
`text`. Without stop strings that is exactly the decode of all generated tokens.
The final text is split into content and tool calls by `ToolSpans`
(toolcalls.py), which also makes the streamed events.

A constrained call (structured output) finishes "stop" only when its grammar
ended it (EOS, which the mask allows only where the grammar accepts); a stop
string or max_tokens that cuts it first finishes "length": the text is not a
whole answer, and is never passed off as one.

The repetition penalty sees the whole conversation (mlx-lm's processors would
only see this call's prompt): earlier tokens are part of its context.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler, make_logits_processors

from kvwake.daemon.model.grammar import Structure
from kvwake.daemon.model.toolcalls import ToolSpans, held_back
from kvwake.errors import InvalidParamsError

__all__ = ["GenerateParams", "GenerateResult", "KeyedSampler", "OnEvent", "TextOutput", "make_processors",
           "make_sampler"]

MAX_TOKENS_LIMIT = 1 << 20
OnEvent = Callable[[dict[str, Any]], None]  # a streamed event: the map a stream notification carries


@dataclass(frozen=True)
class GenerateParams:
    """Sampling and stopping. temperature 0 is greedy; 0 for top_p/top_k/min_p disables them."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None  # additive, over the last 20 tokens (mlx-lm's processors)
    frequency_penalty: float | None = None  # additive per occurrence, over the last 20 tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    structure: Structure | None = None  # structured output: what the text must be (model/grammar.py)

    @classmethod
    def from_params(cls, p: dict[str, Any]) -> GenerateParams:
        """Validate RPC params (unknown keys are ignored by the caller, not here)."""
        def num(name: str, kind: type, lo: float, hi: float, default: Any) -> Any:
            v = p.get(name, default)
            if v is None and default is None:
                return None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
                raise InvalidParamsError(f"{name} must be {kind.__name__}, got {type(v).__name__}", param=name)
            if not lo <= v <= hi:
                raise InvalidParamsError(f"{name}={v} out of range [{lo}, {hi}]", param=name)
            return kind(v)
        stop = p.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
            raise InvalidParamsError("stop must be a string or a list of up to 16 non-empty strings", param="stop")
        return cls(
            max_tokens=num("max_tokens", int, 1, MAX_TOKENS_LIMIT, 256),
            temperature=num("temperature", float, 0.0, 100.0, 0.0), top_p=num("top_p", float, 0.0, 1.0, 0.0),
            top_k=num("top_k", int, 0, 1 << 24, 0), min_p=num("min_p", float, 0.0, 1.0, 0.0),
            repetition_penalty=num("repetition_penalty", float, 0.0, 100.0, None),
            presence_penalty=num("presence_penalty", float, -2.0, 2.0, None),
            frequency_penalty=num("frequency_penalty", float, -2.0, 2.0, None),
            logit_bias=_logit_bias(p.get("logit_bias")),
            seed=num("seed", int, 0, 2**63 - 1, None), stop=tuple(stop), structure=Structure.from_params(p),
        )


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A map of token id (an int, or its decimal string as JSON keys are) to a bias in [-100, 100]."""
    if value is None:
        return ()
    bad = InvalidParamsError("logit_bias must map up to 300 token ids to numbers in [-100, 100]", param="logit_bias")
    if not isinstance(value, dict) or len(value) > 300:
        raise bad
    pairs = []
    for key, bias in value.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.isdigit():
            token = int(key)
        if token is None or isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


@dataclass
class GenerateResult:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (EOS or stop string) | "tool_calls" (stop after parsed calls) | "length" | "cancelled"
    usage: dict[str, Any] = field(default_factory=dict)
    content: str = ""  # text outside the tool-call spans that parsed
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's shape (toolcalls.py)
    tool_call_errors: list[str] = field(default_factory=list)  # spans that did not parse (left in content)
    stop_sequence: str | None = None  # the stop string that ended the call ("stop" without one: EOS)
    reasoning: str = ""  # the thinking spans' text (toolcalls.py), cut from content


class KeyedSampler:
    """Temperature sampling (with top_p, min_p, top_k) from the call's own random state.

    Each call has its own key, split once per token, so a seeded call samples the same tokens
    whatever else the daemon decodes beside it (batched or not); mlx-lm's own samplers draw
    from MLX's one global random state, which concurrent calls would interleave.
    """

    def __init__(self, params: GenerateParams) -> None:
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)
        self._carried: tuple[mx.array, int] | None = None  # (keys, row): its key is row `row` of a batch's keys
        self.temperature = params.temperature
        self.filters: list[Callable[[mx.array], mx.array]] = []
        if 0 < params.top_p < 1.0:
            self.filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p:
            self.filters.append(lambda x: apply_min_p(x, params.min_p, 1))
        if params.top_k > 0:
            self.filters.append(lambda x: apply_top_k(x, params.top_k))

    @property
    def key(self) -> mx.array:
        """The call's random state: its own array, or its row of the keys RowsSampler split last, sliced
        out only when read (a batch that keeps its rows never reads it)."""
        if self._carried is not None:
            keys, row = self._carried
            self._key, self._carried = keys[row], None
        return self._key

    @key.setter
    def key(self, value: mx.array) -> None:
        self._key, self._carried = value, None

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.key, draw = mx.random.split(self.key)
        for keep in self.filters:
            logprobs = keep(logprobs)
        # The Gumbel-max draw, written out (not mx.random.categorical) so RowsSampler can make the
        # same draw for many rows in one op.
        return mx.argmax(logprobs * (1.0 / self.temperature) + mx.random.gumbel(shape=logprobs.shape, key=draw),
                         axis=-1)


class RowsSampler:
    """A batch's rows sampled in one op, each from its own random state: the tokens each row's own
    sampler would draw, bit for bit (its key split as its own call splits it, its Gumbel noise drawn
    from that key), so a seeded call samples the same tokens alone or batched. For rows
    that are greedy or keyed without filters (`fits`); others sample one row at a time, as mlx-lm does.
    Row by row, each sampling row added its own small device ops to every step (docs/decisions.md,
    "Sampling a batch's rows in one op (session 7)").

    While the batch keeps its rows, the keys stay one array from step to step (each row's key is read
    out of it only when its call needs it alone), and the rows' temperatures are made once: a step
    then adds no operation per row (docs/decisions.md, "A sampling batch's keys stay one array from step
    to step (session 21)")."""

    def __init__(self, samplers: list[Callable[[mx.array], mx.array]]) -> None:
        self.samplers = samplers

    @staticmethod
    def fits(samplers: list[Callable[[mx.array], mx.array]]) -> bool:
        keyed = [s for s in samplers if s is not greedy_sampler]
        return len(samplers) > 1 and bool(keyed) and all(isinstance(s, KeyedSampler) and not s.filters for s in keyed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        keyed = [isinstance(s, KeyedSampler) for s in self.samplers]
        keys = self._carried_keys(keyed)
        if keys is None:
            spare = mx.zeros((2,), mx.uint32)  # a greedy row's key: its noise is drawn and not used
            keys = mx.stack([s.key if k else spare for s, k in zip(self.samplers, keyed)])
        pairs = _split_rows(keys)
        width = logprobs.shape[-1]
        noise = mx.vmap(lambda key: mx.random.gumbel(shape=(1, width), key=key))(pairs[:, 1]).reshape(-1, width)
        scale, mask = _row_constants(tuple(s.temperature if k else None for s, k in zip(self.samplers, keyed)))
        scaled = logprobs * scale.astype(logprobs.dtype) + noise
        carried = pairs[:, 0]
        for i, (s, k) in enumerate(zip(self.samplers, keyed)):
            if k:
                s._carried = (carried, i)
        return mx.argmax(mx.where(mask, scaled, logprobs), axis=-1)

    def _carried_keys(self, keyed: list[bool]) -> mx.array | None:
        """The keys the step before left, when every keyed row is still at its row of them (a greedy row's
        key there is whatever its noise was drawn from: unused)."""
        rows = [(i, s) for i, (s, k) in enumerate(zip(self.samplers, keyed)) if k]
        first = rows[0][1]._carried if rows else None
        if first is None or first[0].shape[0] != len(self.samplers):
            return None
        keys = first[0]
        return keys if all(s._carried is not None and s._carried[0] is keys and s._carried[1] == i
                           for i, s in rows) else None


_split_rows = mx.vmap(mx.random.split)  # a key per row -> (new key, draw) per row, in one op


@functools.lru_cache(maxsize=64)
def _row_constants(temperatures: tuple[float | None, ...]) -> tuple[mx.array, mx.array]:
    """Per row (None: greedy): the logits' scale, 1 / temperature, as a float32 column; and which rows sample.
    Made from lists, no operation to evaluate: an eval here, inside the step, would wait for the step
    before."""
    scale = mx.array([[1.0 / t if t is not None else 1.0] for t in temperatures], dtype=mx.float32)
    mask = mx.array([[t is not None] for t in temperatures])
    return scale, mask


def make_sampler(params: GenerateParams) -> Callable[[mx.array], mx.array]:
    """Greedy (one shared function, so a batch of greedy calls samples in one op) or keyed."""
    return greedy_sampler if params.temperature == 0 else KeyedSampler(params)


def make_processors(params: GenerateParams, history: list[int] | None = None) -> list:
    """Logits processors; with `history`, the repetition penalty also sees the tokens before this call.

    The batch gives processors the whole context itself (history included): pass no history there.
    """
    procs = make_logits_processors(logit_bias=dict(params.logit_bias) or None,
                                   repetition_penalty=params.repetition_penalty or None,
                                   presence_penalty=params.presence_penalty or None,
                                   frequency_penalty=params.frequency_penalty or None)
    if not procs:
        return []
    if not history:
        return procs
    past = mx.array(history, dtype=mx.uint32)
    return [lambda tokens, logits, p=p: p(mx.concatenate([past, tokens]), logits) for p in procs]


class TextOutput:
    """One call's generated tokens turned into text as they come: EOS, stop strings, streamed events.

    `add(token)` takes each token the model was fed and returns the finish reason once the call
    is over ("stop", "length", "cancelled"), else None. Text goes to `on_event` once final, split
    by `ToolSpans` into content and tool-call events (toolcalls.py names them); text that could
    begin a stop string is held back, so the text pieces joined always equal `text`.
    """

    def __init__(self, tokenizer: Any, params: GenerateParams, on_event: OnEvent | None = None,
                 should_stop: Callable[[], bool] | None = None, tools: list[dict[str, Any]] | None = None,
                 thinking: bool = False) -> None:
        self.params, self.should_stop = params, should_stop
        self.constrained = params.structure is not None
        self.spans = ToolSpans(tokenizer, tools, on_event, thinking=thinking)
        self.detok = tokenizer.detokenizer  # a fresh copy per call
        self.eos = set(tokenizer.eos_token_ids)
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0
        self.stop_sequence: str | None = None  # the stop string that ended the call, if one did
        self.started, self.first = time.perf_counter(), None

    def add(self, token: int) -> str | None:
        self.first = self.first or time.perf_counter()
        self.tokens.append(token)
        if token in self.eos:
            return self._finish("stop")
        self.detok.add_token(token)
        text, stops = self.detok.text, self.params.stop
        hits = [(i, s) for s in stops if (i := text.find(s, max(0, self.sent - len(s)))) >= 0]
        if hits:
            cut, self.stop_sequence = min(hits)
            return self._close(text[:cut], "length" if self.constrained else "stop")
        self._emit(text[: len(text) - held_back(text, stops)])
        if len(self.tokens) >= self.params.max_tokens:
            return self._finish("length")
        if self.should_stop and self.should_stop():
            return self._finish("cancelled")
        return None

    def _finish(self, reason: str) -> str:
        self.detok.finalize()
        return self._close(self.detok.text, reason)

    def _close(self, text: str, reason: str) -> str:
        self.text = text
        self._emit(text)
        self.spans.finish(reason)
        return reason

    def _emit(self, final: str) -> None:
        if len(final) > self.sent:
            self.spans.feed(final[self.sent :])
        self.sent = max(self.sent, len(final))

    def result(self, finish: str, prompt_tokens: int) -> GenerateResult:
        """The call's result; a reply that stopped on its own after parsed tool calls finishes "tool_calls"."""
        end = time.perf_counter()
        first = self.first or end
        decode_s, n = end - first, len(self.tokens)
        spans = self.spans
        return GenerateResult(
            self.text, list(self.tokens), "tool_calls" if finish == "stop" and spans.calls else finish, {
                "prompt_tokens": prompt_tokens, "generated_tokens": n,
                "ttft_ms": round((first - self.started) * 1000, 3),
                "tokens_per_s": round((n - 1) / decode_s, 3) if n > 1 and decode_s > 0 else None,
            }, spans.content, list(spans.calls), list(spans.errors), self.stop_sequence, spans.reasoning)
