"""Structured output's cost: decode tokens/s under a JSON schema against without, at 1 and N sessions, one run.

usage: python bench/structured.py [--model tiny|default|PATH] [--sessions 1,8] [--tokens 128]
                                  [--context 256] [--rounds 2] [--fill-only] [--vocab-from DIR] [--out bench/out]

decode  for each N in --sessions: N fresh sessions (a --context-token prompt each, prefilled before
        timing) decode --tokens tokens at once in the engine's batched decoder (the daemon's code,
        in process), unconstrained and under SCHEMA, alternating for --rounds rounds. A step's time
        is wall time around `Decoder.step()` (it waits for the step before it, so in steady state
        this is the pipeline's rate); tokens/s = N / mean step time over the steps that ran all N
        calls, after the first WARMUP. Every call runs to --tokens: SCHEMA's array needs
        MIN_ITEMS objects, so no constrained call can end sooner, and as a random model's
        unconstrained calls would sample EOS every few hundred tokens, the bench's engine treats
        no token as EOS (the grammars keep theirs). Reported: tokens/s each way, their ratio, and the mask
        fill time per step (llguidance, all constrained rows, on its thread pool).
fill    the mask fill alone (Masks.fill): 1 and N rows at each token of a sample answer (12 items)
        (`--fill-only`: this part only; the default model's bfloat16 decode is too slow on a small CPU).

`--model tiny` is the tests' tiny llama (byte vocabulary), `default` the default model
(SmolLM2-135M, 49k vocabulary). On the GPU machine: `--model /tmp/m8s` (bench/device.sh makes it),
whose 512-token vocabulary makes masks cheap; `--vocab-from DIR` first writes a copy of the model
beside it with DIR's tokenizer (e.g. the default model's, 49k tokens) and embeddings and lm_head
of that size (random), so the mask costs what a real vocabulary costs.
Results: <out>/structured.json (docs/benchmarks.md summarises them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

from kvwake.daemon.model.engine import Engine  # noqa: E402
from kvwake.daemon.model.generation import GenerateParams  # noqa: E402
from kvwake.daemon.model.grammar import Structure  # noqa: E402
from kvwake.daemon.model.masks import Constraint  # noqa: E402
from kvwake.daemon.session_state import Session  # noqa: E402
from kvwake.store import Store  # noqa: E402

WARMUP = 4  # steps left out at the start of each run (joins, first kernels)
MIN_ITEMS = 200
ITEM = {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                                         "ok": {"type": "boolean"}},
        "required": ["id", "name", "ok"], "additionalProperties": False}
SAMPLE = '{"items":[' + ",".join(f'{{"id":{i * 37},"name":"item number {i}","ok":{str(i % 2 == 0).lower()}}}'
                                 for i in range(12))  # an answer in the middle of SCHEMA
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": MIN_ITEMS}},
          "required": ["items"], "additionalProperties": False}


def model_path(name: str, work: Path) -> Path | None:
    if name == "tiny":
        from testkit.tinymodel import make_model_dir

        return make_model_dir(work / "tiny-llama")
    return None if name == "default" else Path(name)


def widen_vocab(model: Path, tokenizer_dir: Path) -> Path:
    """A copy of `model` with `tokenizer_dir`'s tokenizer: embed_tokens and lm_head resized, random."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    out = model.with_name(f"{model.name}-v{vocab}")
    if (out / "config.json").exists():
        return out
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            (out / name).write_bytes((tokenizer_dir / name).read_bytes())
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = vocab
    config.pop("eos_token_id", None)  # the tokenizer's own
    weights = mx.load(str(model / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            w = weights[name]
            weights[name] = (mx.random.normal((vocab, w.shape[1])) * 0.02).astype(w.dtype)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def timed_steps(decoder: Any, calls: list) -> list[float]:
    """Join the calls and step the decoder until all are done: the wall times of the steps that ran
    every call, after the first WARMUP."""
    for call in calls:
        decoder.join(call)
    times, step = [], 0
    mx.synchronize()
    while decoder.active:
        full = decoder.running == len(calls) and not decoder.waiting
        started = time.perf_counter()
        decoder.step()
        if full and step >= WARMUP:
            times.append(time.perf_counter() - started)
        step += 1
    return times


def decode_run(engine: Engine, n: int, tokens: int, context: int, structure: Structure | None,
               tag: str) -> dict[str, Any]:
    """N calls from fresh sessions, decoded together; per-step times of the steps that ran all N."""
    prompt = list(range(3, 3 + context))  # token ids every vocabulary has
    calls = []
    for i in range(n):
        s = Session(f"{tag}-{i}")
        engine.append(s, tokens=[(t * (i + 7)) % 200 + 3 for t in prompt])
        p = GenerateParams(max_tokens=tokens, temperature=1.0, seed=i, structure=structure)
        calls.append(engine.start_call(s, p))
    decoder, masks = engine.decoder, engine.decoder.masks
    fills, fill_s = masks.fills, masks.fill_s
    passes, ready, take_s = masks.timing["passes"], masks.timing["ready"], masks.timing["take_s"]
    times = timed_steps(decoder, calls)
    results = [c.future.result() for c in calls]
    if structure is not None:  # cut by max_tokens, and every token one the grammar allows
        assert all(r.finish_reason == "length" for r in results), [r.finish_reason for r in results]
        for r in results:
            check = engine.grammars.matcher(structure)
            assert check.validate_tokens(r.tokens) == len(r.tokens), (r.text[:200], check.get_error())
    n_fills, n_passes = masks.fills - fills, masks.timing["passes"] - passes
    if not times:  # an unconstrained call sampled EOS within the warm-up: no step ran all N
        return {"steps_timed": 0, "step_ms": None, "tokens_per_s": None, "mask_fill_ms_per_step": None,
                "mask_take_ms_per_step": None}
    return {"steps_timed": len(times), "step_ms": round(statistics.mean(times) * 1000, 3),
            "tokens_per_s": round(n / statistics.mean(times), 1),
            "mask_fill_ms_per_step": round((masks.fill_s - fill_s) / n_fills * 1000, 4) if n_fills else None,
            # the engine thread's own wait for the mask (filled ahead) or time filling it (in the pass)
            "mask_take_ms_per_step": round((masks.timing["take_s"] - take_s) / n_passes * 1000, 4)
            if n_passes else None, "masks_ready_ahead": masks.timing["ready"] - ready, "mask_passes": n_passes}


def decode(engine: Engine, sessions: list[int], tokens: int, context: int, rounds: int) -> list[dict[str, Any]]:
    structure = Structure.json(SCHEMA)
    started = time.perf_counter()
    engine.check_structure(GenerateParams(structure=structure), None)
    compile_ms = (time.perf_counter() - started) * 1000
    out = []
    decode_run(engine, max(sessions), 16, context, structure, "warm-json")  # kernels and shapes, both ways
    decode_run(engine, max(sessions), 16, context, None, "warm-free")
    masks = engine.decoder.masks
    for n in sessions:
        runs: dict[str, list[dict[str, Any]]] = {"free": [], "json": [], "json-in-pass": []}
        for r in range(rounds):
            for kind in runs:  # json: masks filled ahead (the daemon's way); json-in-pass: filled in the pass
                masks.ahead_enabled = kind != "json-in-pass"
                runs[kind].append(decode_run(engine, n, tokens, context, structure if kind != "free" else None,
                                             f"{kind}-{n}-{r}"))
        masks.ahead_enabled = True

        def median(kind: str, key: str) -> float:
            return round(statistics.median(x[key] for x in runs[kind] if x[key] is not None), 4)

        free, constrained, in_pass = (median(k, "tokens_per_s") for k in ("free", "json", "json-in-pass"))
        row = {"sessions": n, "free_tokens_per_s": free, "json_tokens_per_s": constrained,
               "ratio": round(constrained / free, 3), "json_in_pass_tokens_per_s": in_pass,
               "ratio_in_pass": round(in_pass / free, 3),
               "mask_fill_ms_per_step": median("json", "mask_fill_ms_per_step"),
               "mask_take_ms_per_step": median("json", "mask_take_ms_per_step"),
               "mask_take_ms_per_step_in_pass": median("json-in-pass", "mask_take_ms_per_step"),
               "free_step_ms": median("free", "step_ms"), "json_step_ms": median("json", "step_ms"),
               "json_in_pass_step_ms": median("json-in-pass", "step_ms"), "runs": runs}
        print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
        out.append(row)
    return [{"grammar_compile_ms": round(compile_ms, 3)}, *out]


def fill(engine: Engine, rows: list[int]) -> list[dict[str, Any]]:
    """Masks.fill alone along a real answer: at each token of SAMPLE, N rows at that point (mean and max)."""
    llt, masks = engine.grammars.tokenizer, engine.decoder.masks
    tokens = llt.tokenize_str(SAMPLE)
    out = []
    for n in rows:
        constraints = []
        for _ in range(n):
            c = Constraint(engine.grammars.matcher(Structure.json(SCHEMA)), set(), llt.eos_token)
            c.prompt_token = False
            constraints.append(c)
        times = []
        for t in tokens:
            started = time.perf_counter()
            masks.fill(constraints)
            times.append(time.perf_counter() - started)
            for c in constraints:
                c.feed(t)
            assert all(c.error is None for c in constraints), constraints[0].error
        out.append({"rows": n, "vocab": llt.vocab_size, "positions": len(tokens),
                    "fill_ms_mean": round(statistics.mean(times) * 1000, 4),
                    "fill_ms_p99": round(sorted(times)[int(0.99 * (len(times) - 1))] * 1000, 4),
                    "fill_ms_max": round(max(times) * 1000, 4)})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sessions", default="1,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fill-only", action="store_true")
    ap.add_argument("--vocab-from", type=Path)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    a = ap.parse_args()
    sessions = [int(x) for x in a.sessions.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        store = Store(work / "store", block_tokens=16)
        path = model_path(a.model, work)
        if a.vocab_from is not None:
            path = widen_vocab(path, a.vocab_from)
        engine = Engine(store, work if a.model != "default" else Path.home() / ".kvwake-bench", path,
                        max_batch=max(sessions))
        engine.tokenizer.eos_token_ids = []  # calls end at --tokens
        try:
            device = str(mx.default_device())
            print(json.dumps({"model": engine.model_name, "device": device, "vocab": engine.vocab_size}), flush=True)
            result = {"model": engine.model_name, "device": device, "tokens": a.tokens, "context": a.context,
                      "decode": None if a.fill_only else decode(engine, sessions, a.tokens, a.context, a.rounds),
                      "fill": fill(engine, sorted({1, max(sessions)}))}
        finally:
            engine.close()
            store.close()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
