"""The GPU's clocks, power and throttle reasons in each window of an alternating run (device_round.sh clocks).

usage: python bench/clock_windows.py CLOCKS_CSV ROUNDS_TXT

CLOCKS_CSV: `nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,
clocks_event_reasons.active --format=csv,noheader -lms 250`. ROUNDS_TXT: bench/batching.py --alternate's output,
whose "at T: round R, X begins" lines open each window (the next line closes it). Prints one line per window:
samples, SM clock median / min (MHz), memory clock, power median / max (W), temperature, utilization, and the
throttle reasons seen (hex masks, how often). Says whether the speed that drifts between rounds goes with the clocks.
"""

from __future__ import annotations

import collections
import datetime
import re
import statistics
import sys


def samples(path: str) -> list[tuple[float, list[str]]]:
    got = []
    for line in open(path):
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 7:
            continue
        try:
            at = datetime.datetime.strptime(cells[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        except ValueError:
            continue
        got.append((at, cells[1:]))
    return got


def number(cell: str) -> float | None:
    m = re.match(r"[\d.]+", cell)
    return float(m.group()) if m else None


def windows(path: str) -> list[tuple[str, float, float | None]]:
    opened = [(float(m.group(1)), m.group(2)) for m in
              (re.search(r"at ([\d.]+): (round \d+, .*) begins", line) for line in open(path)) if m]
    return [(name, at, opened[i + 1][0] if i + 1 < len(opened) else None) for i, (at, name) in enumerate(opened)]


def main() -> None:
    rows, wins = samples(sys.argv[1]), windows(sys.argv[2])
    if not rows:
        sys.exit(f"no samples in {sys.argv[1]}")
    # nvidia-smi writes local time; the rounds' marks are epoch seconds: both from this machine's clock
    for name, lo, hi in wins:
        inside = [cells for at, cells in rows if at >= lo and (hi is None or at < hi)]
        if not inside:
            print(f"{name}: no samples")
            continue
        sm = [v for v in (number(c[0]) for c in inside) if v is not None]
        mem = [v for v in (number(c[1]) for c in inside) if v is not None]
        power = [v for v in (number(c[2]) for c in inside) if v is not None]
        temp = [v for v in (number(c[3]) for c in inside) if v is not None]
        util = [v for v in (number(c[4]) for c in inside) if v is not None]
        reasons = collections.Counter(c[5] for c in inside)
        print(f"{name}: {len(inside)} samples; SM {statistics.median(sm):.0f} MHz (min {min(sm):.0f}), "
              f"memory {statistics.median(mem):.0f} MHz, power {statistics.median(power):.0f} W (max {max(power):.0f}), "
              f"{max(temp):.0f} C, utilization {statistics.median(util):.0f}%; reasons "
              + ", ".join(f"{k} x{v}" for k, v in reasons.most_common(4)))


if __name__ == "__main__":
    main()
