"""One line per prefill-row trace (bench/batching.py's batching.json, run with KVWAKE_SLOW_JOB_MS=0): the
talker's p99 gap over its median alone, the longest decode step, the longest plain and fused slices, the
decode steps' count, median and how many took over 20 ms, the checkpoints' engine jobs (count, sum,
longest), the five longest engine jobs, and the GIL's waits when the daemon watched them (KVWAKE_GIL_WATCH_MS:
their count, the five longest with each thread's innermost frame).

usage: python bench/trace_summary.py LABEL batching.json
"""

from __future__ import annotations

import json
import sys


def summary(label: str, path: str) -> str:
    with open(path) as f:
        row = json.load(f)["prefill"]["batched"]
    work = row.get("slow_engine_work", [])

    def longest(prefix: str) -> float:
        return max((j["ms"] for j in work if j["what"].startswith(prefix)), default=0.0)
    top = sorted(work, key=lambda j: -j["ms"])[:5]
    steps = sorted(j["ms"] for j in work if j["what"].startswith("decode step"))
    median = steps[len(steps) // 2] if steps else 0.0
    long = [ms for ms in steps if ms > 20]
    checkpoint = [j["ms"] for j in work if j["what"].startswith(("checkpoint", "_dropping", "list.clear"))]
    return (f"{label}: p99/alone {row['p99_during_over_p50_alone']}x (p99 {row['gap_during_p99_ms']} ms, "
            f"alone p50 {row['gap_alone_p50_ms']} ms, prefill {row['prefill_s']} s); longest decode step "
            f"{longest('decode step')} ms, plain slice {longest('Chunk.step plain')} ms, fused slice "
            f"{longest('Chunk.step fused')} ms; decode steps {len(steps)}, median {median} ms, over 20 ms "
            f"{len(long)}; checkpoint jobs {len(checkpoint)}, {round(sum(checkpoint), 1)} ms, longest "
            f"{max(checkpoint, default=0.0)} ms; top: "
            + "; ".join(f"{j['what']} {j['ms']} ms @{j['at_s']}" for j in top) + gil_waits(row.get("gil_waits", [])))


def gil_waits(waits: list[dict]) -> str:
    """The GIL waits (KVWAKE_GIL_WATCH_MS), longest first, each with every thread's innermost frame: threads
    whose frame is a wait or a queue's `get` last (marked idle): one of them may be the holder, which lets the
    GIL go wherever it is when it next checks (a pool thread back in its loop)."""
    if not waits:
        return ""
    idle = ("wait", "_wait_for_tstate_lock", "get", "select", "_worker", "sleep", "run_forever", "run")
    lines = []
    for w in sorted(waits, key=lambda w: -w["late_ms"])[:5]:
        first = {n: f[0] for n, f in w["threads"].items() if f}
        busy = [f"{n}: {f}" for n, f in first.items() if f.split()[-1] not in idle]
        rest = [f"{n}: {f}" for n, f in first.items() if f.split()[-1] in idle]
        lines.append(f"\n  GIL wait {w['late_ms']} ms @{w['at_s']}: " + "; ".join(busy)
                     + (f" | idle: {'; '.join(rest)}" if rest else ""))
    return f"; GIL waits {len(waits)}, longest {max(w['late_ms'] for w in waits)} ms" + "".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1], sys.argv[2]))
