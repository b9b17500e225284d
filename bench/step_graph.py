"""The MLX operations one batched decode step builds: kvwake's decoder against mlx-lm's BatchGenerator.

usage: python bench/step_graph.py [--model tiny|default|PATH] [--sessions 8] [--temperature 0] [--out bench/out]

Session 21 found both decoders host-bound on the H100 (the GPU busy 39-65% of their decode windows at 8 and 16
rows of the 8B shape): a step costs what building its graph and launching its kernels cost, so every operation
a step adds is time. This counts them, without a GPU: N calls decode together, and in one steady step (all N
rows, after a few) every array handed to `mx.eval` / `mx.async_eval` is exported (`mx.export_to_dot`) before it
runs, and the operations not yet evaluated are counted by kind (each once). The same for `BatchGenerator` on
the same model and prompts. Views (reshapes, slices, broadcasts) are counted too: on CUDA some are copies, all
are graph nodes built in Python. Results: <out>/step_graph.json.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from batching import bench_model, prompts, save  # noqa: E402

from kvwake.daemon.model.engine import Engine  # noqa: E402
from kvwake.daemon.model.generation import GenerateParams  # noqa: E402
from kvwake.daemon.session import Session  # noqa: E402
from kvwake.store import Store  # noqa: E402

NODE = re.compile(r'\{ (\d+) \[label ="([^"]+)", shape=rectangle\]; \}')
STEADY = 6  # steps before the one counted


class Spy:
    """Wraps mx.eval and mx.async_eval; while `on`, exports what each is handed and counts its new operations."""

    def __init__(self, work: Path) -> None:
        self.work, self.on, self.calls = work, False, 0
        self.kinds: collections.Counter[str] = collections.Counter()
        self.seen: set[str] = set()
        self.real = {name: getattr(mx, name) for name in ("eval", "async_eval")}
        for name, real in self.real.items():
            setattr(mx, name, self._wrap(real))

    def _wrap(self, real: Any) -> Any:
        def spy(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                arrays = [a for _, a in tree_flatten(list(args)) if isinstance(a, mx.array)]
                if arrays:
                    self.calls += 1
                    path = self.work / f"step-{self.calls}.dot"
                    mx.export_to_dot(str(path), *arrays)
                    for node, kind in NODE.findall(path.read_text()):
                        if node not in self.seen:
                            self.seen.add(node)
                            self.kinds[kind] += 1
            return real(*args, **kwargs)
        return spy

    def close(self) -> None:
        for name, real in self.real.items():
            setattr(mx, name, real)

    def report(self) -> dict[str, Any]:
        return {"operations": sum(self.kinds.values()), "eval_calls": self.calls,
                "by_kind": dict(self.kinds.most_common())}


def kvwake_step(work: Path, model: Path, n: int, temperature: float) -> dict[str, Any]:
    store = Store(work / "store", block_tokens=16)
    engine = Engine(store, work / "engine", model, max_batch=64)
    engine.tokenizer.eos_token_ids = []
    spy = Spy(work / "kvwake")
    (work / "kvwake").mkdir()
    try:
        decoder = engine.decoder
        for i, text in enumerate(prompts(n)):
            s = Session(f"g-{i}")
            engine.append(s, tokens=engine.tokenizer.encode(text))
            decoder.join(engine.start_call(s, GenerateParams(max_tokens=64, temperature=temperature, seed=i)))
        step = 0
        while decoder.active:
            full = decoder.running == n and not decoder.waiting
            spy.on = full and step == STEADY
            decoder.step()
            if spy.on:
                break
            step += 1
        spy.on = False
        return spy.report()
    finally:
        spy.close()
        engine.close()
        store.close()


def batch_generator_step(work: Path, model: Path, n: int) -> dict[str, Any]:
    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    loaded, tokenizer = mlx_lm.load(str(model))
    gen = BatchGenerator(loaded, max_tokens=64, stop_tokens=[], completion_batch_size=max(32, n),
                         prefill_batch_size=max(8, n))
    gen.insert([tokenizer.encode(p) for p in prompts(n)])
    spy = Spy(work / "bg")
    (work / "bg").mkdir()
    try:
        full_steps = 0
        while True:
            spy.on = full_steps == STEADY
            out = gen.next_generated()
            if spy.on:
                break
            full_steps += len(out) == n
        spy.on = False
        return spy.report()
    finally:
        spy.close()
        gen.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", default="bench/out")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvwake-step-graph-"))
    model = bench_model(a.model, work)
    ours = kvwake_step(work, model, a.sessions, a.temperature)
    theirs = batch_generator_step(work, model, a.sessions)
    kinds = sorted(set(ours["by_kind"]) | set(theirs["by_kind"]),
                   key=lambda k: -(ours["by_kind"].get(k, 0) - theirs["by_kind"].get(k, 0)))
    report = {"model": str(model), "sessions": a.sessions, "temperature": a.temperature, "kvwake": ours,
              "batch_generator": theirs,
              "kvwake_minus_batch_generator": {k: ours["by_kind"].get(k, 0) - theirs["by_kind"].get(k, 0)
                                               for k in kinds if ours["by_kind"].get(k, 0) != theirs["by_kind"].get(k, 0)}}
    print(f"operations in one step of {a.sessions} rows: kvwake {ours['operations']} ({ours['eval_calls']} evals), "
          f"BatchGenerator {theirs['operations']} ({theirs['eval_calls']} evals)")
    print("kvwake - BatchGenerator by kind:", report["kvwake_minus_batch_generator"])
    save(report, a.out, "step_graph.json")


if __name__ == "__main__":
    main()
