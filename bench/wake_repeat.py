"""Wake against mlx-lm's load_prompt_cache, each + first token, repeated: medians for a noisy shared machine.

usage: python bench/wake_repeat.py --model PATH --tokens 4096 --synthetic KV.npz [--repeat 7] [--json OUT]
One process, one size: a synthetic session (bench/capture_kv.py's KV, tiled) is slept once, then woken
`repeat` times from disk (page cache; RAM tier emptied), alternating with mlx-lm's load_prompt_cache of the
same KV, and the single-core verified decode of the same blocks is measured as many times. Uses only the
engine's public calls, so an older kvwake (PYTHONPATH=its tree) runs it too: before and after in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    import kvwake
    from kvwake.daemon.session import Session
    from suite import decode_GBps, first_token, open_engine, synthetic_session, timed_wake, tokens_of

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--synthetic", required=True)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--codec", default="planes-zstd")
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = open_engine(args.model, Path(tmp), args.codec)
        ids = tokens_of(engine, args.tokens)
        s = Session("w")
        synthetic_session(engine, s, ids, args.synthetic)
        f = Path(tmp) / "mlx.safetensors"
        save_prompt_cache(str(f), s.cache)
        slept = engine.sleep(s)
        times: dict[str, list[float]] = {"wake": [], "wake_first_token": [], "mlx_load": [],
                                         "mlx_load_first_token": [], "decode_1core_GBps": []}
        for i in range(args.repeat + 1):  # the first round warms kernels and the page cache, untimed
            wake, wake_ft = timed_wake(engine, "w")
            t0 = time.perf_counter()
            cache = load_prompt_cache(str(f))
            mx.eval([c.state for c in cache])
            load = time.perf_counter() - t0
            load_ft = load + first_token(engine, Session("m", tokens=list(ids), processed=len(ids) - 1, cache=cache))
            del cache
            dec = decode_GBps(engine, slept["snapshot_id"])
            if i:
                for k, v in zip(times, (wake, wake_ft, load, load_ft, dec)):
                    times[k].append(v)
        med = {k: statistics.median(v) for k, v in times.items()}
        raw, cores = slept["raw_bytes"], engine.pool.workers
        out = {"kvwake": str(Path(kvwake.__file__).parent), "tokens": args.tokens, "raw_bytes": raw, "cores": cores,
               "codec": engine.store.codec, "load_average": os.getloadavg(), "medians": med, "all": times,
               "wake_GBps": raw / med["wake"] / 1e9,
               "wake_over_cores_x_decode_1core": raw / med["wake"] / 1e9 / (cores * med["decode_1core_GBps"]),
               "wake_ft_over_mlx_load_ft": med["wake_first_token"] / med["mlx_load_first_token"]}
        engine.close()
    print(f"{out['kvwake']}: wake {med['wake'] * 1000:.0f} ms ({out['wake_GBps']:.2f} GB/s = "
          f"{out['wake_over_cores_x_decode_1core']:.2f} x {cores} cores x {med['decode_1core_GBps']:.2f} GB/s), "
          f"wake+1st {med['wake_first_token'] * 1000:.0f} ms vs mlx load+1st {med['mlx_load_first_token'] * 1000:.0f}"
          f" ms ({out['wake_ft_over_mlx_load_ft']:.2f}x), mlx load {med['mlx_load'] * 1000:.0f} ms; "
          f"load {out['load_average'][0]:.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
