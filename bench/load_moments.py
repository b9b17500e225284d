"""Probe: which of a load's steps stall another model's decode steps (issue 53's gap), one at a time.

On the H200 (docs/benchmarks.md, "Several models", S46) a second model's load stops every stream of the decoding
model twice, ~22-27 ms at its start and ~13-16 ms at its end, while the daemon's GIL watch saw no wait for the GIL
over 6 ms: something other than the loader's Python holds the decoding thread. This probe runs, in one process,
a thread stepping a model's decode without pause (one token a step, evaluated, read back, as the engine thread
does) and, on other threads, a load's steps one kind at a time with quiet between them, each `--repeats` times:

thread      a new thread's first GPU op (MLX makes that thread's stream and command encoder)
cpu_array   a new thread's 32 MiB array on MLX's CPU stream (host memory from MLX's allocator)
staging     two 32 MiB staging slots made and mapped for the GPU (kv/devplanes.py `staging`, as a load's reader)
unmap       the same slots' mappings undone and the arrays dropped (as the reader's close)
clear       MLX's cache of freed buffers emptied (`mx.clear_cache`, as an unload's last step)
modules     mlx-lm's model built lazily from `--load`'s folder (the `modules` phase of a load)
read        the whole of `weights.load` of `--load` on a new thread (every phase of the weights)
rowbuild    the row kernel of `--load`'s heads run on a new thread (built already: what a later load's
            kernel_cache.BesideLoad does with it)
beside      kernel_cache.BesideLoad of `--load` as a later load makes it (its own thread), waited for
engine      a whole engine of `--load` made on a new thread as a later load makes it (model/loader.py), closed

Each step also runs the row kernel (a custom kernel, as the daemon's batched decode does on CUDA): MLX looks a
custom kernel up under a process-wide lock.

Per kind: the stepping thread's longest step that overlapped it, and the median step alone. One JSON line.

usage: python bench/load_moments.py --decode PATH --load PATH [--kinds thread,...] [--repeats 3] [--quiet-ms 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvwake.daemon.kv import cudart, devplanes  # noqa: E402
from kvwake.daemon.model import weights  # noqa: E402

KINDS = ("thread", "cpu_array", "staging", "unmap", "clear", "modules", "read", "rowbuild", "beside", "engine")
SLOT = 32 << 20


def on_new_thread(job) -> None:
    """Run `job` on a thread of its own, to its end (MLX's streams are per thread: a load runs on a new one)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            failed.append(exc)
        finally:
            mx.synchronize()
            mx.clear_streams()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if failed:
        raise failed[0]


class Steps:
    """A thread decoding one token a step over a short prompt, each step's (start, end) kept."""

    def __init__(self, path: Path) -> None:
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache

        from kvwake.daemon.model import ragged_decode
        from kvwake.daemon.model.paged_attention import row_attention

        self.model, _ = load(str(path))
        heads, kv_heads, head_dim, dtype = ragged_decode.shape_of(self.model)
        q, k = mx.zeros((2, heads, head_dim), dtype), mx.zeros((2, kv_heads, 64, head_dim), dtype)
        mx.eval(q, k)  # made here, used on the stepping thread: MLX on CUDA evaluates on the maker's stream only
        self.row = (lambda: row_attention(q, k, k, mx.array([0, 3], mx.int32), mx.array([64, 61], mx.int32), 1.0)) \
            if cudart.on_cuda() and ragged_decode.build(heads, kv_heads, head_dim, dtype) else (lambda: mx.zeros((1,)))
        self.cache = make_prompt_cache(self.model)
        self.model(mx.array([list(range(1, 257))]), cache=self.cache)
        mx.eval([c.state for c in self.cache])
        self.spans: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        token = mx.array([[1]])
        while not self.stop.is_set():
            began = time.perf_counter()
            logits = self.model(token, cache=self.cache)
            token = mx.argmax(logits[:, -1:], axis=-1)
            mx.eval(token, self.row())
            token.item()
            self.spans.append((began, time.perf_counter()))
            if self.cache[0].offset >= 500:  # one buffer size (256 steps): no graph built for a new shape
                for c in self.cache:
                    c.trim(c.offset - 260)


def longest_over(spans: list[tuple[float, float]], window: tuple[float, float]) -> float:
    """The longest step (ms) that overlapped `window`, the gap from one step's start to the next's included."""
    starts = [s for s, _ in spans]
    worst = 0.0
    for i in range(1, len(starts)):
        if starts[i] >= window[0] and starts[i - 1] <= window[1]:
            worst = max(worst, starts[i] - starts[i - 1])
    return round(worst * 1000, 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", type=Path, required=True, help="the model whose steps are timed")
    ap.add_argument("--load", type=Path, required=True, help="the model folder the modules/read kinds load")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quiet-ms", type=float, default=300.0)
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    import tempfile

    from kvwake.daemon.model import kernel_cache, ragged_decode
    from kvwake.daemon.model.engine import Engine
    from kvwake.store import Store

    work = Path(tempfile.mkdtemp(prefix="kvwake-moments-"))
    store = Store(work / "store", block_tokens=128)

    def engine() -> None:  # as model/loader.py makes a later load's (not the first: nothing made beside)
        Engine(store, work, args.load, warm=False, eager_grammars=False, staging_beside_load=False).close()

    with open(args.load / "config.json") as f:
        load_shape = kernel_cache._heads(args.load, json.load(f))
    steps = Steps(args.decode)
    on_new_thread(engine)  # the first: digests, tokenizer, template and the row kernel made before any timing
    steps.thread.start()
    time.sleep(3.0)  # past the stepping model's first shapes
    slots: list = []

    def staging() -> None:
        slots.extend(devplanes.staging((SLOT,)) for _ in range(2))

    def unmap() -> None:
        for _, _, release in slots:
            release()
        slots.clear()

    def modules() -> None:
        from mlx_lm.utils import load_model

        load_model(args.load, lazy=True)

    jobs = {
        "thread": lambda: on_new_thread(lambda: mx.eval(mx.zeros((1,)) + 1)),
        "cpu_array": lambda: on_new_thread(lambda: mx.eval(mx.zeros((SLOT,), mx.uint8, stream=mx.cpu))),
        "staging": staging,  # on this thread: the slots are undone by the next kind
        "unmap": unmap,
        "clear": mx.clear_cache,
        "modules": lambda: on_new_thread(modules),
        "read": lambda: on_new_thread(lambda: weights.load(str(args.load))),
        "rowbuild": lambda: on_new_thread(lambda: cudart.on_cuda() and ragged_decode.build(*load_shape)),
        "beside": lambda: kernel_cache.BesideLoad(args.load, True, None).result(),
        "engine": lambda: on_new_thread(engine),
    }
    windows: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for kind in kinds:
            if kind == "unmap" and not slots:
                staging()
                time.sleep(args.quiet_ms / 1000)
            began = time.perf_counter()
            jobs[kind]()
            windows[kind].append((began, time.perf_counter()))
            time.sleep(args.quiet_ms / 1000)
        unmap()
    steps.stop.set()
    steps.thread.join()
    spans = steps.spans
    busy = [w for ws in windows.values() for w in ws]
    quiet = [e - s for s, e in spans if not any(s <= w[1] + 0.05 and e >= w[0] - 0.01 for w in busy)]
    report = {"step_alone_p50_ms": round(statistics.median(quiet) * 1000, 2),
              "step_alone_max_ms": round(max(quiet) * 1000, 2), "steps": len(spans),
              "kinds": {k: {"ms": [round((e - s) * 1000, 2) for s, e in ws],
                            "longest_step_ms": [longest_over(spans, w) for w in ws]} for k, ws in windows.items()}}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
