"""Where a batched decode step's time goes: mlx-lm's model over `BatchKVCache`, one part of the step at a time.

usage: python3 bench/step_parts.py --model PATH [--rows 1,8,16,32] [--contexts 1024,12288] [--steps 12]
                                   [--out FILE]

A Llama-shaped model (mlx-lm's `llama`: `model.model.layers`, each with `self_attn`, `mlp` and two norms) decodes
`rows` rows whose caches hold `context` tokens of random KV (mlx-lm's `BatchKVCache`, as `BatchGenerator` and
kvwake's masked path hold them). Timed, each evaluated alone and best of `--steps`:
- step: the whole forward pass of one token a row and the greedy pick (what a decode step computes);
- build: the Python time to make that step's graph, not evaluated (the host's share: hidden where the next
  step's graph is built while the device computes this one, as mlx-lm's generator does);
- linears: every layer's q, k, v, o, gate, up and down projections and the head, on the step's shapes;
- attention: every layer's `self_attn` (its projections, RoPE, the cache's update and the masked attention);
- mlp, norms, head: the rest of a layer's parts and the output head with the pick.
The parts are evaluated apart, so they add up to more than a step (each pays a launch and a wait); their
proportions say which part is far from its bytes. Prints one JSON line per (rows, context) (and writes them to
`--out`). Issue 51's short-context steps, far from their bytes where the linear layers are not, are what it is for
(docs/benchmarks.md, "decode_rows").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.utils import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.lib import machine  # noqa: E402


def filled(model: Any, rows: int, context: int) -> list[BatchKVCache]:
    """A batch cache per layer holding `context` tokens of random KV for each of `rows` rows."""
    attn = model.model.layers[0].self_attn
    kv_heads, head_dim = attn.n_kv_heads, attn.head_dim if hasattr(attn, "head_dim") else None
    head_dim = head_dim or model.model.layers[0].self_attn.k_proj.weight.shape[0] // kv_heads
    dtype = model.model.layers[0].self_attn.k_proj.weight.dtype
    caches = []
    for _ in model.model.layers:
        c = BatchKVCache(left_padding=[0] * rows)
        shape = (rows, kv_heads, context, head_dim)
        c.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


def best_ms(run: Callable[[], Any], steps: int) -> float:
    """The fastest of `steps` runs of `run` (its result evaluated), after two not timed."""
    times = []
    for k in range(steps + 2):
        mx.synchronize()
        began = time.perf_counter()
        mx.eval(run())
        mx.synchronize()
        if k >= 2:
            times.append((time.perf_counter() - began) * 1000)
    return round(min(times), 3)


def parts(model: Any, rows: int, context: int, steps: int) -> dict[str, Any]:
    inner = model.model
    cache = filled(model, rows, context)
    tokens = mx.array([[7]] * rows, dtype=mx.uint32)
    h = inner.embed_tokens(tokens)
    mx.eval(h)

    def step() -> mx.array:
        return mx.argmax(model(tokens, cache=cache)[:, -1], axis=-1)

    def build_ms() -> float:
        best = float("inf")
        for _ in range(steps):
            began = time.perf_counter()
            y = step()
            best = min(best, (time.perf_counter() - began) * 1000)
            mx.eval(y)
        return round(best, 3)

    def linears() -> list[mx.array]:
        out = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            out += [a.q_proj(h), a.k_proj(h), a.v_proj(h), a.o_proj(h), m.gate_proj(h), m.up_proj(h)]
            out.append(m.down_proj(m.gate_proj(h)))
        return out

    def attention() -> list[mx.array]:  # each call adds a token to every layer's cache, as a step does
        mask = create_attention_mask(h, cache[0])
        return [layer.self_attn(h, mask, c) for layer, c in zip(inner.layers, cache)]

    def head() -> mx.array:
        logits = model.lm_head(h) if hasattr(model, "lm_head") and not getattr(model.args, "tie_word_embeddings",
                                                                                   False) \
            else inner.embed_tokens.as_linear(h)
        return mx.argmax(logits[:, -1], axis=-1)

    result = {"rows": rows, "context": context,
              "step_ms": best_ms(step, steps), "build_ms": build_ms(),
              "linears_ms": best_ms(linears, steps),
              "attention_ms": best_ms(attention, steps),
              "mlp_ms": best_ms(lambda: [l.mlp(h) for l in inner.layers], steps),
              "norms_ms": best_ms(lambda: [n(h) for l in inner.layers
                                          for n in (l.input_layernorm, l.post_attention_layernorm)], steps),
              "head_ms": best_ms(head, steps)}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--contexts", default="1024,12288")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", type=Path, help="a file for the JSON lines too")
    a = ap.parse_args()
    lines = [{"machine": machine()}]
    print(json.dumps(lines[0]), flush=True)
    model, _ = load_model(Path(a.model))
    for context in (int(c) for c in a.contexts.split(",")):
        for rows in (int(r) for r in a.rows.split(",")):
            lines.append(parts(model, rows, context, a.steps))
            print(json.dumps(lines[-1]), flush=True)
            mx.clear_cache()
    if a.out is not None:
        a.out.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
