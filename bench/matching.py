"""Thousands of stateless conversations: what continuing one costs, the daemon's RSS and start time (issue 26).

usage: python bench/matching.py [--counts 50,500,5000,10000] [--pair 50,5000] [--system-words 2600]
                                [--requests 12] [--out bench/out] [--hot 50,800]

Conversations 0 and 1 are real: stateless chats through the `openai` package and `kvwake serve --http`
on a tiny model (testkit/tinymodel.py: random weights, a real byte-level BPE tokenizer and chat template)
with a long shared system prompt. The others are written into the store while the daemon is stopped
(thousands of generations would take hours on this machine): each is the rendered system prompt and
user-turn opening conversations 0 and 1 share, then its own random tokens, the last 10 of them its
reply, recorded as a stateless session's head snapshot records them (origin "http", chat mode,
reply_start, the last token pending). Their shared blocks are references to conversation 0's real KV;
their own tokens' KV is a stand-in cut from conversation 0's block 0 (the right shape; none of them is
woken: matching reads tokens only).

The store is copied after each count is written, so every measurement starts from the same
conversation 0. Paired: a daemon over the 50 copy and one over the 5,000 copy run side by side and
take turns (the order alternating each round), --requests rounds, each request continuing conversation
0 with the same new user turn (max_tokens 1, not streamed, timed around the `openai` call): the
first wakes it, the rest find it hot. Taking turns puts this shared machine's load on both alike;
their medians' ratio is the issue's target. Then, each count alone: the daemon's start (time to its
ready line, against the empty store's), 4 continuing requests, its RSS (VmRSS) beside the hot KV,
a paged session.list and status over RPC. Last, the largest copy restarts with stateless_ttl_s = 1:
the time until every stateless session has expired, with status answered meanwhile.
Results: <out>/matching.json (docs/benchmarks.md summarises them).

With --hot SMALL,LARGE (issue 50, point 6) the conversations stay hot instead: two daemons, each fed
stateless conversations over HTTP one after another (the shared system prompt, then a user turn of its
own, as an agent host opens them) until one holds SMALL and the other LARGE, none slept (idle timeout
and hot budget out of the way); then they take turns continuing conversation 0, --requests rounds, as
above. Reported: the continuing request's ms and the daemon's own phases of it (status.turns: match,
claim, append, first token), opening a conversation near the start and near the end, RSS and the hot KV
of each daemon. Results: <out>/matching-hot.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

import openai  # noqa: E402

from bench.lib import openai_api  # noqa: E402
from kvwake.store import Store  # noqa: E402
from kvwake.store.format.codec import Tensor  # noqa: E402
from testkit.daemon import Daemon  # noqa: E402

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


def continue_0(api: openai.OpenAI, conv: list[dict], sid0: str, label: str) -> tuple[float, bool]:
    """One request continuing conversation 0 with a new user turn: its ms, and whether it did continue it."""
    conv.append({"role": "user", "content": f"follow-up {label}: and then?"})
    ms, reply = chat(api, conv, 1)
    conv.append({"role": "assistant", "content": reply.choices[0].message.content})
    info = reply.model_extra["kvwake"]
    return round(ms, 2), info["match"] == "continued" and info["session_id"] == sid0


def paired(copies: dict[int, Path], pair: tuple[int, int], model: Path, conv: list[dict], sid0: str,
           rounds: int) -> dict[str, Any]:
    """Two daemons (over fresh copies of the `pair` counts' stores) taking turns continuing conversation 0."""
    daemons, convs, times, ok = {}, {}, {n: [] for n in pair}, []
    for n in pair:
        root = copies[n].parent / f"pair-{n}"
        shutil.copytree(copies[n], root, ignore=shutil.ignore_patterns("run"))
        daemons[n], convs[n] = Daemon(root, model, block_tokens=BLOCK, extra=["--http", "0"]), list(conv)
        daemons[n].start(timeout=900)
    for k in range(rounds):
        for n in (pair if k % 2 == 0 else pair[::-1]):
            ms, continued = continue_0(openai_api(daemons[n]), convs[n], sid0, str(k))
            times[n].append(ms)
            ok.append(continued)
    for d in daemons.values():
        assert d.stop() == 0
    small, large = pair
    row = {"pair": list(pair), "request_ms": {str(n): times[n] for n in pair},
           "woken_request_ms": {str(n): times[n][0] for n in pair},
           "hot_request_ms_median": {str(n): statistics.median(times[n][1:]) for n in pair},
           "all_continued_conversation_0": all(ok)}
    row["hot_ratio"] = round(row["hot_request_ms_median"][str(large)] / row["hot_request_ms_median"][str(small)], 3)
    row["woken_ratio"] = round(times[large][0] / times[small][0], 3)
    print(json.dumps({"paired": row}), flush=True)
    return row


def level(d: Daemon, count: int, conv: list[dict], sid0: str, empty_start: float) -> dict[str, Any]:
    """Start the daemon over `count` stored conversations and continue conversation 0 four times."""
    start_s = started(d)
    api, conv = openai_api(d), list(conv)
    runs = [continue_0(api, conv, sid0, f"{count}-{k}") for k in range(4)]
    times = [ms for ms, _ in runs]
    with d.client() as rpc:
        t = time.perf_counter()
        status = rpc.call("status")
        status_ms = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        page = rpc.call("session.list", origin="http", state="asleep", limit=100)
        list_ms = (time.perf_counter() - t) * 1000
    row = {"stateless_sessions": count, "start_s": start_s, "start_over_empty_s": round(start_s - empty_start, 3),
           "request_ms": times, "all_continued_conversation_0": all(ok for _, ok in runs),
           "rss_bytes": rss_bytes(d.proc.pid), "hot_kv_bytes": status["memory"]["hot_kv_bytes"],
           "sessions": status["sessions"], "status_ms": round(status_ms, 2),
           "session_list_page_ms": round(list_ms, 2), "session_list_page": len(page["sessions"])}
    assert d.stop() == 0 and d.log_problems() == [], d.log_problems()
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


HOT_CONFIG = "idle_timeout_s = 86400\nhot_budget_bytes = 100000000000\n"  # nothing sleeps while measured


def opened(api: openai.OpenAI, system: str, i: int) -> tuple[float, str]:
    """Open stateless conversation i (the shared system prompt, a user turn of its own): its ms and session."""
    ms, reply = chat(api, [{"role": "system", "content": system}, {"role": "user", "content": f"conversation {i}"}], 2)
    return ms, reply.model_extra["kvwake"]["session_id"]


def last_turn(d: Daemon) -> tuple[dict[str, Any], dict[str, Any]]:
    """The daemon's record of its last turn (status.turns), and its memory and session counts."""
    with d.client() as rpc:
        status = rpc.call("status")
    return status["turns"][-1], {"rss_bytes": rss_bytes(d.proc.pid), "hot_kv_bytes": status["memory"]["hot_kv_bytes"],
                                 "sessions": status["sessions"]}


def hot(work: Path, model: Path, system: str, pair: tuple[int, int], rounds: int) -> dict[str, Any]:
    """Two daemons holding `pair` hot stateless conversations take turns continuing conversation 0."""
    daemons, convs, opening, sid0 = {}, {}, {}, {}
    for n in pair:
        root = work / f"hot-{n}"
        root.mkdir()
        (root / "none.toml").write_text(HOT_CONFIG)
        d = daemons[n] = Daemon(root, model, block_tokens=BLOCK, extra=["--http", "0"])
        d.start(timeout=900)
        api, t = openai_api(d), time.perf_counter()
        conv = [{"role": "system", "content": system}, {"role": "user", "content": "conversation 0"}]
        _, first = chat(api, conv, 10)
        convs[n] = conv + [{"role": "assistant", "content": first.choices[0].message.content}]
        sid0[n] = first.model_extra["kvwake"]["session_id"]
        times = [opened(api, system, i)[0] for i in range(1, n)]
        opening[n] = {"first_10_ms_median": statistics.median(times[:10]),
                      "last_10_ms_median": statistics.median(times[-10:]), "all_s": round(time.perf_counter() - t, 1)}
        print(json.dumps({"opened": n, **opening[n]}), flush=True)
    times, phases, ok = {n: [] for n in pair}, {n: [] for n in pair}, []
    for k in range(rounds):
        for n in (pair if k % 2 == 0 else pair[::-1]):
            ms, reply = chat(openai_api(daemons[n]), convs[n] + [{"role": "user", "content": f"follow-up {k}"}], 1)
            convs[n] += [{"role": "user", "content": f"follow-up {k}"},
                         {"role": "assistant", "content": reply.choices[0].message.content}]
            ok.append(reply.model_extra["kvwake"]["match"] == "continued"
                      and reply.model_extra["kvwake"]["session_id"] == sid0[n])
            times[n].append(round(ms, 2))
            phases[n].append(last_turn(daemons[n])[0])
    small, large = pair
    row: dict[str, Any] = {"pair": list(pair), "request_ms": {str(n): times[n] for n in pair},
                           "request_ms_median": {str(n): statistics.median(times[n]) for n in pair},
                           "all_continued_conversation_0": all(ok), "opening": {str(n): opening[n] for n in pair}}
    row["ratio"] = round(row["request_ms_median"][str(large)] / row["request_ms_median"][str(small)], 3)
    for n in pair:
        keys = ("match_ms", "match_store_ms", "claim_ms", "append_ms", "first_token_ms")
        row[f"phases_{n}_median"] = {key: statistics.median(p.get(key) or 0 for p in phases[n]) for key in keys}
        row[f"memory_{n}"] = last_turn(daemons[n])[1]
        assert daemons[n].stop() == 0
    print(json.dumps({"hot": row}), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="50,500,5000,10000")
    ap.add_argument("--pair", default="50,5000", help="the two counts measured side by side")
    ap.add_argument("--system-words", type=int, default=2600, help="the shared system prompt (~7k tokens)")
    ap.add_argument("--requests", type=int, default=12, help="rounds of the paired measurement")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    ap.add_argument("--hot", default=None, help="SMALL,LARGE: the hot case (issue 50) instead of the stored one")
    a = ap.parse_args()
    from testkit.tinymodel import make_model_dir

    counts, pair = [int(c) for c in a.counts.split(",")], tuple(int(c) for c in a.pair.split(","))
    work = Path(tempfile.mkdtemp(prefix="kvwake-matching-"))
    model = make_model_dir(work / "tiny-llama", ascii_replies=True, max_position_embeddings=32768)
    if a.hot is not None:
        report = {"machine": f"{platform.machine()}, {platform.processor() or '?'}, {os.cpu_count()} cores",
                  "load_average_at_start": os.getloadavg(), "block_tokens": BLOCK,
                  "hot": hot(work, model, system_prompt(a.system_words), tuple(int(c) for c in a.hot.split(",")),
                             a.requests)}
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "matching-hot.json").write_text(json.dumps(report, indent=1))
        shutil.rmtree(work)
        return
    root = work / "daemon"
    root.mkdir()
    d = Daemon(root, model, block_tokens=BLOCK, extra=["--http", "0"])
    empty_start = started(d)
    empty_rss = rss_bytes(d.proc.pid)
    system = system_prompt(a.system_words)
    conv = [{"role": "system", "content": system}, {"role": "user", "content": "question 0: where to start?"}]
    _, first = chat(openai_api(d), conv, 10)
    sid0 = first.model_extra["kvwake"]["session_id"]
    conv.append({"role": "assistant", "content": first.choices[0].message.content})
    _, other = chat(openai_api(d), [conv[0], {"role": "user", "content": "question 1: what else?"}], 10)
    assert d.stop() == 0
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {platform.processor() or '?'}, {os.cpu_count()} cores",
        "load_average_at_start": os.getloadavg(), "python": platform.python_version(), "block_tokens": BLOCK,
        "empty_start_s": empty_start, "empty_rss_bytes": empty_rss, "conversation_0_tokens": first.usage.prompt_tokens}
    copies, made = {}, 2
    for count in counts:
        t = time.perf_counter()
        with Store(d.data_dir / "store", block_tokens=BLOCK, codec="raw") as store:
            store.index.db.execute("PRAGMA synchronous=OFF")  # bench setup only: no fsync per commit
            others = Others(store, sid0, other.model_extra["kvwake"]["session_id"], system)
            others.rng.seed(made)
            report["shared_prompt_tokens"] = others.shared
            for i in range(made, count):
                others.write(i)
        copies[count] = work / f"at-{count}"
        shutil.copytree(root, copies[count], ignore=shutil.ignore_patterns("run"))
        print(f"wrote {count - made} conversations in {time.perf_counter() - t:.1f} s", flush=True)
        made = count
    report["paired"] = paired(copies, pair, model, conv, sid0, a.requests)
    report["levels"] = [level(Daemon(copies[n], model, block_tokens=BLOCK, extra=["--http", "0"]), n, conv, sid0,
                              empty_start) for n in counts]
    big = Daemon(copies[counts[-1]], model, block_tokens=BLOCK, extra=["--http", "0"])
    report["expiry"] = expiry(big, copies[counts[-1]])
    assert big.stop() == 0
    base, top = report["levels"][0], report["levels"][-1]
    report["summary"] = {
        "hot_request_ratio": report["paired"]["hot_ratio"], "woken_request_ratio": report["paired"]["woken_ratio"],
        # beyond the hot KV (the same conversation 0 in every copy)
        "rss_bytes_per_asleep_session": round((top["rss_bytes"] - top["hot_kv_bytes"] - base["rss_bytes"]
                                               + base["hot_kv_bytes"])
                                              / (top["stateless_sessions"] - base["stateless_sessions"])),
        "max_start_over_empty_s": max(lv["start_over_empty_s"] for lv in report["levels"]),
        "log_problems": big.log_problems()}
    print(json.dumps(report["summary"]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matching.json").write_text(json.dumps(report, indent=1))
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
