"""The decoder's batched step at agent-length contexts: rows x context, three paths in one process.

usage: python bench/decode_rows.py --model PATH [--rows 1,8,16,32] [--contexts 1024,12288] [--steps 24]
                                   [--modes masked,kernel,paged] [--joins 4] [--join-rows 8] [--out bench/out]

For each (rows, context): that many sessions whose caches hold `context` tokens of random KV (no prefill:
the step's cost does not depend on the values), all decoding at once in the engine's decoder, greedy, for
`steps` steps after 6 to warm up. The paths (`--modes`), alternating, best of two each:
- masked: mlx-lm's `BatchKVCache` attention with its array mask (the path mlx-lm's `BatchGenerator` takes);
- kernel: the same merged batch, its attention by the row kernel (model/ragged_decode.py; CUDA only);
- paged: the sessions' caches in a page pool and the batch over their pages (kv/paged_batch.py): the paged
  kernel on CUDA, the gather reference elsewhere;
- paged-nowrite (a probe): paged with the pool's writes skipped (the step's KV written nowhere; its time only);
- qkernel: with `--quantize` (the model quantized to 4 bits in the process, as `mlx_lm convert -q` does), as
  kernel with the products of up to 32 rows by kvwake's 4-bit kernel (model/quantized_kernel.py); masked and
  kernel then take model/quantized.py's other ways (MLX's vector kernel, a dequantized product).
Reported: ms per step and tokens/s for each; the bytes a step must read (the weights once and every row's
KV) and that read at `--copy-gbs` (the GPU's measured copy speed) as the bound beside them; and a join's
cost: one more session joins the running batch `--joins` times (for 3 tokens each time; up to `--join-rows`
rows), and `<mode>_join_ms` is the median time of its admission (the decoder's, between two steps), the
copies it makes waited for. At a slot size's end (1, 2, 4, 8, ... rows) a merged batch then grows to the
next size, copying every row's KV (and compacts back, copying again, when the call has left); a paged one
takes the row's page table. (A leave is not timed apart: it happens inside a step, and a merged batch's
copies out are queued behind the pass.)

`--probe`: where a step's time goes, per mode: `<mode>_build_ms` (the model's pass building the step's graph on
the host, median), `<mode>_encode_ms` (MLX's `async_eval` of it: the kernels launched, median) and `<mode>_sync_ms`
(a step with the device waited for after it: host and device one after the other), and MLX's peak memory over
what was held before the steps, pipelined (`<mode>_peak_over_mb`) and synced (`<mode>_sync_peak_over_mb`): a
KV buffer's update that cannot reuse the buffer in place (MLX holds a buffer until the kernels that read it have
run) copies it whole, and shows there as a buffer's bytes or more.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from bench.lib import machine, save  # noqa: E402
import importlib  # noqa: E402

from kvwake.daemon.config import Tuning  # noqa: E402
from kvwake.daemon.kv import cache_blocks, paged_cache  # noqa: E402
from kvwake.daemon.kv.pages import PagePool  # noqa: E402
from kvwake.daemon.model import decode_calls, quantized, ragged_decode  # noqa: E402
from kvwake.daemon.model.engine import Engine  # noqa: E402
from kvwake.daemon.model.generation import GenerateParams  # noqa: E402
from kvwake.daemon.session_state import Session  # noqa: E402
from kvwake.store import Store  # noqa: E402

WARM_STEPS = 6
GENERATE = importlib.import_module("mlx_lm.generate")  # the module (the package's `generate` is its function)
JOINER_TOKENS = 3  # tokens a joining call decodes before it leaves


def filled_session(engine: Engine, name: str, context: int, pool: PagePool | None = None) -> Session:
    """A session whose cache holds `context` tokens of random KV, one pending token after them (in `pool`'s
    pages when given)."""
    session, cache = Session(name), engine.kv.make_cache()
    if pool is not None:
        cache = paged_cache.paged_cache(pool, cache)
    for layer in cache:
        heads, dim = layer_shape(engine)
        dtype = pool.layout.dtype if pool is not None else mx.bfloat16
        k, v = (mx.random.normal((1, heads, context, dim)).astype(dtype) * 0.5 for _ in range(2))
        layer.update_and_fetch(k, v)
    mx.eval([c.state for c in cache])
    session.cache, session.processed = cache, context
    session.tokens, session.mode = [int(t) % 1000 + 10 for t in range(context + 1)], "raw"
    return session


def layer_shape(engine: Engine) -> tuple[int, int]:
    args = engine.model.args
    heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    return heads, getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def page_pool(engine: Engine, rows: int, context: int, tokens: int) -> PagePool:
    """A pool of the store's block per page with room for `rows` sessions of `context` + `tokens` tokens."""
    blank = engine.kv.make_cache()
    layout = paged_cache.page_layout(blank, cache_blocks.layout(blank, model=engine.model),
                                     engine.store.block_tokens, engine.store.block_tokens)
    return PagePool(layout, (rows + 1) * -(-(context + tokens) // layout.page_tokens))


def timed(engine: Engine, steps: int, until: Any = None) -> tuple[float, int]:
    """(ms of `steps` decoder steps, or of the steps until `until()`, the device waited for before and after;
    the steps taken)."""
    mx.synchronize()
    began, taken = time.perf_counter(), 0
    while (taken < steps) if until is None else not until():
        engine.decoder.step()
        taken += 1
    mx.synchronize()
    return (time.perf_counter() - began) * 1000, taken


class Probe:
    """The host's share of each step (`--probe`): the model's pass (graph built) and MLX's `async_eval` of the
    step (kernels launched), timed around the decoder's own calls."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.build, self.encode = engine, [], []
        self.model = engine.decoder._model
        self.async_eval = GENERATE.mx.async_eval

    def __enter__(self) -> Probe:
        probe = self

        class Timed:  # the decoder's model for the step, its pass timed
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                began = time.perf_counter()
                out = self.inner(*args, **kwargs)
                probe.build.append(time.perf_counter() - began)
                return out

        def async_eval(*arrays: Any) -> None:
            began = time.perf_counter()
            self.async_eval(*arrays)
            self.encode.append(time.perf_counter() - began)

        self.engine.decoder._model = lambda *a: Timed(self.model(*a))
        # a batch's steps launch in mlx-lm's GenerationBatch, a lone call's in decode_calls (its pass not timed)
        for module in (GENERATE, decode_calls):
            module.mx = _Module(module.mx, async_eval=async_eval)
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.decoder._model  # the class's method again
        for module in (GENERATE, decode_calls):
            module.mx = module.mx.inner

    def report(self, mode: str) -> dict[str, float | None]:
        """Medians in ms; None for what no step timed (a lone call's pass)."""
        return {f"{mode}_{name}_ms": round(statistics.median(times) * 1000, 2) if times else None
                for name, times in (("build", self.build), ("encode", self.encode))}


class _Module:
    """A module with some of its attributes replaced (mlx_lm.generate's `mx`, its async_eval timed)."""

    def __init__(self, inner: Any, **replaced: Any) -> None:
        self.inner, self.replaced = inner, replaced

    def __getattr__(self, name: str) -> Any:
        return self.replaced.get(name) or getattr(self.inner, name)


def synced(engine: Engine, steps: int) -> float:
    """ms of one decoder step with the device waited for after each (host and device in turn), median."""
    times = []
    for _ in range(steps):
        mx.synchronize()
        began = time.perf_counter()
        engine.decoder.step()
        mx.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def admitted(engine: Engine, call: Any) -> float:
    """ms to admit `call` into the running batch (the decoder's admission, no pass), the copies it makes
    waited for: a merged batch copies the row's KV into a slot, a paged one takes its page table."""
    decoder = engine.decoder
    mx.synchronize()
    began = time.perf_counter()
    decoder.join(call)
    decoder.admit()
    mx.eval([c.state for c in decoder.batch.prompt_cache], decoder.batch._next_tokens)
    return (time.perf_counter() - began) * 1000


def step_ms(engine: Engine, rows: int, context: int, steps: int, joins: int, mode: str,
            quantize: bool = False, probe: dict | None = None) -> tuple[float, float | None]:
    """(ms per batched step of `rows` sessions at `context` on `mode`'s path, after WARM_STEPS; the median ms
    of another call's admission into that batch, None when `joins` is 0). The joining call runs
    JOINER_TOKENS tokens and leaves before it joins again. With `probe` (a dict), the host's share of the steps
    and a synced step's time go in it (`Probe`, `synced`)."""
    label = mode
    no_write = mode == "paged-nowrite"
    mode = "paged" if no_write else mode
    engine.decoder.row_kernel = mode != "masked" and ragged_decode.wanted(True)
    if quantize:
        quantized.install(engine.model, kernel=mode == "qkernel")
    engine.decoder.in_pages = mode == "paged"
    engine.decoder.paged_kernel = mode == "paged" and ragged_decode.wanted(True)  # the pages read in place on CUDA
    tokens = WARM_STEPS + steps * (3 if probe is not None else 1) + joins * (JOINER_TOKENS + 2) + 8
    pool = page_pool(engine, rows + 1, context, tokens) if mode == "paged" else None
    sessions = [filled_session(engine, f"r{i}", context, pool) for i in range(rows + (joins > 0))]
    no_end = tuple((int(t), -1e4) for t in engine.tokenizer.eos_token_ids)  # every row runs every step
    calls = [engine.start_call(s, GenerateParams(max_tokens=tokens, logit_bias=no_end)) for s in sessions[:rows]]
    for call in calls:
        engine.decoder.join(call)
    joined, joiner = [], None
    try:  # whatever fails, the calls end here: a next measure must not find them decoding beside its own
        timed(engine, WARM_STEPS)
        if no_write:  # the probe's variant: the step's K and V written nowhere
            pool.write = lambda *args: None
        wall, _ = timed(engine, steps)
        if probe is not None:
            held = mx.get_active_memory()
            mx.reset_peak_memory()
            with Probe(engine) as p:
                timed(engine, steps)
            probe.update(p.report(label))
            probe[f"{label}_peak_over_mb"] = round((mx.get_peak_memory() - held) / 1e6, 1)
            mx.reset_peak_memory()
            probe[f"{label}_sync_ms"] = round(synced(engine, steps), 2)
            probe[f"{label}_sync_peak_over_mb"] = round((mx.get_peak_memory() - held) / 1e6, 1)
        if no_write:
            del pool.write
        for _ in range(joins):  # one more session joins, decodes a few tokens, leaves
            joiner = engine.start_call(sessions[-1], GenerateParams(max_tokens=JOINER_TOKENS, logit_bias=no_end))
            joined.append(admitted(engine, joiner))
            timed(engine, 0, joiner.future.done)
        failed = [c.future.exception() for c in calls if c.future.done() and c.future.exception()]
        if failed:
            raise failed[0]
    finally:
        engine.decoder.abort(RuntimeError("the benchmark is done with these calls"))
        del sessions, calls, joiner, pool  # the caches and the pool go before MLX's cache is cleared
        gc.collect()
        mx.clear_cache()
    return wall / steps, round(statistics.median(joined), 2) if joined else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--contexts", default="1024,12288")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--joins", type=int, default=4, help="times one more call joins the batch and leaves, timed")
    ap.add_argument("--join-rows", type=int, default=8,
                    help="the most rows whose batch a call joins (a merged batch's join copies every row: memory)")
    ap.add_argument("--modes", default="masked,kernel,paged", help="paths to time (kernel: CUDA only)")
    ap.add_argument("--copy-gbs", type=float, default=2470.0, help="the GPU's measured copy speed, GB/s")
    ap.add_argument("--probe", action="store_true", help="also each step's host share and a synced step's time")
    ap.add_argument("--quantize", action="store_true", help="the model quantized to 4 bits (group 64) in the process")
    ap.add_argument("--out", default="bench/out")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvwake-decode-rows-"))
    store = Store(work / "store", block_tokens=256)
    # buffers by default: each mode lays its rows out itself (the paged mode in a pool of its own, page_pool)
    engine = Engine(store, work, a.model, max_batch=64, warm=False, tuning=Tuning(paged_kv=False))
    if a.quantize:
        import mlx.nn as nn

        nn.quantize(engine.model, group_size=64, bits=4)
        mx.eval(engine.model.parameters())
    weights = sum(v.nbytes for _, v in tree_flatten(engine.model.parameters()))
    heads, dim = layer_shape(engine)
    kv_per_token = 2 * len(engine.make_cache()) * heads * dim * 2
    results = []
    for context in [int(c) for c in a.contexts.split(",")]:
        for rows in [int(r) for r in a.rows.split(",")]:
            row = {"rows": rows, "context": context}
            modes = [m for m in a.modes.split(",")
                     if m not in ("kernel", "qkernel", "paged-nowrite") or ragged_decode.wanted(True)]
            try:
                for mode in modes * 2:  # alternating: drift shows
                    joins = a.joins if rows <= a.join_rows else 0
                    probe: dict | None = {} if a.probe else None
                    ms, join = step_ms(engine, rows, context, a.steps, joins, mode, a.quantize, probe)
                    for key, value in (probe or {}).items():
                        row.setdefault(key, []).append(value)
                    row.setdefault(f"{mode}_ms", []).append(round(ms, 2))
                    if join is not None:
                        row.setdefault(f"{mode}_join_ms", []).append(join)
            except Exception as exc:  # noqa: BLE001 - out of memory at the largest shapes: say so, go on
                row["error"] = repr(exc)[:200]
            nbytes = weights + rows * context * kv_per_token
            row["bytes_gb"] = round(nbytes / 1e9, 2)
            row["bound_ms"] = round(nbytes / (a.copy_gbs * 1e9) * 1000, 2)
            for mode in modes:
                if row.get(f"{mode}_ms"):
                    row[f"{mode}_tok_s"] = round(rows * 1000 / min(row[f"{mode}_ms"]), 1)
                    if mode != "masked" and row.get("masked_ms"):
                        row[f"{mode}_speedup"] = round(min(row["masked_ms"]) / min(row[f"{mode}_ms"]), 2)
            print(row, flush=True)
            results.append(row)
    engine.close()
    store.close()
    save({"machine": machine(), "model": a.model, "steps": a.steps, "rows": results}, a.out, "decode_rows.json")


if __name__ == "__main__":
    main()
