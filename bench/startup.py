"""Where `kvwake serve`'s start-up goes, and how long its first requests take (issue 23, point 6).

usage: python bench/startup.py [--model tiny|default|PATH] [--starts 2] [--top 25] [--importtime] [--cold]
                                [--json OUT]

1. In process: the engine made under cProfile (what a daemon does before it listens: loading the
   weights, the bundle hash, warming the batch sizes' kernels, measuring attention paths), the top
   functions by cumulative time, the engine's own phases (`weights`; `bundle`, the wait for the file
   digests started before the weights load) and the time of the import of MLX and mlx-lm before it. The
   digest cache is new, as on a first start; with --cold the model's files are dropped from the page
   cache first (a fresh machine's disk reads; `--starts 0` to stop there).
2. A real daemon, `--starts` times: process start -> "ready" in its log, then the first request (a
   new session's chat call of 8 tokens) and a second one, timed from the client; the daemon's own
   `startup_ms` (status); with --importtime the last start's slowest imports (`-X importtime`).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

from bench.lib import bench_model  # noqa: E402


def in_process(model: Path, top: int, cold: bool) -> dict:
    t0 = time.perf_counter()
    import mlx.core as mx
    import mlx_lm  # noqa: F401

    imported = time.perf_counter() - t0
    if cold:
        from bench.bundle_hash import evict

        evict(model)
    from kvwake.daemon.model.engine import Engine
    from kvwake.store import Store

    with tempfile.TemporaryDirectory() as tmp:
        profile = cProfile.Profile()
        t0 = time.perf_counter()
        profile.enable()
        engine = Engine(Store(Path(tmp) / "store"), Path(tmp), model)
        profile.disable()
        made = time.perf_counter() - t0
        phases = engine.started.ms
        engine.close()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(top)
    print(f"import mlx + mlx_lm {imported:.2f} s; Engine() {made:.2f} s on {mx.default_device()} "
          f"({'cold' if cold else 'cached'} page cache, new digest cache); phases ms {json.dumps(phases)}\n"
          f"{out.getvalue()}", flush=True)
    return {"import_s": imported, "engine_s": made, "phases_ms": phases, "cold": cold, "profile": out.getvalue()}


def daemon_starts(model: Path, starts: int, importtime: bool) -> list[dict]:
    from testkit.daemon import Daemon

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(starts):
            profiled = importtime and i == starts - 1  # the last start: its imports' own times in its log
            d = Daemon(Path(tmp), model, env={"PYTHONPROFILEIMPORTTIME": "1"} if profiled else None)  # one store
            t0 = time.perf_counter()
            d.start(timeout=300)
            ready = time.perf_counter() - t0
            c = d.client()
            phases = c.call("status")["startup_ms"]
            times = []
            for k in range(2):
                t1 = time.perf_counter()
                sid = f"s{i}-{k}"
                c.call("session.create", session_id=sid)
                c.call("session.chat", session_id=sid, messages=[{"role": "user", "content": f"Hello number {k}"}],
                       max_tokens=8)
                times.append(time.perf_counter() - t1)
            c.close()
            d.stop()
            row = {"start": i, "ready_s": ready, "first_request_s": times[0], "second_request_s": times[1],
                   "startup_ms": phases}
            if profiled:
                row["imports_ms"] = top_imports(d.log.read_text(errors="replace"))  # only this start's run
            rows.append(row)
            print(f"start {i}: ready in {ready:.2f} s, first request {times[0] * 1000:.0f} ms, second "
                  f"{times[1] * 1000:.0f} ms; {json.dumps(phases)}", flush=True)
            if profiled:
                print("imports, cumulative ms:", json.dumps(row["imports_ms"]), flush=True)
    return rows


def top_imports(log: str, top: int = 30) -> dict[str, float]:
    """`-X importtime`'s lines in a log: the `top` modules by cumulative time, in ms."""
    found = {}
    for line in log.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            _, cumulative, name = line.split("|")
            if cumulative.strip().isdigit():
                found[name.strip()] = int(cumulative) / 1000
    return dict(sorted(found.items(), key=lambda kv: -kv[1])[:top])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--importtime", action="store_true", help="the last start under -X importtime: its slowest imports")
    ap.add_argument("--cold", action="store_true", help="drop the model's files from the page cache first")
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        model = bench_model(args.model, Path(work))
        out = {"model": args.model, "in_process": in_process(model, args.top, args.cold),
               "daemon": daemon_starts(model, args.starts, args.importtime)}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
