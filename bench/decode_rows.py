"""The decoder's batched step at agent-length contexts: rows x context, the row kernel against mlx-lm's masked path.

usage: python bench/decode_rows.py --model PATH [--rows 1,8,16,32] [--contexts 1024,12288] [--steps 24]
                                   [--out bench/out]

For each (rows, context): that many sessions whose caches hold `context` tokens of random KV (no prefill:
the step's cost does not depend on the values), all decoding at once in the engine's decoder, greedy, for
`steps` steps after 6 to warm up. Reported: ms per step and tokens/s with the row kernel
(model/ragged_decode.py) and with it off (mlx-lm's `BatchKVCache` attention with its array mask, the path
mlx-lm's `BatchGenerator` takes), same process, alternating; the bytes a step must read (the weights once and
every row's KV) and that read at `--copy-gbs` (the GPU's measured copy speed) as the bound beside them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from bench.lib import machine, save  # noqa: E402
from kvwake.daemon.model import ragged_decode  # noqa: E402
from kvwake.daemon.model.engine import Engine  # noqa: E402
from kvwake.daemon.model.generation import GenerateParams  # noqa: E402
from kvwake.daemon.session_state import Session  # noqa: E402
from kvwake.store import Store  # noqa: E402

WARM_STEPS = 6


def filled_session(engine: Engine, name: str, context: int) -> Session:
    """A session whose cache holds `context` tokens of random KV, one pending token after them."""
    session, cache = Session(name), engine.make_cache()
    for layer in cache:
        heads, dim = layer_shape(engine)
        k, v = (mx.random.normal((1, heads, context, dim)).astype(mx.bfloat16) * 0.5 for _ in range(2))
        layer.update_and_fetch(k, v)
    mx.eval([c.state for c in cache])
    session.cache, session.processed = cache, context
    session.tokens, session.mode = [int(t) % 1000 + 10 for t in range(context + 1)], "raw"
    return session


def layer_shape(engine: Engine) -> tuple[int, int]:
    args = engine.model.args
    heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    return heads, getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def step_ms(engine: Engine, rows: int, context: int, steps: int, row_kernel: bool) -> float:
    """ms per batched step of `rows` sessions at `context`, after WARM_STEPS."""
    engine.decoder.row_kernel = row_kernel
    sessions = [filled_session(engine, f"r{i}", context) for i in range(rows)]
    no_end = tuple((int(t), -1e4) for t in engine.tokenizer.eos_token_ids)  # every row runs every step
    calls = [engine.start_call(s, GenerateParams(max_tokens=WARM_STEPS + steps + 2, logit_bias=no_end))
             for s in sessions]
    for call in calls:
        engine.decoder.join(call)
    for _ in range(WARM_STEPS):
        engine.decoder.step()
    mx.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        engine.decoder.step()
    mx.synchronize()
    ms = (time.perf_counter() - began) * 1000 / steps
    failed = [c.future.exception() for c in calls if c.future.done() and c.future.exception()]
    if failed:
        raise failed[0]
    while engine.decoder.active:
        engine.decoder.step()
    for s in sessions:
        s.cache = None
    mx.clear_cache()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--contexts", default="1024,12288")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--copy-gbs", type=float, default=2470.0, help="the GPU's measured copy speed, GB/s")
    ap.add_argument("--out", default="bench/out")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvwake-decode-rows-"))
    store = Store(work / "store", block_tokens=256)
    engine = Engine(store, work, a.model, max_batch=64, warm=False)
    weights = sum(v.nbytes for _, v in tree_flatten(engine.model.parameters()))
    heads, dim = layer_shape(engine)
    kv_per_token = 2 * len(engine.make_cache()) * heads * dim * 2
    results = []
    for context in [int(c) for c in a.contexts.split(",")]:
        for rows in [int(r) for r in a.rows.split(",")]:
            row = {"rows": rows, "context": context}
            try:
                kernel = ragged_decode.wanted(True)  # CUDA only: elsewhere the masked path alone
                for on in (False, True, False, True) if kernel else (False, False):  # alternating: drift shows
                    row.setdefault("kernel_ms" if on else "masked_ms", []).append(
                        round(step_ms(engine, rows, context, a.steps, on), 2))
            except Exception as exc:  # noqa: BLE001 - out of memory at the largest shapes: say so, go on
                row["error"] = repr(exc)[:200]
            nbytes = weights + rows * context * kv_per_token
            row["bytes_gb"] = round(nbytes / 1e9, 2)
            row["bound_ms"] = round(nbytes / (a.copy_gbs * 1e9) * 1000, 2)
            for key in ("kernel_ms", "masked_ms"):
                if row.get(key):
                    best = min(row[key])
                    row[key.replace("_ms", "_tok_s")] = round(rows * 1000 / best, 1)
            if row.get("kernel_ms") and row.get("masked_ms"):
                row["speedup"] = round(min(row["masked_ms"]) / min(row["kernel_ms"]), 2)
            print(row, flush=True)
            results.append(row)
    engine.close()
    store.close()
    save({"machine": machine(), "model": a.model, "steps": a.steps, "rows": results}, a.out, "decode_rows.json")


if __name__ == "__main__":
    main()
