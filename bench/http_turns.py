"""Agents over the OpenAI-compatible API: what a stateless client's conversation costs per turn.

usage: python bench/http_turns.py [--model default|tiny|PATH] [--system-words 450] [--turns 10]
                                  [--reply-tokens 16] [--turn-words 0] [--shared-words 180] [--parts turns,shared]
                                  [--mlx-server] [--out bench/out]

turns       one stateless conversation (the `openai` package, streamed, greedy) of --turns turns
            with a long system prompt, through `kvwake serve --http`; the daemon is restarted
            (SIGTERM: every session sleeps) after turn 5. Per turn: prompt tokens, cached tokens,
            prompt tokens computed, time to first token (first streamed chunk).
cold        turn 2's request again, to a fresh daemon that never saw turn 1 (a re-prefill):
            the ratio of its time to first token to turn 2's is the issue's "10x" target.
shared      a second agent with the same ~200-token system prompt, three ways: stateless HTTP (a
            new session whose first append copies the first agent's hot KV), RPC with the first
            agent hot (the same copy), RPC after the first agent slept (token-granular prefix
            cache): tokens reused against the tokens the two prompts share.
mlx-server  (--mlx-server) the same conversation through `mlx_lm.server` (its in-memory prompt
            cache), restarted after turn 5 as kvwake is: time to first token per turn.
Each kvwake turn also lists `waited_on`: the engine thread's jobs and steps slower than KVWAKE_SLOW_JOB_MS
(50 ms unless set) that ran while the turn waited for its first token, `slow_before`: those that ran from the
turn before's first token to this turn's request (its reply's decode, and what went on beside it), by name, and `phases`: the daemon's own account of it (status "turns": rendering, matching a
session, claiming it, the append, the first token).
Results: <out>/http_turns.json (docs/benchmarks.md summarises them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

import openai  # noqa: E402

from bench.lib import each_turn, openai_api, start_http, system_prompt, WORDS  # noqa: E402
from testkit.daemon import Daemon  # noqa: E402


def timed_chat(api: openai.OpenAI, messages: list[dict], reply_tokens: int, model: str = "local") -> dict[str, Any]:
    """One streamed turn: time to the first chunk, the text, and usage."""
    started = time.perf_counter()
    first, text, usage = None, [], None
    for chunk in api.chat.completions.create(model=model, messages=messages, max_tokens=reply_tokens,
                                             temperature=0, stream=True, stream_options={"include_usage": True}):
        first = first or time.perf_counter()
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else None
    return {"ttft_ms": round((first - started) * 1000, 1), "text": "".join(text),
            "prompt_tokens": usage.prompt_tokens if usage else None, "cached_tokens": cached,
            "computed_tokens": usage.prompt_tokens - cached if usage and cached is not None else None}


def daemon_side(d: Daemon, since: float, until: float) -> tuple[list[list[Any]], dict[str, Any] | None]:
    """What the daemon saw of a turn sent at `since` whose first token came at `until` (wall clock): the
    engine thread's slow jobs and steps (over KVWAKE_SLOW_JOB_MS, 50 unless set) that ran meanwhile,
    [name, ms] each, and the call's phases (status "turns": render, match, claim, append, first token)."""
    with d.client() as rpc:
        status = rpc.call("status")
    slow = status["engine_thread"]["slow"]
    turns = [t for t in status["turns"] if t["at"] >= since - 1e-3]
    return ([[s["what"], s["ms"]] for s in slow if since - 1e-3 <= s["at"] + s["ms"] / 1000 and s["at"] <= until],
            {k: v for k, v in turns[-1].items() if k.endswith("_ms") or k == "match"} if turns else None)


def between(d: Daemon, since: float, until: float) -> dict[str, list[float]]:
    """The engine thread's slow jobs (over KVWAKE_SLOW_JOB_MS) that ran from `since` to `until` (wall clock),
    by name: [how many, their ms in all, the longest]. Between two turns' first tokens: the work a turn may find
    still running (continuous persistence's captures, builds ahead). The daemon keeps the latest KVWAKE_SLOW_JOBS_KEPT."""
    with d.client() as rpc:
        slow = rpc.call("status")["engine_thread"]["slow"]
    out: dict[str, list[float]] = {}
    for s in slow:
        if since <= s["at"] < until:
            n, total, longest = out.get(s["what"], [0, 0.0, 0.0])
            out[s["what"]] = [n + 1, round(total + s["ms"], 1), max(longest, s["ms"])]
    return out


def conversation(work: Path, model: Path, system: str, turns: int, reply_tokens: int,
                 turn_words: int = 0) -> tuple[list, list]:
    d = start_http(work / "a", model)
    messages, rows, requests = [{"role": "system", "content": system}], [], []
    try:
        ended = time.time()  # the previous turn's first token: the jobs since then ran before this turn's
        for turn in each_turn(d, turns):
            extra = " " + " ".join(WORDS[(turn + i) % len(WORDS)] for i in range(turn_words)) if turn_words else ""
            messages.append({"role": "user", "content": f"Turn {turn}: what is the next step?{extra}"})
            requests.append(list(messages))
            sent = time.time()
            before = between(d, ended, sent) if turn else {}
            row = timed_chat(openai_api(d), messages, reply_tokens)
            waited_on, phases = daemon_side(d, sent, sent + row["ttft_ms"] / 1000)
            ended = sent + row["ttft_ms"] / 1000
            rows.append({"turn": turn + 1, "after_restart": turn == 5, **{k: v for k, v in row.items() if k != "text"},
                         "phases": phases, "waited_on": waited_on, "slow_before": before})
            messages.append({"role": "assistant", "content": row["text"]})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        d.stop()
    return rows, requests


