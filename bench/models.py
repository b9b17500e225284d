"""Two models in one daemon: the main model's decoding while the small one loads, the first turn of a
conversation whose model was unloaded, and MLX's peak memory against the models' memory budget (issue 53).

usage: python bench/models.py --main PATH --small PATH [--sessions 4] [--decode-tokens 600]
                              [--alone-tokens 150] [--context 10000] [--budget BYTES] [--gil-watch-ms MS]
                              [--small-tokenizer DIR] [--out bench/out]

--small-tokenizer: the small model loaded with DIR's tokenizer files (a real vocabulary: the shapes' own
tokenizer has 512 tokens, and reading a real one, or building llguidance's view of it, holds the GIL for
hundreds of ms: docs/benchmarks.md, "Several models", S45): a folder made of small's weights (linked) and DIR's
tokenizer files, named as small. Its replies are never decoded here (the load alone is measured with it).

One real `kvwake serve` serving both model folders by their folder names (main the default, loaded at
start; small loaded on demand), in one run:
            (First, where tuning digests_ahead is on, the daemon's hashing of small's files at its start waited for:
            `digests_ahead_ms`.)
load        --sessions sessions of main decode at once, streamed (greedy, EOS banned), --decode-tokens
            each; once the first stream has --alone-tokens pieces, `model.load` loads small. Reported:
            main's gaps between tokens (as its clients receive them, bench/lib.py Stream) before the load
            (p50, p99), while it loads (p50, p99, max) and after it (p50, p99: small's warm-up jobs run
            then), the load's time, the longest gaps during it each with the small model's weight pieces
            read meanwhile (`model.load`'s `weight_pieces`), the p99 during the load over the median alone (the issue's
            target: <= 2x), main's engine-thread jobs and steps over the slow mark during the load, and with
            --gil-watch-ms the daemon's waits for the GIL during the load (status.gil: what held it).
reload      once `load`'s streams end, small is unloaded, its modules built again while nothing decodes (tuning
            modules_ahead, on CUDA: `built_ahead_ms`, waited for), and `load` runs again with new sessions of
            main: the same figures for a reload.
unloaded    a conversation of --context tokens on main sleeps and wakes once (a plain wake, timed by
            the client); then it sleeps, main is unloaded (`model.unload`), and the conversation's next
            turn is sent (`session.chat`, one token): it loads main and wakes the conversation. Reported:
            that first turn against the load that served it (as the daemon measured it) + 1.2x the plain
            wake (the issue's target: <=), and the turn's wake (`status` turns: its blocks from memory and
            from disk), with the engine thread's slow jobs and (--gil-watch-ms) the GIL's waits during the
            turn (`slow_jobs_during_turn`, `gil_during_turn`); then the same wake again on the reloaded
            engine (`wake_after_turn`) and a turn like the first on it (`warm_turn_usage`: its first token
            on a warm engine). Then main is unloaded and loaded again by hand (its load alone:
            `separate_load`, with the bound it gives; `unloaded_turn` says why it is not the bound's), and a
            second after that load the session wakes (`separate_load.wake_a_second_after`: a reloaded
            engine's first wake apart from its load, with the slow jobs around it: the model's warm-up is
            no longer held then).
memory      MLX's peak bytes over the whole run (`status` memory) against the models' memory budget and
            MLX's memory limit (`model.list` memory, `status` memory).

Prints one JSON line of results (and writes <out>/models.json). docs/benchmarks.md, "Several models",
gives the device command line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

from bench.lib import Stream, machine, pct  # noqa: E402
from testkit.daemon import Daemon, RawClient, freed  # noqa: E402

BLOCK = 128
UNIT = "The archive holds notes, plans and tool output from many earlier runs. "


def start(root: Path, main: Path, small: Path, budget: int | None, gil_watch_ms: float | None) -> Daemon:
    root.mkdir(parents=True, exist_ok=True)
    # No session sleeps for idleness mid-run; the memory budget is the daemon's own unless --budget names one.
    (root / "none.toml").write_text("idle_timeout_s = 100000.0\n"
                                    + (f"models_budget_bytes = {budget}\n" if budget is not None else "")
                                    + (f"[tuning]\ngil_watch_ms = {gil_watch_ms}\ngil_watch_kept = 256\n"
                                       if gil_watch_ms else ""))
    return Daemon(root, main, block_tokens=BLOCK, extra=["--model", str(small)]).start(timeout=900)


def gil_waits(status: dict[str, Any], window: tuple[float, float]) -> dict[str, Any] | None:
    """The daemon's waits for the GIL (status.gil, when --gil-watch-ms is on) that ended within `window`
    (Unix times), longest first, each with the innermost frames of the threads that could have held it."""
    gil = status.get("gil")
    if gil is None:
        return None
    waits = sorted((w for w in gil["waits"] if window[0] <= w["at"] <= window[1]), key=lambda w: -w["late_ms"])
    return {"over_ms": gil["over_ms"], "late": gil["late"], "count": len(waits),
            "total_ms": round(sum(w["late_ms"] for w in waits), 1), "waits": waits[:24]}


def slow_jobs(status: dict[str, Any], window: tuple[float, float]) -> list[dict[str, Any]]:
    """The engine thread's steps and jobs over the slow mark (`status` engine_thread slow) that began within
    `window` (Unix times)."""
    return [j for j in status["engine_thread"]["slow"] if window[0] <= j["at"] <= window[1]]


def wake_row(seconds: float, woken: dict[str, Any]) -> dict[str, Any]:
    """A timed `session.wake`'s figures: its seconds, phases and where its blocks came from."""
    return {"s": round(seconds, 3), "phases_ms": woken.get("phases_ms"),
            "blocks": {"memory": woken.get("blocks_from_memory"), "disk": woken.get("blocks_from_disk")}}


