"""`kvwake bench`: what sleeping and waking cost on the running daemon, end to end over its socket.

Every session shares one system prompt and gets its own user messages:

    first turn    create + chat: a cold prefill for the first session; later
                  sessions may reuse the shared prompt's blocks once stored
    cycles        sleep, wake, chat again (the turn after a wake prefills
                  only the new message) — `--cycles` times

Sleep and wake timings are the daemon's own (their `ms`). Time to first token
(`ttft_ms`) is measured by the client, from sending the request to the first
streamed piece, so it includes prefilling the new messages (`daemon_ttft_ms`,
the daemon's usage field, starts after that prefill); `rpc_ms` is the whole
round trip. Nothing is estimated: a field the daemon did not report is None. Sessions are deleted afterwards
unless `keep`.

`kvwake bench NAME` runs one of the registered workloads instead (`WORKLOADS`): scripts of bench/ in a
repository checkout, beside the installed package's folders (an editable install); a wheel has no bench/.
"""

from __future__ import annotations

import contextlib
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvwake.client.client import Client
from kvwake.errors import KvwakeError

__all__ = ["WORKLOADS", "BenchConfig", "NoBenchDir", "UnknownBenchmark", "Workload", "bench_dir", "run_bench", "workload_argv"]

PARAGRAPH = (
    "You are a careful assistant working for a shipping company. You track containers, vessels, "
    "ports and weather, answer questions about delays plainly, cite the record you used, and say "
    "so when a record is missing. Keep every answer short and give dates in ISO format. "
)


@dataclass(frozen=True)
class BenchConfig:
    sessions: int = 4
    cycles: int = 2  # sleep/wake/chat rounds per session
    system_words: int = 200  # length of the shared system prompt
    max_tokens: int = 16
    keep: bool = False


def system_prompt(words: int) -> str:
    base = PARAGRAPH.split()
    return " ".join(base[i % len(base)] for i in range(words))


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def _chat(client: Client, session_id: str, text: str, max_tokens: int) -> dict[str, Any]:
    """One streamed turn. ttft_ms is the client's: request sent to first piece, prefill included
    (the daemon's usage.ttft_ms starts after the messages are prefilled; it is daemon_ttft_ms)."""
    started, first = time.perf_counter(), None
    with client.chat(session_id, text, max_tokens=max_tokens, stream=True) as stream:
        for _ in stream:
            first = first or time.perf_counter()
        reply = stream.result
    done = time.perf_counter()
    append = reply.append or {}
    return {"ttft_ms": round(((first or done) - started) * 1000, 3), "daemon_ttft_ms": reply.usage.get("ttft_ms"),
            "tokens_per_s": reply.usage.get("tokens_per_s"), "generated": reply.usage.get("generated_tokens"),
            "prefilled": append.get("prefilled"), "reused": append.get("reused"),
            "rpc_ms": round((done - started) * 1000, 3)}


def _cycle(client: Client, session_id: str, text: str, max_tokens: int) -> dict[str, Any]:
    slept = client.sleep(session_id)
    woke = client.wake(session_id)
    after = _chat(client, session_id, text, max_tokens)
    return {"tokens": slept.get("tokens"), "sleep_ms": slept.get("ms"), "raw_bytes": slept.get("raw_bytes"),
            "stored_bytes": slept.get("stored_bytes"), "written_bytes": slept.get("written_bytes"),
            "new_blocks": slept.get("new_blocks"), "reused_blocks": slept.get("reused_blocks"),
            "wake_ms": woke.get("ms"), "blocks_from_memory": woke.get("blocks_from_memory"),
            "blocks_from_disk": woke.get("blocks_from_disk"), "after_wake": after}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    firsts = [r["first_turn"] for r in rows]
    cycles = [c for r in rows for c in r["cycles"]]
    later = [f for f in firsts[1:] if f["prefilled"] is not None and f["reused"] is not None]
    shared = sum(f["reused"] for f in later), sum(f["reused"] + f["prefilled"] for f in later)
    raw = sum(c["raw_bytes"] or 0 for c in cycles)
    stored = sum(c["stored_bytes"] or 0 for c in cycles)
    nums = lambda items, key: [x[key] for x in items if isinstance(x.get(key), (int, float))]  # noqa: E731
    return {
        "cold_ttft_ms": firsts[0]["ttft_ms"] if firsts else None,
        "first_turn_ttft_ms_p50": _p(nums(firsts, "ttft_ms"), 0.5),
        "prefix_reuse_rate": round(shared[0] / shared[1], 4) if shared[1] else None,
        "sleep_ms_p50": _p(nums(cycles, "sleep_ms"), 0.5), "sleep_ms_max": _p(nums(cycles, "sleep_ms"), 1.0),
        "wake_ms_p50": _p(nums(cycles, "wake_ms"), 0.5), "wake_ms_max": _p(nums(cycles, "wake_ms"), 1.0),
        "ttft_after_wake_ms_p50": _p(nums([c["after_wake"] for c in cycles], "ttft_ms"), 0.5),
        "tokens_per_s_p50": _p(nums(firsts + [c["after_wake"] for c in cycles], "tokens_per_s"), 0.5),
        "snapshot_tokens_p50": _p(nums(cycles, "tokens"), 0.5),
        "compression_ratio": round(raw / stored, 3) if stored else None,
        "written_bytes": sum(c["written_bytes"] or 0 for c in cycles),
    }


