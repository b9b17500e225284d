"""Where the engine's memory goes: resident memory and MLX's own counters, sampled through a long session.

usage: python bench/memory.py --model PATH [--tokens 32768] [--cache-limit GB] [--memory-limit GB] [--out DIR]

Issue 25: on the H100 machine a process running the engine was OOM-killed at
~130 GB resident (mostly file-backed: MLX's CUDA managed memory) during
`bench/suite.py resume` at 32k tokens. This runs that benchmark's phases on one
session (prefill N tokens, mlx-lm save and load, sleep, wake, a first token,
a cold re-prefill) while a thread samples, every 100 ms, the process's VmRSS
with its anonymous, file-backed and shared parts (/proc/self/status) and MLX's
active, cache and peak memory. It prints the peak of each per phase, and the
time each phase took: run it once as MLX sets its limits by itself and once
with `--cache-limit` to see what the buffer cache holds and what a limit costs.
Samples go to DIR/memory-<label>.jsonl as they are taken, so a killed run still
tells how far it got.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.append(str(ROOT))

GB = 1 << 30
FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmSwap")


def proc_status() -> dict[str, int]:
    """The resident-memory lines of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in FIELDS:
                out[name] = int(value.split()[0]) * 1024
    return out


class Sampler:
    """Samples memory every `period` seconds into a JSONL file and keeps each phase's peaks."""

    def __init__(self, path: Path, period: float = 0.1) -> None:
        import mlx.core as mx

        self.mx, self.period, self.file = mx, period, path.open("w")
        self.phase, self.peaks, self._stop = "start", {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict[str, Any]:
        row = {"t": time.time(), "phase": self.phase, **proc_status(),
               "mlx_active": self.mx.get_active_memory(), "mlx_cache": self.mx.get_cache_memory(),
               "mlx_peak": self.mx.get_peak_memory()}
        peaks = self.peaks.setdefault(self.phase, {})
        for key, value in row.items():
            if key not in ("t", "phase"):
                peaks[key] = max(peaks.get(key, 0), value)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        return row

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        self.file.close()

    def run(self, phase: str, fn: Any) -> tuple[Any, float]:
        """Run fn() as `phase` (MLX's peak counter reset first); returns its result and seconds."""
        self.mx.reset_peak_memory()
        self.phase = phase
        self.sample()
        t0 = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - t0
        self.sample()
        self.peaks[phase]["seconds"] = elapsed
        return result, elapsed


def probe(model: str, tokens: int, out: Path, label: str) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from kvwake.daemon.kv import state as kvstate
    from kvwake.daemon.session import Session
    from suite import first_token, open_engine, tokens_of

    with tempfile.TemporaryDirectory() as tmp, Sampler(out / f"memory-{label}.jsonl") as s:
        engine, _ = s.run("load", lambda: open_engine(model, Path(tmp)))
        ids = tokens_of(engine, tokens)
        session = Session("probe")
        s.run("prefill", lambda: engine.append(session, tokens=ids))
        kv_bytes = kvstate.cache_nbytes(session.cache)
        f = Path(tmp) / "mlx.safetensors"
        s.run("mlx_save", lambda: save_prompt_cache(str(f), session.cache))

        def mlx_load() -> None:
            cache = load_prompt_cache(str(f))
            mx.eval([c.state for c in cache])
            first_token(engine, Session("mlx", tokens=list(ids), processed=tokens - 1, cache=cache))

        s.run("mlx_load", mlx_load)
        s.run("sleep", lambda: engine.sleep(session))
        woken, _ = s.run("wake", lambda: engine.wake("probe"))[0]
        s.run("first_token", lambda: first_token(engine, woken))
        del woken
        s.run("clear_cache", mx.clear_cache)
        cold = Session("cold")
        unseen = [(ids[0] + 1) % engine.vocab_size, *ids[1:]]
        s.run("reprefill", lambda: engine.append(cold, tokens=unseen))
        engine.close()
    return {"label": label, "tokens": tokens, "kv_bytes": kv_bytes, "device": str(mx.default_device()),
            "phases": s.peaks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--cache-limit", type=float, help="mx.set_cache_limit, GB")
    parser.add_argument("--memory-limit", type=float, help="mx.set_memory_limit, GB")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = parser.parse_args(argv)
    import mlx.core as mx

    label = "default"
    if args.cache_limit is not None:
        mx.set_cache_limit(int(args.cache_limit * GB))
        label = f"cache{args.cache_limit:g}"
    if args.memory_limit is not None:
        mx.set_memory_limit(int(args.memory_limit * GB))
        label += f"-mem{args.memory_limit:g}"
    args.out.mkdir(parents=True, exist_ok=True)
    result = probe(args.model, args.tokens, args.out, label)
    (args.out / f"memory-{label}.json").write_text(json.dumps(result, indent=1))
    print(f"{label}: {args.tokens} tokens, KV {result['kv_bytes'] / GB:.2f} GiB")
    for phase, p in result["phases"].items():
        print(f"  {phase:12s} {p.get('seconds', 0):7.2f}s  RSS {p['VmRSS'] / GB:6.1f} (anon {p['RssAnon'] / GB:5.1f}, "
              f"file {p['RssFile'] / GB:6.1f}, shmem {p['RssShmem'] / GB:5.1f})  mlx active {p['mlx_active'] / GB:6.1f} "
              f"cache {p['mlx_cache'] / GB:6.1f} peak {p['mlx_peak'] / GB:6.1f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
