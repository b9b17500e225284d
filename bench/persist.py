"""Continuous persistence: what it saves a sleep, and what it costs a neighbour's decoding.

usage: python bench/persist.py [--model default|tiny|PATH] [--tokens 4096] [--talk 64] [--prefill-step 512]
                               [--out bench/out]

Two real `kvwake serve` daemons on the same model, in one run: persistence on, then off.
sleep       one session appends --tokens tokens (natural text) and sits idle until persistence has
            written every full block (on); then it sleeps. Reported: the append's time, how long
            after it the last checkpoint committed (the lag), the sleep's time as the client sees
            it and as the daemon counts it, and the blocks and bytes the sleep wrote. The ratio of
            the two sleeps is the saving (the issue's target: <= 0.3 s for 32k tokens on the H100).
neighbour   one session decodes (streamed) while another appends --tokens tokens (persisting as it
            prefills, when on), then while that one sleeps: the decoding session's p50/p99 gap
            between tokens during each, against its median gap alone (target: p99 <= 2x median).
--append-ab only: append --tokens random tokens three times to each of two daemons up at once,
            on and off alternated: what persistence costs a prefill.

Gaps are measured where a client sees them (bench/batching.py's Stream). `--model default` is
SmolLM2-135M (the default model, a real tokenizer), `tiny` the tests' tiny llama.
Results: <out>/persist.json (docs/benchmarks.md summarises them).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

from bench.lib import bench_model, gap_stats, machine, save, Stream  # noqa: E402
from testkit.daemon import Daemon, RawClient  # noqa: E402

BLOCK = 128


def start(root: Path, model: Path, persist: bool, prefill_step: int) -> Daemon:
    root.mkdir(parents=True, exist_ok=True)
    # A budget and idle time no run reaches: no session is put to sleep in the middle of a measurement.
    (root / "none.toml").write_text(f"prefill_step = {prefill_step}\nhot_budget_bytes = {1 << 40}\n"
                                    f"idle_timeout_s = 100000.0\npersist = {'true' if persist else 'false'}\n")
    return Daemon(root, model, block_tokens=BLOCK).start(timeout=900)


def client(d: Daemon) -> RawClient:
    return RawClient(d.socket, timeout=1800)  # a long prefill on a small machine takes minutes


def text_of(tokenizer: Any, n: int) -> str:
    unit = "The archive holds notes, plans and tool output from many earlier runs. "
    return unit * max(1, n // max(1, len(tokenizer.encode(unit))))


def wait_persisted(c: RawClient, sid: str, tokens: int, timeout: float = 600.0) -> float:
    """Seconds until the session's head holds `tokens` (a multiple of the block) and nothing is queued."""
    t0 = time.perf_counter()
    while True:
        p = c.call("status")["persistence"]
        if c.call("session.info", session_id=sid)["persisted_tokens"] >= tokens and not p["queued"] and not p["running"]:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"{sid}: not persisted after {timeout} s: {p}")
        time.sleep(0.005)


