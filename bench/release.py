"""A decoding neighbour while a big session's KV is freed (by its sleep, by its delete): the gaps between its tokens.

usage: python bench/release.py [--gb 2.0] [--layers 16] [--rounds 3] [--out bench/out]

One real `kvwake serve` on a tiny llama whose KV is as wide as the 8B shape's (by default 16 layers of 16
KV heads of 128: 128 KiB a token) and whose compute is tiny (hidden size 64), so a talker decodes fast and a big
session costs no prefill: the big sessions' snapshots are written beforehand from random KV (the store's
own writer, through the in-process engine on the same model and store; every session holds the same
tokens, so their blocks are stored once), then woken by the daemon, each into its own KV. The talker
decodes, streamed, while a big session sleeps (its blocks are stored: the sleep writes its tail and frees
its KV) or is deleted (first, --rounds sleeps with no talker: how long the client waits for each): the
talker's gaps from the operation's start to 0.3 s after its end (a free that
happens later, where the last reference drops, is counted too) against its median gap alone, and the
engine thread's jobs over KVWAKE_SLOW_JOB_MS (set to 5 ms here) in that window.
Results: <out>/release.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from batching import save  # noqa: E402
from persist import client, gaps_beside, start  # noqa: E402

BLOCK, HEAD_DIM, TOKEN_BYTES = 128, 128, 128 << 10  # the 8B shape's KV a token
AFTER_S = 0.3  # the window goes on this long after the operation returns


def wide_model(work: Path, layers: int) -> tuple[Path, int]:
    """The model, and its KV heads (as many as make 128 KiB a token over `layers` layers)."""
    from tests.tinymodel import make_model_dir

    heads = TOKEN_BYTES // (layers * HEAD_DIM * 4)
    return make_model_dir(work / "wide", num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=heads, head_dim=HEAD_DIM, max_position_embeddings=1 << 20,
                          ascii_replies=True), heads


def write_sessions(data_dir: Path, model: Path, heads: int, names: list[str], tokens: int) -> None:
    """Snapshots of `names`, each `tokens` random tokens of random KV, in the daemon's store (not running)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.session import Session
    from kvwake.store import Store

    store = Store(data_dir / "store", block_tokens=BLOCK)
    engine = Engine(store, data_dir, model, warm=False)
    ids = [random.Random(0).randrange(3, 250) for _ in range(tokens)]
    try:
        for name in names:
            cache = make_prompt_cache(engine.model)
            for c in cache:
                kv = mx.random.normal((2, 1, heads, tokens, HEAD_DIM)).astype(mx.bfloat16)
                c.update_and_fetch(kv[0], kv[1])
            mx.eval([c.state for c in cache])
            s = Session(name)
            s.tokens, s.processed, s.cache, s.mode = list(ids), tokens, cache, "raw"
            store.ensure_session(name, {})
            engine.sleep(s)
    finally:
        engine.close()
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0, help="each big session's KV, in GB")
    ap.add_argument("--layers", type=int, default=16, help="layers of the model (its KV heads make 128 KiB a token)")
    ap.add_argument("--rounds", type=int, default=3, help="big sessions slept, and as many deleted")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    a = ap.parse_args()
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from suite import machine

    work = Path(tempfile.mkdtemp(prefix="kvwake-release-"))
    model, heads = wide_model(work, a.layers)
    tokenizer = load_tokenizer(model)
    tokens = int(a.gb * 1e9 / TOKEN_BYTES) // BLOCK * BLOCK
    names = [f"big{i}" for i in range(2 * a.rounds + 1)]
    write_sessions(work / "d" / "data", model, heads, names, tokens)
    os.environ["KVWAKE_SLOW_JOB_MS"] = "5"  # the daemon names every job or step over 5 ms
    d = start(work / "d", model, True, 512)
    report: dict[str, Any] = {"machine": machine(), "model": str(model), "layers": a.layers, "kv_heads": heads,
                              "tokens": tokens, "kv_bytes": tokens * TOKEN_BYTES,
                              "sleep_alone": [], "sleep": [], "delete": []}
    try:
        with client(d) as c:  # the talker's step, so it outlasts the work; and a warm-up round
            c.call("session.create", session_id="probe")
            c.call("session.append", session_id="probe", text="Count to a hundred.")
            t0 = time.perf_counter()
            c.call("session.generate", session_id="probe", max_tokens=64)
            step_s = (time.perf_counter() - t0) / 64
            c.call("session.wake", session_id=names[0])
            c.call("session.sleep", session_id=names[0])
        for i in range(a.rounds):  # a sleep with no neighbour: how long the client waits (the free included)
            with client(d) as c:
                c.call("session.wake", session_id=names[0])
                t0 = time.perf_counter()
                slept = c.call("session.sleep", session_id=names[0])
                report["sleep_alone"].append({"s": round(time.perf_counter() - t0, 4), "ms_daemon": slept["ms"]})
        print("sleep alone", json.dumps(report["sleep_alone"]), flush=True)
        for i in range(a.rounds):
            for op, name in (("sleep", names[1 + 2 * i]), ("delete", names[2 + 2 * i])):
                with client(d) as c:
                    c.call("session.wake", session_id=name)

                def work_(c: Any, op: str = op, name: str = name) -> dict[str, Any]:
                    began_wall = time.time()
                    got = c.call(f"session.{op}", session_id=name)
                    time.sleep(AFTER_S)
                    slow = [j for j in c.call("status")["engine_thread"]["slow"] if j["at"] >= began_wall]
                    return {"ms": got.get("ms"), "slow_engine_work": [{"what": j["what"], "ms": j["ms"]} for j in slow]}

                got = gaps_beside(d, tokenizer, step_s, work_, 1.0, f"{op}{i}")
                report[op].append(got)
                print(op, i, json.dumps(got), flush=True)
    finally:
        d.stop()
    save(report, a.out, "release.json")


if __name__ == "__main__":
    main()
