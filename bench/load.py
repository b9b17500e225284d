"""Load with faults: concurrent agents over RPC and HTTP, random disconnects, one kill -9 mid-run.

usage: python bench/load.py [--clients 32] [--seconds 60] [--kill-at 0.5] [--seed 0] [--model scripted|PATH]
                            [--out bench/out]

The generator and its checks are testkit/load.py (tests/test_load.py runs a short one). Results:
<out>/load.json and the daemon's log, <out>/load-daemon.log; exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

from testkit.load import failed_checks, run_load  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--kill-at", type=float, default=0.5, help="when the kill -9 comes, as a share of the run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="scripted")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = ap.parse_args(argv)
    result = run_load(args.out, args.clients, args.seconds, args.kill_at, args.seed, args.model)
    (args.out / "load.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    failed = failed_checks(result)
    print("load: all checks passed" if not failed else f"load: a check FAILED: {', '.join(failed)} "
          f"(unexpected: {result['unexpected']}, restart: {result['restart']})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
