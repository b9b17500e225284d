"""N agents send their next turn at once, beside a session that decodes: how long their first tokens take.

usage: python bench/turns_at_once.py [--model tiny|default|PATH] [--sessions 16] [--rounds 2] [--out bench/out]

Each of N sessions has a conversation (one chat turn made before). A talker decodes a long reply; then
all N send their next chat turn (a new user message, about 40 tokens) in one moment, non-streamed,
`max_tokens` 8. Reported per round: the turns' first tokens as the daemon counts them (`usage.ttft_ms`,
from the call's arrival: the turn's prefill and its join), p50 and max, the calls' wall time, the
engine thread's jobs and decode steps between the round's start and end, the packed prefills (turns whose
short chunks went in one forward pass: `prefill_packs`, `prefill_packed_chunks`), and the checkpoints committed
and dropped (`checkpoints_moved`: the session went into the batch before its capture ran). While a call decodes
the engine runs one job between two steps (model/thread.py), and a turn is several jobs (its cache cut back
with its chunk queued, the chunk computed, its checkpoint's captures): N turns at once are about N x jobs steps.
Each round's turn sends the replies back as the client got them; a random-weight model's reply text does
not always tokenize back to its tokens, so a later round may prefill more than its new message (the report's
`prefilled_p50` says how much). (Session 23, here, tiny model: 16 turns of ~260 tokens, 80 jobs, 57 steps,
first tokens p50 364 ms, max 534 ms.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

from bench.lib import bench_model, engine_work, machine, start_daemon  # noqa: E402


def turn(i: int, replies: list[str]) -> list[dict[str, str]]:
    """Session i's conversation with its replies so far, and its next user message."""
    messages: list[dict[str, str]] = []
    for j in range(len(replies) + 1):
        messages.append({"role": "user", "content": f"Agent {i}, step {j}: read the tests and the docs of module "
                                                    f"{i * 7 + j}, then say what you found in them and what to fix."})
        if j < len(replies):
            messages.append({"role": "assistant", "content": replies[j]})
    return messages


def talk(d: Any, stop: threading.Event, steps: list[int]) -> None:
    """A session decoding until `stop`: a new one each time the last reaches its max_tokens."""
    with d.client() as c:
        k = 0
        while not stop.is_set():
            name = f"talker-{k}"
            c.call("session.create", session_id=name)
            c.call("session.append", session_id=name, text="Tell a long story about a lighthouse keeper.")
            steps.append(len(c.call("session.generate", session_id=name, max_tokens=1000)["tokens"]))
            c.call("session.delete", session_id=name)
            k += 1


ALONE_S = 0.5  # each round begins with the talker alone this long


def one_round(d: Any, n: int, replies: list[list[str]]) -> dict[str, Any]:
    out: list[tuple[float, dict[str, Any]] | None] = [None] * n
    barrier = threading.Barrier(n)

    def call(i: int) -> None:
        with d.client() as c:
            barrier.wait()
            t = time.perf_counter()
            r = c.call("session.chat", session_id=f"a{i}", messages=turn(i, replies[i]), max_tokens=8)
            out[i] = ((time.perf_counter() - t) * 1000, r["usage"])
            replies[i].append(r["text"])

    alone_wall = time.time()
    time.sleep(ALONE_S)  # the talker alone: its gaps' baseline
    with d.client() as c:
        status = c.call("status")
        before, saved, counted = status["engine_thread"], status["persistence"], status["counters"]
    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    began_wall = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with d.client() as c:
        status = c.call("status")
        after = status["engine_thread"]
        time.sleep(0.5)  # the turns' checkpoints (their end offers) settle
        persisted = c.call("status")["persistence"]
    done = [o for o in out if o is not None]
    work = engine_work(status, alone_wall, time.time())
    ttft = [u["ttft_ms"] for _, u in done]
    walls = [w for w, _ in done]
    return {"turns": len(done), "ttft_p50_ms": round(statistics.median(ttft), 1), "ttft_max_ms": round(max(ttft), 1),
            "wall_p50_ms": round(statistics.median(walls), 1), "wall_max_ms": round(max(walls), 1),
            "prefilled_p50": statistics.median(u.get("prefilled_tokens", 0) for _, u in done),
            "engine_jobs": after["jobs"] - before["jobs"], "engine_steps": after["steps"] - before["steps"],
            # checkpoints committed, and dropped because the session moved (into the batch) under them
            **{k: persisted[k] - saved[k] for k in ("checkpoints", "checkpoints_moved")},
            # forward passes that prefilled several turns at once, and the turns in them (model/packing.py)
            **{k: status["counters"][k] - counted[k] for k in ("prefill_packs", "prefill_packed_chunks")},
            # the engine's jobs and steps over its SLOW_S during the round (all with KVWAKE_SLOW_JOB_MS=0)
            "slow_engine_work": [{**j, "at_s": round(j["at_s"] - ALONE_S, 3)} for j in work],
            **talker_gaps(work, ALONE_S, (began_wall - alone_wall) + max(w for w, _ in done) / 1000)}


def talker_gaps(work: list[dict[str, Any]], alone_s: float, until_s: float) -> dict[str, Any]:
    """The talker's side: intervals between the engine's decode steps (their starts, from the trace of every
    job and step: KVWAKE_SLOW_JOB_MS=0 in the daemon's environment), alone (before `alone_s`) and while the
    turns prefill (to `until_s`), p50 / p99 / max in ms; {} without the trace."""
    steps = [j["at_s"] for j in work if j["what"].startswith("decode step")]
    gaps = [(b, (b - a) * 1000) for a, b in zip(steps, steps[1:])]
    alone = sorted(g for at, g in gaps if at <= alone_s)
    during = sorted(g for at, g in gaps if alone_s < at <= until_s)
    if len(alone) < 10 or not during:
        return {}
    def pick(values: list[float], q: float) -> float:
        return round(values[min(len(values) - 1, int(q * len(values)))], 1)
    return {"talker_gap_alone_ms": [pick(alone, 0.5), pick(alone, 0.99)],
            "talker_gap_during_ms": [pick(during, 0.5), pick(during, 0.99), round(during[-1], 1)],
            "talker_p99_during_over_p50_alone": round(pick(during, 0.99) / pick(alone, 0.5), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvwake-turns-"))
    model = bench_model(args.model, work)
    d = start_daemon(work / "daemon", model, 32, 512)
    rounds: list[dict[str, Any]] = []
    replies: list[list[str]] = [[] for _ in range(args.sessions)]
    stop, talked = threading.Event(), []
    try:
        with d.client() as c:
            for i in range(args.sessions):
                c.call("session.create", session_id=f"a{i}")
                first = c.call("session.chat", session_id=f"a{i}", messages=turn(i, []), max_tokens=4)
                replies[i].append(first["text"])
        talker = threading.Thread(target=talk, args=(d, stop, talked), daemon=True)
        talker.start()
        time.sleep(1.0)  # the talker decodes
        for r in range(args.rounds):
            row = one_round(d, args.sessions, replies)
            print(json.dumps({"round": r + 1, **{k: v for k, v in row.items() if k != "slow_engine_work"}}), flush=True)
            rounds.append(row)
        stop.set()
        talker.join(600)
    finally:
        d.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "model": str(args.model), "sessions": args.sessions, "rounds": rounds}
    (out / "turns_at_once.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
