"""How far batched decoding is from decoding alone: logprob differences and greedy agreement.

usage: python bench/batch_exactness.py [--model tiny|PATH] [--lengths 16,300,1000,4000] [--tokens 64]
                                       [--out bench/out]

Each prompt is prefilled alone into its own cache, twice. One copy decodes alone with mlx-lm's
`generate_step` (what kvwake does with max_batch = 1); the other joins the others in one
`GenerationBatch` over a left-padded `BatchKVCache` (what kvwake's decoder does), each call joining
one step after the previous. Per prompt: greedy tokens that agree before the first divergence, the
largest |logprob difference| over the steps both saw the same history, and whether the caches
handed back are bit-identical. Results: <out>/batch-exactness.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--lengths", default="16,300,1000,4000")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    a = ap.parse_args()
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import GenerationBatch, StopSequences, generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import greedy_sampler

    sys.path.insert(0, str(ROOT / "bench"))
    from suite import machine

    if a.model == "tiny":
        from tests.tinymodel import make_model_dir

        path = make_model_dir(Path(tempfile.mkdtemp()) / "tiny-llama")
    else:
        path = Path(a.model)
    model, tokenizer = mlx_lm.load(str(path))
    vocab = len(tokenizer.vocab)
    rng = random.Random(0)
    lengths = [int(x) for x in a.lengths.split(",")]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]

    def prefilled(prompt: list[int]) -> list:
        cache = make_prompt_cache(model)
        for i in range(0, len(prompt) - 1, 512):
            model(mx.array(prompt[i : min(i + 512, len(prompt) - 1)])[None], cache=cache)
            mx.eval([c.state for c in cache])
        return cache

    alone = []
    for p in prompts:
        cache, steps = prefilled(p), []
        for token, logprobs in generate_step(mx.array(p[-1:]), model, prompt_cache=cache, max_tokens=a.tokens):
            steps.append((token, logprobs))
        alone.append((steps, cache))

    batched: dict[int, list] = {i: [] for i in range(len(prompts))}
    caches: dict[int, list] = {}
    batch = None
    for step in range(a.tokens + len(prompts)):
        if step < len(prompts):  # one call joins per step
            c = prefilled(prompts[step])
            one = GenerationBatch(model, [step], mx.array(prompts[step][-1:]), [x.merge([x]) for x in c], [[]],
                                  [None], greedy_sampler, [()], [StopSequences()], [a.tokens])
            batch = one if batch is None else (batch.extend(one) or batch)
        if batch is None or not batch.uids:
            break
        for r in batch.next():
            batched[r.uid].append((r.token, r.logprobs))
            if r.finish_reason:
                caches[r.uid] = r.prompt_cache

    rows: list[dict[str, Any]] = []
    for i, n in enumerate(lengths):
        solo_steps, solo_cache = alone[i]
        agree, max_diff = 0, 0.0
        for (t1, l1), (t2, l2) in zip(solo_steps, batched[i]):
            max_diff = max(max_diff, float(mx.abs(l1.astype(mx.float32) - l2.astype(mx.float32)).max()))
            if t1 != t2:
                break
            agree += 1
        same_cache = agree == a.tokens and all(
            mx.array_equal(x.state[0][..., : x.offset, :], y.state[0][..., : y.offset, :]).item()
            for x, y in zip(solo_cache, caches[i]))
        rows.append({"prompt_tokens": n, "greedy_agree": agree, "of": a.tokens,
                     "max_abs_logprob_diff": max_diff, "cache_bit_identical": same_cache})
        print(rows[-1], flush=True)
    report = {"machine": machine(), "model": str(path), "dtype": str(model.parameters()["model"]["embed_tokens"]
                                                                       ["weight"].dtype), "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch-exactness.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