def sleep_round(d: Daemon, text: str, persist: bool, tag: str) -> dict[str, Any]:
    sid = f"{tag}-long"
    with client(d) as c:
        c.call("session.create", session_id=sid)
        t0 = time.perf_counter()
        appended = c.call("session.append", session_id=sid, text=text)
        append_s = time.perf_counter() - t0
        full = appended["tokens"] - 1  # the last token stays pending
        lag = wait_persisted(c, sid, full // BLOCK * BLOCK) if persist else None
        t0 = time.perf_counter()
        slept = c.call("session.sleep", session_id=sid)
        sleep_s = time.perf_counter() - t0
    return {"tokens": appended["tokens"], "append_s": round(append_s, 3),
            "persist_lag_s": round(lag, 3) if lag is not None else None,
            "sleep_s": round(sleep_s, 4), "sleep_ms_daemon": slept["ms"], "sleep_phases_ms": slept.get("phases_ms"),
            "new_blocks": slept["new_blocks"],
            "reused_blocks": slept["reused_blocks"], "written_bytes": slept["written_bytes"],
            "raw_bytes": slept["raw_bytes"]}


def gaps_beside(d: Daemon, tokenizer: Any, step_s: float, work: Any, expect_s: float, tag: str) -> dict[str, Any]:
    """The talker decodes; once it has 64 tokens `work(client)` runs; its gaps during the work against alone.
    Its max_tokens outlasts the work (`expect_s`, from an earlier run of the same work) by half; a call
    must end by itself for its gaps to be tied to its tokens."""
    talker = f"{tag}-talker"
    with client(d) as c:
        c.call("session.create", session_id=talker)
        c.call("session.append", session_id=talker, text="Tell the long story of the migration.")
    stream = Stream(client(d), talker, 64 + int((1.5 * expect_s + 1.0) / step_s))
    thread = threading.Thread(target=stream.run)
    thread.start()
    while len(stream.pieces) < 64 and thread.is_alive():
        time.sleep(0.005)
    alone_until = time.perf_counter()
    with client(d) as c:
        began = time.perf_counter()
        info = work(c)
        ended = time.perf_counter()
    thread.join()
    outlasted = stream.ended > ended
    stream.client.close()
    return {"work_s": round(ended - began, 3), "talker_outlasted_work": outlasted, "work": info,
            **gap_stats(stream, tokenizer, alone_until, (began, ended))}


def neighbour_rounds(d: Daemon, tokenizer: Any, text: str, persist: bool, alone: dict[str, Any],
                     tag: str) -> dict[str, Any]:
    """`alone`: the sleep round's figures (how long the same prefill and sleep took without a neighbour)."""
    with client(d) as c:  # the decode step's time, so the talker outlasts the work
        c.call("session.create", session_id=f"{tag}-probe")
        c.call("session.append", session_id=f"{tag}-probe", text="Count to a hundred.")
        t0 = time.perf_counter()
        c.call("session.generate", session_id=f"{tag}-probe", max_tokens=64)
        step_s = (time.perf_counter() - t0) / 64
        c.call("session.delete", session_id=f"{tag}-probe")
    reader = f"{tag}-reader"
    text = "A second archive, another agent's. " + text  # no prefix of it is stored: all of it is prefilled

    def prefill(c: RawClient) -> dict[str, Any]:
        c.call("session.create", session_id=reader)
        appended = c.call("session.append", session_id=reader, text=text)
        lag = wait_persisted(c, reader, (appended["tokens"] - 1) // BLOCK * BLOCK) if persist else None
        return {"prefilled": appended["prefilled"], "persist_lag_s": round(lag, 3) if lag is not None else None}

    def sleep(c: RawClient) -> dict[str, Any]:
        slept = c.call("session.sleep", session_id=reader)
        return {"new_blocks": slept["new_blocks"], "ms": slept["ms"]}

    return {"prefill": gaps_beside(d, tokenizer, step_s, prefill, alone["append_s"] + (alone["persist_lag_s"] or 0),
                                   f"{tag}-p"),
            "sleep": gaps_beside(d, tokenizer, step_s, sleep, alone["sleep_s"], f"{tag}-s")}


def append_ab(work: Path, model: Path, tokens: int, prefill_step: int, reps: int = 3) -> dict[str, list[float]]:
    """Append time with persistence on and off, alternated between two daemons up at once (on, off;
    off, on; ...): a cost of persistence to a prefill, free of the drift of a shared machine."""
    import random

    daemons = {tag: start(work / f"ab-{tag}", model, tag == "on", prefill_step) for tag in ("on", "off")}
    rng, times = random.Random(0), {"on": [], "off": []}
    try:
        for rep in range(reps):
            for tag in ("on", "off") if rep % 2 == 0 else ("off", "on"):
                with client(daemons[tag]) as c:
                    c.call("session.create", session_id=f"ab{rep}")
                    prompt = [rng.randrange(3, 250) for _ in range(tokens)]
                    t0 = time.perf_counter()
                    c.call("session.append", session_id=f"ab{rep}", tokens=prompt)
                    times[tag].append(round(time.perf_counter() - t0, 3))
    finally:
        for d in daemons.values():
            d.stop()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--prefill-step", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    ap.add_argument("--append-ab", action="store_true", help="only the alternated append timing (append_ab)")
    a = ap.parse_args()
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="kvwake-persist-"))
    model = bench_model(a.model, work)
    tokenizer = load_tokenizer(model)
    if a.append_ab:
        save({"machine": machine(), "model": str(model), "tokens": a.tokens,
              "append_s": append_ab(work, model, a.tokens, a.prefill_step)}, a.out, "persist-append-ab.json")
        return
    text = text_of(tokenizer, a.tokens)
    report: dict[str, Any] = {"machine": machine(), "model": str(model), "tokens": a.tokens,
                              "prefill_step": a.prefill_step}
    for persist in (True, False):
        tag = "on" if persist else "off"
        d = start(work / tag, model, persist, a.prefill_step)
        try:
            warm = "Warming up. " + text_of(tokenizer, 600)  # no prefix of the measured text: nothing shared
            sleep_round(d, warm, persist, f"warm-{tag}")  # kernels and code paths warmed
            alone = sleep_round(d, text, persist, tag)
            report[tag] = {"sleep": alone, "neighbour": neighbour_rounds(d, tokenizer, text, persist, alone, tag)}
            with client(d) as c:
                report[tag]["persistence"] = c.call("status")["persistence"]
        finally:
            d.stop()
        print(tag, json.dumps(report[tag]), flush=True)
        save(report, a.out, "persist.json")  # what a run cut short has measured so far
    on, off = report["on"]["sleep"], report["off"]["sleep"]
    report["sleep_on_over_off"] = round(on["sleep_s"] / off["sleep_s"], 3)
    save(report, a.out, "persist.json")


if __name__ == "__main__":
    main()
