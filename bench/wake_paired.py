"""Paired wakes in one process: this tree's verified read path against an older codec.py and a copy-into-buffer
read, alternating wake by wake, so a shared machine's load falls on both alike.

usage: python bench/wake_paired.py --model PATH --synthetic KV.npz --old-codec OLD/store/format/codec.py
       [--tokens 4096] [--rounds 9]
"old": decode_into of the given codec.py (e.g. a git archive of main) on a file copied into a per-thread
buffer (StoreFiles.read); "new": this tree's (pieces digested in cache, file mapped). Everything else
(the pipeline, the staging) is this tree's: this isolates the host read path of a wake.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    from kvwake.daemon.session import Session
    from kvwake.store import core
    from suite import open_engine, synthetic_session, tokens_of

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--synthetic", required=True)
    ap.add_argument("--old-codec", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--codec", default="planes-zstd")
    ap.add_argument("--old-read", choices=["copied", "mapped"], default="copied",
                    help="how the old side reads files (mapped: isolates the codec change)")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("old_codec", args.old_codec)
    old = importlib.util.module_from_spec(spec)
    sys.modules["old_codec"] = old  # its dataclasses look their module up
    spec.loader.exec_module(old)
    new_decode = core.decode_into
    with tempfile.TemporaryDirectory() as tmp:
        engine = open_engine(args.model, Path(tmp), args.codec)
        files = engine.store.files
        new_mapped = files.mapped

        @contextlib.contextmanager
        def copied(rel: str):
            yield files.read(rel)

        def use(which: str) -> None:
            core.decode_into = old.decode_into if which == "old" else new_decode
            files.mapped = copied if which == "old" and args.old_read == "copied" else new_mapped

        s = Session("w")
        synthetic_session(engine, s, tokens_of(engine, args.tokens), args.synthetic)
        raw = engine.sleep(s)["raw_bytes"]
        times: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(args.rounds + 1):
            for which in (("old", "new") if i % 2 else ("new", "old")):
                use(which)
                engine.hot.__init__(engine.hot.budget)
                t0 = time.perf_counter()
                woken, _ = engine.wake("w")
                if i:
                    times[which].append(time.perf_counter() - t0)
                del woken
        engine.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.tokens} tokens, {args.codec}, old read {args.old_read}, {args.rounds} pairs: wake old {med['old'] * 1000:.0f} ms "
          f"({raw / med['old'] / 1e9:.2f} GB/s), new {med['new'] * 1000:.0f} ms ({raw / med['new'] / 1e9:.2f} GB/s): "
          f"new/old {med['new'] / med['old']:.2f}; pairs where new was faster: "
          f"{sum(n < o for n, o in zip(times['new'], times['old']))}/{args.rounds}", flush=True)


if __name__ == "__main__":
    main()
