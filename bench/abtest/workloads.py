"""The hot paths, each driven over a daemon's socket with the bundled client: one call of a function is
one sample of each of its metrics.

resume_round   a fresh session: append a long prompt (prefill tokens/s), a short turn on it (ms), sleep it
               (every block new: ms), then wake it from disk `wakes` times (ms; a re-sleep between wakes
               stores nothing new and is not counted).
decode_round   every decode session generates at once (greedy): aggregate tokens/s, and ms per decode step
               from the daemon's `status` (its decode step counter over the round; its own step time
               while every row ran).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Sizes", "prompt_tokens", "prepare_decoders", "resume_round", "decode_round"]

# Token ids every model here has as plain (not special) tokens: the tests' byte-level vocabulary
# and the device's random models both keep their specials outside this range.
TOKEN_IDS = range(40, 120)


@dataclass(frozen=True)
class Sizes:
    """How big each workload is (tokens), and how often each sample repeats within a round."""

    resume_tokens: int  # the long prompt: what is prefilled, slept and woken
    turn_tokens: int  # the short turn appended to it
    wakes: int  # wakes per round
    decode_contexts: tuple[int, ...]  # one decode session per entry, of this many tokens
    decode_tokens: int  # tokens each decode session generates per round


def prompt_tokens(seed: str, n: int) -> list[int]:
    """n token ids drawn from `seed`: the same for both trees in a round, new in every round (no prefix
    of one round's prompt is stored when the next starts, so each prefill and sleep does all its work)."""
    rng = random.Random(seed)
    return rng.choices(TOKEN_IDS, k=n)


def timed(call: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = call(*args, **kwargs)
    return result, (time.perf_counter() - t0) * 1000


def resume_round(client: Any, tag: str, sizes: Sizes) -> dict[str, list[float]]:
    """One sample of prefill, short turn and sleep; `sizes.wakes` of wake. The session is deleted after."""
    sid = client.create_session(f"resume-{tag}")["session_id"]
    got, prefill_ms = timed(client.append, sid, tokens=prompt_tokens(f"long-{tag}", sizes.resume_tokens))
    _, turn_ms = timed(client.append, sid, tokens=prompt_tokens(f"turn-{tag}", sizes.turn_tokens))
    _, sleep_ms = timed(client.sleep, sid)
    held = sizes.resume_tokens + sizes.turn_tokens
    wake_ms = []
    for i in range(sizes.wakes):
        if i:
            client.sleep(sid)
        woke, ms = timed(client.wake, sid)
        wake_ms.append(ms)
        if woke["tokens"] != held:
            raise RuntimeError(f"session {sid} woke with {woke['tokens']} tokens, appended {held}")
    client.delete_session(sid)
    return {"prefill_tok_s": [got["prefilled"] / prefill_ms * 1000], "turn_ms": [turn_ms],
            "sleep_ms": [sleep_ms], "wake_ms": wake_ms}


def prepare_decoders(client: Any, sizes: Sizes) -> list[str]:
    """The decode sessions, one per context size, filled once (each round's replies then grow them alike)."""
    names = []
    for i, n in enumerate(sizes.decode_contexts):
        sid = client.create_session(f"decode-{i}")["session_id"]
        client.append(sid, tokens=prompt_tokens(f"decode-{i}", n))
        names.append(sid)
    return names


def decode_round(client: Any, sessions: list[str], sizes: Sizes) -> dict[str, list[float]]:
    """Every session generates `sizes.decode_tokens` at once, from one barrier; a watcher reads the
    daemon's decoder status meanwhile."""
    barrier = threading.Barrier(len(sessions) + 1)
    replies: list[Any] = [None] * len(sessions)

    def one(i: int) -> None:
        barrier.wait()
        replies[i] = client.generate(sessions[i], max_tokens=sizes.decode_tokens, temperature=0.0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    before = decoder_status(client)
    barrier.wait()
    t0 = time.perf_counter()
    step_ms = watch_steps(client, threads, len(sessions))
    wall_s = time.perf_counter() - t0
    after = decoder_status(client)
    generated = sum(len(r.tokens) for r in replies)
    steps = after.get("decode_steps", 0) - before.get("decode_steps", 0)
    sample = {"decode_tok_s": [generated / wall_s]}
    if steps > 0:
        sample["decode_wall_ms_per_step"] = [wall_s * 1000 / steps]
    if step_ms:
        sample["decode_step_ms"] = [statistics.median(step_ms)]
    return sample


def decoder_status(client: Any) -> dict[str, Any]:
    """The decoder's part of `status` ({} where a daemon does not report one)."""
    return client.status().get("generation") or {}


def watch_steps(client: Any, threads: list[threading.Thread], rows: int, every_s: float = 0.1) -> list[float]:
    """The daemon's own decode step time, sampled while all `rows` calls run; returns when the calls end."""
    seen = []
    while any(t.is_alive() for t in threads):
        g = decoder_status(client)
        if g.get("running") == rows and "step_ms" in g:
            seen.append(float(g["step_ms"]))
        time.sleep(every_s)
    for t in threads:
        t.join()
    return seen