def client(d: Daemon) -> RawClient:
    return RawClient(d.socket, timeout=1800)


def gaps_ms(streams: list[Stream], tokenizer: Any, window: tuple[float, float]) -> list[float]:
    return [g for s in streams for g in s.gaps(tokenizer, window)]


def largest_gaps(streams: list[Stream], tokenizer: Any, window: tuple[float, float], began: float,
                 kept: int = 12) -> list[dict[str, Any]]:
    """The `kept` longest gaps within `window` (perf_counter times), each with its stream and when it ended,
    seconds from `began`: which stalls every stream shared, and where in the load they fell. Gaps that round to
    0.0 ms are none (tokens that came in one read): a short window on a tiny model may have fewer than `kept`."""
    gaps = [{"stream": i, "ended_s": round(when - began, 3), "ms": round(ms, 1)}
            for i, s in enumerate(streams) for when, ms in s.timed_gaps(tokenizer, window) if round(ms, 1) > 0]
    return sorted(gaps, key=lambda g: -g["ms"])[:kept]


def with_pieces(gaps: list[dict[str, Any]], pieces: list[dict[str, float]]) -> list[dict[str, Any]]:
    """Each gap with the pieces of the load's weights read while it lasted (their `at_ms` counts from the
    loading engine's start, a hop after the call that `ended_s` counts from: lined up within that hop)."""
    out = []
    for g in gaps:
        end = g["ended_s"] * 1000
        start = end - g["ms"]
        out.append({**g, "pieces": [p for p in pieces if p["at_ms"] < end and p["at_ms"] + p["ms"] > start]})
    return out


def pieces_summary(pieces: list[dict[str, float]]) -> dict[str, Any]:
    """How many pieces the weights were read in, their bytes, and their times (ms): p50, p99, max, the longest."""
    times = [p["ms"] for p in pieces]
    return {"count": len(pieces), "bytes": sum(p["bytes"] for p in pieces), "ms_p50": pct(times, 0.5),
            "ms_p99": pct(times, 0.99), "ms_max": max(times) if times else None,
            "longest": sorted(pieces, key=lambda p: -p["ms"])[:5]}


def logged(d: Daemon, event: str, after: int = 0, timeout: float = 600.0) -> dict[str, Any]:
    """The daemon's first log line of `event` past byte `after` of its log, waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in d.log.read_bytes()[after:].decode(errors="replace").splitlines():
            if f'"event": "{event}"' in line:
                return json.loads(line)
        time.sleep(0.2)
    raise TimeoutError(f"the daemon did not log {event!r}")


def tuned_off(knob: str) -> bool:
    """Whether the environment turns the daemon's tuning knob off (KVWAKE_<KNOB>=false)."""
    return os.environ.get(f"KVWAKE_{knob.upper()}", "").lower() in ("0", "false", "no", "off")


def digests_made_ahead(d: Daemon) -> float | None:
    """Wait for the daemon's first start to have hashed small's files ahead (tuning digests_ahead, kv/bundle.py),
    so that main's gaps alone are not measured beside that thread; its ms, None where the knob is off."""
    return None if tuned_off("digests_ahead") else logged(d, "digests made ahead").get("ms")


