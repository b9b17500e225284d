"""A memory soak of a real daemon: long conversations over HTTP, sleeps, wakes and restarts.

usage: python bench/soak.py --model PATH [--words 12000,4000] [--turns 3] [--restarts 2] [--out DIR]

Issue 25, point 7: peak memory must stay under the largest session's KV, plus the
weights, plus a stated margin. One daemon (`kvwake serve --http`) serves
conversations of the given system-prompt sizes through the official `openai`
package, streamed and greedy: each gets --turns turns, then is slept over RPC, so
one is hot at a time; then the daemon is restarted (SIGTERM) and the round repeats
(--restarts times): every later turn wakes its conversation. A thread samples the daemon's VmRSS from /proc every 100 ms;
after each step the daemon's `status` gives MLX's active, cache and peak memory.
Reported: the weights, the largest session's KV, the peaks, and the margin left:
peak - weights - largest KV. Results: <out>/soak.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

import openai  # noqa: E402

from bench.lib import system_prompt  # noqa: E402
from kvwake.client import openai_config  # noqa: E402
from testkit.daemon import Daemon  # noqa: E402

GB = 1 << 30


class RssWatch:
    """The peak VmRSS of a process, sampled every 100 ms in a thread (restarts: `pid` is read each time)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon, self.peak, self._stop = daemon, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            proc = self.daemon.proc
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
                self.peak = max(self.peak, rss)
            except (OSError, StopIteration, AttributeError):
                pass

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def turn(d: Daemon, messages: list[dict[str, Any]]) -> dict[str, Any]:
    api = openai.OpenAI(**openai_config(d.socket), max_retries=0, timeout=3600)
    started, first, text = time.perf_counter(), None, []
    for chunk in api.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0, stream=True,
                                             stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    messages.append({"role": "assistant", "content": "".join(text) or "(nothing)"})
    return {"ttft_s": round((first or time.perf_counter()) - started, 3), "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens}


def memory(d: Daemon) -> dict[str, Any]:
    with d.client() as rpc:
        return rpc.call("status")["memory"]


def sleep_all(d: Daemon) -> None:
    with d.client() as rpc:
        for s in rpc.call("session.list")["sessions"]:
            if s["state"] == "hot":
                rpc.call("session.sleep", session_id=s["session_id"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--words", default="12000,4000", help="system prompt words per conversation")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvwake-soak-"))
    conversations = [[{"role": "system", "content": system_prompt(int(w))}] for w in a.words.split(",")]
    d = Daemon(work, Path(a.model).expanduser().resolve(), block_tokens=128, extra=["--http", "0"])
    facts = memory(d.start(timeout=900))
    kv_per_token = facts["kv_bytes_per_token"]
    d.stop()
    steps, watch = [], None
    (work / "none.toml").write_text("hot_budget_bytes = 100_000_000_000\n")  # sleeps are this run's own
    try:
        d.start(timeout=900)
        watch = RssWatch(d)
        for round_ in range(a.restarts + 1):
            for i, messages in enumerate(conversations):
                for _ in range(a.turns):
                    messages.append({"role": "user", "content": f"Round {round_}: the next step for agent {i}?"})
                    steps.append({"round": round_, "conversation": i, **turn(d, messages), **memory(d)})
                    print(json.dumps(steps[-1]), flush=True)
                sleep_all(d)  # one conversation hot at a time: the next one wakes (or is prefilled) alone
                steps.append({"round": round_, "slept": True, **memory(d)})
            if round_ < a.restarts:
                assert d.stop() == 0
                d.start(timeout=900)
    finally:
        peak_rss = watch.stop() if watch else 0
        d.stop()
    largest_kv = max(s["prompt_tokens"] for s in steps if "prompt_tokens" in s) * kv_per_token
    mlx_peak = max(s["mlx_peak_bytes"] for s in steps)
    report = {"model": a.model, "words": a.words, "turns": a.turns, "restarts": a.restarts,
              "weights_bytes": facts["weights_bytes"], "kv_bytes_per_token": kv_per_token,
              "largest_session_kv_bytes": largest_kv, "peak_rss_bytes": peak_rss, "mlx_peak_bytes": mlx_peak,
              "mlx_margin_bytes": mlx_peak - facts["weights_bytes"] - largest_kv,
              "mlx_margin_over_largest_kv": round((mlx_peak - facts["weights_bytes"] - largest_kv) / largest_kv, 2),
              "steps": steps}
    print(f"weights {facts['weights_bytes'] / GB:.1f} GiB, largest KV {largest_kv / GB:.2f} GiB, MLX peak "
          f"{mlx_peak / GB:.1f} GiB (margin {report['mlx_margin_bytes'] / GB:.1f} GiB = "
          f"{report['mlx_margin_over_largest_kv']}x the largest KV), peak RSS {peak_rss / GB:.1f} GiB", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
