"""One line per fleet run (bench/fleet's output folders): its phases beside what the daemon held at the end of its
rounds (status at the first process's stop: the hot KV, MLX's peak, paged KV's pool), for runs of one device part
made with different settings (bench/device.sh's `paged-ab`).

    python bench/fleet_runs.py OUT/paged-ab-1-true/ OUT/paged-ab-2-false/ ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PHASES = ("round_1_first_token_p50_s", "turns_2_on_first_token_p50_s", "turns_2_on_first_token_p95_s",
          "restart_first_token_p50_s", "restart_first_token_max_s", "rounds_wall_s", "tokens_per_s")


def runs(folder: Path) -> list[dict]:
    """Each kvwake run of `folder`'s fleet.json, with its first process's trace (held at the rounds' end)."""
    lines = []
    for config in json.loads((folder / "fleet.json").read_text())["configs"]:
        for name, run in config["runs"].items():
            line = {"run": folder.name, "server": name, **{k: run.get(k) for k in PHASES}}
            traces = sorted((folder / "traces").glob(f"*{name.replace(' ', '-')}*trace-1.json"))
            if traces:
                trace = json.loads(traces[0].read_text())
                memory, pages = trace.get("memory") or {}, trace.get("pages") or {}
                line.update(hot_kv_bytes=memory.get("hot_kv_bytes"), mlx_peak_bytes=memory.get("mlx_peak_bytes"),
                            **{f"pages_{k}": pages.get(k) for k in ("held_bytes", "shared_pages", "allocated_pages",
                                                                     "grows", "grow_ms") if pages})
            lines.append(line)
    return lines


def main(argv: list[str]) -> int:
    for folder in argv:
        for line in runs(Path(folder)):
            print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
