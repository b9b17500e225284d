"""Codex's and the Agents SDK's shape of work over the Responses API: what each turn costs, and a restart.

usage: python bench/responses_turns.py [--model tiny|default|PATH] [--instruction-words 1500] [--tools 4]
                                       [--turns 10] [--reply-tokens 16] [--out bench/out/cpu]

Two conversations through the official `openai` package (streamed, greedy), each restarted
(SIGTERM: every session sleeps) before turn 6, on one daemon:
- chain: each turn sends only its new user message and the previous response's id
  (`previous_response_id`, `store` true), as the Agents SDK can;
- resend: each turn sends the whole conversation again (`store: false`, a `prompt_cache_key`),
  as Codex CLI does. It starts after the chain, with the same instructions: its first turn
  branches from the chain's stored prefix.
Per turn: input tokens, `cached_tokens`, and time to first token (the first output delta, or
the response's end if it has none). cold: the chain's turn-6 prompt (its whole conversation,
`store: false`) sent to a fresh daemon that never saw it; the ratio of its time to first
token to the chain's turn 6 is the issue's "10x". The tiny model (testkit/tinymodel.py, 64k
context, 1 byte = 1 token): 1500 words are about 10k tokens. Results:
<out>/responses_turns.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

import openai  # noqa: E402

from bench.lib import agent_model, each_turn, openai_api, start_http, system_prompt  # noqa: E402
from testkit.daemon import Daemon  # noqa: E402


def tools(n: int) -> list[dict[str, Any]]:
    """n function tools, shaped as Codex's (a name, a paragraph, a parameters schema)."""
    return [{"type": "function", "name": f"tool_{i}", "description": f"Tool {i}: " + system_prompt(40),
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                            "required": ["path"]}} for i in range(n)]


def timed_turn(api: openai.OpenAI, request: dict[str, Any]) -> dict[str, Any]:
    """One streamed turn: time to first token, the response, and its usage."""
    started, first, final = time.perf_counter(), None, None
    for event in api.responses.create(**request, stream=True):
        if event.type.endswith(".delta") and first is None:
            first = time.perf_counter()
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None, "the stream ended without its response"
    u = final.usage
    return {"ttft_ms": round(((first or time.perf_counter()) - started) * 1000, 1), "response": final,
            "input_tokens": u.input_tokens, "cached_tokens": u.input_tokens_details.cached_tokens,
            "computed_tokens": u.input_tokens - u.input_tokens_details.cached_tokens,
            "output_tokens": u.output_tokens, "session": final.model_extra["kvwake"]["session_id"]}


def replayed(response: Any) -> list[dict[str, Any]]:
    return [item.model_dump(exclude_none=True) for item in response.output]


def user(turn: int) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                           "text": f"Turn {turn}: what is the next step?"}]}


def chain(d: Daemon, base: dict[str, Any], turns: int) -> tuple[list, list]:
    """previous_response_id turns; also the whole conversation as items, for the cold baseline."""
    rows, items, previous, whole = [], [], None, []
    for turn in each_turn(d, turns):
        items.append(user(turn))
        whole.append(list(items))
        request = {**base, "input": [user(turn)], **({"previous_response_id": previous} if previous else {})}
        row = timed_turn(openai_api(d), request)
        response = row.pop("response")
        items += replayed(response)
        previous = response.id
        rows.append({"turn": turn + 1, "after_restart": turn == 5, **row})
        print(json.dumps({"chain": rows[-1]}), flush=True)
    return rows, whole


def resend(d: Daemon, base: dict[str, Any], turns: int) -> list:
    """store false turns, the whole conversation every time, under one prompt_cache_key."""
    rows, items = [], []
    for turn in each_turn(d, turns):
        items.append(user(100 + turn))
        row = timed_turn(openai_api(d), {**base, "input": list(items), "store": False, "prompt_cache_key": "bench"})
        items += replayed(row.pop("response"))
        rows.append({"turn": turn + 1, "after_restart": turn == 5, **row})
        print(json.dumps({"resend": rows[-1]}), flush=True)
    return rows


def cold(work: Path, model: Path, request: dict[str, Any]) -> dict[str, Any]:
    d = start_http(work / "cold", model)
    try:
        row = timed_turn(openai_api(d), request)
        row.pop("response")
        return row
    finally:
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--instruction-words", type=int, default=1500, help="~6.7 tokens a word on the tiny model")
    ap.add_argument("--tools", type=int, default=4)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "cpu"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvwake-responses-"))
    model = agent_model(a.model, work)
    base = {"model": "gpt-5-codex", "instructions": system_prompt(a.instruction_words), "tools": tools(a.tools),
            "max_output_tokens": a.reply_tokens, "temperature": 0}
    d = start_http(work / "a", model)
    try:
        chained, whole = chain(d, base, a.turns)
        resent = resend(d, base, a.turns)
    finally:
        d.stop()
    after = next(r for r in chained if r["after_restart"])
    baseline = cold(work, model, {**base, "input": whole[after["turn"] - 1], "store": False})
    report = {"machine": f"{platform.machine()}, {platform.processor() or '?'}, {os.cpu_count()} cores",
              "model": str(model), "reply_tokens": a.reply_tokens, "tools": a.tools, "chain": chained,
              "resend": resent, "cold_after_restart_request": baseline,
              "restart_ttft_ratio": round(baseline["ttft_ms"] / after["ttft_ms"], 2)}
    print(json.dumps({k: report[k] for k in ("cold_after_restart_request", "restart_ttft_ratio")}), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "responses_turns.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
