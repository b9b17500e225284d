"""kvwake's benchmark suite: every number is a ratio against a baseline measured in the same run.

usage: python bench/suite.py [resume|storage|rpc|all] [--model PATH] [--sizes 256,1024,4096]
                             [--sessions 100] [--out bench/out]

resume   per size N: re-prefill N tokens + first token (the baseline users pay
         without kvwake) vs kvwake sleep/wake + first token vs mlx-lm's own
         save_prompt_cache / load_prompt_cache + first token. Also: bytes stored
         per token vs raw KV vs mlx-lm's file, wake and sleep throughput (GB/s
         of KV), the single-core verified decode rate of the same blocks (the
         yardstick for wake's parallel efficiency: wake / (cores x that rate)),
         peak RSS growth while sleeping (fraction of the KV) and while waking,
         and per size the process's peak RSS and MLX's peak memory. Kernels are
         warmed up for each size before anything is timed.
storage  S sessions sharing a 1k-token system prompt with 200 own tokens each:
         kvwake's store bytes vs S mlx-lm cache files; time to first token of a
         session whose prompt is in the prefix cache vs a cold prefill.
rpc      a real daemon (tiny model): hello round trip p50/p99 over one
         connection vs a bare asyncio msgpack echo server (bench/rpc_echo.py)
         started in the same run, and requests/s with 32 concurrent clients.

Results go to <out>/<name>.json and are summarised in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

from bench.lib import machine  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The process's peak resident set so far (getrusage: KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class PeakRss:
    """Samples RSS every millisecond in a thread; .growth is peak minus the level at start."""

    def __enter__(self) -> PeakRss:
        self.start, self.peak, self._stop = rss_bytes(), rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def tokens_of(engine: Any, n: int) -> list[int]:
    """n tokens of natural English (the same prompt builder bench/capture_kv.py uses)."""
    from bench.capture_kv import build_prompt

    return build_prompt(engine.tokenizer, n)


def open_engine(model: str | None, root: Path, codec: str = "planes-zstd") -> Any:
    from kvwake.daemon.kv.restore_buffers import auto_codecs
    from kvwake.daemon.model.engine import Engine
    from kvwake.store import Store

    return Engine(Store(root / "store", block_tokens=128, codec=codec, auto_among=auto_codecs()), root, model)


def decode_GBps(engine: Any, snapshot_id: str, workers: int = 1) -> float:
    """Read, decode and verify every block of a snapshot on `workers` threads, into preallocated arrays.

    The same codec work a wake does per block (files from the page cache into
    a reused buffer, zstd, byte planes joined in place, BLAKE3), without MLX:
    with one worker, the yardstick for wake's parallel efficiency; with all,
    what the codec alone reaches on this machine.
    """
    import concurrent.futures as cf

    import numpy as np

    from kvwake.store.format.codec import DTYPES

    record = engine.store.snapshot(snapshot_id)
    specs = engine.store.block_specs(record.blocks[0])
    local = threading.local()

    def read(ref: Any) -> None:
        if not hasattr(local, "dest"):
            local.dest = {n: np.empty(shape, DTYPES[dtype][0]) for n, (dtype, shape) in specs.items()}
        engine.store.read_block(ref, place=lambda name, dtype, shape: local.dest.get(name))

    with cf.ThreadPoolExecutor(workers) as pool:
        list(pool.map(read, record.blocks[: 2 * workers]))  # warm each thread's buffers and the page cache
        t0 = time.perf_counter()
        list(pool.map(read, record.blocks))
        elapsed = time.perf_counter() - t0
    return sum(b.raw_bytes for b in record.blocks) / elapsed / 1e9


def first_token(engine: Any, session: Any) -> float:
    """Seconds until the first token is available (the engine's TTFT: feeding the pending token).

    Not the whole generate call: mlx-lm's generate_step computes the next
    token before yielding one, which would double this on a CPU.
    """
    from kvwake.daemon.model.generation import GenerateParams

    return engine.generate(session, GenerateParams(max_tokens=1)).usage["ttft_ms"] / 1000


def timed_wake(engine: Any, session_id: str) -> tuple[float, float]:
    """(wake, wake + first token) seconds of a wake from disk: the RAM tier emptied first, the woken cache
    dropped and MLX's cached buffers freed after (the next round starts as this one did)."""
    import mlx.core as mx

    engine.ram_tier.__init__(engine.ram_tier.budget)
    t0 = time.perf_counter()
    woken, _ = engine.wake(session_id)
    wake = time.perf_counter() - t0
    with_first = wake + first_token(engine, woken)
    del woken
    mx.clear_cache()
    return wake, with_first


def synthetic_session(engine: Any, session: Any, ids: list[int], kv_file: str) -> None:
    """Give `session` the KV of `ids` without prefilling: real KV from bench/capture_kv.py, tiled.

    For machines where a prefill of thousands of tokens takes many minutes (the
    default model prefills ~15 tokens/s on a 2-core CPU). The bytes are real
    KV of this model, so compression and every timing but re-prefill are as
    for a prefilled session; re-prefill is then not measured.
    """
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    kv = np.load(kv_file)
    n = len(ids) - 1
    cache = make_prompt_cache(engine.model)
    for i, c in enumerate(cache):
        parts = []
        for part in ("keys", "values"):
            a = kv[f"layers.{i}.{part}"]
            reps = -(-n // a.shape[2])
            parts.append(mx.array(np.concatenate([a] * reps, axis=2)[:, :, :n]).view(mx.bfloat16))
        c.update_and_fetch(*parts)
    mx.eval([c.state for c in cache])
    session.tokens, session.processed, session.cache, session.mode = list(ids), n, cache, "raw"


def reprefill_first_token_s(engine: Any, ids: list[int]) -> float:
    """A cold prefill of ids + first token. The same tokens would hit the prefix cache (the session's
    own blocks are stored now): a different first token changes every chain key, at equal cost."""
    from kvwake.daemon.session_state import Session

    cold = Session(f"cold-{len(ids)}")
    unseen = [(ids[0] + 1) % engine.vocab_size, *ids[1:]]
    t0 = time.perf_counter()
    got = engine.append(cold, tokens=unseen)
    assert got["reused"] == 0, got
    return time.perf_counter() - t0 + first_token(engine, cold)


def resume_one(engine: Any, n: int, work: Path, synthetic: str | None = None) -> dict[str, Any]:
    """One size: prefill, sleep vs save_prompt_cache, wake vs load_prompt_cache, each + first token."""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from kvwake.daemon.kv import cache_blocks as kvstate
    from kvwake.daemon.session_state import Session

    ids = tokens_of(engine, n)
    mx.reset_peak_memory()
    s = Session(f"resume-{n}")
    if synthetic:
        synthetic_session(engine, s, ids, synthetic)
    else:
        engine.append(s, tokens=ids)
    kv_bytes = kvstate.cache_nbytes(s.cache)
    f = work / f"mlx-{n}.safetensors"
    t0 = time.perf_counter()
    save_prompt_cache(str(f), s.cache)
    mlx_save_s = time.perf_counter() - t0
    # Warm-up, untimed: a first token on a cache of this size compiles its kernels (CUDA, Metal).
    warm = Session("warm", tokens=list(ids), processed=n - 1, cache=load_prompt_cache(str(f)))
    first_token(engine, warm)
    del warm
    # Warm-up, untimed: one sleep and wake of this very session compiles the capture and restore
    # kernels for its size; then its snapshot and blocks go, so the timed sleep writes every block.
    engine.sleep(s)
    s, _ = engine.wake(s.id)
    engine.store.delete_session(s.id)
    engine.store.gc()
    with PeakRss() as peak:
        slept = engine.sleep(s)
    engine.ram_tier.__init__(engine.ram_tier.budget)  # measure the disk path, not the RAM tier
    with PeakRss() as wake_peak:
        t0 = time.perf_counter()
        woken, info = engine.wake(s.id)
        wake_s = time.perf_counter() - t0
    wake_ft_s = wake_s + first_token(engine, woken)
    del woken
    t0 = time.perf_counter()
    cache = load_prompt_cache(str(f))
    mx.eval([c.state for c in cache])
    mlx_load_s = time.perf_counter() - t0
    loaded = Session("mlx", tokens=list(ids), processed=n - 1, cache=cache)
    mlx_load_ft_s = mlx_load_s + first_token(engine, loaded)
    del loaded, cache
    decode_1core = decode_GBps(engine, slept["snapshot_id"])
    decode_all = decode_GBps(engine, slept["snapshot_id"], engine.pool.workers)
    if synthetic:  # no prefill to compare with: the tokens never went through the model
        reprefill_ft_s = float("nan")
    else:
        reprefill_ft_s = reprefill_first_token_s(engine, ids)
    raw, cores = slept["raw_bytes"], engine.pool.workers
    raw, cores = slept["raw_bytes"], engine.pool.workers
    return {
        "tokens": n, "kv_bytes": kv_bytes, "kv_bytes_per_token": kv_bytes / n, "codec": engine.store.codec,
        "workers": cores, "restore_mode": __import__("kvwake.daemon.kv.restore_buffers", fromlist=["x"]).restore_mode(),
        "reprefill_first_token_s": reprefill_ft_s, "wake_first_token_s": wake_ft_s,
        "mlx_load_first_token_s": mlx_load_ft_s, "wake_s": wake_s, "mlx_load_s": mlx_load_s,
        "sleep_s": slept["ms"] / 1000, "mlx_save_s": mlx_save_s,
        "stored_bytes": slept["stored_bytes"], "raw_bytes": raw, "mlx_file_bytes": f.stat().st_size,
        "stored_bytes_per_token": slept["stored_bytes"] / n, "mlx_bytes_per_token": f.stat().st_size / n,
        "wake_GBps": raw / wake_s / 1e9, "sleep_GBps": raw / (slept["ms"] / 1000) / 1e9,
        "decode_1core_GBps": decode_1core, "decode_all_cores_GBps": decode_all, "wake_MBps": raw / wake_s / 1e6,
        "sleep_peak_rss_growth_bytes": peak.growth, "wake_peak_rss_growth_bytes": wake_peak.growth,
        # Peak memory of this size (the process's resident peak so far, MLX's own peak since this size began):
        # one process runs every size, and the largest must fit the machine (issue 23).
        "peak_rss_bytes": peak_rss_bytes(), "mlx_peak_bytes": mx.get_peak_memory(),
        "ratios": {
            "reprefill_over_wake": reprefill_ft_s / wake_ft_s,
            "wake_over_mlx_load": wake_ft_s / mlx_load_ft_s,
            "sleep_over_mlx_save": slept["ms"] / 1000 / mlx_save_s,
            "stored_over_mlx_file": slept["stored_bytes"] / f.stat().st_size,
            "sleep_rss_growth_over_kv": peak.growth / kv_bytes,
            "wake_over_cores_x_decode_1core": raw / wake_s / 1e9 / (cores * decode_1core),
        },
    }


def bench_resume(model: str | None, sizes: list[int], codec: str = "planes-zstd",
                 synthetic: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVWAKE_BENCH_DIR")) as tmp:
        engine = open_engine(model, Path(tmp), codec)
        runs = []
        for n in sizes:
            r = resume_one(engine, n, Path(tmp), synthetic)
            runs.append(r)
            print(f"  {n:5d} tokens: re-prefill+1st {r['reprefill_first_token_s']:.2f}s, wake+1st "
                  f"{r['wake_first_token_s'] * 1000:.0f}ms ({r['ratios']['reprefill_over_wake']:.0f}x), mlx load+1st "
                  f"{r['mlx_load_first_token_s'] * 1000:.0f}ms (wake {r['ratios']['wake_over_mlx_load']:.2f}x of it), "
                  f"wake {r['wake_GBps']:.2f} GB/s = {r['ratios']['wake_over_cores_x_decode_1core']:.2f} x "
                  f"{r['workers']} cores x {r['decode_1core_GBps']:.2f} GB/s, sleep {r['sleep_GBps']:.2f} GB/s "
                  f"({r['ratios']['sleep_over_mlx_save']:.2f}x mlx save), "
                  f"stored {r['ratios']['stored_over_mlx_file']:.2f}x mlx file, sleep RSS growth "
                  f"{r['ratios']['sleep_rss_growth_over_kv']:.1%} of KV, wake RSS growth "
                  f"{r['wake_peak_rss_growth_bytes'] / 1e9:.2f} GB, peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB, "
                  f"MLX peak {r['mlx_peak_bytes'] / 1e9:.2f} GB", flush=True)
        result = {"model": engine.model_name, "runs": runs}
        engine.close()
    return result


def bench_storage(model: str | None, sessions: int, system_tokens: int = 1024, own: int = 200) -> dict[str, Any]:
    from mlx_lm.models.cache import save_prompt_cache

    from kvwake.daemon.session_state import Session

    with tempfile.TemporaryDirectory() as tmp:
        engine = open_engine(model, Path(tmp))
        shared = tokens_of(engine, system_tokens + own * sessions)
        prompt = shared[:system_tokens]
        ttft_cold = ttft_hit = None
        mlx_bytes = 0
        for i in range(sessions):
            s = Session(f"agent-{i}")
            mine = prompt + shared[system_tokens + i * own : system_tokens + (i + 1) * own]
            t0 = time.perf_counter()
            got = engine.append(s, tokens=mine)
            ttft = time.perf_counter() - t0 + first_token(engine, s)
            if i == 0:
                ttft_cold = ttft
            elif i == 1:
                ttft_hit, reused = ttft, got["reused"]
            if i < 3 or i == sessions - 1:  # mlx-lm file size depends only on the token count: measured, not assumed
                f = Path(tmp) / "mlx.safetensors"
                save_prompt_cache(str(f), s.cache)
                mlx_one = f.stat().st_size
            mlx_bytes += mlx_one
            engine.sleep(s)
            if i % 10 == 9:
                print(f"  {i + 1} sessions stored", flush=True)
        stored = engine.store.stored_bytes()
        engine.close()
    return {"model": engine.model_name, "sessions": sessions, "system_tokens": system_tokens, "own_tokens": own,
            "kvwake_store_bytes": stored, "mlx_files_bytes": mlx_bytes, "ttft_cold_s": ttft_cold,
            "ttft_prefix_hit_s": ttft_hit, "prefix_hit_reused_tokens": reused,
            "ratios": {"store_over_mlx_files": stored / mlx_bytes, "cold_over_hit_ttft": ttft_cold / ttft_hit}}


def bench_rpc(rounds: int = 10, per_round: int = 500, clients: int = 32, per_client: int = 200) -> dict[str, Any]:
    """hello round trips to a real daemon vs a bare asyncio msgpack echo server (bench/rpc_echo.py),
    in alternating rounds so both see the same machine state; then requests/s with `clients` clients."""
    import subprocess

    from bench.rpc_echo import round_trips

    from testkit.daemon import Daemon
    from testkit.tinymodel import make_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon(Path(tmp), make_model_dir(Path(tmp) / "tiny")).start()
        echo_path = str(Path(tmp) / "echo.sock")
        echo = subprocess.Popen([sys.executable, str(ROOT / "bench" / "rpc_echo.py"), echo_path],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
            kvwake: list[float] = []
            bare: list[float] = []
            for _ in range(rounds):
                kvwake += round_trips(str(d.socket), per_round)
                bare += round_trips(echo_path, per_round)
            rps = _concurrent_rps(d, clients, per_client)
        finally:
            echo.terminate()
            echo.wait()
            d.stop()
    summary = {name: _percentiles(times) for name, times in (("kvwake_hello", kvwake), ("bare_echo", bare))}
    return {**summary, "clients": clients, "requests_per_s": rps,
            "ratios": {"hello_over_echo_p50": summary["kvwake_hello"]["p50_us"] / summary["bare_echo"]["p50_us"],
                       "hello_over_echo_p99": summary["kvwake_hello"]["p99_us"] / summary["bare_echo"]["p99_us"]}}


def _percentiles(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {"p50_us": times[len(times) // 2] * 1e6, "p99_us": times[int(len(times) * 0.99)] * 1e6,
            "mean_us": statistics.mean(times) * 1e6, "n": len(times)}


def _concurrent_rps(d: Any, clients: int, per_client: int) -> float:
    conns = [d.client() for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)

    def run(c: Any) -> None:
        barrier.wait()
        for _ in range(per_client):
            c.call("hello")

    threads = [threading.Thread(target=run, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for c in conns:
        c.close()
    return clients * per_client / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="?", default="all", choices=["resume", "storage", "rpc", "all"])
    parser.add_argument("--model", help="mlx-lm model folder (default: the default model)")
    parser.add_argument("--sizes", default="256,1024,4096")
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--codec", default="planes-zstd", help="block codec of the resume run's store")
    parser.add_argument("--synthetic", metavar="KV.npz", help="resume: tile this real KV (bench/capture_kv.py) "
                        "instead of prefilling; re-prefill is then not measured")
    parser.add_argument("--device", choices=["default", "cpu"], default="default",
                        help="cpu: MLX on the CPU where a GPU is (a many-core host's CPU wake against its cores)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = parser.parse_args(argv)
    if args.device == "cpu":  # before any engine: the restore mode and the kernels follow the default device
        import mlx.core as mx

        mx.set_default_device(mx.cpu)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"machine: {info}")
    jobs = {"resume": lambda: bench_resume(args.model, [int(x) for x in args.sizes.split(",")], args.codec,
                                           args.synthetic),
            "storage": lambda: bench_storage(args.model, args.sessions),
            "rpc": bench_rpc}
    for name in (jobs if args.which == "all" else [args.which]):
        print(f"{name}:", flush=True)
        result = {"machine": info, **jobs[name]()}
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result.get("ratios") or {k: v for k, v in result.items() if k != "machine" and k != "runs"},
                         indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