def cold(work: Path, model: Path, request: list[dict], reply_tokens: int) -> dict[str, Any]:
    d = start_http(work / "cold", model)
    try:
        return {k: v for k, v in timed_chat(openai_api(d), request, reply_tokens).items() if k != "text"}
    finally:
        d.stop()


def shared(work: Path, model: Path, reply_tokens: int, words: int) -> dict[str, Any]:
    """A ~200-token system prompt, reused by a second agent, three ways (each its own prompt, so none
    feeds another): stateless HTTP, RPC with the first agent hot, RPC after the first agent slept."""
    d = start_http(work / "shared", model)
    prompts = {way: f"[{way}] " + system_prompt(words) for way in ("stateless", "rpc_hot", "rpc_slept")}
    user = ("Agent one.", "Agent two.")
    try:
        api = openai_api(d)
        one = [{"role": "system", "content": prompts["stateless"]}, {"role": "user", "content": user[0]}]
        timed_chat(api, one, reply_tokens)
        two = timed_chat(api, [one[0], {"role": "user", "content": user[1]}], reply_tokens)
        report = {"stateless": {"shared_tokens": shared_prompt_tokens(model, prompts["stateless"], user),
                                "reused": two["cached_tokens"], "computed": two["computed_tokens"]}}
        with d.client() as rpc:
            for way in ("rpc_hot", "rpc_slept"):
                first, second = f"{way}-1", f"{way}-2"
                rpc.call("session.create", session_id=first, system=prompts[way])
                rpc.call("session.chat", session_id=first, messages=[{"role": "user", "content": user[0]}],
                         max_tokens=reply_tokens)
                if way == "rpc_slept":
                    rpc.call("session.sleep", session_id=first)
                rpc.call("session.create", session_id=second, system=prompts[way])
                turn = rpc.call("session.chat", session_id=second, messages=[{"role": "user", "content": user[1]}],
                                max_tokens=reply_tokens)
                report[way] = {"shared_tokens": shared_prompt_tokens(model, prompts[way], user),
                               "reused": turn["append"]["reused"], "prefilled": turn["append"]["prefilled"]}
            report["prefix_copies"] = rpc.call("status")["counters"]["prefix_copies"]
    finally:
        d.stop()
    return report


def shared_prompt_tokens(model: Path, system: str, user: tuple[str, str]) -> int:
    """Tokens the two agents' rendered prompts have in common (the system turn and the user turn's head)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(model)
    a, b = (tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": u}],
                                    add_generation_prompt=True) for u in user)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mlx_server(model: Path, requests: list[list[dict]], reply_tokens: int) -> list[dict[str, Any]]:
    """mlx_lm.server, the same turns (the replies kvwake gave), restarted after turn 5 as kvwake was."""
    rows, proc = [], None

    def launch() -> tuple[subprocess.Popen, openai.OpenAI]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        p = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(1200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except OSError:
                time.sleep(0.25)
        return p, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)

    try:
        proc, api = launch()
        for turn, messages in enumerate(requests):
            if turn == 5:
                proc.terminate()
                proc.wait(60)
                proc, api = launch()
            row = timed_chat(api, messages, reply_tokens, str(model))  # mlx_lm.server loads the model it is named
            rows.append({"turn": turn + 1, "ttft_ms": row["ttft_ms"], "cached_tokens": row["cached_tokens"]})
            print("mlx_lm.server", json.dumps(rows[-1]), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--system-words", type=int, default=450)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--turn-words", type=int, default=0, help="words added to each user message (a longer turn)")
    ap.add_argument("--shared-words", type=int, default=180, help="the shared system prompt (~200 tokens)")
    ap.add_argument("--parts", default="turns,shared", help="turns (with the cold baseline), shared")
    ap.add_argument("--mlx-server", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvwake-http-"))
    if a.model == "default":
        from kvwake.daemon.model.convert import ensure_default_model

        model = ensure_default_model(work / "models")
    elif a.model == "tiny":
        from testkit.tinymodel import make_model_dir

        model = make_model_dir(work / "tiny-llama", ascii_replies=True)
    else:
        model = Path(a.model).expanduser().resolve()
    parts = set(a.parts.split(","))
    report: dict[str, Any] = {"machine": f"{platform.machine()}, {platform.processor() or '?'}, "
                                         f"{os.cpu_count()} cores", "model": str(model), "reply_tokens": a.reply_tokens}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    requests: list[list[dict]] = []
    if "turns" in parts:
        rows, requests = conversation(work, model, system_prompt(a.system_words), a.turns, a.reply_tokens,
                                      a.turn_words)
        baseline = cold(work, model, requests[1], a.reply_tokens)
        report.update(turns=rows, cold_turn_2=baseline,
                      turn_2_ttft_ratio=round(baseline["ttft_ms"] / rows[1]["ttft_ms"], 2))
        print(json.dumps({k: report[k] for k in ("cold_turn_2", "turn_2_ttft_ratio")}), flush=True)
    if "shared" in parts:
        report["shared"] = shared(work, model, a.reply_tokens, a.shared_words)
        print(json.dumps(report["shared"]), flush=True)
    if a.mlx_server and requests:
        report["mlx_server_turns"] = mlx_server(model, requests, a.reply_tokens)
    (out / "http_turns.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
