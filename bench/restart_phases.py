"""Where a fleet run's restart went, one line per run: the first token after it, and its turns' trace.

usage: python bench/restart_phases.py OUT [OUT...]

Each OUT is a `bench/fleet --out` folder of a kvwake run (its fleet.json and traces/). Per kvwake API run: the
restart's first token p50 and max, seconds from the restart to "ready", then over the restarted process's
woken turns (status.turns, p50): claim, wake, append and first token after, each wake phase
(`wake_phases_ms`), the blocks taken from memory and from disk, and the hot set's reader (status
.restart_prefetch: what it read, in how long; docs/decisions.md, "The hot set read during start-up").
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def restart_line(out: Path, name: str, run: dict[str, Any]) -> dict[str, Any]:
    api = name.removeprefix("kvwake ")
    traces = sorted(out.glob(f"traces/*kvwake-{api}-trace-2.json"))
    trace = json.loads(traces[-1].read_text()) if traces else {}
    woken = [t for t in trace.get("turns", []) if t.get("wake_ms") is not None]
    phases: dict[str, list[float]] = {}
    for turn in woken:
        for phase, ms in (turn.get("wake_phases_ms") or {}).items():
            phases.setdefault(phase, []).append(ms)
    counters = trace.get("counters") or {}
    return {"run": str(out), "api": api, "restart_prefetch": (trace.get("tuning") or {}).get("restart_prefetch"),
            "restart_first_token_p50_s": run.get("restart_first_token_p50_s"),
            "restart_first_token_max_s": run.get("restart_first_token_max_s"),
            "restart_ready_s": round(run["restart_start_s"], 3) if "restart_start_s" in run else None,
            **{f"{k}_p50": p50([t[k] for t in woken if t.get(k) is not None])
               for k in ("claim_ms", "wake_ms", "append_ms", "first_token_ms")},
            "wake_phases_p50_ms": {phase: p50(ms) for phase, ms in phases.items()},
            "blocks_memory": counters.get("blocks_ram"), "blocks_disk": counters.get("blocks_disk"),
            "blocks_shared": counters.get("blocks_shared"), "reader": trace.get("restart_prefetch"),
            "startup_ms": trace.get("startup_ms")}


def main() -> None:
    for folder in sys.argv[1:]:
        out = Path(folder)
        for config in json.loads((out / "fleet.json").read_text())["configs"]:
            for name, run in config["runs"].items():
                if name.startswith("kvwake"):
                    print(json.dumps(restart_line(out, name, run)), flush=True)


if __name__ == "__main__":
    main()
