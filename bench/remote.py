"""Remote wake vs local wake, in one run: a real SeaweedFS on loopback and two real daemons.

usage: python bench/remote.py [--tokens 2048] [--sessions 3] [--out bench/out]

The model is random and small (8 layers, 2 KV heads of 64 dims, bf16: 4 KiB of
KV per token) so the prefill is quick on a CPU; a 30-layer SmolLM2-shaped one
did not prefill 1k tokens within minutes on the 2-core test box. Daemon A fills `sessions` sessions of `tokens` tokens each, then per
session: sleeps it, wakes it locally (timed), sleeps it with release (waits for
the upload). Daemon B, with its own data dir, then wakes each one (timed): that
wake fetches the manifest and blocks, verifies them, commits them to B's
store and restores. Times are the client's wall clock around `session.wake`.
Throughput is the snapshot's raw KV bytes over that time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

from testkit.daemon import Daemon, RawClient  # noqa: E402
from testkit.seaweed import BUCKET, Seaweed  # noqa: E402
from testkit.tinymodel import make_model_dir  # noqa: E402

KV_SHAPE = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
            "num_hidden_layers": 8, "intermediate_size": 128}


def timed_wake(client, sid: str) -> tuple[float, dict]:
    started = time.perf_counter()
    info = client.call("session.wake", session_id=sid)
    return time.perf_counter() - started, info


def run(tokens: int, sessions: int, work: Path) -> dict:
    model = make_model_dir(work / "model", **KV_SHAPE)
    weed = Seaweed(work / "s3").start()
    daemons = []
    try:
        for name in ("a", "b"):
            (work / name).mkdir()
            d = Daemon(work / name, model, block_tokens=128, extra=["--remote", f"s3://{BUCKET}/bench"],
                       env=weed.env).start(timeout=300)
            daemons.append(d)
        a, b = (RawClient(d.socket, timeout=900) for d in daemons)
        local, remote = [], []
        for i in range(sessions):
            sid = f"s{i}"
            a.call("session.create", session_id=sid)
            a.call("session.append", session_id=sid, tokens=[(7 * i + 13 * k) % 250 + 1 for k in range(tokens)])
            a.call("session.sleep", session_id=sid)
            seconds, info = timed_wake(a, sid)
            local.append((seconds, info))
            a.call("session.sleep", session_id=sid, release=True)
        for i in range(sessions):
            remote.append(timed_wake(b, f"s{i}"))
        raw = local[0][1]["raw_bytes"]
        result = {"tokens": tokens, "sessions": sessions, "raw_kv_bytes": raw,
                  "local_wake_s": [round(s, 4) for s, _ in local], "remote_wake_s": [round(s, 4) for s, _ in remote],
                  "remote_blocks_from_memory": [i["blocks_from_memory"] for _, i in remote],
                  "status_remote": b.call("status")["remote"]}
        result["local_GBps"] = round(raw / statistics.median(s for s, _ in local) / 1e9, 3)
        result["remote_GBps"] = round(raw / statistics.median(s for s, _ in remote) / 1e9, 3)
        result["remote_over_local"] = round(result["remote_GBps"] / result["local_GBps"], 3)
        return result
    finally:
        for d in daemons:
            d.stop()
        weed.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.tokens, args.sessions, Path(tmp))
    print(json.dumps({k: v for k, v in result.items() if k != "status_remote"}, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "remote.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