def during_reload(d: Daemon, main: Path, small: str, args: argparse.Namespace, ahead: bool) -> dict[str, Any]:
    """small unloaded once `load`'s streams ended, its modules built again while nothing decodes (`ahead`: tuning
    modules_ahead on, where weights are read the mapped way; sessions/models.py: waited for by its log line),
    then loaded again as `load` loads it, beside new streams of main."""
    after = d.log.stat().st_size
    with client(d) as c:
        c.call("model.unload", name=small)
    built = logged(d, "model built ahead", after, timeout=120).get("ms") if ahead else None
    return {"built_ahead_ms": built, **during_load(d, main, small, args, prefix="again")}


def builds_ahead(weights_read: str | None) -> bool:
    """Whether the daemon builds an unloaded model's modules ahead here: the knob on, weights read the mapped way
    (the default on CUDA)."""
    import mlx.core as mx

    mapped = weights_read == "mapped" or (weights_read is None and mx.cuda.is_available())
    return mapped and not tuned_off("modules_ahead")


def during_load(d: Daemon, main: Path, small: str, args: argparse.Namespace, prefix: str = "decoder") -> dict[str, Any]:
    """Main's sessions decoding (named `prefix` and a number), small loaded once the first stream is past
    --alone-tokens pieces."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(main)
    greedy = {"temperature": 0, "logit_bias": {str(t): -100.0 for t in tokenizer.eos_token_ids}}  # every token decoded
    clients = [client(d) for _ in range(args.sessions)]
    streams = []
    for i, c in enumerate(clients):
        sid = f"{prefix}{i}"
        c.call("session.create", session_id=sid)
        c.call("session.append", session_id=sid, text=f"Agent {i}: " + UNIT * 4)
        streams.append(Stream(c, sid, args.decode_tokens, greedy))
    threads = [threading.Thread(target=s.run, daemon=True) for s in streams]
    for t in threads:
        t.start()
    while len(streams[0].pieces) < args.alone_tokens and threads[0].is_alive():
        time.sleep(0.005)
    with client(d) as c:
        began, began_wall = time.perf_counter(), time.time()
        loaded = c.call("model.load", name=small)
        ended = time.perf_counter()
        status = c.call("status")
        window = (began_wall, began_wall + (ended - began))
        slow = slow_jobs(status, window)  # what main's engine thread did slowly meanwhile, by name
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    alone, inside = gaps_ms(streams, tokenizer, (0.0, began)), gaps_ms(streams, tokenizer, (began, ended))
    after = gaps_ms(streams, tokenizer, (ended, float("inf")))  # small's warm-up runs then, as idle jobs
    median = statistics.median(alone) if alone else None
    p99 = pct(inside, 0.99)
    return {"sessions": args.sessions, "load_s": round(ended - began, 3), "loaded": loaded["loaded"],
            "gap_alone_p50_ms": round(median, 3) if median else None, "gap_alone_p99_ms": pct(alone, 0.99),
            "gap_during_p50_ms": pct(inside, 0.5), "gap_during_p99_ms": p99,
            "gap_during_max_ms": round(max(inside), 3) if inside else None,
            "gap_after_p50_ms": pct(after, 0.5), "gap_after_p99_ms": pct(after, 0.99),
            "gap_samples": {"alone": len(alone), "during": len(inside), "after": len(after)},
            "streams_past_the_load": sum(s.ended > ended for s in streams), "main_slow_during": slow,
            "gil_during": gil_waits(status, window),
            # the engine thread's own intervals between steps' hand-overs (its latest 512: the load's), against
            # the gaps clients saw: a stall seen only by clients lies between the engine and the socket
            "main_step_gaps": status["engine_thread"]["step_gaps"],
            # each with the small model's weight pieces read during it: the next probe of the gaps (issue 53)
            "largest_gaps_during": with_pieces(largest_gaps(streams, tokenizer, (began, ended), began),
                                               loaded["weight_pieces"]),
            "weight_pieces": pieces_summary(loaded["weight_pieces"]),
            # the load's own phases (ms each, in order), to line the largest gaps' `ended_s` up against
            "load_phases_ms": loaded["phases_ms"],
            # the garbage collector's runs so far, by generation (a full one pauses every thread: daemon/gcwatch.py)
            "gc": status.get("gc"),
            "p99_during_over_p50_alone": round(p99 / median, 2) if p99 and median else None,
            "target": "<= 2.0", "met": bool(p99 and median and p99 <= 2 * median)}


def timed(c: RawClient, method: str, **params: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = c.call(method, **params)
    return time.perf_counter() - t0, result


def model_row(c: RawClient, name: str) -> dict[str, Any]:
    """Model `name`'s row of `model.list`: its state, and while loaded its last load (`load_ms`, `load_phases_ms`)."""
    return next(m for m in c.call("model.list")["models"] if m["name"] == name)


