"""Thousands of stateless conversations: what continuing one costs, the daemon's RSS and start time (issue 26).

usage: python bench/matching.py [--counts 50,500,5000,10000] [--system-words 2600] [--requests 8]
                                [--out bench/out]

Conversations 0 and 1 are real: stateless chats through the `openai` package and `kvwake serve --http`
on a tiny model (tests/tinymodel.py: random weights, a real byte-level BPE tokenizer and chat template)
with a long shared system prompt. The others are written into the store while the daemon is stopped
(thousands of generations would take hours on this machine): each is the rendered system prompt and
user-turn opening conversations 0 and 1 share, then its own random tokens, the last 10 of them its
reply, recorded as a stateless session's head snapshot records them (origin "http", chat mode,
reply_start, the last token pending). Their shared blocks are references to conversation 0's real KV;
their own tokens' KV is a stand-in cut from conversation 0's block 0 (the right shape; none of them is
woken: matching reads tokens only).

At each count the daemon starts (time to its ready line, against the empty store's), then --requests
requests continue conversation 0 (one new user turn each, max_tokens 1, not streamed, timed around
the `openai` call): the first wakes it, the rest find it hot. Then: the daemon's RSS (VmRSS), a paged
session.list and status over RPC. After the last count the daemon restarts with stateless_ttl_s = 1
and the time until every stateless session has expired is measured, with status answered meanwhile.
Results: <out>/matching.json (docs/benchmarks.md summarises them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # tests/ helpers: the real daemon and a raw msgpack-rpc client

import openai  # noqa: E402

from kvwake.client import openai_config  # noqa: E402
from kvwake.store import Store  # noqa: E402
from kvwake.store.format.codec import Tensor  # noqa: E402
from tests.daemon import Daemon  # noqa: E402

BLOCK = 128
WORDS = ("tool retry policy budget cache session agent memory plan step verify source answer brief "
         "careful index block prefix token model restore sleep wake store digest bundle").split()


def system_prompt(words: int) -> str:
    return "You are a careful agent. " + " ".join(WORDS[i % len(WORDS)] for i in range(words)) + "."


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def started(d: Daemon) -> float:
    t = time.perf_counter()
    d.start(timeout=900)
    return round(time.perf_counter() - t, 3)


def chat(api: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[float, Any]:
    t = time.perf_counter()
    reply = api.chat.completions.create(model="local", messages=messages, max_tokens=max_tokens, temperature=0)
    return (time.perf_counter() - t) * 1000, reply


class Others:
    """Writes the stand-in conversations (see the module docstring) into a stopped daemon's store."""

    def __init__(self, store: Store, sid0: str, sid1: str, system: str) -> None:
        self.store, self.system = store, system
        head0 = store.snapshot(store.latest_snapshot(sid0))
        head1 = store.snapshot(store.latest_snapshot(sid1))
        t0, t1 = list(head0.token_ids), list(head1.token_ids)
        self.shared = next((i for i, (a, b) in enumerate(zip(t0, t1)) if a != b), min(len(t0), len(t1)))
        self.prefix, self.bundle = t0[: self.shared], head0.bundle
        self.block = store.read_block(head0.blocks[0])  # the stand-in KV
        self.rng = random.Random(26)

    def standin(self, n: int) -> dict[str, Tensor]:
        """Arrays shaped like n tokens' KV, cut from a real block along its token axis."""
        out = {}
        for name, t in self.block.items():
            axis = t.array.shape.index(BLOCK)
            out[name] = Tensor(t.dtype, t.array.take(range(n), axis=axis))
        return out

    def write(self, i: int) -> None:
        sid = f"http-bench-{i:05d}"
        tokens = self.prefix + [self.rng.randrange(40, 120) for _ in range(self.rng.randrange(20, 200))]
        kept = tokens[:-1]  # the last token is pending, as after a generation
        state = {"mode": "chat", "messages": [{"role": "system", "content": self.system},
                                              {"role": "user", "content": f"conversation {i}"},
                                              {"role": "assistant", "content": "a reply"}],
                 "tools": None, "pending": tokens[-1:], "metadata": {"origin": "http"},
                 "reply_start": len(tokens) - 10}
        with self.store.writer(sid, self.bundle, kept, metadata=state) as w:
            for b in w.needed:
                w.add_block(b, self.standin(BLOCK))
            full = len(kept) // BLOCK * BLOCK
            if full < len(kept):
                w.set_tail(self.standin(len(kept) - full))
            w.commit()
        self.store.ensure_session(sid, {"origin": "http"})


