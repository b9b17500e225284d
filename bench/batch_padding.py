"""KV bytes of a batch with one long session among short ones: bounded (the long one alone) or padded.

usage: python bench/batch_padding.py [--long 4096] [--short 64] [--rows 8]

In process, tiny llama: --rows - 1 sessions of --short tokens and one of --long join the decoder at
once; after the step that admits them, the KV the decoder holds: the batch's (rows x its length, what
`BatchKVCache` computes over) plus the lone call's own cache, against the same with the bound off
(every row padded to the longest). One JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from kvwake.daemon.model import decoder as decoder_module  # noqa: E402
from kvwake.daemon.model.engine import Engine  # noqa: E402
from kvwake.daemon.model.generation import GenerateParams  # noqa: E402
from kvwake.daemon.session import Session  # noqa: E402
from kvwake.store import Store  # noqa: E402


def held_bytes(engine: Engine) -> dict[str, int]:
    """KV bytes the decoder computes over: the batch's used length for every row, and the lone calls'."""
    d, batch_bytes = engine.decoder, 0
    if d.batch is not None:
        for layer in d.batch.prompt_cache:
            k, v = layer.keys, layer.values
            batch_bytes += (k.nbytes + v.nbytes) * layer.size() // k.shape[2]
    lone = sum((c.keys.nbytes + c.values.nbytes) * c.offset // c.keys.shape[2]
               for call in d.solo for c in call.solo.cache)
    return {"batch_rows": len(d.batch.uids) if d.batch is not None else 0, "batch_kv_bytes": batch_bytes,
            "alone_calls": len(d.solo), "alone_kv_bytes": lone, "total_kv_bytes": batch_bytes + lone}


def run(engine: Engine, long: int, short: int, rows: int, tag: str) -> dict[str, int]:
    sessions = [Session(f"{tag}-long")] + [Session(f"{tag}-{i}") for i in range(rows - 1)]
    for i, s in enumerate(sessions):
        n = long if i == 0 else short
        engine.append(s, tokens=[(j * 31 + i * 7) % 200 + 20 for j in range(n)])
    calls = [engine.start_call(s, GenerateParams(max_tokens=4)) for s in sessions]
    for call in calls:
        engine.decoder.join(call)
    engine.decoder.step()
    held = held_bytes(engine)
    while engine.decoder.active:
        engine.decoder.step()
    return held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--rows", type=int, default=8)
    a = ap.parse_args()
    from tests.tinymodel import make_model_dir

    work = Path(tempfile.mkdtemp(prefix="kvwake-padding-"))
    model = make_model_dir(work / "tiny", max_position_embeddings=1 << 16)
    store = Store(work / "store", block_tokens=128)
    engine = Engine(store, work, model, prefill_step=2048)
    try:
        bounded = run(engine, a.long, a.short, a.rows, "bounded")
        decoder_module.PAD_SLACK = 1 << 62  # the bound off: every row padded to the longest
        padded = run(engine, a.long, a.short, a.rows, "padded")
    finally:
        engine.close()
        store.close()
    print(json.dumps({"long": a.long, "short": a.short, "rows": a.rows, "bounded": bounded, "padded": padded,
                      "padded_over_bounded": round(padded["total_kv_bytes"] / bounded["total_kv_bytes"], 2),
                      "kv_bytes_per_token": engine.token_bytes}))


if __name__ == "__main__":
    main()
