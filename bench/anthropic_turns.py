"""Claude Code's shape of work over the Anthropic Messages API: what each turn costs, and a restart.

usage: python bench/anthropic_turns.py [--model tiny|default|PATH] [--system-words 3000] [--tools 12]
                                       [--turns 10] [--reply-tokens 16] [--out bench/out/cpu]

One stateless conversation through the official `anthropic` package (streamed, greedy),
as Claude Code sends it: a long system prompt (text blocks, the first a billing header
that changes on every request), a dozen tool schemas, the whole conversation every turn.
The daemon is restarted (SIGTERM: every session sleeps) after turn 5. Per turn:
tokens computed (`input_tokens`) and read from the cache (`cache_read_input_tokens`),
and time to first token (the first content delta, or the message's end if it has none).
cold: turn 6's request (the first after the restart) to a fresh daemon that never saw
the conversation; the ratio of its time to first token to turn 6's is the issue's "10x".
The tiny model (testkit/tinymodel.py, 64k context, 1 byte = 1 token): 3000 words are
about 20k tokens. Results: <out>/anthropic_turns.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

from bench.lib import agent_model, each_turn, start_http, system_prompt  # noqa: E402
from kvwake.client import openai_config  # noqa: E402
from testkit.daemon import Daemon  # noqa: E402

if TYPE_CHECKING:
    import anthropic


def tools(n: int) -> list[dict[str, Any]]:
    """n tool schemas, shaped as Claude Code's (a name, a paragraph, an input schema)."""
    return [{"name": f"tool_{i}", "description": f"Tool {i}: " + system_prompt(40),
             "input_schema": {"type": "object", "properties": {"path": {"type": "string", "description": "a path"},
                                                               "limit": {"type": "integer"}},
                              "required": ["path"]}} for i in range(n)]


def api_of(d: Daemon) -> anthropic.Anthropic:
    # imported here: the fleet imports this module's tools without the anthropic package where it runs the
    # OpenAI API only (the GPU machine's anthropic 2.x needs httpx2, which it lacks)
    import anthropic

    config = openai_config(d.socket)
    return anthropic.Anthropic(base_url=config["base_url"].removesuffix("/v1"), api_key=config["api_key"],
                               max_retries=0, timeout=3600)


def timed_turn(api: anthropic.Anthropic, request: dict[str, Any]) -> dict[str, Any]:
    """One streamed turn: time to first token, the reply's content, and usage."""
    billing = {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.{secrets.token_hex(3)};"}
    started, first = time.perf_counter(), None
    with api.messages.stream(**{**request, "system": [billing, *request["system"]]}) as stream:
        for event in stream:
            if event.type in ("content_block_delta", "message_delta") and first is None:
                first = time.perf_counter()
        final = stream.get_final_message()
        session = stream.response.headers.get("x-kvwake-session")
    u = final.usage
    return {"ttft_ms": round(((first or time.perf_counter()) - started) * 1000, 1), "content": final.content,
            "input_tokens": u.input_tokens, "cache_read_input_tokens": u.cache_read_input_tokens,
            "output_tokens": u.output_tokens, "session": session}


def conversation(work: Path, model: Path, base: dict[str, Any], turns: int) -> tuple[list, list]:
    d = start_http(work / "a", model)
    messages: list[dict[str, Any]] = []
    rows, requests = [], []
    try:
        for turn in each_turn(d, turns):
            messages.append({"role": "user", "content": f"Turn {turn}: what is the next step?"})
            requests.append({**base, "messages": list(messages)})
            row = timed_turn(api_of(d), requests[-1])
            messages.append({"role": "assistant", "content": row.pop("content") or "(nothing)"})
            rows.append({"turn": turn + 1, "after_restart": turn == 5, **row})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        d.stop()
    return rows, requests


def cold(work: Path, model: Path, request: dict[str, Any]) -> dict[str, Any]:
    d = start_http(work / "cold", model)
    try:
        row = timed_turn(api_of(d), request)
        row.pop("content")
        return row
    finally:
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--system-words", type=int, default=3000, help="~6.7 tokens a word on the tiny model")
    ap.add_argument("--tools", type=int, default=12)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "cpu"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvwake-anthropic-"))
    model = agent_model(a.model, work)
    system = [{"type": "text", "text": system_prompt(a.system_words), "cache_control": {"type": "ephemeral"}}]
    base = {"model": "claude-sonnet-4-6", "max_tokens": a.reply_tokens, "system": system, "tools": tools(a.tools),
            "extra_body": {"temperature": 0}}  # greedy (the SDK has no temperature argument any more)
    rows, requests = conversation(work, model, base, a.turns)
    after = next(r for r in rows if r["after_restart"])
    baseline = cold(work, model, requests[after["turn"] - 1])
    report = {"machine": f"{platform.machine()}, {platform.processor() or '?'}, {os.cpu_count()} cores",
              "model": str(model), "reply_tokens": a.reply_tokens, "tools": a.tools, "turns": rows,
              "cold_after_restart_request": baseline,
              "restart_ttft_ratio": round(baseline["ttft_ms"] / after["ttft_ms"], 2)}
    print(json.dumps({k: report[k] for k in ("cold_after_restart_request", "restart_ttft_ratio")}), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "anthropic_turns.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