def level(d: Daemon, count: int, conv: list[dict], sid0: str, requests: int, empty_start: float) -> dict[str, Any]:
    """Start the daemon over `count` stored conversations and continue conversation 0 `requests` times."""
    start_s = started(d)
    api = openai.OpenAI(**openai_config(d.socket), max_retries=0, timeout=3600)
    times, matches = [], []
    for k in range(requests):
        conv.append({"role": "user", "content": f"follow-up {count}-{k}: and then?"})
        ms, reply = chat(api, conv, 1)
        info = reply.model_extra["kvwake"]
        matches.append(info["match"] == "continued" and info["session_id"] == sid0)
        conv.append({"role": "assistant", "content": reply.choices[0].message.content})
        times.append(round(ms, 2))
    with d.client() as rpc:
        t = time.perf_counter()
        status = rpc.call("status")
        status_ms = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        page = rpc.call("session.list", origin="http", state="asleep", limit=100)
        list_ms = (time.perf_counter() - t) * 1000
    row = {"stateless_sessions": count, "start_s": start_s, "start_over_empty_s": round(start_s - empty_start, 3),
           "request_ms": times, "woken_request_ms": times[0], "hot_request_ms_median": statistics.median(times[1:]),
           "all_continued_conversation_0": all(matches), "rss_bytes": rss_bytes(d.proc.pid),
           "hot_kv_bytes": status["memory"]["hot_kv_bytes"], "sessions": status["sessions"],
           "status_ms": round(status_ms, 2), "session_list_page_ms": round(list_ms, 2),
           "session_list_page": len(page["sessions"])}
    print(json.dumps(row), flush=True)
    return row


def expiry(d: Daemon, root: Path) -> dict[str, Any]:
    """Restart with a 1 s TTL; time until no stateless session is left, and status latency meanwhile."""
    (root / "none.toml").write_text("stateless_ttl_s = 1\ngc_interval_s = 1\nlifecycle_interval_s = 0.2\n")
    start_s = started(d)
    t, samples = time.perf_counter(), []
    with d.client() as rpc:
        while True:
            s = time.perf_counter()
            left = rpc.call("status")["sessions"]["asleep"]
            samples.append((time.perf_counter() - s) * 1000)
            if left == 0 or time.perf_counter() - t > 1800:
                break
            time.sleep(0.5)
    row = {"start_s": start_s, "expired_all_s": round(time.perf_counter() - t, 2), "left": left,
           "status_ms_max_while_expiring": round(max(samples), 2),
           "status_ms_median_while_expiring": round(statistics.median(samples), 2)}
    print(json.dumps({"expiry": row}), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="50,500,5000,10000")
    ap.add_argument("--system-words", type=int, default=2600, help="the shared system prompt (~7k tokens)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    a = ap.parse_args()
    from tests.tinymodel import make_model_dir

    work = Path(tempfile.mkdtemp(prefix="kvwake-matching-"))
    model = make_model_dir(work / "tiny-llama", ascii_replies=True, max_position_embeddings=32768)
    root = work / "daemon"
    root.mkdir()
    d = Daemon(root, model, block_tokens=BLOCK, extra=["--http", "0"])
    empty_start = started(d)
    empty_rss = rss_bytes(d.proc.pid)
    system = system_prompt(a.system_words)
    api = openai.OpenAI(**openai_config(d.socket), max_retries=0, timeout=3600)
    conv = [{"role": "system", "content": system}, {"role": "user", "content": "question 0: where to start?"}]
    _, first = chat(api, conv, 10)
    sid0 = first.model_extra["kvwake"]["session_id"]
    conv.append({"role": "assistant", "content": first.choices[0].message.content})
    _, other = chat(api, [conv[0], {"role": "user", "content": "question 1: what else?"}], 10)
    assert d.stop() == 0
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {platform.processor() or '?'}, {os.cpu_count()} cores",
        "python": platform.python_version(), "block_tokens": BLOCK, "empty_start_s": empty_start,
        "empty_rss_bytes": empty_rss, "conversation_0_tokens": first.usage.prompt_tokens, "levels": []}
    made = 2
    for count in [int(c) for c in a.counts.split(",")]:
        if count > made:
            t = time.perf_counter()
            with Store(d.data_dir / "store", block_tokens=BLOCK) as store:
                store.index.db.execute("PRAGMA synchronous=OFF")  # bench setup only: no fsync per commit
                others = Others(store, sid0, other.model_extra["kvwake"]["session_id"], system)
                others.rng.seed(made)
                report["shared_prompt_tokens"] = others.shared
                for i in range(made, count):
                    others.write(i)
            print(f"wrote {count - made} conversations in {time.perf_counter() - t:.1f} s", flush=True)
            made = count
        report["levels"].append(level(d, count, conv, sid0, a.requests, empty_start))
        assert d.stop() == 0
    report["expiry"] = expiry(d, root)
    assert d.stop() == 0
    base, top = report["levels"][0], report["levels"][-1]
    per = [lv for lv in report["levels"] if lv["stateless_sessions"] == 5000] or [top]
    report["summary"] = {
        "hot_request_ratio_5000_over_50": round(per[0]["hot_request_ms_median"] / base["hot_request_ms_median"], 3),
        "woken_request_ratio_5000_over_50": round(per[0]["woken_request_ms"] / base["woken_request_ms"], 3),
        # beyond the hot KV (conversation 0 grows by a turn per request)
        "rss_bytes_per_asleep_session": round((top["rss_bytes"] - top["hot_kv_bytes"] - base["rss_bytes"]
                                               + base["hot_kv_bytes"])
                                              / (top["stateless_sessions"] - base["stateless_sessions"])),
        "max_start_over_empty_s": max(lv["start_over_empty_s"] for lv in report["levels"]),
        "log_problems": d.log_problems()}
    print(json.dumps(report["summary"]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matching.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
