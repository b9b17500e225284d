"""Generation: mlx-lm's generate_step and samplers, stop strings, streamed text.

`generate_step` feeds every token to the model before yielding it, so when
generation ends every generated token is in the cache (`processed` catches up
with `tokens`). Streaming uses the tokenizer's streaming detokenizer; text that
could be the start of a stop string is held back until it is known not to be,
so the pieces streamed, joined, always equal the final `text`. Without stop
strings that is exactly the decode of all generated tokens.

The repetition penalty sees the whole conversation (mlx-lm's processors would
only see this call's prompt): earlier tokens are prepended to their history.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from kvwake.errors import InvalidParamsError

__all__ = ["GenerateParams", "GenerateResult", "run_generation"]

MAX_TOKENS_LIMIT = 1 << 20


@dataclass(frozen=True)
class GenerateParams:
    """Sampling and stopping. temperature 0 is greedy; 0 for top_p/top_k/min_p disables them."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

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
            seed=num("seed", int, 0, 2**63 - 1, None), stop=tuple(stop),
        )


@dataclass
class GenerateResult:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    usage: dict[str, Any] = field(default_factory=dict)


def _processors(params: GenerateParams, history: list[int]) -> list | None:
    if not params.repetition_penalty:
        return None
    past = mx.array(history, dtype=mx.uint32) if history else None

    def with_history(proc: Callable) -> Callable:
        return lambda tokens, logits: proc(mx.concatenate([past, tokens]) if past is not None else tokens, logits)

    return [with_history(p) for p in make_logits_processors(repetition_penalty=params.repetition_penalty)]


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could still begin a stop string."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold


def run_generation(
    model: Any,
    tokenizer: Any,
    cache: list,
    prompt: list[int],
    history: list[int],
    params: GenerateParams,
    on_text: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> GenerateResult:
    """Generate from `prompt` (the pending tokens) on top of `cache`; the cache is updated in place.

    history: tokens already in the cache (for the repetition penalty).
    on_text: called with each new piece of text as it becomes final.
    should_stop: polled after each token; True ends generation ("cancelled").
    """
    if params.seed is not None:
        mx.random.seed(params.seed)
    sampler = make_sampler(params.temperature, params.top_p, params.min_p, top_k=params.top_k)
    detok = tokenizer.detokenizer
    detok.reset()
    eos = set(tokenizer.eos_token_ids)
    tokens: list[int] = []
    sent, finish, start, first = 0, "length", time.perf_counter(), None
    for token, _ in generate_step(mx.array(prompt, dtype=mx.uint32), model, prompt_cache=cache,
                                  max_tokens=params.max_tokens, sampler=sampler,
                                  logits_processors=_processors(params, history)):
        first = first or time.perf_counter()
        tokens.append(int(token))
        if token in eos:
            finish = "stop"
            break
        detok.add_token(int(token))
        text = detok.text
        cut = min((i for i in (text.find(s, max(0, sent - len(s))) for s in params.stop) if i >= 0), default=-1)
        if cut >= 0:
            sent = _emit(on_text, text[:cut], sent)
            return _result(text[:cut], tokens, "stop", prompt, start, first)
        sent = _emit(on_text, text[: len(text) - _held_back(text, params.stop)], sent)
        if should_stop and should_stop():
            finish = "cancelled"
            break
    detok.finalize()
    sent = _emit(on_text, detok.text, sent)
    return _result(detok.text, tokens, finish, prompt, start, first)


def _emit(on_text: Callable[[str], None] | None, final: str, sent: int) -> int:
    if on_text and len(final) > sent:
        on_text(final[sent:])
    return max(sent, len(final))


def _result(text: str, tokens: list[int], finish: str, prompt: list[int], start: float, first: float | None) -> GenerateResult:
    end = time.perf_counter()
    first = first or end
    decode_s = end - first
    return GenerateResult(text, tokens, finish, {
        "prompt_tokens": len(prompt), "generated_tokens": len(tokens),
        "ttft_ms": round((first - start) * 1000, 3),
        "tokens_per_s": round((len(tokens) - 1) / decode_s, 3) if len(tokens) > 1 and decode_s > 0 else None,
    })