def run_bench(client: Client, config: BenchConfig, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run the benchmark (one session at a time); `progress(1)` after each session. Returns the report."""
    tag, system = secrets.token_hex(3), system_prompt(config.system_words)
    status = client.status()
    rows: list[dict[str, Any]] = []
    created: list[str] = []
    try:
        for i in range(config.sessions):
            sid = f"bench-{tag}-{i}"
            client.create_session(sid, system=system, metadata={"bench": tag})
            created.append(sid)
            first = _chat(client, sid, f"Where is container {i}-0?", config.max_tokens)
            cycles = [_cycle(client, sid, f"And container {i}-{c + 1}?", config.max_tokens)
                      for c in range(config.cycles)]
            rows.append({"session_id": sid, "first_turn": first, "cycles": cycles})
            if progress:
                progress(1)
    except BaseException:
        if not config.keep:  # best effort: the error that stopped the run is the one to report
            for sid in created:
                with contextlib.suppress(KvwakeError, ConnectionError):
                    client.delete_session(sid)
        raise
    if not config.keep:
        for sid in created:
            client.delete_session(sid)
    return {"model": status.get("model"), "bundle_hash": status.get("bundle_hash"), "config": asdict(config),
            "summary": summarize(rows), "sessions": rows}


@dataclass(frozen=True)
class Workload:
    """A registered benchmark: `bench/<script>` run with `args` first, then the user's."""

    name: str
    script: str
    about: str
    args: tuple[str, ...] = ()


WORKLOADS = (
    Workload("resume", "suite.py", "sleep and wake against re-prefill and mlx-lm's cache files, by size", ("resume",)),
    Workload("storage", "suite.py", "shared-prefix store bytes and time to first token against mlx-lm's files",
             ("storage",)),
    Workload("rpc", "suite.py", "the RPC front's round trip against a bare msgpack echo server", ("rpc",)),
    Workload("batching", "batching.py", "many sessions decoding at once, and a long prefill beside decoding"),
    Workload("turns-at-once", "turns_at_once.py", "agents sending their next turn at once beside a decoding session"),
    Workload("decode-rows", "decode_rows.py", "the decoder's batched step at rows x context: the row kernel "
             "against mlx-lm's masked path, the bytes bound beside"),
    Workload("step-parts", "step_parts.py", "where a batched decode step's time goes: the step, its graph's "
             "building, linear layers, attention, MLP, norms and head apart, at rows x context"),
    Workload("paged-decode", "paged_decode.py", "decode attention over pages against mlx's over contiguous rows"),
    Workload("paged-wakes", "paged_wakes.py", "sessions sharing a long prompt, paged_kv off and on: hot KV bytes, "
             "blocks read at wake, wakes into pages against through buffers (ms, peak bytes)"),
    Workload("bundle-hash", "bundle_hash.py", "a first start's bundle hash: file digests beside the load"),
    Workload("fleet", "fleet/__main__.py", "N agents at once over the openai and anthropic packages against "
             "mlx_lm.server, a restart, issue 50's targets"),
    Workload("openai-turns", "http_turns.py", "an agent's turns over the OpenAI chat API, a restart mid-way"),
    Workload("responses-turns", "responses_turns.py", "an agent's turns over the Responses API, a restart mid-way"),
    Workload("anthropic-turns", "anthropic_turns.py", "an agent's turns over the Anthropic Messages API, a restart"),
    Workload("claude-code", "claude_code.py", "the real Claude Code CLI against the daemon (npm)"),
    Workload("codex-cli", "codex_cli.py", "the real Codex CLI against the daemon (npm)"),
    Workload("persist", "persist.py", "continuous persistence: the sleep it saves, what it costs a neighbour"),
    Workload("matching", "matching.py", "thousands of stateless conversations: continuing one, RSS, start time"),
    Workload("load", "load.py", "concurrent agents over RPC and HTTP with disconnects and a kill -9"),
    Workload("soak", "soak.py", "long conversations, sleeps, wakes and restarts: memory over time"),
    Workload("remote", "remote.py", "remote wake against local wake (a real SeaweedFS on loopback)"),
    Workload("structured", "structured.py", "decode speed under a JSON schema against without"),
    Workload("startup", "startup.py", "where the daemon's start goes, and its first requests"),
    Workload("models", "models.py", "two models in one daemon: decoding while the other loads, an unloaded "
             "model's first turn, MLX's peak against the memory budget"),
    Workload("codec", "codec_bench.py", "the block codecs' ratio and speed on real KV (bench/capture_kv.py's file)"),
)


class NoBenchDir(FileNotFoundError):
    """This install has no bench/ folder (only a repository checkout has one)."""


class UnknownBenchmark(LookupError):
    """No registered workload has that name."""


def bench_dir() -> Path:
    """bench/ of the repository this package runs from; NoBenchDir where there is none."""
    here = Path(__file__).resolve().parent.parent / "bench"
    if not (here / "lib.py").is_file():
        raise NoBenchDir(f"no bench/ beside the installed package (looked in {here}): the registered benchmarks "
                         "run from a repository checkout (pip install -e .)")
    return here


def workload_argv(name: str, args: tuple[str, ...] | list[str]) -> list[str]:
    """The command line that runs workload `name` with the user's `args` (run it from bench_dir().parent).
    Raises UnknownBenchmark, NoBenchDir."""
    found = {w.name: w for w in WORKLOADS}
    if name not in found:
        raise UnknownBenchmark(f"no benchmark named {name!r} (kvwake bench --list names them)")
    w = found[name]
    return [sys.executable, str(bench_dir() / w.script), *w.args, *args]