def unloaded_turn(d: Daemon, main: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A --context-token conversation: its plain wake, then its next turn with its model unloaded, then
    the model's load alone.

    The bound is the turn's own load + 1.2x the plain wake: the load that served the turn, as the daemon
    measured it (`model.list` `load_ms`: its start to its serving). Timed apart, by a second `model.load`
    after the turn, two loads of the same model differ by more than the margin the target leaves
    (docs/benchmarks.md, "Several models"), so that second load's noise decided met or missed. It stays
    reported (`separate_load`: timed by the client, and as the daemon measured it), with its own bound and
    ratio."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    sid, turn, name = "long", [{"role": "user", "content": "And the next step?"}], main.name
    per_unit = max(1, len(load_tokenizer(main).encode(UNIT)))
    with client(d) as c:
        c.call("session.create", session_id=sid)
        history = [{"role": "user", "content": UNIT * max(1, args.context // per_unit)}]
        appended = c.call("session.append", session_id=sid, messages=history)
        c.call("session.sleep", session_id=sid)
        freed(c)  # a plain wake: every block read, none of the sleep's pages still there mapped
        wake_s, woken = timed(c, "session.wake", session_id=sid)
        c.call("session.sleep", session_id=sid)
        c.call("model.unload", name=name)
        turn_wall = time.time()
        turn_s, reply = timed(c, "session.chat", session_id=sid, messages=turn, max_tokens=1, temperature=0)
        served = model_row(c, name)  # the load that served the turn, and the turn's wake (status turns)
        status = c.call("status")
        traced = next(t for t in reversed(status["turns"]) if t["session"] == sid)
        # the engine thread's slow jobs during the turn, and with --gil-watch-ms the GIL's waits then: where a
        # reloaded engine's first wake goes, beside the phases
        window = (turn_wall, turn_wall + turn_s)
        slow, gil = slow_jobs(status, window), gil_waits(status, window)
        # the same wake again on the reloaded engine, once its turn is done: whether what slows the turn's wake
        # stays with the reloaded engine or passes with the moments after its load
        c.call("session.sleep", session_id=sid)
        freed(c)
        again_s, again = timed(c, "session.wake", session_id=sid)
        # and a turn like the first on the woken session: the first token a warm engine gives it
        warm_reply = c.call("session.chat", session_id=sid, messages=turn, max_tokens=1, temperature=0)
        warm_traced = next(t for t in reversed(c.call("status")["turns"]) if t["session"] == sid)
        c.call("model.unload", name=name)
        separate_s, _ = timed(c, "model.load", name=name)
        separate = model_row(c, name)
        # and the reloaded engine's first wake a moment after its load rather than within it (the session's blocks
        # from the store: no operation waited for this load)
        time.sleep(1.0)
        loaded_wall = time.time()
        loaded_s, loaded_wake = timed(c, "session.wake", session_id=sid)
        # the model's warm-up, no longer held by a waiting operation, may run jobs before or beside this wake
        loaded_slow = slow_jobs(c.call("status"), (loaded_wall - 1.5, loaded_wall + loaded_s))
    # from the figures as reported (ms), so that the report's bound is its load + 1.2x its wake exactly
    load_s, wake_s, turn_s = round(served["load_ms"] / 1000, 3), round(wake_s, 3), round(turn_s, 3)
    separate_s = round(separate_s, 3)
    bound, bound_separate = load_s + 1.2 * wake_s, separate_s + 1.2 * wake_s
    return {"tokens": appended["tokens"], "wake_s": wake_s, "wake_tokens": woken["tokens"],
            "wake_blocks": {"memory": woken.get("blocks_from_memory"), "disk": woken.get("blocks_from_disk")},
            "wake_phases_ms": woken.get("phases_ms"),
            "first_turn_s": turn_s, "first_turn_usage": reply.get("usage"),
            "first_turn_wake": {"ms": traced.get("wake_ms"), "tokens": traced.get("wake_tokens"),
                                "blocks": {"memory": traced.get("wake_blocks_from_memory"),
                                           "disk": traced.get("wake_blocks_from_disk")},
                                "phases_ms": traced.get("wake_phases_ms"),
                                # the rest of the turn after its claim (the wake within it): its input's
                                # prefill and the first token
                                **{k: traced.get(k) for k in ("claim_ms", "append_ms", "first_token_ms")}},
            # the load's reader of the turn's blocks (sessions/read_ahead.py): how long its reading took against
            # the load, what it read (a wake waits for a block still in its flight)
            "read_ahead": served.get("read_ahead"),
            "slow_jobs_during_turn": slow, "gil_during_turn": gil,
            "warm_turn_usage": warm_reply.get("usage"),
            "warm_turn_ms": {k: warm_traced.get(k) for k in ("claim_ms", "append_ms", "first_token_ms")},
            "wake_after_turn": wake_row(again_s, again),
            "load_s": load_s, "load_phases_ms": served["load_phases_ms"], "bound_s": round(bound, 3),
            "first_turn_over_bound": round(turn_s / bound, 3), "target": "<= load + 1.2x wake",
            "met": turn_s <= bound,
            "separate_load": {"client_s": separate_s, "daemon_s": round(separate["load_ms"] / 1000, 3),
                              "bound_s": round(bound_separate, 3),
                              "first_turn_over_bound": round(turn_s / bound_separate, 3),
                              "met": turn_s <= bound_separate,
                              "wake_a_second_after": {**wake_row(loaded_s, loaded_wake),
                                                      "slow_jobs": loaded_slow}}}


def memory(d: Daemon) -> dict[str, Any]:
    with client(d) as c:
        status, listed = c.call("status"), c.call("model.list")
    peak, budget = status["memory"]["mlx_peak_bytes"], listed["memory"]["budget_bytes"]
    limit = status["memory"]["mlx_memory_limit_bytes"]
    return {"mlx_peak_bytes": peak, "budget_bytes": budget, "mlx_memory_limit_bytes": limit,
            "weights_bytes": listed["memory"]["weights_bytes"],
            "weights_by_model": {m["name"]: m.get("weights_bytes") for m in listed["models"]},
            "peak_over_budget": round(peak / budget, 3) if budget else None,
            "within_budget": budget is None or peak <= budget, "within_limit": limit is None or peak <= limit}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")


def with_tokenizer(model: Path, tokenizer: Path, under: Path) -> Path:
    """A folder `under`/<model's name>: `model`'s files linked, its tokenizer files replaced by `tokenizer`'s."""
    folder = under / model.name
    folder.mkdir(parents=True)
    for f in model.iterdir():
        if f.name not in TOKENIZER_FILES:
            (folder / f.name).symlink_to(f)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copyfile(tokenizer / name, folder / name)
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--main", type=Path, required=True, help="the main model's folder (the default, loaded at start)")
    ap.add_argument("--small", type=Path, required=True, help="the small model's folder (loaded on demand)")
    ap.add_argument("--sessions", type=int, default=4, help="main's sessions decoding while small loads")
    ap.add_argument("--decode-tokens", type=int, default=600, help="tokens each of them decodes")
    ap.add_argument("--alone-tokens", type=int, default=150, help="pieces the first stream gets before the load")
    ap.add_argument("--context", type=int, default=10000, help="tokens of the conversation whose model unloads")
    ap.add_argument("--budget", type=int, default=None, help="models_budget_bytes (default: the daemon's own)")
    ap.add_argument("--gil-watch-ms", type=float, default=None,
                    help="keep the daemon's waits for the GIL of this many ms or more (status.gil) and report "
                         "those during the load, with what held it (a diagnostic: its watcher takes the GIL "
                         "a thousand times a second)")
    ap.add_argument("--small-tokenizer", type=Path, default=None,
                    help="a folder whose tokenizer files the small model loads with (a real vocabulary)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    main_dir, small_dir = args.main.expanduser().resolve(), args.small.expanduser().resolve()
    if main_dir.name == small_dir.name:
        ap.error("--main and --small are served by their folder names: give folders named apart")
    with tempfile.TemporaryDirectory(prefix="kvwake-models-") as work:
        if args.small_tokenizer is not None:
            small_dir = with_tokenizer(small_dir, args.small_tokenizer.expanduser().resolve(), Path(work) / "small")
        d = start(Path(work), main_dir, small_dir, args.budget, args.gil_watch_ms)
        try:
            with d.client() as c:  # how the weights were read (tuning `weights_read`; null: by the backend)
                weights_read = c.call("status")["tuning"].get("weights_read")
            report = {"machine": machine(), "main": str(main_dir), "small": str(small_dir), "weights_read": weights_read,
                      "digests_ahead_ms": digests_made_ahead(d),
                      "load": during_load(d, main_dir, small_dir.name, args),
                      "reload": during_reload(d, main_dir, small_dir.name, args, builds_ahead(weights_read)),
                      "unloaded": unloaded_turn(d, main_dir, args), "memory": memory(d)}
        finally:
            code = d.stop()
        report["daemon_exit"], report["log_problems"] = code, d.log_problems()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "models.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
