"""A long prompt's render beside a decoding session: how long the talker's tokens pause meanwhile.

usage: python bench/render_beside.py [--model default|tiny|PATH] [--old SITE] [--rounds 3] [--appends 8]
                                     [--text-tokens 40000] [--together 1] [--chat] [--out bench/out]

A talker streams tokens while another session appends, --appends times, a text of --text-tokens
tokens: past the daemon's context (capped at half the text), so the daemon renders it (tokenizes it: its whole cost, nothing is
prefilled) and refuses it (CONTEXT_TOO_LONG). Reported per daemon: the talker's median gap outside
the appends, its longest gap overlapping each append (median and max of them), and the appends' own
time. `--together R`: R readers append at once, each to its own session; `--chat`: each appends a chat
whose system message is the text, new to the daemon's kept pieces (model/pieces.py), as agents' first
turns are. `--old SITE`: a second daemon from a tree installed there (`pip install --no-deps --target SITE`), the
two alternating round after round: before and after, one machine. Session 20's change rendered the
prompt on the append's worker thread; the tree before rendered it in an engine-thread job.
`--model default` is SmolLM2-135M (a real tokenizer; 8,192 tokens of context).
Results: <out>/render_beside.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from batching import Stream, bench_model, save  # noqa: E402
from tests.daemon import Daemon, RawClient, RpcError  # noqa: E402

UNIT = "The archive holds notes, plans and tool output from many earlier runs. "


def refused(d: Daemon, session: str, inputs: dict[str, Any]) -> float:
    """Append `inputs` (past the context) and see it refused; the append's time, ms."""
    began = time.perf_counter()
    with d.client() as c:
        try:
            c.call("session.append", session_id=session, **inputs)
            raise AssertionError("the text fit the context: give more --text-tokens")
        except RpcError as exc:
            if "CONTEXT_TOO_LONG" not in str(exc):
                raise
    return (time.perf_counter() - began) * 1000


def one_round(root: Path, model: Path, site: str | None, appends: int, text: str, tokenizer: Any,
              together: int = 1, chat: bool = False) -> dict[str, Any]:
    env = {"PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)} if site else {}
    root.mkdir(parents=True)
    # the daemon's context capped at half the text, so that the text is refused whatever the model's own context
    cap = len(tokenizer.encode(text)) // 2
    (root / "none.toml").write_text(f"hot_budget_bytes = {1 << 40}\npersist = false\nmax_context = {cap}\n")
    d = Daemon(root, model, block_tokens=128, env=env).start(timeout=600)
    try:
        with d.client() as c:
            for name in ("talker", *(f"reader{i}" for i in range(together))):
                c.call("session.create", session_id=name)
            c.call("session.append", session_id="talker", text="Tell the long story of the migration.")
            c.call("session.generate", session_id="talker", max_tokens=16)  # kernels built (CUDA: seconds)
            t0 = time.perf_counter()
            c.call("session.generate", session_id="talker", max_tokens=16)
            step = (time.perf_counter() - t0) / 16
        stream = Stream(RawClient(d.socket, timeout=600), "talker", int((appends * 1.0 + 4.0) / step) + 64)
        thread = threading.Thread(target=stream.run)
        thread.start()
        while len(stream.pieces) < 32 and thread.is_alive():
            time.sleep(0.005)
        windows, took = [], []
        for k in range(appends):
            # each reader's input new to the daemon: a chat's system message new to the kept pieces
            inputs = [{"messages": [{"role": "system", "content": f"Desk {k}-{i}. {text}"},
                                    {"role": "user", "content": "Go on."}]} if chat else {"text": text}
                      for i in range(together)]
            began = time.perf_counter()
            with ThreadPoolExecutor(together) as pool:
                took += pool.map(lambda i: refused(d, f"reader{i}", inputs[i]), range(together))
            windows.append((began, time.perf_counter()))
            time.sleep(0.3)
        thread.join()
        stream.client.close()
    finally:
        d.stop()
    arrivals = stream.arrivals(tokenizer)
    pairs = [(a[1], b[1]) for a, b in zip(arrivals, arrivals[1:]) if b[0] == a[0] + 1]
    overlaps = lambda p, w: p[0] < w[1] and p[1] > w[0]  # noqa: E731
    if not stream.ended > windows[-1][1]:
        missed = sum(stream.ended < w[1] for w in windows)
        raise AssertionError(f"the talker ended before the last append: its gaps miss {missed} of them (its "
                             "tokens are sized from its step alone: a slower machine needs more)")
    longest = [max(((b - a) * 1000 for a, b in pairs if overlaps((a, b), w)), default=0.0) for w in windows]
    outside = [(b - a) * 1000 for a, b in pairs if not any(overlaps((a, b), w) for w in windows)]
    return {"gap_p50_outside_ms": round(statistics.median(outside), 2),
            "longest_gap_per_append_ms": [round(x, 1) for x in longest], "append_ms": [round(x, 1) for x in took]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--old", default=None,
                    help="a site folder holding the tree to compare (pip install --no-deps --target)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--appends", type=int, default=8)
    ap.add_argument("--text-tokens", type=int, default=40000)
    ap.add_argument("--together", type=int, default=1, help="readers appending at once, each its own session")
    ap.add_argument("--chat", action="store_true",
                    help="each reader appends a chat whose system message is the text (new to the kept pieces)")
    ap.add_argument("--out", default="bench/out")
    a = ap.parse_args()
    from mlx_lm.utils import load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="kvwake-render-"))
    model = bench_model(a.model, Path.home() / ".cache" / "kvwake-bench")
    tokenizer = load_tokenizer(model)
    text = UNIT * max(1, a.text_tokens // len(tokenizer.encode(UNIT)))
    trees = {"new": None, **({"old": a.old} if a.old else {})}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for r in range(a.rounds):
        for name, site in trees.items():
            got = one_round(work / f"{name}-{r}", model, site, a.appends, text, tokenizer, a.together, a.chat)
            rounds[name].append(got)
            print(name, r, got, flush=True)
    summary = {}
    for name, got in rounds.items():
        longest = [x for g in got for x in g["longest_gap_per_append_ms"]]
        summary[name] = {"gap_p50_outside_ms": statistics.median(g["gap_p50_outside_ms"] for g in got),
                         "longest_gap_beside_an_append_ms": {"median": statistics.median(longest), "max": max(longest)},
                         "append_ms_median": statistics.median(x for g in got for x in g["append_ms"])}
    variant = "" if a.together == 1 and not a.chat else f"-{a.together}{'-chat' * a.chat}"
    name = f"render_beside{variant}.json"
    save({"model": str(model), "text_tokens": len(tokenizer.encode(text)), "appends": a.appends,
          "together": a.together, "chat": a.chat, "rounds": rounds, "summary": summary}, a.out, name)


if __name__ == "__main__":
    main()
