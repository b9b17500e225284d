"""Many agents at once: batched decoding against one call at a time, and a long prefill beside decoding.

usage: python bench/batching.py [--model tiny|tiny:ARCH|PATH] [--sessions 1,4,8,16,32] [--tokens 64] [--prefill 8192]
                                [--prefill-hit] [--whole 4:96] [--mlx-server] [--no-batch-generator] [--alternate 3]
                                [--status-every 0.25]
                                [--out bench/out]

decode      for each N in --sessions: N sessions (short prompts, appended first) generate --tokens
            tokens each, all at once, streamed, through a real `kvwake serve` with batching on
            (--max-batch 32) and off (--max-batch 1): aggregate decode tokens/s (every token /
            wall time), steady tokens/s (while all N stream: what BatchGenerator's figure counts;
            `steady_x_batch_generator`), the p50/p99 gap between a session's consecutive tokens, and
            the daemon's own view meanwhile (its status every --status-every s: decode step ms, the
            batch's rows and dead rows) and after (`engine_step_gap_ms`: the engine thread's intervals
            between decode steps' hand-overs, p50/p99: the engine's side of the client's gaps).
prefill     one session decodes (streamed) while another appends --prefill tokens: the decoding
            session's gaps while the prompt prefills against its median gap alone; batching on and off.
            The prompt is all new (--prefill-hit: partly restored from the store, sessions 10-15's row).
whole       (--whole N:T) N sessions generate T tokens each, not streamed, against one session
            alone (batching on), --repeat times: the "N sessions >= 2x one alone" row (median ratio).
batchgen    mlx-lm's own `BatchGenerator` in this process on the same model and prompts (no EOS, steady
            state: tokens/s once every row decodes), the ceiling kvwake's batched decode is held to.
alternate   (--alternate R) the daemon's steady tokens/s and BatchGenerator's for --alternate-sizes,
            round after round, R rounds (BatchGenerator in a fresh process each round, or
            --alternate-in-process): this machine's speed drifts within minutes, for both alike;
            each pair's ratio and the ratio of the medians.
mlx-server  (--mlx-server) `mlx_lm.server` on the same model: N concurrent /v1/completions of
            --tokens tokens with the same prompts; aggregate tokens/s and kvwake's ratio to it.

Gaps are measured where a client sees them: the arrival of streamed pieces. A piece is tied to
the token that completed it by replaying the tokenizer's streaming detokenizer over the call's
tokens; only pieces one token apart give a gap sample. `--model tiny` is the tests' tiny llama,
`tiny:gemma3_text` (sliding windows), `tiny:lfm2` or `tiny:qwen3_next` (recurrent state) another family's.
Results: <out>/batching.json (docs/benchmarks.md summarises them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

from bench.lib import bench_model, engine_work, free_port, gap_stats, machine, pct, prompts, save, start_daemon, Stream  # noqa: E402
from testkit.daemon import Daemon, RawClient  # noqa: E402


WATCH_S = 0.25  # seconds between status samples while the decode rows run (--status-every)


class GpuBusy:
    """The GPU's utilization while a block runs (nvidia-smi, every 100 ms): the share of time a kernel ran.
    Session 21 read 40-65% for kvwake and for BatchGenerator alike at 8 and 16 rows of the 8B shape on the
    H100, its clocks steady: both host-bound, so their tokens/s follow the host's speed. `pct`: the median
    sample; None without nvidia-smi (here). The block starts after nvidia-smi's first sample: its start
    (the driver's NVML set up) is not inside the measured round, where it came at the calls' first tokens."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.proc: subprocess.Popen | None = None
        self._timed: list[tuple[float, float]] = []
        self._first = threading.Event()
        self._reader: threading.Thread | None = None
        self._since = 0.0

    def __enter__(self) -> "GpuBusy":
        exe = shutil.which("nvidia-smi")
        if exe:
            self.proc = subprocess.Popen([exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
            self._first.wait(5)
        self._since = time.perf_counter()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip().replace(".", "", 1).isdigit():
                self._timed.append((time.perf_counter(), float(line)))
                self._first.set()

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            if self._reader is not None:
                self._reader.join(5)
            self.samples = [v for t, v in self._timed if t >= self._since]

    @property
    def pct(self) -> float | None:
        return round(statistics.median(self.samples), 1) if self.samples else None


def steady_tokens_per_s(streams: list[Stream], tokenizer: Any) -> float | None:
    """Tokens/s while every stream was running (from the last one's first piece to the first one's last):
    what `BatchGenerator`'s figure counts (its steps once all N rows decode)."""
    seen = [s.arrivals(tokenizer) for s in streams]
    if not all(seen):
        return None
    start, end = max(a[0][1] for a in seen), min(a[-1][1] for a in seen)
    if end <= start:
        return None
    done = lambda a, t: max((k for k, when in a if when <= t), default=0)  # noqa: E731
    return round(sum(done(a, end) - done(a, start) for a in seen) / (end - start), 1)


def decode_round(d: Daemon, n: int, tokens: int, tokenizer: Any, tag: str) -> dict[str, Any]:
    names = [f"{tag}-{n}-{i}" for i in range(n)]
    with d.client() as c:
        for name, text in zip(names, prompts(n)):
            c.call("session.create", session_id=name)
            c.call("session.append", session_id=name, text=text)
    clients = [RawClient(d.socket, timeout=600) for _ in names]
    streams = [Stream(cl, name, tokens) for cl, name in zip(clients, names)]
    barrier = threading.Barrier(n)
    threads = [threading.Thread(target=lambda s=s: (barrier.wait(), s.run())) for s in streams]
    inside: list[dict[str, Any]] = []  # the daemon's own view while all N decode (its status, 4 times a second)
    watch = threading.Thread(target=watch_decoder, args=(d, n, threads, inside, WATCH_S))
    began_wall = time.time()
    with GpuBusy() as busy:
        for t in threads:
            t.start()
        watch.start()
        for t in threads:
            t.join()
        watch.join()
    for cl in clients:
        cl.close()
    with d.client() as c:  # the engine's side of the gaps: its latest steps' hand-over intervals (this round's)
        status = c.call("status")
        engine_gaps = status["engine_thread"].get("step_gaps")
    slow = engine_work(status, began_wall, time.time())
    # the daemon's side of the first tokens: its claim of each session, and from the call's start (prompt in the
    # cache, the call made) to its first token
    turns = [t for t in status.get("turns", []) if t["session"] in set(names)]
    daemon_turns = {"claim_ms_max": pct([t["claim_ms"] for t in turns], 1.0),
                    "first_token_ms_p50": pct([t["first_token_ms"] for t in turns], 0.5),
                    "first_token_ms_max": pct([t["first_token_ms"] for t in turns], 1.0)}
    total = sum(len(s.result.get("tokens", [])) for s in streams)
    wall = max(s.ended for s in streams) - min(s.started for s in streams)
    gaps = [g for s in streams for g in s.gaps(tokenizer)]
    # the admission's share of the wall time: each call's first piece after its send, and the last first piece
    # after the first send (all N decoding from then on: what the steady rate counts)
    firsts = [(s.pieces[0][0] - s.started) * 1000 for s in streams if s.pieces]
    all_in = (max(s.pieces[0][0] for s in streams if s.pieces) - min(s.started for s in streams)) * 1000 \
        if firsts else None
    return {"sessions": n, "tokens": total, "wall_s": round(wall, 3), "tokens_per_s": round(total / wall, 1),
            "first_token_ms": {"p50": pct(firsts, 0.5), "max": pct(firsts, 1.0),
                               "all_decoding_after": round(all_in, 1) if all_in is not None else None},
            "daemon_turns": daemon_turns,
            "steady_tokens_per_s": steady_tokens_per_s(streams, tokenizer), "gap_p50_ms": pct(gaps, 0.5),
            "gap_p99_ms": pct(gaps, 0.99), "gap_samples": len(gaps), "engine_step_gap_ms": engine_gaps,
            "status_every_s": WATCH_S, "gpu_busy_pct": busy.pct,
            "daemon_step_ms_p50": pct([g["step_ms"] for g in inside], 0.5), **engine_split(inside),
            "daemon_batch_rows": sorted({g["batch_rows"] for g in inside}),
            "daemon_dead_rows": sorted({g["dead_rows"] for g in inside}), **gil_during(status, streams),
            # the engine's jobs and steps over its SLOW_S during the round (all of them with KVWAKE_SLOW_JOB_MS=0)
            "slow_engine_work": slow}


def gil_during(status: dict[str, Any], streams: list[Stream]) -> dict[str, Any]:
    """With KVWAKE_GIL_WATCH_MS in the daemon's environment: how late its watching thread got the GIL (its
    latest wakes) and its waits of that long or more while the round's calls ran (daemon/gilwatch.py)."""
    gil = status.get("gil")
    if not gil:
        return {}
    wall = time.time() - time.perf_counter()  # the streams' perf_counter times as Unix time
    first, last = wall + min(s.started for s in streams), wall + max(s.ended for s in streams)
    waits = [w["late_ms"] for w in gil["waits"] if first <= w["at"] <= last]
    return {"gil_late_ms": gil["late"], "gil_waits_over_ms": gil["over_ms"], "gil_waits_count": len(waits),
            "gil_wait_max_ms": max(waits, default=None),
            # the daemon kept its latest `kept` waits only: the count is a floor when they were all kept
            "gil_waits_capped": len(gil["waits"]) >= gil["kept"]}


def watch_decoder(d: Daemon, n: int, threads: list[threading.Thread], inside: list[dict[str, Any]],
                  every_s: float) -> None:
    """Sample the decoder's status (its step time, a moving average; its batch's rows, dead ones included)
    while all n calls run, every `every_s` (--status-every: a status call is work on the daemon's loop)."""
    with d.client() as c:
        while any(t.is_alive() for t in threads):
            status = c.call("status")
            g = status["generation"]
            if g["running"] == n:
                inside.append({"at": time.perf_counter(),
                               **{k: g[k] for k in ("step_ms", "batch_rows", "dead_rows", "batch_next_s",
                                                   "batch_outputs_s", "decode_steps") if k in g},
                               **({"admit_s": g["admit_s"]} if "admit_s" in g else {}),
                               **{k: v for k, v in status["engine_thread"].items() if k != "slow"}})
            time.sleep(every_s)


def engine_split(inside: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the engine thread's time went while all N decoded (first to last status sample), per step, ms:
    mlx-lm's step (the pass queued, the one before waited for), host work on the tokens, jobs between
    steps, handing output to the event loop, and the wall clock (what the rest is: the thread's loop,
    waiting for the GIL outside a step)."""
    if len(inside) < 2:
        return {}
    a, b = inside[0], inside[-1]
    steps = b["decode_steps"] - a["decode_steps"]
    if steps <= 0:
        return {}
    per = lambda k: round((b[k] - a[k]) / steps * 1000, 3)  # noqa: E731
    return {"split_ms_per_step": {"batch_next": per("batch_next_s"), "batch_outputs": per("batch_outputs_s"),
                                  "admit": per("admit_s") if "admit_s" in b else None,
                                  "step_total": per("step_s"), "jobs": per("job_s"), "flush": per("flush_s"),
                                  "wall": per("at")},
            "split_steps": steps}


def prefill_round(d: Daemon, prefill_tokens: int, tokenizer: Any, tag: str, hit: bool = False) -> dict[str, Any]:
    """The talker decodes; once it has 64 tokens, the reader appends a long prompt. The talker's
    max_tokens is sized from a warm-up (a prompt as long alone, 64 tokens alone) to outlast it.

    `hit`: the warm-up's prompt is the reader's, so the reader's append finds the blocks the warm-up
    persisted in the store and restores them, prefilling the rest (the row of sessions 10-15: ~5k of 8k
    tokens restored). Otherwise the warm-up's prompt differs from its first token and the reader
    prefills all of its own (the issue's "another session's 8k prefill")."""
    unit = "The archive holds notes, plans and tool output from many earlier runs. "
    text = unit * max(1, prefill_tokens // max(1, len(tokenizer.encode(unit))))
    talker, reader, warm = f"{tag}-talker", f"{tag}-reader", f"{tag}-warm"
    with d.client() as c:
        for name in (talker, reader, warm):
            c.call("session.create", session_id=name)
        c.call("session.append", session_id=talker, text="Tell the long story of the migration.")
        t0 = time.perf_counter()
        c.call("session.append", session_id=warm, text=text if hit else "Warm-up. " + text)
        prefill_alone = time.perf_counter() - t0
        c.call("session.delete", session_id=warm)  # hot, it would serve the reader's prompt (a prefix copy)
        t0 = time.perf_counter()
        c.call("session.generate", session_id=talker, max_tokens=64)
        step = (time.perf_counter() - t0) / 64
    stream = Stream(RawClient(d.socket, timeout=600), talker, 64 + int((3 * prefill_alone + 1.0) / step))
    thread = threading.Thread(target=stream.run)
    thread.start()
    while len(stream.pieces) < 64 and thread.is_alive():
        time.sleep(0.005)
    alone_until = time.perf_counter()
    with d.client() as c:
        before = c.call("status")
        gc_before = before["gc"]["generations"]
        began, began_wall = time.perf_counter(), time.time()
        info = c.call("session.append", session_id=reader, text=text)
        ended, ended_wall = time.perf_counter(), time.time()
        after = c.call("status")
        gc_after = after["gc"]
    thread.join()
    stream.client.close()
    return {"prefill_tokens": info["prefilled"], "restored_tokens": info["reused"],
            "prefill_s": round(ended - began, 3),
            "prefill_alone_s": round(prefill_alone, 3), "talker_outlasted_prefill": stream.ended > ended,
            # the daemon's garbage collections during the prefill (and after it, to the status call), per generation,
            # and the longest of the latest ones
            "gc_during": [{"collections": b["collections"] - a["collections"], "max_ms": b["max_ms"]}
                          for a, b in zip(gc_before, gc_after["generations"])], "gc_frozen": gc_after["frozen"],
            # MLX's cache of freed buffers (its limit: mlx_cache_bytes) before and after the prefill
            "mlx_cache_bytes": [before["memory"]["mlx_cache_bytes"], after["memory"]["mlx_cache_bytes"]],
            **gap_stats(stream, tokenizer, alone_until, (began, ended)),
            # the talker's tokens as they arrived during the prefill, ms from its start (beside the engine's work)
            "arrivals_during_ms": [[k, round((when - began) * 1000, 1)] for k, when in stream.arrivals(tokenizer)
                                   if began <= when <= ended],
            # the engine thread's jobs and steps over its SLOW_S during the prefill: what the talker waited for
            "slow_engine_work": engine_work(after, began_wall, ended_wall),
            # with KVWAKE_GIL_WATCH_MS in the daemon's environment: its waits for the GIL during the prefill
            # (at_s: the wait's start), each with the threads' stacks as it ended (daemon/gilwatch.py)
            "gil_waits": [{"late_ms": w["late_ms"], "at_s": round(w["at"] - w["late_ms"] / 1000 - began_wall, 3),
                           "threads": w["threads"]} for w in (after.get("gil") or {}).get("waits", [])
                          if began_wall <= w["at"] <= ended_wall]}
# KVWAKE_SLOW_JOB_MS=0 KVWAKE_SLOW_JOBS_KEPT=20000 in the daemon's environment makes slow_engine_work every job
# and step of the engine thread during the prefill: its timeline, to lay beside arrivals_during_ms.


def run_threads(threads: list[threading.Thread]) -> float:
    """Start the threads together, wait for all: the wall seconds."""
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def whole_round(d: Daemon, n: int, tokens: int, tag: str) -> dict[str, Any]:
    """N sessions generate `tokens` tokens each, not streamed, all at once: aggregate tokens/s."""
    names = [f"{tag}-{n}-{i}" for i in range(n)]
    with d.client() as c:
        for name, text in zip(names, prompts(n)):
            c.call("session.create", session_id=name)
            c.call("session.append", session_id=name, text=text)
    counts: list[int] = []
    clients = [RawClient(d.socket, timeout=600) for _ in names]
    barrier = threading.Barrier(n)

    def one(client: RawClient, name: str) -> None:
        barrier.wait()
        counts.append(len(client.call("session.generate", session_id=name, max_tokens=tokens)["tokens"]))

    wall = run_threads([threading.Thread(target=one, args=(cl, name)) for cl, name in zip(clients, names)])
    for cl in clients:
        cl.close()
    return {"sessions": n, "tokens": sum(counts), "wall_s": round(wall, 3), "tokens_per_s": round(sum(counts) / wall, 1)}


def batch_generator_steps(loaded: Any, tokenizer: Any, n: int, tokens: int, skip: int = 0) -> list[float]:
    """Seconds per steady step of mlx-lm's BatchGenerator (one that returns all n rows; no stop tokens),
    the first `skip` of them left out."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(loaded, max_tokens=tokens, stop_tokens=[], completion_batch_size=max(32, n),
                         prefill_batch_size=max(8, n))
    gen.insert([tokenizer.encode(p) for p in prompts(n)])
    times, total, last = [], 0, None
    while total < n * tokens:
        out = gen.next_generated()
        now = time.perf_counter()
        total += len(out)
        if len(out) == n and last is not None:
            times.append(now - last)
        last = now if len(out) == n else None
    gen.close()
    return times[skip:]


def batch_generator_round(model: Path, sizes: list[int], tokens: int) -> list[dict[str, Any]]:
    """mlx-lm's BatchGenerator in this process: N prompts, `tokens` each, no stop tokens; tokens/s over the
    steps once all N rows decode (steady state)."""
    import mlx_lm

    loaded, tokenizer = mlx_lm.load(str(model))
    batch_generator_steps(loaded, tokenizer, max(sizes), tokens)  # warms every shape up
    rows = []
    for n in sizes:
        with GpuBusy() as busy:
            steps = batch_generator_steps(loaded, tokenizer, n, tokens)
        rows.append({"sessions": n, "tokens": n * tokens, "gpu_busy_pct": busy.pct,
                     "tokens_per_s": round(n * len(steps) / sum(steps), 1) if steps else None})
    return rows


def alternating_rounds(d: Daemon, model: Path, sizes: list[int], tokens: int, rounds: int,
                       tokenizer: Any, in_process: bool = False) -> list[dict[str, Any]]:
    """The daemon's steady tokens/s and `BatchGenerator`'s (the daemon idle meanwhile), round after round,
    each size one after the other: this machine's speed drifts by a third within minutes, for both alike
    (docs/history/benchmarks-journal.md, "Session 11"), so a ratio of runs taken minutes apart says more about
    the drift than about either. `BatchGenerator` runs in a fresh process each round (loads the model,
    warms every shape, runs, exits: no second CUDA context lingers on the GPU beside the daemon's rounds,
    which session 11's in-process rounds left and may have paid for), or with `in_process` in this one.
    Per size: each pair's ratio, and the ratio of the medians."""
    loaded = None
    if in_process:
        import mlx_lm

        loaded = mlx_lm.load(str(model))
        batch_generator_steps(*loaded, max(sizes), tokens)  # warms every shape up
    pairs: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
    busy: dict[int, list[tuple[float | None, float | None]]] = {n: [] for n in sizes}  # GPU busy %: ours, theirs
    for r in range(rounds):
        print(f"at {time.time():.2f}: round {r}, kvwake begins", flush=True)  # windows to lay beside GPU clocks
        our_rows = {n: decode_round(d, n, tokens, tokenizer, f"alt{r}") for n in sizes}
        ours = {n: row["steady_tokens_per_s"] for n, row in our_rows.items()}
        their_busy: dict[int, float | None] = {}
        print(f"at {time.time():.2f}: round {r}, BatchGenerator begins", flush=True)
        if loaded is not None:
            theirs = {}
            for n in sizes:
                with GpuBusy() as gpu:
                    steps = batch_generator_steps(*loaded, n, tokens)
                theirs[n], their_busy[n] = (n * len(steps) / sum(steps) if steps else None), gpu.pct
        else:
            elsewhere = batch_generator_elsewhere(model, sizes, tokens)
            theirs = {row["sessions"]: row["tokens_per_s"] for row in elsewhere}
            their_busy = {row["sessions"]: row.get("gpu_busy_pct") for row in elsewhere}
        for n in sizes:
            if ours[n] and theirs[n]:
                pairs[n].append((ours[n], theirs[n]))
                busy[n].append((our_rows[n]["gpu_busy_pct"], their_busy.get(n)))
            print(f"round {r}, {n} sessions: kvwake {ours[n]} tok/s, BatchGenerator "
                  f"{theirs[n] and round(theirs[n], 1)}", flush=True)
    rows = []
    for n, got in pairs.items():
        ours_med = statistics.median(o for o, _ in got) if got else None
        theirs_med = statistics.median(t for _, t in got) if got else None
        rows.append({"sessions": n, "rounds": len(got), "batch_generator_in_process": in_process,
                     "kvwake_steady_tokens_per_s": [round(o, 1) for o, _ in got],
                     "batch_generator_tokens_per_s": [round(t, 1) for _, t in got],
                     "each_ratio": [round(o / t, 2) for o, t in got],
                     "kvwake_gpu_busy_pct": [o for o, _ in busy[n]],
                     "batch_generator_gpu_busy_pct": [t for _, t in busy[n]],
                     "ratio_of_medians": round(ours_med / theirs_med, 3) if got else None})
    return rows


def batch_generator_elsewhere(model: Path, sizes: list[int], tokens: int) -> list[dict[str, Any]]:
    """`batch_generator_round` in a fresh process (this file run with --batch-generator-only)."""
    out = subprocess.run([sys.executable, __file__, "--batch-generator-only", "--model", str(model),
                          "--sessions", ",".join(map(str, sizes)), "--tokens", str(tokens)],
                         capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def mlx_server_round(model: Path, sizes: list[int], tokens: int) -> list[dict[str, Any]]:
    """mlx_lm.server on the same model: N concurrent non-streamed completions per N, the second of two rounds."""
    port = free_port()
    log = open(Path(tempfile.mkdtemp()) / "mlx-server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port),
                             "--decode-concurrency", "32", "--max-tokens", str(tokens)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}/v1/completions"

    def complete(text: str, out: list) -> None:
        body = json.dumps({"prompt": text, "max_tokens": tokens, "temperature": 0.0}).encode()
        req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as r:
            out.append(json.loads(r.read())["usage"]["completion_tokens"])

    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                complete("warm up", [])
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mlx_lm.server did not start: {log.name}") from None
                time.sleep(1)
        rows = []
        for n in sizes:  # twice: the first round of a size builds its shapes' kernels (CUDA), the second is timed
            runs = []
            for _ in range(2):
                counts: list[int] = []
                wall = run_threads([threading.Thread(target=complete, args=(p, counts)) for p in prompts(n)])
                runs.append((sum(counts), wall))
            (_, cold), (done, wall) = runs
            rows.append({"sessions": n, "tokens": done, "wall_s": round(wall, 3), "first_round_wall_s": round(cold, 3),
                         "tokens_per_s": round(done / wall, 1)})
        return rows
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sessions", default="1,4,8,16,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=8192, help="the prefill row's prompt, tokens (0: no prefill row)")
    ap.add_argument("--prefill-step", type=int, default=512)
    ap.add_argument("--prefill-hit", action="store_true",
                    help="the prefill row's prompt is partly in the store (sessions 10-15's row); default: all new")
    ap.add_argument("--mlx-server", action="store_true")
    ap.add_argument("--whole", default="4:96", help="N:T for the non-streamed row (empty: skip)")
    ap.add_argument("--no-batch-generator", action="store_true")
    ap.add_argument("--no-persist", action="store_true", help="the daemons run with persist = false")
    ap.add_argument("--daemon-config", default="", help="more lines of the daemons' TOML config (\\n between)")
    ap.add_argument("--modes", default="batched,solo", help="daemon modes to run: batched (max_batch 32), solo (1)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of the --whole row (alone, then together; median ratio)")
    ap.add_argument("--alternate", type=int, default=0,
                    help="rounds of the daemon and BatchGenerator alternating, per size (0: skip)")
    ap.add_argument("--alternate-sizes", default="8,16", help="sessions for --alternate")
    ap.add_argument("--alternate-in-process", action="store_true",
                    help="--alternate's BatchGenerator in this process, loaded once (default: a fresh one each round)")
    ap.add_argument("--batch-generator-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--status-every", type=float, default=0.25,
                    help="seconds between the decode rows' status samples (a status call is work on the daemon's loop)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    a = ap.parse_args()
    global WATCH_S
    WATCH_S = a.status_every
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    if a.batch_generator_only:  # a round of --alternate: one JSON line
        print(json.dumps(batch_generator_round(Path(a.model), [int(x) for x in a.sessions.split(",")], a.tokens)))
        return
    work = Path(tempfile.mkdtemp(prefix="kvwake-batching-"))
    model = bench_model(a.model, work)
    tokenizer = load_tokenizer(model)
    sizes = [int(x) for x in a.sessions.split(",")]
    report: dict[str, Any] = {"machine": machine(), "model": str(model), "tokens_per_call": a.tokens,
                              "persist": not a.no_persist,
                              "prefill_step": a.prefill_step, "decode": {}, "prefill": {}}
    for mode, max_batch in [(m, b) for m, b in (("batched", 32), ("solo", 1)) if m in a.modes.split(",")]:
        d = start_daemon(work / mode, model, max_batch, a.prefill_step, persist=not a.no_persist,
                         config=a.daemon_config.replace("\\n", "\n"))
        try:
            decode_round(d, max(sizes), 8, tokenizer, f"warm-{mode}")  # kernels for every batch shape seen
            report["decode"][mode] = [decode_round(d, n, a.tokens, tokenizer, mode) for n in sizes]
            if mode == "batched" and a.alternate:
                report["alternating"] = alternating_rounds(
                    d, model, [int(x) for x in a.alternate_sizes.split(",")], a.tokens, a.alternate, tokenizer,
                    in_process=a.alternate_in_process)
            if a.prefill:  # --prefill 0: no prefill row
                report["prefill"][mode] = prefill_round(d, a.prefill, tokenizer, mode, hit=a.prefill_hit)
            if mode == "batched" and a.whole:
                n, t = (int(x) for x in a.whole.split(":"))
                runs = [(whole_round(d, 1, t, f"whole{r}"), whole_round(d, n, t, f"whole{r}")) for r in range(a.repeat)]
                ratios = sorted(together["tokens_per_s"] / alone["tokens_per_s"] for alone, together in runs)
                report["whole"] = {"runs": [{"alone": x, "together": y} for x, y in runs],
                                   "x_one_session_alone_median": round(ratios[len(ratios) // 2], 2),
                                   "x_one_session_alone_each": [round(r, 2) for r in ratios]}
        finally:
            d.stop()
        print(mode, json.dumps(report["decode"][mode]), json.dumps(report["prefill"].get(mode)), flush=True)
    solo_one = report["decode"]["solo"][0]["tokens_per_s"] if sizes[0] == 1 and "solo" in report["decode"] else None
    for row in report["decode"]["batched"]:
        row["x_one_session_alone"] = round(row["tokens_per_s"] / solo_one, 2) if solo_one else None
    if not a.no_batch_generator:
        report["batch_generator"] = batch_generator_round(model, sizes, a.tokens)
        for ours, theirs in zip(report["decode"]["batched"], report["batch_generator"]):
            ours["x_batch_generator"] = round(ours["tokens_per_s"] / theirs["tokens_per_s"], 2) \
                if theirs["tokens_per_s"] else None
            ours["steady_x_batch_generator"] = round(ours["steady_tokens_per_s"] / theirs["tokens_per_s"], 2) \
                if theirs["tokens_per_s"] and ours["steady_tokens_per_s"] else None
    if a.mlx_server:
        report["mlx_server"] = mlx_server_round(model, sizes, a.tokens)
        for ours, theirs in zip(report["decode"]["batched"], report["mlx_server"]):
            ours["x_mlx_server"] = round(ours["tokens_per_s"] / theirs["tokens_per_s"], 2)
    save(report, a.out, "batching.json")


if __name__ == "__main__":
    main()
