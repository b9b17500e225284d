"""Hot paths of two kvwake trees, measured in one run: wake, sleep, prefill and batched decode.

usage: python bench/abtest/abtest.py --tree A=SITE_A --tree B=SITE_B --model MODEL_DIR --work DIR
                                     [--rounds 4] [--resume-tokens 2048] [--turn-tokens 32] [--wakes 3]
                                     [--decode-contexts 256,512,1024,1536] [--decode-tokens 32] [--out FILE]

Each SITE is a folder a tree is installed in (bench/abtest/run.sh installs them). Both daemons run
for the whole run, each on its own socket and store; rounds interleave the trees (A B, then B A, ...)
so the machine's drift reaches both alike. Round 0 warms every shape up and is not counted.
This process talks to the daemons only through kvwake.client (the one PYTHONPATH gives it).
Prints one line per metric: per tree the median and best of all samples, the ratio B/A of the
medians, and the range of the per-round ratios (the noise); the whole record goes to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemons import CONFIG, Daemon, Tree  # noqa: E402
from workloads import Sizes, decode_round, prepare_decoders, resume_round  # noqa: E402

# Metrics where a larger number is better; every other one is a time (smaller is better).
HIGHER_IS_BETTER = {"prefill_tok_s", "decode_tok_s"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, type=Tree.parse, help="LABEL=SITE_DIR (twice)")
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--work", required=True, type=Path, help="daemons' sockets, stores and logs")
    ap.add_argument("--rounds", type=int, default=4, help="counted rounds (one warm-up round comes first)")
    ap.add_argument("--resume-tokens", type=int, default=2048)
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--wakes", type=int, default=3)
    ap.add_argument("--decode-contexts", default="256,512,1024,1536", help="one decode session per size")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a daemon may take to start")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if len({t.label for t in args.tree}) != len(args.tree) or len(args.tree) < 2:
        ap.error("give two or more trees with distinct labels")
    return args


def sizes_of(args: argparse.Namespace) -> Sizes:
    contexts = tuple(int(n) for n in args.decode_contexts.split(",") if n)
    return Sizes(args.resume_tokens, args.turn_tokens, args.wakes, contexts, args.decode_tokens)


def run_rounds(clients: dict[str, Any], sizes: Sizes, rounds: int) -> dict[str, list[dict[str, list[float]]]]:
    """Per tree, one dict of samples per counted round. Odd rounds run the trees in reverse order."""
    decoders = {label: prepare_decoders(c, sizes) for label, c in clients.items()}
    record: dict[str, list[dict[str, list[float]]]] = {label: [] for label in clients}
    for r in range(rounds + 1):
        order = list(clients) if r % 2 == 0 else list(reversed(clients))
        for label in order:
            sample = resume_round(clients[label], f"r{r}", sizes)
            sample.update(decode_round(clients[label], decoders[label], sizes))
            if r:
                record[label].append(sample)
            print(f"round {r}{' (warm-up)' if not r else ''} {label}: "
                  + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in sample.items()), flush=True)
    return record


def summarize(record: dict[str, list[dict[str, list[float]]]]) -> dict[str, Any]:
    """Per metric: each tree's median and best of all samples; each later tree's ratio to the first
    (medians) and the range of its per-round ratios (medians of that round's samples)."""
    labels = list(record)
    first = labels[0]
    metrics = sorted({m for rounds in record.values() for sample in rounds for m in sample})
    summary: dict[str, Any] = {}
    for m in metrics:
        best = max if m in HIGHER_IS_BETTER else min
        rows: dict[str, Any] = {}
        for label in labels:
            values = [v for sample in record[label] for v in sample.get(m, [])]
            if values:
                rows[label] = {"p50": statistics.median(values), "best": best(values), "n": len(values)}
        for label in labels[1:]:
            if label in rows and first in rows:
                pairs = [(statistics.median(b[m]), statistics.median(a[m]))
                         for a, b in zip(record[first], record[label]) if m in a and m in b]
                ratios = [b / a for b, a in pairs if a]
                rows[label]["ratio"] = rows[label]["p50"] / rows[first]["p50"]
                rows[label]["round_ratios"] = [round(x, 3) for x in ratios]
        summary[m] = rows
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    for m, rows in summary.items():
        better = "higher" if m in HIGHER_IS_BETTER else "lower"
        cells = [f"{label} p50 {r['p50']:.2f} best {r['best']:.2f}" for label, r in rows.items()]
        for label, r in rows.items():
            if "ratio" in r:
                spread = f" [{min(r['round_ratios']):.3f}..{max(r['round_ratios']):.3f}]" if r["round_ratios"] else ""
                cells.append(f"{label}/A {r['ratio']:.3f}{spread}")
        print(f"{m} ({better} is better): " + "; ".join(cells))


def main(argv: list[str] | None = None) -> None:
    from kvwake.client import Client

    args = parse_args(argv)
    daemons = [Daemon(t, args.model, args.work / t.label) for t in args.tree]
    clients: dict[str, Any] = {}
    try:
        for d in daemons:
            d.start()
        for d in daemons:
            d.wait_ready(args.ready_timeout)
            clients[d.tree.label] = Client(d.socket, timeout=None, autostart=False)
        hellos = {label: c.hello("kvwake-abtest") for label, c in clients.items()}
        record = run_rounds(clients, sizes_of(args), args.rounds)
    finally:
        for c in clients.values():
            c.close()
        for d in daemons:
            d.stop()
    summary = summarize(record)
    print_summary(summary)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": platform.node(), "trees": {t.label: str(t.site) for t in args.tree},
                                        "hello": hellos, "config": CONFIG, "sizes": vars(sizes_of(args)),
                                        "summary": summary, "samples": record}, indent=1, default=str))


if __name__ == "__main__":
    main()
